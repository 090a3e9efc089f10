"""A run's page in a real headless Chromium: the navigation lists only the tabs with records, the
Trace tab's plotly timelines hold the profiled step's device-timed phases and every rank's
collectives of that step, the header's link downloads the run's trace.pftrace, and a click on a
tab draws it without reloading the page; the console has no errors."""

from __future__ import annotations

import pytest
from report_factory import WORLD, make_report, serve_dashboard, write_run
from test_trace_view import DEVICE_STEP, RUN_ID, with_device_times

from dslab.report.timeline import TRACE_FILE

pytestmark = pytest.mark.browser

SUITE = "gpt2_medium"


@pytest.fixture(scope="module")
def run_server(tmp_path_factory):
    from dslab.profilers.trace import write_trace

    pytest.importorskip("perfetto.trace_builder.proto_builder")
    root = tmp_path_factory.mktemp("run_page_browser")
    data = with_device_times(make_report(RUN_ID))
    run = write_run(root, data)
    write_trace(run)
    for url in serve_dashboard(root):
        yield url, data, run


def _drawn(browser, count: int):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 30, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: d.execute_script(
            "const gs = document.querySelectorAll('#page .dash-graph');"
            f"return gs.length == {count} && Array.from(gs).every(g => g.querySelector('.main-svg'))"))


def test_trace_tab_hidden_tabs_and_the_trace_link(browser, run_server):
    from selenium.webdriver.common.by import By

    base, data, run = run_server
    browser.get_log("browser")
    browser.get(f"{base}/run/{SUITE}/{RUN_ID}/trace?case=seq128")
    _drawn(browser, 2)
    tabs = [a.text for a in browser.find_elements(By.CSS_SELECTOR, "#run-tabs a")]
    assert tabs == ["Run", "Flops", "Comms", "Memory", "Telemetry", "Trace"]

    device = data["profilers"]["flops"]["seq128"]["device_time"]
    phases = browser.execute_script(
        "const g = document.getElementById('trace-step').querySelector('.js-plotly-plot');"
        "return g._fullData.map(t => [t.name, Array.from(t.hovertext).filter(n => n == t.name),"
        " Array.from(t.x).filter((x, i) => t.hovertext[i] == t.name)])")
    widths = {name: xs[0] for name, labels, xs in phases if labels}
    assert widths["forward"] == pytest.approx(device["forward_ms"])
    assert widths["backward"] == pytest.approx(device["backward_ms"])
    assert widths["optimizer"] == pytest.approx(device["optimizer_ms"])

    rows = browser.execute_script(
        "const g = document.getElementById('trace-collectives').querySelector('.js-plotly-plot');"
        "return g._fullData.map(t => Array.from(t.y)).flat()")
    per_rank = data["profilers"]["comms"]["seq128"]["per_rank"]
    for rank in range(WORLD):
        step_calls = [r for r in per_rank[str(rank)] if r["step"] == DEVICE_STEP]
        assert rows.count(f"rank {rank}") == len(step_calls) > 0

    link = browser.find_element(By.ID, "trace-file")
    assert link.get_attribute("href").endswith(f"/trace/{SUITE}/{RUN_ID}")
    size = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch(arguments[0]).then(r => r.arrayBuffer()).then(b => done(b.byteLength))", link.get_attribute("href"))
    assert size == (run / TRACE_FILE).stat().st_size

    browser.execute_script("window.notReloaded = true")
    next(a for a in browser.find_elements(By.CSS_SELECTOR, "#run-tabs a") if a.text == "Run").click()
    _drawn(browser, 4)  # arms and trials of both cases
    assert browser.execute_script("return window.notReloaded === true")
    assert "Environment" in browser.find_element(By.ID, "page").text
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe
