"""The Flops tab in a real headless Chromium over a real GPU report (GPT-2 124M, kept under
``fixtures/training_reports``): the module table holds one row per module under readable headers,
its depth filter leaves depth 3 with every attention block, the treemap names the model's own ops
with their flops, the roofline's legend names each depth; a case whose profile never ran shows one
message with the reason. The console has no errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from report_factory import make_report, serve_dashboard, write_run

from dashboards import flops_view

pytestmark = pytest.mark.browser

RUN = "20261127T050756Z-85c737"
REPORT = Path(__file__).parent / "fixtures" / "training_reports" / "gpt2" / RUN / "run.json"
NOT_PROFILED = "20261201T100000Z-noprof"


@pytest.fixture(scope="module")
def flops_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("flops_browser")
    (root / "gpt2" / RUN).mkdir(parents=True)
    shutil.copy(REPORT, root / "gpt2" / RUN / "run.json")
    data = make_report(NOT_PROFILED, "gpt2_medium")
    data["profilers"]["flops"] = {"seq128": {"profiled": False, "profile_step": 40}}
    write_run(root, data)
    yield from serve_dashboard(root)


def _wait(browser):
    from selenium.common.exceptions import JavascriptException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, 30, poll_frequency=0.2,
                         ignored_exceptions=(StaleElementReferenceException, JavascriptException))


def _expected():
    from dslab.report import frames, read_report

    report = read_report(REPORT)
    nodes = flops_view.flops_tree(frames.flops_modules(report, case="124m", strict=True))
    model = next(n for n in nodes if n["id"] == "(root)")
    top = sum(n["flops"] for n in nodes if n["parent"] == "(root)")
    return nodes, model["flops"] - top


def test_flops_tab_draws_the_module_table_treemap_and_roofline(browser, flops_server):
    from selenium.webdriver.common.by import By

    nodes, root_own_ops = _expected()
    browser.get_log("browser")
    browser.get(f"{flops_server}/run/gpt2/{RUN}/flops?case=124m")
    wait = _wait(browser)
    wait.until(lambda d: d.execute_script(
        "const gs = document.querySelectorAll('.dash-graph');"
        "return gs.length == 2 && Array.from(gs).every(g => g.querySelector('.main-svg'))"))
    wait.until(lambda d: d.execute_script("return dash_ag_grid.getApi('flops-modules').getDisplayedRowCount()") > 0)
    grid = browser.execute_script(
        "const api = dash_ag_grid.getApi('flops-modules');"
        "const rows = []; api.forEachNodeAfterFilterAndSort(n => rows.push(n.data.module));"
        "return [api.getColumnDefs().map(c => c.headerName), rows]")
    assert grid[0] == [header for _, header in flops_view.MODULE_COLUMNS]
    assert grid[1] == [n["id"] for n in sorted(nodes, key=lambda n: n["order"])]  # one row per module
    shown = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#flops-modules .ag-header-cell-text")]
    assert "module" in shown and "params (M)" in shown and "depth" in shown
    # the widths set on the server fit every header and every drawn cell: no text is cut
    cut = browser.execute_script(
        "return Array.from(document.querySelectorAll('#flops-modules .ag-header-cell-text, #flops-modules .ag-cell'))"
        ".filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.innerText)")
    assert cut == []
    # the depth column's number filter: depth 3 is every block's attention, MLP and norms
    depth3 = browser.execute_script(
        "const api = dash_ag_grid.getApi('flops-modules');"
        "api.setFilterModel({depth: {filterType: 'number', type: 'equals', filter: 3}});"
        "const rows = []; api.forEachNodeAfterFilter(n => rows.push([n.data.module, n.data.type])); return rows")
    assert [m for m, t in depth3 if t == "SelfAttention"] == [f"layers.{i}.attention" for i in range(12)]
    assert len(depth3) == sum(1 for n in nodes if n["depth"] == 3) == 48
    wait.until(lambda d: "layers.0.attention" in d.find_element(By.ID, "flops-modules").text)

    tree = browser.execute_script(
        "const g = document.getElementById('flops-treemap').querySelector('.js-plotly-plot');"
        "const t = g._fullData[0];"
        "return [Array.from(t.ids), Array.from(t.labels), Array.from(t.values), t.branchvalues,"
        " Array.from(g.querySelectorAll('.slicetext')).map(e => e.textContent)]")
    ids, labels, values, branchvalues, drawn = tree
    assert branchvalues == "total" and labels.count("(own ops)") > 1
    assert values[ids.index("(root) (own ops)")] == root_own_ops
    assert any(text.startswith("(own ops)") for text in drawn), drawn  # drawn, with its label

    legend = browser.execute_script(
        "const g = document.getElementById('flops-roofline').querySelector('.js-plotly-plot');"
        "return [Array.from(g.querySelectorAll('.legendtext')).map(e => e.textContent),"
        " g._fullLayout.xaxis.title.text, g._fullLayout.yaxis.title.text]")
    assert {"modules at depth 3", "modules at depth 4"} <= set(legend[0]), legend[0]
    assert "FLOP/byte" in legend[1] and "TFLOP/s" in legend[2]
    types = browser.find_element(By.ID, "flops-types").text
    assert "SelfAttention" in types and "share of model flops (%)" in types
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe


def test_a_profile_that_never_ran_shows_the_reason(browser, flops_server):
    from selenium.webdriver.common.by import By

    browser.get_log("browser")
    browser.get(f"{flops_server}/run/gpt2_medium/{NOT_PROFILED}/flops")
    message = _wait(browser).until(lambda d: d.find_element(By.ID, "flops-no-profile").text)
    assert "did not profile this case" in message and "step 40 (flops_profiler.profile_step)" in message
    page = browser.find_element(By.ID, "page")
    assert not page.find_elements(By.CSS_SELECTOR, ".dash-graph, .ag-root-wrapper, h3")
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe
