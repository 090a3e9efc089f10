"""The Inference tab in a real headless Chromium over the committed GPU inference report (GPT-2
124M, batch 1 and 32, one H200): the arms grid holds every arm's figures from the report, the
per-token graph draws one bar per arm with its p50, the greedy table compares against the
reference arm, only the tabs with records are offered, and the console has no errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from report_factory import serve_dashboard

pytestmark = pytest.mark.browser

ROOT = Path(__file__).parent / "fixtures" / "inference_reports"
RUN = "20261126T044232Z-e33ccf"
CASE = "124m-b32"


@pytest.fixture(scope="module")
def inference_server():
    yield from serve_dashboard(ROOT)


def test_inference_tab_draws_each_arm_from_the_report(browser, inference_server):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    record = json.loads((ROOT / "gpt2_inference" / RUN / "run.json").read_text())["inference"][CASE]
    browser.get_log("browser")
    browser.get(f"{inference_server}/run/gpt2_inference/{RUN}/inference?case={CASE}")
    wait = WebDriverWait(browser, 30, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,))
    wait.until(lambda d: d.execute_script(
        "const g = document.getElementById('inference-per-token');"
        "return g !== null && g.querySelector('.main-svg') !== null"))
    wait.until(lambda d: d.execute_script("return dash_ag_grid.getApi('inference-arms').getDisplayedRowCount()") > 0)
    rows = browser.execute_script(
        "const rows = []; dash_ag_grid.getApi('inference-arms').forEachNode(n => rows.push(n.data)); return rows")
    assert [r["arm"] for r in rows] == list(record["arms"])
    for row in rows:
        assert row["per_token_ms_p50"] == pytest.approx(record["arms"][row["arm"]]["per_token_ms_p50"], rel=1e-3)
        assert row["tokens_per_s"] == pytest.approx(record["arms"][row["arm"]]["tokens_per_s"], rel=1e-3)
    drawn = browser.execute_script(
        "const g = document.getElementById('inference-per-token').querySelector('.js-plotly-plot');"
        "return g._fullData.map(t => [t.name, Array.from(t.x || []), Array.from(t.y || [])])")
    shown = {name: (xs, ys) for name, xs, ys in drawn}
    assert shown, drawn
    plotted = [v for xs, ys in shown.values() for v in (*xs, *ys) if isinstance(v, (int, float))]
    for arm, m in record["arms"].items():
        assert any(v == pytest.approx(m["per_token_ms_p50"], rel=1e-3) for v in plotted), (arm, drawn)
    text = browser.find_element(By.ID, "page").text
    assert f"batch {record['batch']}" in text and "could not be drawn" not in text
    assert "Greedy tokens against the reference arm" in text
    tabs = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".tabs a.tab")]
    assert "Inference" in tabs and "I/O" not in tabs
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
