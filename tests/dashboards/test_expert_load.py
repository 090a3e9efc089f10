"""The expert-load view of MoE runs without a browser: the layer x expert table from a report's
``profilers["moe"]``, the tab shown only for MoE runs, malformed records, the PNG figure."""

from __future__ import annotations

import copy

import pytest
from report_factory import make_report, write_run

from dashboards import experts_view, pages, views
from dashboards.app import render
from dashboards.data import RunStore
from dashboards.plots import write_plots
from dslab.report import frames, report_from_dict

RUN_ID = "20261201T100000Z-aaaa00"
CASE = "gpt2_moe_top2"


def moe_report(run_id: str = RUN_ID) -> dict:
    """A two-arm MoE run of one case: two MoE layers of 4 experts, top-2, the second dropping."""
    layers = [
        {"layer": 1, "exp_counts": [40, 20, 30, 38], "tokens": 64, "k": 2, "capacity": None, "assignments": 128,
         "dropped": 0, "kept": 128, "dropped_fraction": 0.0, "max_over_mean": 1.25},
        {"layer": 3, "exp_counts": [64, 16, 16, 32], "tokens": 64, "k": 2, "capacity": 40, "assignments": 128,
         "dropped": 24, "kept": 104, "dropped_fraction": 0.1875, "max_over_mean": 2.0},
    ]
    record = {"source": "the dslab arm's model after its last timed step", "family": "gpt2_moe", "num_experts": 4,
              "k": 2, "hidden": 128, "ffn": 512, "ep_size": 1, "drop_tokens": True, "capacity_factor": 1.0,
              "tokens_per_step": 64, "layers": layers, "assignments": 256, "dropped": 24,
              "dropped_fraction": 24 / 256, "expert_flops_note": "12 * H * F per kept assignment",
              "expert_flops_per_step": {"dslab": 232 * 12 * 128 * 512, "torch": 232 * 12 * 128 * 512}}
    results = []
    for arm, step_ms in (("dslab", 10.0), ("torch", 20.0)):
        metrics = {"samples_per_s": 2 / (step_ms / 1e3), "step_time_ms": step_ms,
                   "expert_tflops": record["expert_flops_per_step"][arm] / (step_ms / 1e3) / 1e12}
        results.append({"case": CASE, "arm": arm, "status": "ok", "error": None,
                        "trials": [{"trial": 0, "step_times_ms": [step_ms], "metrics": metrics}], "metrics": metrics})
    return {"schema": "dslab.run", "schema_version": 2, "run_id": run_id, "suite": "moe", "status": "complete",
            "created": "2026-12-01T10:00:00+00:00", "environment": {}, "config": {"precision": "bf16"}, "data": {},
            "peaks": {}, "results": results, "ratios": {}, "best_plain": {}, "profilers": {"moe": {CASE: record}},
            "notes": []}


def test_expert_load_table():
    report = report_from_dict(moe_report())
    assert experts_view.has_moe(report)
    cases, chosen, data = views.section(report, "moe")
    assert cases == [CASE] and chosen == CASE
    load = experts_view.expert_load(data)
    assert load["layers"] == ["layer 1", "layer 3"] and load["experts"] == [f"expert {e}" for e in range(4)]
    assert load["counts"][1] == [64, 16, 16, 32]
    assert load["share_pct"][0] == pytest.approx([31.25, 15.625, 23.4375, 29.6875])
    assert all(sum(row) == pytest.approx(100.0) for row in load["share_pct"])
    assert load["dropped_pct"] == pytest.approx(9.375) and (load["num_experts"], load["k"]) == (4, 2)
    rows = {r["layer"]: r for r in load["rows"]}
    assert rows["layer 3"]["dropped_pct"] == pytest.approx(18.75) and rows["layer 3"]["capacity"] == 40
    assert rows["layer 3"]["max_over_mean"] == pytest.approx(2.0)
    arms = {r["arm"]: r for r in experts_view.expert_tflops_rows(frames.results(report), CASE, data)}
    assert arms["dslab"]["expert_tflops"] == pytest.approx(2 * arms["torch"]["expert_tflops"])
    assert arms["dslab"]["expert_gflops_per_step"] == pytest.approx(232 * 12 * 128 * 512 / 1e9)
    assert experts_view.all_to_all_rows(data) == []
    rows = views.arm_rows(frames.results(report), frames.trials(report))
    assert {r["arm"]: r["expert_tflops"] for r in rows}["torch"] == arms["torch"]["expert_tflops"]


@pytest.mark.parametrize("layers,problem", [
    ([], "moe.layers is empty"),
    ("x", "moe.layers should be a list"),
    ([{"layer": 1, "exp_counts": [1, "a"]}], "exp_counts should be a list of numbers"),
    ([{"layer": 1, "exp_counts": [1, 2]}, {"layer": 3, "exp_counts": [1, 2, 3]}], "has 3 experts, the first layer 2"),
])
def test_malformed_records_raise_naming_the_key(layers, problem):
    with pytest.raises(ValueError, match=problem):
        experts_view.expert_load({"layers": layers})


def test_the_tab_is_shown_only_for_moe_runs(tmp_path):
    data = moe_report()
    write_run(tmp_path, data)
    dense = make_report("20261201T100000Z-bbbb00", "gpt2")
    write_run(tmp_path, dense)
    broken = copy.deepcopy(data)
    broken["run_id"] = "20261201T100000Z-cccc00"
    broken["profilers"]["moe"][CASE]["layers"] = "not a list"
    write_run(tmp_path, broken)
    store = RunStore(tmp_path)

    page = str(render(store, f"/run/moe/{RUN_ID}/experts"))
    assert "expert-load-heatmap" in page and "Expert load per MoE layer" in page and "expert-tflops" in page
    assert "Expert load" in str(render(store, f"/run/moe/{RUN_ID}"))  # the tab's link
    assert "expert TFLOP/s" in str(render(store, f"/run/moe/{RUN_ID}"))  # the arms table's column
    assert not experts_view.has_moe(report_from_dict(dense))
    run_page = str(render(store, "/run/gpt2/20261201T100000Z-bbbb00"))
    assert "Expert load" not in run_page and "expert TFLOP/s" not in run_page
    assert "no MoE records in this run" in str(render(store, "/run/gpt2/20261201T100000Z-bbbb00/experts"))
    shown = str(render(store, "/run/moe/20261201T100000Z-cccc00/experts"))
    assert "could not be drawn" in shown and "moe.layers should be a list" in shown
    assert [tab for tab, _ in pages.TABS] == ["", "flops", "comms", "memory", "telemetry", "io"]


def test_expert_load_png(tmp_path):
    written, warnings = write_plots(report_from_dict(moe_report()), tmp_path)
    assert warnings == []
    assert sorted(p.name for p in written) == [f"arms_{CASE}.png", f"experts_{CASE}.png"]
