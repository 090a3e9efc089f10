"""The Runs and Compare pages in a real headless Chromium, over runs whose gate verdicts are known
(:mod:`compare_factory`): plotly drew one history line per GPU model and one axis per case, the
gate's regression mark on the slowed run, the compare link names two runs of one suite, and the
Compare page shows A and B apart, the verdict column's text and the change per case."""

from __future__ import annotations

import pytest
from compare_factory import H100, H200, make_trial_report
from report_factory import make_small_report, serve_dashboard, write_run

pytestmark = pytest.mark.browser

A_ID, B_ID, C_ID = "20261201T100000Z-h100aa", "20261202T100000Z-h100bb", "20261203T100000Z-h200cc"
LONE = "20261204T100000Z-bert01"


@pytest.fixture(scope="module")
def compare_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare_browser")
    write_run(root, make_trial_report(A_ID, created="2026-12-01T10:00:00+00:00", gpu=H100))
    write_run(root, make_trial_report(B_ID, created="2026-12-02T10:00:00+00:00", gpu=H100, slowdown={"124m": 0.9}))
    write_run(root, make_trial_report(C_ID, created="2026-12-03T10:00:00+00:00", gpu=H200))
    write_run(root, make_small_report(LONE, "bert_large", "2026-12-04T10:00:00+00:00", 50.0))  # newest, alone
    yield from serve_dashboard(root)


def _open(browser, url: str, graphs: int):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get_log("browser")
    browser.get(url)
    wait = WebDriverWait(browser, 30, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,))
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#page h2"))
    wait.until(lambda d: d.execute_script(
        f"const gs = document.querySelectorAll('.dash-graph'); return gs.length >= {graphs} && "
        "Array.from(gs).every(g => g.querySelector('.main-svg'))"))
    return wait


def _drawn(browser, graph_id: str) -> list[dict]:
    return browser.execute_script(
        f"const g = document.getElementById('{graph_id}').querySelector('.js-plotly-plot');"
        "return g._fullData.map(t => ({name: t.name, meta: t.meta, yaxis: t.yaxis, visible: t.visible,"
        " mode: t.mode, x: Array.from(t.x || []), y: Array.from(t.y || []), text: t.text}))")


