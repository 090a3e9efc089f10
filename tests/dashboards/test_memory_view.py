"""The Memory tab's views (dashboards/memory_view.py) on the committed GPU and CPU reports and
constructed ones: activation memory as a module tree whose parents hold their children and whose
table folds the numbered blocks; the trials, warm-ups and profiled steps marked on the timeline;
the profiled step's phase deltas; where the step's wall time went."""

from __future__ import annotations

from pathlib import Path

import pytest
from report_factory import RUN_IDS, make_report

from dashboards import figures, memory_tab, memory_view
from dslab.report import frames, read_report, report_from_dict

FIXTURES = Path(__file__).parent / "fixtures"
GPT2 = FIXTURES / "training_reports" / "gpt2" / "20261126T100551Z-d7b758"  # 5 trials, 10 warm-up, 20 timed
ZERO = FIXTURES / "zero_reports" / "zero" / "20261128T212522Z-68abb2"  # 3 trials, 5 warm-up, 8 timed
CPU = FIXTURES / "comms_reports" / "gpt2" / "20261126T020306Z-cbf34f"  # 3 gloo ranks, no allocator


@pytest.fixture(scope="module")
def gpt2():
    return read_report(GPT2)


def _steps(report, key: str) -> list[int]:
    return memory_view.memory_timeline(frames.memory_timeline(report, case=key, strict=True))["step"]


def test_activation_tree_parents_hold_their_children(gpt2):
    records = frames.records(frames.memory_activations(gpt2, case="1.5b", strict=True))
    nodes = memory_view.activation_tree(frames.memory_activations(gpt2, case="1.5b", strict=True))
    by_id = {n["id"]: n for n in nodes}
    assert len(records) == 340 and set(by_id) == {r["module"] for r in records} | {"layers"}
    assert by_id["layers"]["own_bytes"] == 0 and by_id["layers.0"]["parent"] == "layers"
    assert by_id["wte"]["parent"] == "(root)" and by_id["(root)"]["parent"] == ""
    for n in nodes:
        assert n["bytes"] == n["own_bytes"] + sum(c["bytes"] for c in nodes if c["parent"] == n["id"])
    assert by_id["(root)"]["bytes"] == sum(r["bytes"] for r in records)
    seen = set()
    for n in nodes:  # parents before children
        assert n["parent"] in seen or n["parent"] == ""
        seen.add(n["id"])
    fig = memory_view.activation_treemap(nodes, "1.5b")
    assert fig.data[0].branchvalues == "total" and list(fig.data[0].values) == [n["bytes"] for n in nodes]


def test_the_top_table_folds_the_blocks_of_a_module_list(gpt2):
    nodes = memory_view.activation_tree(frames.memory_activations(gpt2, case="1.5b", strict=True))
    rows = memory_view.activation_top_rows(nodes)
    by_path = {r["path"]: r for r in rows}
    blocks = [n for n in nodes if n["parent"] == "layers"]
    assert len(blocks) == 48
    assert by_path["layers.*"]["instances"] == 48 and by_path["layers.*"]["module"].strip() == "layers.*"
    assert by_path["layers.*"]["mib"] == pytest.approx(sum(n["bytes"] for n in blocks) / 2**20)
    fc_out = [n for n in nodes if n["id"].endswith(".mlp.fc_out")]
    assert by_path["layers.*.mlp.fc_out"]["mib"] == pytest.approx(sum(n["bytes"] for n in fc_out) / 2**20)
    assert rows[0]["path"] == "(root)" and rows[0]["share_pct"] == pytest.approx(100.0)
    assert len(rows) <= memory_view.TOP_MODULES and len(rows) < 20  # not 340 bars
    for i, r in enumerate(rows[1:], start=1):  # an indented tree: each row's parent is above it
        parent = r["path"].rsplit(".", 1)[0] if "." in r["path"] else "(root)"
        above = [p["path"] for p in rows[:i]]
        assert parent in above and r["module"].startswith("\u00a0" * 4 * r["depth"])
    mlp = rows.index(by_path["layers.*.mlp"])
    assert [r["path"] for r in rows[mlp + 1: mlp + 3]] == ["layers.*.mlp.fc_out", "layers.*.mlp.fc_in"]  # largest first


