"""The expert-load tab in a real headless Chromium, on the report of a tiny ``suites/moe`` run
made here on the CPU: the heatmap renders (plotly drew its SVG with one trace per case), the
dropped fraction and the expert TFLOP/s table are shown, the console has no errors."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A tiny MoE run (the dslab and torch arms, one trial of two steps per case): (root, run_id)."""
    from dslab.bench.runner import run_suite

    root = tmp_path_factory.mktemp("moe_reports")
    report, _ = run_suite(REPO / "suites" / "moe", scale="tiny", arms=["dslab", "torch"], trials=1, steps=2,
                          warmup_steps=1, out=root, stream=io.StringIO())
    assert report.status == "complete"
    return root, report.run_id


@pytest.fixture(scope="module")
def moe_server(moe_run):
    from werkzeug.serving import make_server

    from dashboards.app import create_app

    httpd = make_server("127.0.0.1", 0, create_app(moe_run[0]).server, threaded=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    thread.join(timeout=10)


def _wait(browser):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, 30, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,))


def _open(browser, url: str) -> str:
    """Load ``url``, wait for Dash and plotly to finish, return the page's text."""
    from selenium.webdriver.common.by import By

    browser.get_log("browser")
    browser.get(url)
    wait = _wait(browser)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#page h2"))
    wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, "[data-dash-is-loading='true']"))
    wait.until(lambda d: d.execute_script(
        "return Array.from(document.querySelectorAll('.dash-graph')).every(g => g.querySelector('.main-svg'))"))
    wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, ".ag-overlay-loading-center"))
    return wait.until(lambda d: d.find_element(By.ID, "page").text)


@pytest.mark.parametrize("case,layer", [("layer_top2", "layer 0"), ("gpt2_moe_top1", "layer 1")])
def test_expert_load_tab_draws_the_heatmap(browser, moe_server, moe_run, tmp_path, case, layer):
    run = f"{moe_server}/run/moe/{moe_run[1]}"
    text = _open(browser, f"{run}/experts?case={case}")
    assert "Expert load per MoE layer" in text and "could not be drawn" not in text
    assert "dropped assignments" in text and "0.00%" in text and "Expert TFLOP/s per arm" in text
    drawn = browser.execute_script(
        "const g = document.getElementById('expert-load-heatmap').querySelector('.js-plotly-plot');"
        "return g && g._fullData ? g._fullData.map(t => [t.type, t.y.length, t.x.length]) : null")
    assert drawn == [["heatmap", 1, 4]]
    assert layer in browser.execute_script(
        "return document.getElementById('expert-load-heatmap').querySelector('.main-svg').textContent")
    assert [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    browser.save_screenshot(str(tmp_path / f"experts_{case}.png"))

    text = _open(browser, run)
    assert "Expert load" in text and "expert TFLOP/s" in text
