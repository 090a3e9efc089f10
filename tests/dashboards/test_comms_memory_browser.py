"""The Comms and Memory tabs in a real headless Chromium, on the committed reports: what plotly
drew and the tables hold is the data of the views. Comms (three gloo ranks, rank 1 slowed, a bus
bandwidth curve written into the copy's peaks by benchmarks/comms_busbw.py): the straggler table
names rank 1, the heatmap's colour range ignores the warm-up collective and crosses mark rank 1,
bandwidth on log-log axes beside the reference, headers with units. Memory (GPT-2 1.5B on an
H100): the trials shaded and the profiled steps drawn on the timeline, the activation treemap and
its table with the blocks folded, the phase deltas, the peak by allocation site (written into the
copy as memory_tracer.snapshot records it), where the step's wall time went."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from report_factory import serve_dashboard

from dashboards import comms_view, memory_view
from dslab.report import frames, read_report

pytestmark = pytest.mark.browser

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]
COMMS_RUN, COMMS_CASE = "20261126T020306Z-cbf34f", "124m"
GPT2_RUN, GPT2_CASE = "20261126T100551Z-d7b758", "1.5b"
REFERENCE = {1 << 20: [2.0, 2.2, 2.1], 64 << 20: [9.0, 9.5, 9.2]}
PEAK_SITES = {"peak_bytes": 40 << 30, "sites": [
    {"site": "(allocated before the trace)", "bytes": 30 << 30, "blocks": 600},
    {"site": "dslab/kernels/attention/attention.py:88 forward", "bytes": 6 << 30, "blocks": 48},
    {"site": "dslab/models/gpt2.py:210 forward", "bytes": 4 << 30, "blocks": 96}]}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("comms_memory_browser")
    shutil.copytree(FIXTURES / "comms_reports" / "gpt2" / COMMS_RUN, root / "gpt2" / COMMS_RUN)
    shutil.copytree(FIXTURES / "training_reports" / "gpt2" / GPT2_RUN, root / "gpt2" / GPT2_RUN)
    spec = importlib.util.spec_from_file_location("comms_busbw", REPO / "benchmarks" / "comms_busbw.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.write_reference(root / "gpt2" / COMMS_RUN, script.reference_record(REFERENCE, REFERENCE, 3, "CPU", 3))
    # the memory tracer's peak by allocation site, as a run with memory_tracer.snapshot records it
    run_json = root / "gpt2" / GPT2_RUN / "run.json"
    data = json.loads(run_json.read_text())
    data["profilers"]["memory"][GPT2_CASE]["peak_sites"] = PEAK_SITES
    run_json.write_text(json.dumps(data))
    return root


@pytest.fixture(scope="module")
def server(root):
    yield from serve_dashboard(root)


def _graph(browser, graph_id: str) -> dict:
    return browser.execute_script(
        "const g = document.querySelector('#' + arguments[0] + ' .js-plotly-plot');"
        "return {data: g._fullData.map(t => ({name: t.name, type: t.type, x: t.x ? Array.from(t.x) : null,"
        " y: t.y ? Array.from(t.y) : null, zmax: t.zmax, ids: t.ids ? Array.from(t.ids) : null,"
        " values: t.values ? Array.from(t.values) : null})),"
        " shapes: g._fullLayout.shapes.map(s => ({type: s.type, x0: s.x0, x1: s.x1, fill: s.fillcolor})),"
        " xtype: g._fullLayout.xaxis && g._fullLayout.xaxis.type, ytype: g._fullLayout.yaxis && g._fullLayout.yaxis.type}",
        graph_id)


def _plain(browser, table_id: str, columns: list[str]) -> list[dict]:
    """The rows of the plain table ``table_id`` (:func:`dashboards.components.plain_table`), in order."""
    return browser.execute_script(
        "return Array.from(document.querySelectorAll('#' + arguments[0] + ' tbody tr'))"
        ".map(r => Object.fromEntries(arguments[1].map(c => [c, r.querySelector('[data-field=\"' + c + '\"]').innerText])))",
        table_id, columns)


def _plain_headers(browser, table_id: str) -> list[str]:
    return browser.execute_script(
        "return Array.from(document.querySelectorAll('#' + arguments[0] + ' th')).map(e => e.innerText)", table_id)


def test_comms_tab_names_and_marks_the_late_rank(browser, server, root, tmp_path):
    from test_dashboard_browser import _load, _severe, _text

    report = read_report(root / "gpt2" / COMMS_RUN)
    calls = frames.comms_calls(report, case=COMMS_CASE, strict=True)
    analysis = frames.stragglers(report, case=COMMS_CASE, strict=True)
    matrix = comms_view.straggler_matrix(calls, analysis)
    rows = comms_view.straggler_rows(analysis, matrix)

    browser.get_log("browser")
    _load(browser, f"{server}/run/gpt2/{COMMS_RUN}/comms", tmp_path, "comms_tab")
    assert "could not be drawn" not in _text(browser)

    table = _plain(browser, "comms-stragglers-table", ["rank", "late", "times_last"])
    assert [(r["rank"], r["late"], r["times_last"]) for r in table] == [
        (str(r["rank"]), r["late"], str(r["times_last"])) for r in rows]
    assert {r["rank"]: r["late"] for r in table} == {"0": "no", "1": "yes", "2": "no"}
    assert _plain_headers(browser, "comms-ops")[:2] == ["op", "message bytes"]
    assert {"algbw GB/s", "busbw GB/s", "mean latency (ms)"} <= set(_plain_headers(browser, "comms-ops"))

    heatmap = _graph(browser, "comms-stragglers")
    cells, crosses = heatmap["data"]
    assert cells["type"] == "heatmap" and cells["zmax"] == pytest.approx(matrix["colour_max_ms"])
    assert cells["zmax"] < 200 < matrix["spread_ms"][0]  # the first collective is not the scale
    assert cells["y"] == ["rank 0", "rank 1 (straggler)", "rank 2"]
    assert crosses["y"] == [f"rank {r}" + (" (straggler)" if r == 1 else "") for r in matrix["last"]]

    bar = _graph(browser, "comms-caused-wait")["data"][0]
    by_rank = {r["rank"]: r["caused_wait_ms"] for r in rows}
    assert bar["y"] == pytest.approx([by_rank[r] for r in range(3)])

    bandwidth = _graph(browser, "comms-bandwidth")
    assert bandwidth["xtype"] == "log" and bandwidth["ytype"] == "log"
    points = comms_view.bandwidth_points(calls)
    (measured, reference) = bandwidth["data"]
    assert measured["name"] == "all_reduce" and measured["y"] == pytest.approx([p["busbw_GBps"] for p in points])
    assert reference["name"] == "measured all_reduce busbw (3 x CPU)"
    assert reference["x"] == [1 << 20, 64 << 20] and reference["y"] == [2.1, 9.2]

    step = _graph(browser, "comms-step")["data"]
    assert [t["name"] for t in step] == ["all_reduce"] and len(step[0]["x"]) == 1
    assert _severe(browser) == []


def test_memory_tab_marks_the_timeline_and_draws_the_module_tree(browser, server, root, tmp_path):
    from test_dashboard_browser import _load, _severe, _text

    report = read_report(root / "gpt2" / GPT2_RUN)
    data = report.profilers["memory"][GPT2_CASE]
    nodes = memory_view.activation_tree(frames.memory_activations(report, case=GPT2_CASE, strict=True))
    top = memory_view.activation_top_rows(nodes)

    browser.get_log("browser")
    _load(browser, f"{server}/run/gpt2/{GPT2_RUN}/memory?case={GPT2_CASE}", tmp_path, "memory_tab")
    page = _text(browser)
    assert "could not be drawn" not in page and "Where the step's wall time went" in page

    timeline = _graph(browser, "memory-timeline")
    rects = [(s["x0"], s["x1"], s["fill"]) for s in timeline["shapes"] if s["type"] == "rect"]
    assert len(rects) == 10 and rects[:2] == [(-0.5, 9.5, "#9ca3af"), (9.5, 29.5, "#1f77b4")]
    assert rects[-1] == (97.5, 117.5, "#1f77b4")
    assert sorted(s["x0"] for s in timeline["shapes"] if s["type"] == "line") == [3, 6]
    assert [t["name"] for t in timeline["data"]] == ["peak allocated", "peak reserved"]

    folded = memory_view.folded_activation_nodes(nodes)
    treemap = _graph(browser, "memory-activations")["data"][0]
    assert treemap["type"] == "treemap" and treemap["ids"] == [n["id"] for n in folded]
    assert treemap["values"] == [n["bytes"] for n in folded]
    assert "layers.*" in treemap["ids"] and "layers.0" not in treemap["ids"]  # the 48 blocks in one box
    table = _plain(browser, "memory-activations-top", ["module", "instances", "path"])
    assert [r["path"] for r in table] == [r["path"] for r in top]
    layers = next(r for r in table if r["path"] == "layers.*")
    assert layers["instances"] == "48" and layers["module"].strip() == "layers.*"

    phases = _plain(browser, "memory-phases", ["phase", "delta_mib"])
    assert [p["phase"] for p in phases] == ["forward", "backward", "optimizer step"]
    assert float(phases[0]["delta_mib"]) == pytest.approx(data["phases"]["forward_delta"] / 2**20, rel=1e-3)
    levels = _graph(browser, "memory-phase-levels")["data"][0]
    assert levels["y"] == pytest.approx([v for _, v in memory_view.phase_levels(data)])

    sites = _plain(browser, "memory-peak-sites", ["site", "gib", "share_pct"])
    assert [(r["site"], float(r["gib"]), float(r["share_pct"])) for r in sites] == [
        (s["site"], s["bytes"] / 2**30, 100.0 * s["bytes"] / PEAK_SITES["peak_bytes"]) for s in PEAK_SITES["sites"]]
    assert "traced peak: 40.00 GiB" in page

    step_ms = memory_view.profiled_result(report, GPT2_CASE).metrics["step_time_ms"]
    rows = memory_view.wall_clock_rows(frames.wall_clock(report, case=GPT2_CASE), step_ms)
    bar = _graph(browser, "memory-wall-clock-bar")["data"]
    assert [(t["name"], t["x"][0]) for t in bar] == [(r["phase"], pytest.approx(r["step_ms"])) for r in rows]
    assert _severe(browser) == []