def test_top_rows_keep_the_parents_of_the_largest():
    data = make_report(RUN_IDS[0])
    data["profilers"]["memory"]["seq128"]["activations"] = [
        {"module": f"branch{b}.leaf{i}", "bytes": (b * 10 + i) << 20, "tensors": 1, "storages": 1, "shared_bytes": 0}
        for b in range(4) for i in range(8)]
    report = report_from_dict(data)
    rows = memory_view.activation_top_rows(
        memory_view.activation_tree(frames.memory_activations(report, case="seq128", strict=True)), top=6)
    paths = [r["path"] for r in rows]
    assert paths[:2] == ["(root)", "branch3"] and "branch3.leaf7" in paths
    assert all(p.split(".")[0] in paths for p in paths if "." in p)


def test_the_timeline_marks_each_trial_its_warm_up_and_the_profiled_steps(gpt2):
    marks = memory_view.timeline_marks(gpt2, "1.5b", _steps(gpt2, "1.5b"), gpt2.profilers["memory"]["1.5b"])
    assert marks["arm"] == "dslab" and marks["note"] is None
    assert marks["trials"] == [{"trial": 0, "warmup": (0, 9), "timed": (10, 29)}] + [
        {"trial": t, "warmup": (8 + 22 * t, 9 + 22 * t), "timed": (10 + 22 * t, 29 + 22 * t)} for t in range(1, 5)]
    assert marks["profile_step"] == 6 and marks["flops_step"] == 3
    fig = figures.memory_timeline(memory_view.memory_timeline(frames.memory_timeline(gpt2, case="1.5b")), marks, "1.5b")
    regions = [(s.x0, s.x1, s.fillcolor) for s in fig.layout.shapes if s.type == "rect"]
    assert regions[:3] == [(-0.5, 9.5, "#9ca3af"), (9.5, 29.5, "#1f77b4"), (29.5, 31.5, "#9ca3af")]
    assert len(regions) == 10
    lines = sorted(s.x0 for s in fig.layout.shapes if s.type == "line")
    assert lines == [3, 6]
    assert "of the dslab arm" in fig.layout.title.text

    zero = read_report(ZERO)
    key = "355m-n4 dslab-zero2"
    marks = memory_view.timeline_marks(zero, key, _steps(zero, key), zero.profilers["memory"][key])
    assert marks["arm"] == "dslab-zero2"
    assert [t["timed"] for t in marks["trials"]] == [(5, 12), (15, 22), (25, 32)]

    steps = _steps(gpt2, "1.5b")[:-3]  # a run cut short: the steps no longer add up
    marks = memory_view.timeline_marks(gpt2, "1.5b", steps, gpt2.profilers["memory"]["1.5b"])
    assert marks["trials"] == [] and "115 steps recorded" in marks["note"]


def test_the_profiled_step_phase_by_phase(gpt2):
    data = gpt2.profilers["memory"]["1.5b"]
    rows = memory_view.phase_rows(data)
    assert [r["phase"] for r in rows] == ["forward", "backward", "optimizer step"]
    allocated = data["phases"]["allocated"]
    assert rows[0]["delta_mib"] == data["phases"]["forward_delta"] / 2**20
    assert rows[1]["begin_gib"] == allocated["backward_begin"] / 2**30
    assert rows[2]["end_gib"] == allocated["optimizer_end"] / 2**30
    levels = memory_view.phase_levels(data)
    assert [v for _, v in levels] == [allocated[k] / 2**30 for k, _ in memory_view.PHASE_HOOKS]
    assert memory_view.phase_rows(read_report(CPU).profilers["memory"]["124m"]) == []


def test_where_the_step_wall_time_went():
    report = read_report(CPU)
    phases = frames.wall_clock(report, case="124m", strict=True)
    step_ms = memory_view.profiled_result(report, "124m").metrics["step_time_ms"]
    rows = memory_view.wall_clock_rows(phases, step_ms)
    raw = report.profilers["wall_clock"]["124m"]["phases"]
    assert [r["phase"] for r in rows] == ["forward", "backward", "optimizer step", "rest of the measured step"]
    assert [r["step_ms"] for r in rows[:3]] == [raw[p]["median_ms"] for p in ("forward", "backward", "step")]
    assert rows[3]["step_ms"] == pytest.approx(step_ms - sum(raw[p]["median_ms"] for p in raw))
    assert sum(r["share_pct"] for r in rows) == pytest.approx(100.0)
    bar = memory_view.wall_clock_bar(rows, step_ms, "124m")
    assert [(t.name, t.x[0]) for t in bar.data] == [(r["phase"], r["step_ms"]) for r in rows if r["step_ms"] >= 0]

    data = make_report(RUN_IDS[0])  # gradient accumulation: four forwards and backwards per optimizer step
    data["profilers"]["wall_clock"]["seq128"]["phases"] = {
        "forward": {"count": 8, "mean_ms": 10.0, "median_ms": 10.0, "min_ms": 9.0, "max_ms": 11.0},
        "backward": {"count": 8, "mean_ms": 20.0, "median_ms": 20.0, "min_ms": 19.0, "max_ms": 21.0},
        "step": {"count": 2, "mean_ms": 3.0, "median_ms": 3.0, "min_ms": 3.0, "max_ms": 3.0}}
    rows = memory_view.wall_clock_rows(frames.wall_clock(report_from_dict(data), case="seq128"), 100.0)
    assert [(r["per_step"], r["step_ms"]) for r in rows] == [(4.0, 40.0), (4.0, 80.0), (1.0, 3.0), (None, -23.0)]
    assert "23 ms more than the measured step" in memory_view.wall_clock_bar(rows, 100.0, "seq128").layout.title.text


def test_the_memory_tab_without_a_trace_still_shows_the_wall_clock():
    report = read_report(CPU)
    page = str(memory_tab.memory_tab(report, "gpt2", CPU.name, None))
    assert "no per-step allocator peaks" in page and "no phase deltas in this trace" in page
    assert "Where the step's wall time went" in page and "memory-wall-clock-bar" in page
    del report.profilers["memory"]
    page = str(memory_tab.memory_tab(report, "gpt2", CPU.name, None))
    assert "no memory trace in this run" in page and "memory-wall-clock-bar" in page and "memory-ranks-bar" in page


def test_the_peak_by_allocation_site_is_a_table_with_shares():
    data = make_report(RUN_IDS[0])
    sites = [{"site": "(allocated before the trace)", "bytes": 3 << 30, "blocks": 120},
             {"site": "dslab/engine/zero/param_offload.py:301 fetch", "bytes": 1 << 29, "blocks": 8},
             {"site": "dslab/kernels/attention/attention.py:88 forward", "bytes": 1 << 28, "blocks": 4}]
    data["profilers"]["memory"]["seq128"]["peak_sites"] = {"peak_bytes": 4 << 30, "sites": sites}
    report = report_from_dict(data)
    rows = memory_view.peak_site_rows(report.profilers["memory"]["seq128"])
    assert [r["site"] for r in rows] == [s["site"] for s in sites]
    assert [r["gib"] for r in rows] == [3.0, 0.5, 0.25] and [r["share_pct"] for r in rows] == [75.0, 12.5, 6.2]
    page = str(memory_tab.memory_tab(report, "gpt2_medium", RUN_IDS[0], "seq128"))
    assert "memory-peak-sites" in page and "traced peak: 4.00 GiB" in page and "param_offload.py:301 fetch" in page
    # a run without a snapshot says so instead of an empty table
    plain = report_from_dict(make_report(RUN_IDS[0]))
    assert memory_view.peak_site_rows(plain.profilers["memory"]["seq128"]) == []
    page = str(memory_tab.memory_tab(plain, "gpt2_medium", RUN_IDS[0], "seq128"))
    assert "no allocation sites: the run recorded no allocator snapshot" in page and "memory-peak-sites" not in page
