"""Run pages of the largest fixture report load within :data:`BUDGET_S`.

Policy: the app is warm (imported, the report read once, as after any first request), then

- server side, every tab's page is drawn by :func:`dashboards.app.render` for the first time
  within the budget, and a second time (the page kept by the store) within :data:`CACHED_S`;
- in a real headless Chromium, after one load of the page that compiles the app's scripts, the
  Run tab loads (navigation start to every graph drawn) within the budget: the best of
  :data:`BROWSER_LOADS` loads, so that a neighbour's burst of CPU on a busy machine does not fail
  it while a page that takes 5 s every time still does.

Marked ``serial``: the timings hold on the 2-core CI machine when nothing else runs beside them.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from dash import html
from report_factory import serve_dashboard

from dashboards import app as dash_app
from dashboards import pages
from dashboards.data import RunStore

pytestmark = pytest.mark.serial

FIXTURES = Path(__file__).parent / "fixtures"
BUDGET_S = 2.0
CACHED_S = 0.2
BROWSER_LOADS = 5
# performance.now() (ms from the navigation's start) once the page and every graph are drawn, else false
DRAWN = ("const gs = document.querySelectorAll('#page .dash-graph');"
         "const drawn = document.querySelector('#page h2') !== null && document.querySelector('._dash-loading') === null"
         " && gs.length > 0 && Array.from(gs).every(g => g.querySelector('.main-svg'));"
         "return drawn && performance.now()")


def largest_fixture() -> tuple[Path, str, str]:
    """``(reports root, suite, run id)`` of the largest ``run.json`` among the fixtures."""
    path = max(FIXTURES.glob("*/*/*/run.json"), key=lambda p: p.stat().st_size)
    return path.parents[2], path.parent.parent.name, path.parent.name


def _errors(components) -> list[str]:
    stack, out = list(components), []
    while stack:
        c = stack.pop()
        if isinstance(c, html.Div) and getattr(c, "className", None) == "error":
            out.append(str(c.children))
        children = getattr(c, "children", None)
        stack.extend(children if isinstance(children, list) else [children] if children is not None else [])
    return out


def test_every_tab_of_the_largest_report_renders_within_budget():
    root, suite, run_id = largest_fixture()
    store = RunStore(root)
    store.report(suite, run_id)
    slow = {}
    for tab, _ in pages.ALL_TABS:
        path = f"/run/{suite}/{run_id}" + (f"/{tab}" if tab else "")
        started = time.perf_counter()
        page = dash_app.render(store, path)
        first = time.perf_counter() - started
        started = time.perf_counter()
        again = dash_app.render(store, path)
        cached = time.perf_counter() - started
        assert not _errors(page) and again is page, (tab, _errors(page))
        if first > BUDGET_S or cached > CACHED_S:
            slow[tab or "run"] = (round(first, 2), round(cached, 3))
    assert not slow, f"(first, cached) seconds over ({BUDGET_S}, {CACHED_S}): {slow}"


@pytest.mark.browser
def test_the_run_page_loads_in_the_browser_within_budget(browser):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    root, suite, run_id = largest_fixture()
    server = serve_dashboard(root)
    base = next(server)
    try:
        url = f"{base}/run/{suite}/{run_id}"
        wait = WebDriverWait(browser, 60, poll_frequency=0.02, ignored_exceptions=(StaleElementReferenceException,))
        loads = []
        for _ in range(BROWSER_LOADS + 1):
            browser.get("about:blank")
            browser.get(url)
            loads.append(wait.until(lambda d: d.execute_script(DRAWN)) / 1e3)
        graphs = browser.execute_script("return document.querySelectorAll('#page .dash-graph').length")
        assert graphs == 2 * len(RunStore(root).report(suite, run_id).cases())
        assert min(loads[1:]) <= BUDGET_S, f"page loads (s, the first compiles the scripts): {loads}"
    finally:
        next(server, None)
