"""The Comms page on a report of real processes: ``dslab bench suites/gpt2`` at the tiny scale on
three gloo processes, rank 1 slowed by 150 ms a step (``fixtures/comms_reports``, whose README gives
the command). The views and the trace read every rank from it; in Chromium the per-op table has
rows, the bandwidth plot has a point per all_reduce, the straggler view names and marks rank 1,
and the Memory page has a row and a bar per rank."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from report_factory import serve_dashboard

from dashboards import comms_view, figures, memory_tab, memory_view
from dashboards.app import render
from dashboards.data import RunStore
from dslab.profilers.trace import build_trace
from dslab.report import frames, read_report

FIXTURES = Path(__file__).parent / "fixtures" / "comms_reports"
SUITE, RUN_ID, CASE = "gpt2", "20261126T020306Z-cbf34f", "124m"
WORLD, SLOW_RANK = 3, 1


@pytest.fixture(scope="module")
def comms() -> dict:
    return json.loads((FIXTURES / SUITE / RUN_ID / "run.json").read_text())["profilers"]["comms"][CASE]


def _collectives_with_payload(comms: dict) -> int:
    """The collectives with a payload (all_reduce; not the all_gather_object): one bandwidth point each."""
    return len({(r["op"], r["seq"]) for records in comms["per_rank"].values() for r in records
                if r["bytes"] > 0 and (r["latency_ms"] or 0) > 0})


def test_the_fixture_is_a_three_rank_run_with_rank_1_slowed(comms):
    report = read_report(FIXTURES / SUITE / RUN_ID)
    assert report.config["world_size"] == WORLD and report.config["inject_step_sleep_ms"] == 150
    assert comms["stragglers"] == [SLOW_RANK] and set(comms["per_rank"]) == {"0", "1", "2"}
    calls = frames.comms_calls(report, case=CASE, strict=True)
    assert comms_view.comms_op_rows(frames.comms_ops(report, case=CASE, strict=True))
    assert len(comms_view.bandwidth_points(calls)) == _collectives_with_payload(comms) == 4
    matrix = comms_view.straggler_matrix(calls, frames.stragglers(report, case=CASE, strict=True))
    assert matrix["ranks"] == [0, 1, 2] and matrix["stragglers"] == [SLOW_RANK]
    assert len(matrix["labels"]) == comms["straggler"]["matched"]
    assert all(wait == 0.0 for wait in matrix["wait_ms"][SLOW_RANK][1:])  # last to arrive after its first sleep
    assert matrix["last"][1:] == [SLOW_RANK] * 4
    assert all(late > 100 for late in matrix["lateness_ms"][SLOW_RANK])  # the dark row


def test_the_trace_has_a_process_per_rank():
    trace_pb2 = pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2")
    trace = trace_pb2.Trace.FromString(build_trace(read_report(FIXTURES / SUITE / RUN_ID)))
    processes = [p.track_descriptor.process.process_name for p in trace.packet
                 if p.HasField("track_descriptor") and p.track_descriptor.HasField("process")]
    assert processes == [f"{CASE} rank {r}" for r in range(WORLD)]


def test_memory_per_rank_has_each_ranks_peak_and_model_states():
    report = read_report(FIXTURES / SUITE / RUN_ID)
    ranks = frames.rank_memory(report, case=CASE, strict=True)
    assert memory_view.rank_count(ranks) == WORLD
    rows = memory_view.rank_memory_rows(ranks)
    (trial,) = report.result(CASE, "dslab").trials
    states = report.profilers["memory"][CASE]["model_states_per_rank"]
    assert [(r["arm"], r["rank"], r["kind"], r["trials"]) for r in rows] == [("dslab", r, "host RSS", 1)
                                                                             for r in range(WORLD)]
    assert [r["peak_gib"] * 2**30 for r in rows] == [trial.metrics[f"peak_rss_bytes_rank{r}"] for r in range(WORLD)]
    assert [r["model_states_gib"] * 2**30 for r in rows] == [s["total"] for s in states]
    assert sum(r["peak_over_mean"] for r in rows) == pytest.approx(WORLD)
    bar = figures.rank_memory_bar(rows, CASE)
    assert [t.name for t in bar.data] == ["dslab: host RSS", "dslab: model states"]
    assert list(bar.data[0].x) == [f"rank {r}" for r in range(WORLD)]

    page = str(render(RunStore(FIXTURES), f"/run/{SUITE}/{RUN_ID}/memory"))
    assert "Memory per rank" in page and "memory-ranks-bar" in page and "could not be drawn" not in page
    assert "memory-ranks" not in str(render(RunStore(FIXTURES), f"/run/{SUITE}/{RUN_ID}/comms"))
    del report.profilers["memory"]  # no memory trace: the peaks per rank still shown, without model states
    page = str(memory_tab.memory_tab(report, SUITE, RUN_ID, None))
    assert "no memory trace in this run" in page and "memory-ranks-bar" in page


def test_memory_per_rank_is_left_out_for_one_rank():
    gpu_reports = FIXTURES.parent / "gpu_reports"
    store = RunStore(gpu_reports)
    for run in sorted(gpu_reports.glob("*/*/run.json")):
        suite, run_id = run.parent.parent.name, run.parent.name
        assert frames.rank_memory(read_report(run.parent)).empty
        page = str(render(store, f"/run/{suite}/{run_id}/memory"))
        assert "Timeline" in page  # the memory trace is drawn
        assert "Memory per rank" not in page and "memory-ranks" not in page


@pytest.fixture(scope="module")
def comms_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("comms_reports")
    shutil.copytree(FIXTURES / SUITE, root / SUITE)
    yield from serve_dashboard(root)


@pytest.mark.browser
def test_comms_page_shows_every_rank_and_names_the_straggler(browser, comms_server, tmp_path, comms):
    from test_dashboard_browser import _check_page, _wait

    page = _check_page(browser, comms_server, tmp_path, "comms_three_ranks", f"/run/{SUITE}/{RUN_ID}/comms", 2,
                       "Per op (reporting rank)")
    assert f"stragglers named: rank {SLOW_RANK}" in page

    rows = _wait(browser).until(lambda d: d.execute_script(
        "return Array.from(document.querySelectorAll('#comms-ops tbody tr')).map(r => r.innerText)"))
    assert len(rows) == len(comms["ops"]) and any("all_reduce" in row for row in rows)

    def plotted(graph_id):
        return browser.execute_script(
            "const g = document.querySelector(arguments[0] + ' .js-plotly-plot');"
            "return g && g._fullData ? g._fullData.map(t => ({name: t.name, type: t.type, n: (t.x || []).length,"
            " y: t.y})) : null", f"#{graph_id}")

    (bandwidth,) = plotted("comms-bandwidth")
    assert bandwidth["name"] == "all_reduce" and bandwidth["n"] == _collectives_with_payload(comms)
    heatmap, crosses = plotted("comms-stragglers")
    assert heatmap["type"] == "heatmap" and heatmap["n"] == comms["straggler"]["matched"]
    assert heatmap["y"] == ["rank 0", f"rank {SLOW_RANK} (straggler)", "rank 2"]
    assert crosses["y"][1:] == [f"rank {SLOW_RANK} (straggler)"] * 4


@pytest.mark.browser
def test_memory_page_shows_a_row_and_a_bar_per_rank(browser, comms_server, tmp_path):
    from test_dashboard_browser import _load, _severe, _text, _wait

    browser.get_log("browser")  # drop what earlier pages logged
    _load(browser, f"{comms_server}/run/{SUITE}/{RUN_ID}/memory", tmp_path, "memory_three_ranks")
    page = _text(browser)
    assert "Memory per rank" in page and "could not be drawn" not in page
    rows = _wait(browser).until(lambda d: d.execute_script(
        "return Array.from(document.querySelectorAll('#memory-ranks .ag-center-cols-container .ag-row'))"
        ".map(r => ({rank: r.querySelector('[col-id=\"rank\"]').innerText,"
        " kind: r.querySelector('[col-id=\"kind\"]').innerText}))"))
    assert sorted(r["rank"] for r in rows) == [str(r) for r in range(WORLD)]
    assert {r["kind"] for r in rows} == {"host RSS"}
    bars = browser.execute_script(
        "const g = document.querySelector('#memory-ranks-bar .js-plotly-plot');"
        "return g && g._fullData ? g._fullData.map(t => ({name: t.name, x: t.x})) : null")
    assert [b["name"] for b in bars] == ["dslab: host RSS", "dslab: model states"]
    assert all(b["x"] == [f"rank {r}" for r in range(WORLD)] for b in bars)
    assert _severe(browser) == []