def _severe(browser) -> list:
    return [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_runs_page_history_and_default_pair(browser, compare_server):
    from selenium.webdriver.common.by import By

    wait = _open(browser, compare_server + "/", 2)
    href = wait.until(lambda d: d.find_element(By.ID, "compare-link").get_attribute("href")).replace("%2F", "/")
    assert f"a=gpt2/{B_ID}" in href and f"b=gpt2/{C_ID}" in href  # gpt2's newest two, not bert_large's lone run
    traces = _drawn(browser, "history-gpt2")
    lines = {(t["name"], t["meta"]): t for t in traces if t["mode"] == "lines+markers"}
    assert lines[(f"dslab on {H100}", "124m")]["y"] == pytest.approx([900.0, 810.0])
    assert lines[(f"dslab on {H200}", "124m")]["y"] == pytest.approx([900.0])
    assert lines[(f"dslab on {H100}", "1.5b")]["y"] == pytest.approx([60.0, 60.0])
    assert {lines[(f"dslab on {gpu}", "124m")]["yaxis"] for gpu in (H100, H200)} == {"y"}
    assert {lines[(f"dslab on {gpu}", "1.5b")]["yaxis"] for gpu in (H100, H200)} == {"y2"}
    assert lines[(f"torch on {H100}", "124m")]["visible"] == "legendonly"
    bands = [t for t in traces if t["name"] == f"dslab on {H100}: trial min-max" and t["meta"] == "124m"]
    assert len(bands) == 1 and max(bands[0]["y"]) == pytest.approx(909.0) and min(bands[0]["y"]) == pytest.approx(801.9)
    marks = [t for t in traces if t["name"] == "gate: regression against the previous run"]
    assert [(m["meta"], m["yaxis"], m["y"]) for m in marks] == [("124m", "y", pytest.approx([810.0]))]
    assert not _severe(browser)


def test_compare_page_shows_a_and_b_apart_the_verdicts_and_the_change(browser, compare_server):
    from selenium.webdriver.common.by import By

    wait = _open(browser, f"{compare_server}/compare?a=gpt2/{A_ID}&b=gpt2/{B_ID}", 1)
    header = browser.find_element(By.ID, "compare-runs")
    assert [th.text for th in header.find_elements(By.CSS_SELECTOR, "thead th")] == ["", "A (baseline)", "B (candidate)"]
    runs = {row.find_element(By.TAG_NAME, "th").text: [td.text for td in row.find_elements(By.TAG_NAME, "td")]
            for row in header.find_elements(By.CSS_SELECTOR, "tbody tr")}
    assert runs["run"] == [A_ID, B_ID] and runs["suite"] == ["gpt2", "gpt2"] and runs["GPU"] == [H100, H100]
    assert "regression: 124m/dslab" in browser.find_element(By.ID, "compare-outcome").text

    cells = wait.until(lambda d: d.execute_script(
        "const rows = document.querySelectorAll('#compare-verdicts .ag-center-cols-container .ag-row');"
        "const cell = (r, c) => (r.querySelector(`[col-id=\"${c}\"]`) || {}).textContent;"
        "const out = Array.from(rows).map(r => [cell(r, 'case'), cell(r, 'arm'), cell(r, 'B_over_A'), cell(r, 'verdict')]);"
        "return out.length == 4 && out.every(r => r[3]) ? out : null"))
    assert sorted(cells) == [["1.5b", "dslab", "1", "no change"], ["1.5b", "torch", "1", "no change"],
                             ["124m", "dslab", "0.9", "regression"], ["124m", "torch", "1", "no change"]]
    headers = browser.execute_script(
        "return Array.from(document.querySelectorAll('#compare-verdicts .ag-header-cell-text')).map(e => e.textContent)")
    assert "A: samples/s (median)" in headers and "B/A" in headers and "gate verdict" in headers

    traces = _drawn(browser, "compare-change")
    mark = [t for t in traces if t["name"] == "gate: regression"]
    assert [(m["meta"], m["x"], m["y"]) for m in mark] == [("124m", ["dslab"], pytest.approx([0.9]))]
    b_124m = next(t for t in traces if t["name"] == f"B: gpt2/{B_ID}" and t["meta"] == "124m")
    assert b_124m["y"] == pytest.approx([0.9, 1.0]) and b_124m["text"] == ["0.900", "1.000"]
    assert {t["yaxis"] for t in traces if t["meta"] == "1.5b"} == {"y2"}
    layout = browser.execute_script(
        "const l = document.getElementById('compare-change').querySelector('.js-plotly-plot')._fullLayout;"
        "return [l.shapes.map(s => [s.y0, s.y1, s.yref]), l.yaxis.range]")
    assert layout[0] == [[0.95, 1.05, "y"], [0.95, 1.05, "y2"]]  # the gate's threshold around 1
    assert 0.8 < layout[1][0] < 0.9 * 0.99  # fitted to the trials, not stretched to 0
    assert not _severe(browser)


def test_runs_on_other_gpus_are_not_comparable(browser, compare_server):
    from selenium.webdriver.common.by import By

    wait = _open(browser, f"{compare_server}/compare?a=gpt2/{A_ID}&b=gpt2/{C_ID}", 1)
    outcome = browser.find_element(By.ID, "compare-outcome").text
    assert outcome.startswith("The gate cannot compare these runs") and H200 in outcome
    verdicts = wait.until(lambda d: d.execute_script(
        "const cells = document.querySelectorAll('#compare-verdicts .ag-center-cols-container [col-id=\"verdict\"]');"
        "return cells.length == 4 ? Array.from(cells).map(c => c.textContent) : null"))
    assert verdicts == ["not comparable"] * 4
    assert not _severe(browser)
