"""The Pipeline tab in a real headless Chromium: plotly drew the stage utilisation bars with the
report's busy and idle percentages and the bubble line, and the timeline's bars per stage; the
console has no errors."""

from __future__ import annotations

import pytest
from report_factory import PIPELINE_RUN_ID, make_pipeline_report, serve_dashboard, write_run

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def pipeline_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_browser")
    write_run(root, make_pipeline_report())
    yield from serve_dashboard(root)


def test_pipeline_tab_draws_utilisation_and_timeline(browser, pipeline_server):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get_log("browser")
    browser.get(f"{pipeline_server}/run/parallel/{PIPELINE_RUN_ID}/pipeline")
    wait = WebDriverWait(browser, 30, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,))
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#page h2"))
    wait.until(lambda d: d.execute_script(
        "const gs = document.querySelectorAll('.dash-graph');"
        "return gs.length == 2 && Array.from(gs).every(g => g.querySelector('.main-svg'))"))
    text = browser.find_element(By.ID, "page").text
    assert "Stage utilisation" in text and "Latest batch, per stage" in text and "could not be drawn" not in text
    drawn = browser.execute_script(
        "const g = document.getElementById('pipeline-utilisation').querySelector('.js-plotly-plot');"
        "return [g._fullData.map(t => [t.name, Array.from(t.y)]), g._fullLayout.shapes.map(s => s.y0)]")
    assert drawn[0] == [["busy", [60, 70]], ["idle", [40, 30]]]
    assert drawn[1][0] == pytest.approx(100 * 2 / 3)
    bars = browser.execute_script(
        "const g = document.getElementById('pipeline-timeline').querySelector('.js-plotly-plot');"
        "return g._fullData.map(t => [t.name, Array.from(t.text)])")
    assert bars == [["forward", ["F0", "F1", "F0", "F1"]], ["backward", ["B0", "B1", "B0", "B1"]]]
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe
