"""The profile over the run in a real headless Chromium: plotly drew the MFU-over-steps graph with
each profile's MFU against both peaks at its step (the failed profile left out), and a line per
top module; the console has no errors."""

from __future__ import annotations

import pytest
from report_factory import serve_dashboard, write_run
from test_continuous_view import (
    CONTINUOUS_RUN_ID, CONTINUOUS_SUITE, MFU_DATASHEET, MFU_MEASURED, STEPS, make_continuous_report,
)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def continuous_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("continuous_browser")
    write_run(root, make_continuous_report())
    yield from serve_dashboard(root)


def test_mfu_over_the_run_is_drawn(browser, continuous_server):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get_log("browser")
    browser.get(f"{continuous_server}/run/{CONTINUOUS_SUITE}/{CONTINUOUS_RUN_ID}/flops")
    wait = WebDriverWait(browser, 30, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,))
    wait.until(lambda d: d.execute_script(
        "const g = document.getElementById('flops-continuous-mfu');"
        "return g && g.querySelector('.main-svg') && g.querySelector('.js-plotly-plot')._fullData.length == 2"))
    text = browser.find_element(By.ID, "page").text
    assert "Over the run (a profile every 100 steps)" in text and "could not be drawn" not in text
    wait.until(lambda d: d.execute_script(
        "return document.querySelectorAll('#flops-continuous .ag-cell[col-id=\"host_ahead\"]').length == 5"))
    cells = browser.execute_script(
        "const q = c => Array.from(document.querySelectorAll('#flops-continuous .ag-cell[col-id=\"' + c + '\"]'));"
        "const byRow = c => q(c).sort((a, b) => a.closest('.ag-row').getAttribute('row-index')"
        " - b.closest('.ag-row').getAttribute('row-index')).map(e => e.innerText);"
        "return [byRow('timer'), byRow('host_ahead'),"
        " document.querySelector('#flops-continuous .ag-header-cell[col-id=\"host_ahead\"]').innerText]")
    assert cells[0] == ["kernels", "events", "events", "events", ""]
    assert cells[1] == ["", "yes", "yes", "no", ""] and cells[2] == "host ahead"
    drawn = browser.execute_script(
        "const g = document.getElementById('flops-continuous-mfu').querySelector('.js-plotly-plot');"
        "return [g._fullData.map(t => [t.name, Array.from(t.x), Array.from(t.y)]), g._fullLayout.yaxis.title.text]")
    (measured, datasheet), y_title = drawn
    assert measured[0] == "MFU, measured peak" and datasheet[0] == "MFU, datasheet peak"
    assert measured[1] == datasheet[1] == list(STEPS)
    assert measured[2] == pytest.approx([100 * v for v in MFU_MEASURED])
    assert datasheet[2] == pytest.approx([100 * v for v in MFU_DATASHEET])
    assert y_title == "MFU (%)"
    lines = browser.execute_script(
        "const g = document.getElementById('flops-continuous-modules').querySelector('.js-plotly-plot');"
        "return g._fullData.map(t => t.name)")
    assert lines[:2] == ["layers", "layers.1"] and "layers.2" in lines
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe
