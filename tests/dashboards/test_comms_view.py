"""The Comms tab's views (dashboards/comms_view.py) on constructed records and the committed
reports: a rank late by 5 ms is named, marked and has the largest caused wait; a warm-up
collective a second and a half late does not set the colour range; bus bandwidth is one point per
collective with the op's bus factor, beside the curve benchmarks/comms_busbw.py writes into the
run's peaks; one step's collectives of a 4-GPU ZeRO run; the tables' headers carry units."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from report_factory import RUN_IDS, STRAGGLER_RANK, comms_record, late_rank_records, make_report
from table_reader import read_plain_table

from dashboards import comms_tab, comms_view, figures
from dslab.profilers.comms_analysis import bus_factor
from dslab.report import frames, read_report, report_from_dict

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]
CASE = "seq128"


def _report(per_rank: dict, **peaks):
    data = make_report(RUN_IDS[0])
    data["profilers"]["comms"] = {CASE: comms_record(per_rank)}
    data["peaks"].update(peaks)
    return report_from_dict(data)


def _frames(report, case: str = CASE):
    return frames.comms_calls(report, case=case, strict=True), frames.stragglers(report, case=case, strict=True)


def _components(tree, kind: str) -> list:
    """Every component of type ``kind`` (``"Graph"``, ``"AgGrid"``) under ``tree``."""
    found = []

    def walk(node):
        if isinstance(node, (list, tuple)):
            for child in node:
                walk(child)
        elif hasattr(node, "to_plotly_json"):
            if type(node).__name__ == kind:
                found.append(node)
            walk(getattr(node, "children", None))

    walk(tree)
    return found


def test_the_bus_factors_are_the_comms_analysis_ones():
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv", "barrier"):
        for n in range(1, 10):
            assert comms_view.bus_factor(op, n) == bus_factor(op, n), (op, n)


def test_a_rank_late_by_5_ms_is_named_marked_and_caused_the_most_wait():
    report = _report(late_rank_records(late_rank=2, late_ms=5.0))
    calls, analysis = _frames(report)
    matrix = comms_view.straggler_matrix(calls, analysis)
    assert matrix["stragglers"] == [2] and matrix["last"] == [2] * 12 and matrix["clipped"] == 0
    assert all(4.7 <= v <= 5.3 for v in matrix["lateness_ms"][2])
    assert all(v <= 0.3 for rank in (0, 1, 3) for v in matrix["lateness_ms"][rank])
    assert matrix["colour_max_ms"] == pytest.approx(max(matrix["spread_ms"]))

    rows = comms_view.straggler_rows(analysis, matrix)
    assert [r["rank"] for r in rows][0] == 2 and [r["late"] for r in rows] == ["yes", "no", "no", "no"]
    late = rows[0]
    assert late["times_last"] == 12 and late["caused_wait_ms"] == pytest.approx(12 * 5.0, abs=12 * 0.3)
    assert late["mean_lateness_ms"] == pytest.approx(5.0, abs=0.3) and late["median_lateness_ms"] > 4.7
    assert all(r["caused_wait_ms"] == 0.0 and r["times_last"] == 0 for r in rows[1:])

    heatmap = figures.straggler_heatmap(matrix, CASE)
    cells, crosses = heatmap.data
    assert list(cells.y) == ["rank 0", "rank 1", "rank 2 (straggler)", "rank 3"]
    assert cells.zmax == matrix["colour_max_ms"] and cells.zmin == 0
    assert list(crosses.y) == ["rank 2 (straggler)"] * 12 and list(crosses.x) == list(range(12))
    assert "stragglers named: rank 2" in heatmap.layout.title.text
    bar = comms_view.caused_wait_bar(rows, CASE).data[0]
    assert list(bar.x) == [f"rank {r}" for r in range(4)] and bar.y[2] == late["caused_wait_ms"]
    assert list(bar.marker.color) == [comms_view.OTHER_COLOUR] * 2 + [comms_view.LATE_COLOUR, comms_view.OTHER_COLOUR]


def test_a_large_first_collective_does_not_set_the_colour_range():
    report = _report(late_rank_records(late_rank=2, late_ms=5.0, first_late=(1, 1500.0)))
    matrix = comms_view.straggler_matrix(*_frames(report))
    assert matrix["spread_ms"][0] > 1400 and matrix["last"][0] == 1
    steady = matrix["spread_ms"][1:]
    assert matrix["colour_max_ms"] == max(steady) < 6 and matrix["clipped"] == 1
    assert matrix["lateness_ms"][1][0] > 1400  # the hover still has the true value
    heatmap = figures.straggler_heatmap(matrix, CASE)
    assert heatmap.data[0].zmax == max(steady)
    assert "1 collective(s) later still" in heatmap.layout.title.text


def test_colour_max_is_tukeys_fence_of_the_spreads_with_a_floor():
    assert comms_view.colour_max([]) == 1.0
    assert comms_view.colour_max([0.1, 0.2, 0.3]) == 1.0  # below the floor: nobody was late
    assert comms_view.colour_max([5.0, 5.2, 4.9, 5.1, 900.0]) == 5.2
    assert comms_view.colour_max([10.0, 200.0, 400.0, 600.0]) == 600.0  # spread evenly: nothing clipped


def test_bus_bandwidth_is_one_point_per_collective_at_the_fastest_members_latency():
    report = _report(late_rank_records(late_rank=3, late_ms=5.0, collectives=6))
    calls, _ = _frames(report)
    points = comms_view.bandwidth_points(calls)
    assert len(points) == 6 and {p["op"] for p in points} == {"all_reduce"}
    for p in points:
        assert p["rank"] == 3 and p["latency_ms"] == pytest.approx(0.25)  # the last arriver did not wait
        assert p["busbw_GBps"] == pytest.approx((8 << 20) / 0.25e-3 / 1e9 * 2 * 3 / 4)
    fig = figures.comms_bandwidth(points, None, CASE)
    assert [t.name for t in fig.data] == ["all_reduce"] and list(fig.data[0].y) == [p["busbw_GBps"] for p in points]
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"


def test_over_the_limit_the_bandwidth_plot_draws_the_median_per_op_and_size_with_its_range():
    report = read_report(FIXTURES / "zero_reports" / "zero" / "20261128T212522Z-68abb2")
    points = comms_view.bandwidth_points(frames.comms_calls(report, case="355m-n4 dslab-zero2", strict=True))
    assert len(points) > comms_view.BANDWIDTH_POINTS_MAX
    sizes = comms_view.bandwidth_by_size(points)
    assert sum(s["count"] for s in sizes) == len(points) and len(sizes) < 20
    for s in sizes:
        mine = sorted(p["busbw_GBps"] for p in points if (p["op"], p["bytes"]) == (s["op"], s["bytes"]))
        middle = len(mine) // 2
        median = mine[middle] if len(mine) % 2 else (mine[middle - 1] + mine[middle]) / 2
        assert (s["count"], s["busbw_min_GBps"], s["busbw_max_GBps"]) == (len(mine), mine[0], mine[-1])
        assert s["busbw_GBps"] == pytest.approx(median)
    fig = figures.comms_bandwidth(points, None, "355m-n4 dslab-zero2")
    assert f"{len(points)} collectives: the median per op and message size" in fig.layout.title.text
    drawn = [(t.name, x, y, hi, lo) for t in fig.data
             for x, y, hi, lo in zip(t.x, t.y, t.error_y.array, t.error_y.arrayminus)]
    assert drawn == [(s["op"], s["bytes"], s["busbw_GBps"], s["busbw_max_GBps"] - s["busbw_GBps"],
                      s["busbw_GBps"] - s["busbw_min_GBps"]) for s in sizes]
    few = points[:comms_view.BANDWIDTH_POINTS_MAX]  # at the limit: a marker per collective
    assert sum(len(t.x) for t in figures.comms_bandwidth(few, None, "c").data) == len(few)


def test_the_three_rank_report_has_a_point_per_all_reduce_and_the_warm_up_clipped():
    run = FIXTURES / "comms_reports" / "gpt2" / "20261126T020306Z-cbf34f"
    report = read_report(run)
    calls, analysis = _frames(report, "124m")
    raw = json.loads((run / "run.json").read_text())["profilers"]["comms"]["124m"]["per_rank"]
    points = comms_view.bandwidth_points(calls)
    assert [p["seq"] for p in points] == [0, 1, 2, 3]  # all_gather_object moves no payload
    for p in points:
        latencies = [next(r["latency_ms"] for r in raw[str(k)] if r["op"] == "all_reduce" and r["seq"] == p["seq"])
                     for k in range(3)]
        assert p["latency_ms"] == min(latencies)
        assert p["busbw_GBps"] == pytest.approx(p["bytes"] / (min(latencies) * 1e-3) / 1e9 * 4 / 3)
    matrix = comms_view.straggler_matrix(calls, analysis)
    assert matrix["stragglers"] == [1] and matrix["last"][1:] == [1, 1, 1, 1]
    assert matrix["spread_ms"][0] > 1000 and matrix["clipped"] == 1 and matrix["colour_max_ms"] < 200
    rows = {r["rank"]: r for r in comms_view.straggler_rows(analysis, matrix)}
    assert rows[1]["late"] == "yes" and rows[1]["times_last"] == 4
    assert rows[1]["median_lateness_ms"] == max(r["median_lateness_ms"] for r in rows.values())


def _busbw_script():
    spec = importlib.util.spec_from_file_location("comms_busbw", REPO / "benchmarks" / "comms_busbw.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_measured_curve_comms_busbw_writes_is_the_reference_line(tmp_path):
    script = _busbw_script()
    run = tmp_path / "gpt2" / "20261126T020306Z-cbf34f"
    shutil.copytree(FIXTURES / "comms_reports" / "gpt2" / run.name, run)
    before = json.loads((run / "run.json").read_text())
    direct = {1 << 20: [20.0, 22.0, 21.0], 256 << 20: [150.0, 160.0, 155.0]}
    logged = {1 << 20: [19.0, 20.0, 21.0], 256 << 20: [149.0, 150.0, 151.0]}
    record = script.reference_record(direct, logged, world=2, gpu="NVIDIA H200", trials=3)
    assert [(p["size_bytes"], p["busbw_GBps"], p["logged_busbw_GBps"]) for p in record["points"]] == [
        (1 << 20, 21.0, 20.0), (256 << 20, 155.0, 150.0)]
    script.write_reference(run, record)
    after = json.loads((run / "run.json").read_text())
    assert after["peaks"] == {**before["peaks"], "comms_busbw": record}
    assert {k: v for k, v in after.items() if k != "peaks"} == {k: v for k, v in before.items() if k != "peaks"}

    report = read_report(run)
    reference = comms_view.reference_busbw(report)
    assert reference["label"] == "measured all_reduce busbw (2 x NVIDIA H200)"
    fig = figures.comms_bandwidth(comms_view.bandwidth_points(frames.comms_calls(report, case="124m")), reference, "124m")
    line = fig.data[-1]
    assert line.name == reference["label"] and list(line.x) == [1 << 20, 256 << 20] and list(line.y) == [21.0, 155.0]
    with pytest.raises(FileNotFoundError, match="no run report"):
        script.write_reference(tmp_path, record)

    report.peaks["comms_busbw"] = {"points": [{"size_bytes": 1024}]}
    with pytest.raises(ValueError, match=r"peaks.comms_busbw.points\[0\]"):
        comms_view.reference_busbw(report)


def test_one_step_of_a_four_gpu_zero_run_shows_each_bucket():
    report = read_report(FIXTURES / "zero_reports" / "zero" / "20261128T212522Z-68abb2")
    key = "355m-n4 dslab-zero2"
    calls = frames.comms_calls(report, case=key, strict=True)
    steps = comms_view.step_calls(calls, 0)
    assert sorted(steps) == list(range(33))
    # 31 collectives a step, and the runner's all_gather_object after each of the 3 trials
    assert sorted(len(g) for g in steps.values()) == [31] * 30 + [32] * 3
    assert all(g[-1]["op"] == "all_gather_object" for g in steps.values() if len(g) == 32)
    mine = [c for c in frames.records(calls) if c["rank"] == 0 and c["step"] == 20]
    group = steps[20]
    assert [c["op"] for c in group] == [c["op"] for c in sorted(mine, key=lambda c: c["arrival_ns"])]
    assert [c["op"] for c in group[:15]] == ["reduce_scatter"] * 15 and group[15]["op"] == "all_reduce"
    t0 = min(c["arrival_ns"] for c in mine)
    for c, raw in zip(group, sorted(mine, key=lambda c: c["arrival_ns"])):
        assert c["start_ms"] == pytest.approx((raw["arrival_ns"] - t0) / 1e6)
        assert c["end_ms"] == pytest.approx(c["start_ms"] + raw["latency_ms"])
    rows = {r["step"]: r for r in comms_view.step_rows(steps)}
    row = rows[20]
    assert row["calls"] == 31 and row["mib"] == pytest.approx(sum(c["bytes"] for c in mine) / 2**20)
    assert row["span_ms"] == pytest.approx(max(c["end_ms"] for c in group))
    assert row["tail_ms"] == pytest.approx(row["span_ms"] - group[-1]["start_ms"])
    assert row["issue_span_ms"] <= row["span_ms"] and row["busy_ms"] <= row["span_ms"]
    step = comms_view.typical_step(list(rows.values()))
    spans = sorted(r["span_ms"] for r in rows.values() if r["calls"] == 31)  # the common count: no trial's end
    assert rows[step]["span_ms"] == spans[len(spans) // 2]
    fig = comms_view.step_timeline(steps, step, 0, key, {"backward": 31.9})
    assert [t.name for t in fig.data] == ["reduce_scatter", "all_reduce", "all_gather"]
    assert sum(len(t.x) for t in fig.data) == 31 and list(fig.data[0].base) == [c["start_ms"] for c in steps[step][:15]]
    assert "backward 31.9 ms" in fig.layout.title.text

    one_gpu = frames.comms_calls(report, case="355m-n1 dslab-zero2", strict=True)
    assert not one_gpu.empty and comms_view.step_calls(one_gpu, 0) == {}  # group of one rank: no overlap to show


def test_the_comms_tab_labels_its_columns_with_units_and_draws_each_view():
    report = _report(late_rank_records(late_rank=STRAGGLER_RANK, late_ms=5.0))
    tree = comms_tab.comms_tab(report, "gpt2_medium", RUN_IDS[0], CASE)
    grids = {g.id: [c["headerName"] for c in g.columnDefs] for g in _components(tree, "AgGrid")}
    grids.update({t.id: [name for _, name in read_plain_table(t).headers]
                  for t in _components(tree, "Markdown")})  # the plain tables' headers
    assert grids["comms-ops"] == ["op", "message bytes", "calls", "timed calls", "mean latency (ms)",
                                  "min latency (ms)", "max latency (ms)", "algbw GB/s", "busbw GB/s"]
    assert "caused wait (ms)" in grids["comms-stragglers-table"] and "times last" in grids["comms-stragglers-table"]
    assert "after the last issue (ms)" in grids["comms-steps"]
    graphs = {g.id for g in _components(tree, "Graph")}
    assert graphs == {"comms-caused-wait", "comms-stragglers", "comms-bandwidth", "comms-step"}
    assert "could not be drawn" not in str(tree)

    data = make_report(RUN_IDS[0])
    data["profilers"]["comms"] = {CASE: {"rank": 0, "ops": [], "per_rank": {"0": []}}}
    page = str(comms_tab.comms_tab(report_from_dict(data), "gpt2_medium", RUN_IDS[0], CASE))
    assert "no timed collectives in this case" in page and "comms-bandwidth" not in page


def test_comms_busbw_sizes_each_op_as_the_comms_logger_records_it():
    script = _busbw_script()
    for op, factor in (("all_reduce", 2 * 3 / 4), ("all_gather", 3 / 4), ("reduce_scatter", 3 / 4)):
        output, input = script.buffers(op, 4 * 2**20 + 6, script.torch.bfloat16, 4, device="cpu")
        # 4 MiB + 6 bytes of bf16 over 4 ranks: rounded down to whole per-rank slices
        assert script.size_of(op, output, input) == 4 * 2**20
        if op == "all_reduce":
            assert output is input
        else:
            whole, part = (output, input) if op == "all_gather" else (input, output)
            assert whole.numel() == 4 * part.numel() == 2 * 2**20
        assert script.bus_factor(op, 4) == factor
