"""Every dashboard page in a real headless Chromium: it loads from the fixture reports, each graph
renders (plotly drew its SVG), the console has no errors, and a screenshot is saved."""

from __future__ import annotations

import pytest
from report_factory import PARTIAL, RUN_IDS, SUITE

pytestmark = pytest.mark.browser

RUN = f"/run/{SUITE}/{RUN_IDS[0]}"
# (name, path, graphs at least, text the page must show)
PAGES = [
    ("run", RUN, 4, "best plain samples/s"),
    ("flops", f"{RUN}/flops", 2, "Module types per depth"),
    ("flops_seq512", f"{RUN}/flops?case=seq512", 2, "seq512: roofline"),
    ("comms", f"{RUN}/comms", 2, "stragglers named: rank 3"),
    ("memory", f"{RUN}/memory", 3, "Activation memory per module"),
    ("telemetry", f"{RUN}/telemetry", 1, "Time series per GPU"),
    ("io", f"{RUN}/io", 0, "no I/O tuner results in this run"),
    ("compare", f"/compare?a={SUITE}/{RUN_IDS[0]}&b={SUITE}/{RUN_IDS[4]}", 1, "B: dslab/best plain"),
]


def _wait(browser):
    """A wait that polls again when Dash re-rendered an element between finding and reading it."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, 30, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,))


def _text(browser, element_id: str = "page") -> str:
    """The element's visible text, read again if the element was replaced while being read."""
    from selenium.webdriver.common.by import By

    return _wait(browser).until(lambda d: d.find_element(By.ID, element_id).text)


def _load(browser, url: str, shots, name: str):
    from selenium.webdriver.common.by import By

    browser.get(url)
    wait = _wait(browser)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#page h2"))
    wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, "[data-dash-is-loading='true']"))
    # one script, so a graph re-rendered mid-check cannot leave a stale handle behind
    wait.until(lambda d: d.execute_script(
        "return Array.from(document.querySelectorAll('.dash-graph')).every(g => g.querySelector('.main-svg'))"))
    wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, ".ag-overlay-loading-center"))
    height = browser.execute_script("return document.body.scrollHeight")
    browser.set_window_size(1400, min(max(height + 80, 800), 8000))
    path = shots / f"{name}.png"
    browser.save_screenshot(str(path))
    browser.set_window_size(1400, 1000)
    return path


def _severe(browser) -> list[str]:
    return [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    return tmp_path_factory.mktemp("screenshots")


def _check_page(browser, server, shots, name: str, path: str, graphs: int, text: str) -> str:
    """Load ``path``; it shows ``text``, no section failed, at least ``graphs`` graphs drew their
    SVG, the console holds no error, and the screenshot is saved. Returns the page's text."""
    from selenium.webdriver.common.by import By

    browser.get_log("browser")  # drop what earlier pages logged
    shot = _load(browser, server + path, shots, name)
    page = _text(browser)
    assert text in page
    assert "could not be drawn" not in page
    assert len(browser.find_elements(By.CSS_SELECTOR, ".dash-graph .main-svg")) >= graphs
    traces = browser.execute_script(  # the traces plotly drew in each graph
        "return Array.from(document.querySelectorAll('.dash-graph .js-plotly-plot')).map(e => (e._fullData || []).length)")
    assert len(traces) >= graphs and all(n > 0 for n in traces), traces
    assert _severe(browser) == []
    assert shot.stat().st_size > 10_000
    return page


@pytest.mark.parametrize("name,path,graphs,text", PAGES, ids=[p[0] for p in PAGES])
def test_page_renders(browser, server, shots, name, path, graphs, text):
    _check_page(browser, server, shots, name, path, graphs, text)


def test_runs_page(browser, server, shots):
    from selenium.webdriver.common.by import By

    text = _check_page(browser, server, shots, "runs", "/", 1, "Runs (8)")
    assert "2 run(s) could not be read" in text
    for run_id in RUN_IDS[-3:]:
        assert run_id in text
    assert "gate: regression" in _text(browser, f"history-{SUITE}")
    assert "baseline seq128/dslab" in _text(browser, f"history-{SUITE}")
    href = _wait(browser).until(
        lambda d: d.find_element(By.ID, "compare-link").get_attribute("href")).replace("%2F", "/")
    assert f"a={SUITE}/{RUN_IDS[4]}" in href and f"b={SUITE}/{PARTIAL}" in href


def test_partial_report_shows_warnings_and_what_it_can(browser, server, shots):
    run = f"/run/{SUITE}/{PARTIAL}"
    text = _check_page(browser, server, shots, "partial_run", run, 2, "this report lacks environment")
    assert "results[" in text and "skipped" in text
    browser.get_log("browser")
    for tab, problem in (("flops", "flops.modules should be a list"),
                         ("memory", "memory.steps[0] should be an object")):
        _load(browser, f"{server}{run}/{tab}", shots, f"partial_{tab}")
        assert problem in _text(browser), tab
    assert "6.1" in _check_page(browser, server, shots, "partial_io", f"{run}/io", 0, "I/O tuner")
    assert _severe(browser) == []


@pytest.mark.parametrize("path", ["/run/..%2F..%2Fetc/passwd", "/run/%2E%2E%2F%2E%2E/etc", f"/run/{SUITE}/..%2F..%2F..%2Fetc",
                                  "/compare?a=../../etc&b=x/y"])
def test_path_traversal_is_refused(browser, server, shots, path):
    _load(browser, server + path, shots, "traversal")
    text = _text(browser)
    assert "Cannot show this" in text or "Not found" in text
    assert "root:" not in text
