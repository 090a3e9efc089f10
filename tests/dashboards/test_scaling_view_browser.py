"""The Scaling tab in a real headless Chromium, on a data-parallel run's report
(:func:`report_factory.make_scaling_report`): plotly drew the three figures with the report's
points (no skipped or failed arm among them), the dashed line at efficiency 1.0, the peer table
lists the skipped and failed peers with their status, the console has no errors; a run without
process-count cases has no Scaling tab."""

from __future__ import annotations

import pytest
from report_factory import (
    SCALING_RUN_ID,
    SCALING_SKIPPED,
    SCALING_SUITE,
    make_report,
    make_scaling_report,
    serve_dashboard,
    write_run,
)

pytestmark = pytest.mark.browser

PLAIN_RUN = "20261205T100000Z-plain0"


@pytest.fixture(scope="module")
def scaling_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("scaling_browser")
    write_run(root, make_scaling_report())
    write_run(root, make_report(PLAIN_RUN, "gpt2"))
    yield from serve_dashboard(root)


def _wait(browser):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, 30, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,))


def _open(browser, url: str) -> str:
    """Load ``url``, wait for Dash, plotly and the grids to finish, return the page's text."""
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


def _drawn(browser, graph_id: str):
    """``[[trace type, name, x, y]]`` of what plotly drew in graph ``graph_id``."""
    return browser.execute_script(
        "const g = document.getElementById(arguments[0]).querySelector('.js-plotly-plot');"
        "return g && g._fullData ? g._fullData.map(t => [t.type, t.name, Array.from(t.x), Array.from(t.y)]) : null",
        graph_id)


def test_scaling_tab_draws_the_figures_and_the_table(browser, scaling_server, tmp_path):
    run = f"{scaling_server}/run/{SCALING_SUITE}/{SCALING_RUN_ID}"
    text = _open(browser, f"{run}/scaling")
    assert "could not be drawn" not in text
    for title in ("Throughput against processes", "Weak-scaling efficiency", "Peak memory per GPU",
                  "dslab against its sharding peers", "Every arm and process count"):
        assert title in text

    throughput = _drawn(browser, "scaling-throughput")
    assert [t[1] for t in throughput] == ["dslab-zero0", "ddp", "dslab-zero3", "fsdp2"]
    assert throughput[0] == ["scatter", "dslab-zero0", [1, 2, 4], [10000, 19000, 36000]]
    assert throughput[3][2:] == [[1, 2], [8000, 12800]]  # out of memory at N=4: no point
    efficiency = _drawn(browser, "scaling-efficiency")
    assert efficiency[2][1] == "dslab-zero3" and efficiency[2][3] == pytest.approx([1.0, 0.9, 0.8])
    dash = browser.execute_script(
        "const g = document.getElementById('scaling-efficiency').querySelector('.js-plotly-plot');"
        "return g._fullLayout.shapes.map(s => [s.y0, s.y1, s.line.dash])")
    assert dash == [[1, 1, "dash"]]
    memory = _drawn(browser, "scaling-memory")
    assert {t[0] for t in memory} == {"bar"}
    assert memory[2] == ["bar", "dslab-zero3", [1, 2, 4], [12, 7, 4.5]] and memory[3][2:] == [[1, 2], [12.5, 7.5]]
    assert SCALING_SKIPPED not in {t[1] for t in throughput + efficiency + memory}

    peers = _wait(browser).until(lambda d: d.find_element("id", "scaling-peers").text)
    assert "fsdp2 failed" in peers and f"{SCALING_SKIPPED} skipped" in peers and "1.125" in peers
    assert "memory \u00d7" in peers
    assert [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    browser.save_screenshot(str(tmp_path / "scaling.png"))

    text = _open(browser, f"{run}/scaling?case=124m")
    assert [t[1] for t in _drawn(browser, "scaling-throughput")] == ["dslab-zero0", "ddp"]
    assert "124m-n2" in text and "355m-n4" not in text


def test_no_scaling_tab_without_process_counts(browser, scaling_server):
    text = _open(browser, f"{scaling_server}/run/gpt2/{PLAIN_RUN}")
    assert "Scaling" not in text and "Telemetry" in text
    assert "Scaling" in _open(browser, f"{scaling_server}/run/{SCALING_SUITE}/{SCALING_RUN_ID}")
