"""An autotune run's page in a real headless Chromium, on a generated ``dslab autotune`` report
(:func:`report_factory.make_autotune_report`): the summary line, the experiments table with every
experiment in run order and its status, plotly's metric figure with the pruned experiments marked
apart (in the strip of experiments without a metric, their own symbol), the running best and the best experiment, the memory figure with
the pruned estimates above the budget line; the console has no errors. An autotune run without the
section shows why instead."""

from __future__ import annotations

import pytest
from report_factory import (
    AUTOTUNE_EXPERIMENTS,
    AUTOTUNE_RUN_ID,
    AUTOTUNE_SUITE,
    make_autotune_report,
    serve_dashboard,
    write_run,
)

pytestmark = pytest.mark.browser

EMPTY_RUN = "20261207T110000Z-tune01"
NAMES = [e[0] for e in AUTOTUNE_EXPERIMENTS]
PRUNED_RUNS = [i + 1 for i, e in enumerate(AUTOTUNE_EXPERIMENTS) if e[5] == "pruned"]


@pytest.fixture(scope="module")
def autotune_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("autotune_browser")
    write_run(root, make_autotune_report())
    empty = make_autotune_report(EMPTY_RUN)
    empty["profilers"] = {}
    write_run(root, empty)
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


def _drawn(browser, graph_id: str) -> dict:
    """``{trace name: [type, x, y, marker symbol]}`` of what plotly drew in graph ``graph_id``, in
    the order of its traces."""
    pairs = browser.execute_script(
        "const g = document.getElementById(arguments[0]).querySelector('.js-plotly-plot');"
        "return g._fullData.map(t => [t.name, [t.type, Array.from(t.x), Array.from(t.y),"
        " t.marker ? t.marker.symbol : null]])", graph_id)
    return dict(pairs)


def test_the_run_page_draws_the_experiments_and_the_pruned_marker(browser, autotune_server, tmp_path):
    text = _open(browser, f"{autotune_server}/run/{AUTOTUNE_SUITE}/{AUTOTUNE_RUN_ID}")
    assert "could not be drawn" not in text and "This page could not be drawn" not in text
    for title in ("Autotuning", "Metric per experiment", "Estimated memory against the budget", "Experiments"):
        assert title in text
    assert ("gridsearch tuner on throughput (higher is better): best z1_mbs4_gas1 at 170 samples/s; 9 experiments "
            "in 225 s: 4 ok, 1 early stopped, 2 pruned, 1 out of memory, 1 failed.") in text

    rows = browser.execute_script(
        "return Array.from(document.querySelectorAll('#autotune-experiments .ag-center-cols-container .ag-row'))"
        ".sort((a, b) => Number(a.getAttribute('row-index')) - Number(b.getAttribute('row-index')))"
        ".map(r => [r.querySelector('[col-id=name]').innerText, r.querySelector('[col-id=status]').innerText])")
    assert rows == [[e[0], e[5]] for e in AUTOTUNE_EXPERIMENTS]
    table = browser.find_element("id", "autotune-experiments").text
    assert "estimated 91.2 GB > 80.0 GB budget" in table and "offload_optimizer=cpu" in table

    metric = _drawn(browser, "autotune-metric")
    assert list(metric) == ["ok", "early stopped", "pruned", "out of memory", "failed", "running best", "best"]
    assert metric["pruned"] == ["scatter", PRUNED_RUNS, ["pruned", "pruned"], "x"]
    assert metric["ok"][1:3] == [[1, 2, 4, 7], [110, 150, 170, 165]]
    assert metric["early stopped"][1:] == [[6], [120], "diamond-open"]
    assert metric["best"][1:] == [[4], [170], "star"]
    assert metric["running best"][2] == [110, 150, 150, 170, 170, 170, 170, 170, 170]
    symbols = [v[3] for k, v in metric.items() if k != "running best"]
    assert len(set(symbols)) == len(symbols)
    # the strip under the metric's axis: the pruned, out-of-memory and failed marks, drawn
    strip = browser.execute_script(
        "return Array.from(document.querySelectorAll('#autotune-metric .subplot.x2y2 .scatterlayer .trace'))"
        ".map(t => t.querySelectorAll('.point').length)")
    assert strip == [len(PRUNED_RUNS), 1, 1]

    memory = _drawn(browser, "autotune-memory")
    assert memory["estimate, pruned"][:2] == ["bar", PRUNED_RUNS]
    assert memory["estimate, pruned"][2] == pytest.approx([91.2, 120.5])
    budget = browser.execute_script(
        "const g = document.getElementById('autotune-memory').querySelector('.js-plotly-plot');"
        "return g._fullLayout.shapes.map(s => [s.y0, s.y1, s.line.dash])")
    assert budget == [[80, 80, "dash"]]
    assert [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    browser.save_screenshot(str(tmp_path / "autotune.png"))


def test_an_autotune_run_without_the_section_says_why(browser, autotune_server):
    text = _open(browser, f"{autotune_server}/run/{AUTOTUNE_SUITE}/{EMPTY_RUN}")
    assert "no autotuning results in this run" in text and 'profilers["autotuning"]' in text
    assert "could not be drawn" not in text and "Traceback" not in text
    assert browser.find_elements("id", "autotune-metric") == []
    assert [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
