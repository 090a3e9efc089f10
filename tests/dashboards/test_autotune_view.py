"""The autotuning view without a browser, on a generated ``dslab autotune`` report
(:func:`report_factory.make_autotune_report`): the experiments table follows the run order with
each experiment's settings, status, metric, memory estimate and reason; the running best counts ok
experiments only, in the metric's direction (checked against a brute-force reference over seeded
random runs); the summary line; the figures mark pruned, failed and early-stopped experiments apart
and the best one; an autotune run's page draws them, and a report without the section says so; the
Runs page draws no throughput history of the autotune suite (a panel per experiment)."""

from __future__ import annotations

import copy
import random

import pytest
from dash import html
from dash.development.base_component import Component
from report_factory import (
    AUTOTUNE_BUDGET_BYTES,
    AUTOTUNE_EXPERIMENTS,
    AUTOTUNE_OOM,
    AUTOTUNE_RUN_ID,
    AUTOTUNE_SUITE,
    make_autotune_report,
    make_report,
    write_run,
)

from dashboards import autotune_view
from dashboards.app import render
from dashboards.data import RunStore
from dslab.report import report_from_dict

RUN = f"/run/{AUTOTUNE_SUITE}/{AUTOTUNE_RUN_ID}"
EMPTY_RUN = "20261207T110000Z-tune01"
SECTION_RUN = "20261207T120000Z-bert00"
PLAIN_RUN = "20261207T130000Z-plain0"
NAMES = [e[0] for e in AUTOTUNE_EXPERIMENTS]
# the throughputs of the ok experiments so far, by hand from AUTOTUNE_EXPERIMENTS
RUNNING_BEST = [110.0, 150.0, 150.0, 170.0, 170.0, 170.0, 170.0, 170.0, 170.0]


def _find(component, component_id: str):
    """The component with ``id`` ``component_id`` in a Dash component tree (or list of them)."""
    if isinstance(component, (list, tuple)):
        for c in component:
            found = _find(c, component_id)
            if found is not None:
                return found
        return None
    if getattr(component, "id", None) == component_id:
        return component
    children = getattr(component, "children", None)
    return _find(children, component_id) if isinstance(children, (list, tuple, Component)) else None


def _with_class(component, class_name: str) -> list:
    """Every component of the tree whose ``className`` is ``class_name``."""
    stack, out = [component], []
    while stack:
        c = stack.pop()
        if isinstance(c, (list, tuple)):
            stack.extend(c)
            continue
        if getattr(c, "className", None) == class_name:
            out.append(c)
        children = getattr(c, "children", None)
        if isinstance(children, (list, tuple, Component)):
            stack.append(children)
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("autotune_reports")
    write_run(root, make_autotune_report())
    empty = make_autotune_report(EMPTY_RUN)
    empty["profilers"] = {}
    empty["status"] = "running"
    write_run(root, empty)
    write_run(root, make_autotune_report(SECTION_RUN, "bert_large"))
    write_run(root, make_report(PLAIN_RUN, "gpt2"))
    return RunStore(root)


def test_rows_follow_the_run_order_whatever_the_list_order():
    data = make_autotune_report()
    random.Random(0).shuffle(data["profilers"]["autotuning"]["experiments"])
    rows = autotune_view.experiment_rows(data)
    assert [r["name"] for r in rows] == NAMES and [r["run"] for r in rows] == list(range(1, len(NAMES) + 1))
    assert autotune_view.experiment_rows(report_from_dict(data)) == rows  # a RunReport or its dict
    for row, (name, stage, mbs, gas, _, status, throughput, estimated_gb, reason) in zip(rows, AUTOTUNE_EXPERIMENTS):
        assert (row["stage"], row["micro_batch"], row["gas"], row["status"]) == (stage, mbs, gas, status), name
        assert row["metric"] == throughput and row["samples_per_s"] == throughput
        assert row["estimated_gb"] == pytest.approx(estimated_gb)
        assert row["peak_gb"] == (None if throughput is None else pytest.approx(estimated_gb * 0.9))
        assert row["best"] is (name == "z1_mbs4_gas1")
        if reason is not None:
            assert row["reason"] == reason
    by_name = {r["name"]: r for r in rows}
    assert by_name["z2_mbs8_gas2"]["extras"] == "offload_optimizer=cpu, activation_checkpointing=on"
    assert by_name["z1_mbs4_gas1"]["extras"] == ""
    assert by_name["z1_mbs8_gas1"]["reason"] == AUTOTUNE_OOM.splitlines()[0]  # the first line only
    assert by_name["z0_mbs8_gas1"]["reason"] == "estimated 91.2 GB > 80.0 GB budget"
    # the latency of a step of micro-batch 4 x 4 GPUs at 170 samples/s, from the experiment's result
    assert by_name["z1_mbs4_gas1"]["latency_ms"] == pytest.approx(16 / 170 * 1e3)


def test_a_reason_missing_from_the_section_comes_from_the_result():
    data = make_autotune_report()
    for exp in data["profilers"]["autotuning"]["experiments"]:
        exp["reason"] = None
    rows = {r["name"]: r for r in autotune_view.experiment_rows(data)}
    assert rows["z1_mbs8_gas1"]["reason"] == "CUDA out of memory. Tried to allocate 2.00 GiB"
    assert rows["z0_mbs8_gas1"]["reason"] == "estimated 91.2 GB > 80.0 GB budget"  # the skipped result's error
    assert rows["z1_mbs4_gas1"]["reason"] is None


def test_running_best_counts_ok_experiments_in_the_metric_direction():
    rows = autotune_view.experiment_rows(make_autotune_report())
    assert autotune_view.running_best(rows, autotune_view.METRICS["throughput"]) == RUNNING_BEST

    rng = random.Random(1234)
    statuses = autotune_view.STATUSES
    for draw in range(200):
        metric = rng.choice(list(autotune_view.METRICS))
        spec = autotune_view.METRICS[metric]
        rows = [{"status": rng.choice(statuses),
                 "metric": None if rng.random() < 0.2 else rng.uniform(0.1, 100.0)} for _ in range(rng.randint(0, 12))]
        pick = max if spec.direction == "higher" else min
        expected = []
        for i in range(len(rows)):
            ok = [r["metric"] for r in rows[:i + 1] if r["status"] == "ok" and r["metric"] is not None]
            expected.append(pick(ok) if ok else None)
        assert autotune_view.running_best(rows, spec) == expected, (draw, metric, rows)


def test_latency_is_shown_in_ms_and_lower_is_better():
    data = make_autotune_report()
    section = data["profilers"]["autotuning"]
    section["metric"] = "latency"
    seconds = [0.5, 0.4, None, 0.3, None, 0.1, 0.35, None, None]  # the early-stopped one is the fastest
    for exp, value in zip(section["experiments"], seconds):
        exp["metric"] = value
    section["best"], section["best_metric"] = "z1_mbs4_gas1", 0.3
    rows = autotune_view.experiment_rows(data)
    assert [r["metric"] for r in rows] == [None if s is None else pytest.approx(s * 1e3) for s in seconds]
    assert autotune_view.running_best(rows, autotune_view.METRICS["latency"]) == [
        pytest.approx(v) for v in (500, 400, 400, 300, 300, 300, 300, 300, 300)]
    facts = autotune_view.summary(data, rows)
    assert facts["best_metric"] == pytest.approx(300.0)
    assert "on latency (lower is better): best z1_mbs4_gas1 at 300 ms per step" in autotune_view.summary_line(facts)
    assert autotune_view.columns(facts["spec"])[7] == ("metric", "latency (ms per step)")


def test_summary_line_and_counts():
    data = make_autotune_report()
    rows = autotune_view.experiment_rows(data)
    assert autotune_view.status_counts(rows) == {"ok": 4, "early_stopped": 1, "pruned": 2, "oom": 1, "failed": 1}
    facts = autotune_view.summary(data, rows)
    assert facts["budget_gb"] == AUTOTUNE_BUDGET_BYTES / 1e9 == 80.0 and facts["num_params"] == 355_000_000
    # wall time: 24 + 2 x order seconds for each experiment that ran (orders 0, 1, 3, 4, 5, 6, 7), plus 5
    assert facts["wall_time_s"] == 24 * 7 + 2 * (0 + 1 + 3 + 4 + 5 + 6 + 7) + 5 == 225
    assert autotune_view.summary_line(facts) == (
        "gridsearch tuner on throughput (higher is better): best z1_mbs4_gas1 at 170 samples/s; 9 experiments "
        "in 225 s: 4 ok, 1 early stopped, 2 pruned, 1 out of memory, 1 failed.")
    data["profilers"]["autotuning"].update(best=None, best_metric=None)
    assert "no best experiment (none ran to the end)" in autotune_view.summary_line(autotune_view.summary(data))


def test_the_metric_figure_marks_each_status_the_running_best_and_the_best():
    rows = autotune_view.experiment_rows(make_autotune_report())
    fig = autotune_view.metric_figure(rows, autotune_view.METRICS["throughput"])
    traces = {t.name: t for t in fig.data}
    assert list(traces) == ["ok", "early stopped", "pruned", "out of memory", "failed", "running best", "best"]
    assert (list(traces["ok"].x), list(traces["ok"].y)) == ([1, 2, 4, 7], [110.0, 150.0, 170.0, 165.0])
    assert (list(traces["early stopped"].x), list(traces["early stopped"].y)) == ([6], [120.0])
    # no metric: a strip of its own under the metric's axis, a line per status, never a value of the metric
    assert (list(traces["pruned"].x), list(traces["pruned"].y)) == ([3, 9], ["pruned", "pruned"])
    assert (list(traces["out of memory"].x), list(traces["out of memory"].y)) == ([5], ["out of memory"])
    assert (list(traces["failed"].x), list(traces["failed"].y)) == ([8], ["failed"])
    assert {name: t.yaxis for name, t in traces.items()} == {
        "ok": "y", "early stopped": "y", "pruned": "y2", "out of memory": "y2", "failed": "y2",
        "running best": "y", "best": "y"}
    assert fig.layout.yaxis2.type == "category" and fig.layout.yaxis2.title.text == "no metric"
    symbols = {name: t.marker.symbol for name, t in traces.items() if t.mode == "markers"}
    assert len(set(symbols.values())) == len(symbols)  # every status and the best drawn apart
    assert [c[1] for c in traces["pruned"].customdata] == ["estimated 91.2 GB > 80.0 GB budget",
                                                           "estimated 120.5 GB > 80.0 GB budget"]
    assert list(traces["running best"].y) == RUNNING_BEST and traces["running best"].line.shape == "hv"
    assert (list(traces["best"].x), list(traces["best"].y)) == ([4], [170.0])
    everything_ran = autotune_view.metric_figure([r for r in rows if r["metric"] is not None],
                                                 autotune_view.METRICS["throughput"])
    assert {t.yaxis for t in everything_ran.data} == {"y"} and "yaxis2" not in everything_ran.layout
    empty = autotune_view.metric_figure([], autotune_view.METRICS["throughput"])
    assert not empty.data and empty.layout.annotations[0].text == "no experiments"


def test_the_memory_figure_draws_the_estimates_against_the_budget():
    rows = autotune_view.experiment_rows(make_autotune_report())
    fig = autotune_view.memory_figure(rows, 80.0)
    bars = {t.name: (list(t.x), list(t.y)) for t in fig.data if t.type == "bar"}
    assert bars["estimate, pruned"] == ([3, 9], [pytest.approx(91.2), pytest.approx(120.5)])
    assert bars["estimate, ok"][0] == [1, 2, 4, 7] and bars["estimate, out of memory"] == ([5], [pytest.approx(78.9)])
    peak = next(t for t in fig.data if t.name == "measured peak")
    assert list(peak.x) == [1, 2, 4, 6, 7] and list(peak.y) == pytest.approx([36.18, 56.25, 45.9, 39.6, 63.27])
    (budget,) = fig.layout.shapes
    assert (budget.y0, budget.y1, budget.line.dash) == (80.0, 80.0, "dash")
    assert all(y > budget.y0 for y in bars["estimate, pruned"][1])
    for row in rows:
        row["estimated_gb"] = None
    assert not autotune_view.memory_figure(rows, 80.0).data


def test_the_run_page_of_an_autotune_run_draws_the_view(store):
    page = render(store, RUN)
    assert not _with_class(page, "error") and not _with_class(page, "warning"), _with_class(page, "warning")
    assert render(store, RUN) is page  # drawn once per version of the report
    assert _find(page, "autotune-summary").children.startswith("gridsearch tuner on throughput")
    table = _find(page, "autotune-experiments")
    assert [r["name"] for r in table.rowData] == NAMES
    assert [r["status"] for r in table.rowData] == [e[5] for e in AUTOTUNE_EXPERIMENTS]
    headers = [c["headerName"] for c in table.columnDefs]
    assert headers[:9] == ["#", "experiment", "ZeRO stage", "micro-batch", "grad. accum.", "other settings", "status",
                           "throughput (samples/s)", "estimated GB"]
    assert "pruned" in {t.name for t in _find(page, "autotune-metric").figure.data}
    assert _find(page, "autotune-memory") is not None and _find(page, "environment") is not None
    assert _find(page, "arms-table") is None and _find(page, "trace-link") is None


def test_any_run_with_the_section_shows_the_view_and_other_runs_do_not(store):
    page = render(store, f"/run/bert_large/{SECTION_RUN}")
    assert autotune_view.is_autotune(store.report("bert_large", SECTION_RUN))
    assert [r["name"] for r in _find(page, "autotune-experiments").rowData] == NAMES
    plain = render(store, f"/run/gpt2/{PLAIN_RUN}")
    assert not autotune_view.is_autotune(store.report("gpt2", PLAIN_RUN))
    assert _find(plain, "arms-table") is not None and _find(plain, "autotune-summary") is None


def test_a_report_without_the_section_says_so(store):
    report = store.report(AUTOTUNE_SUITE, EMPTY_RUN)
    assert autotune_view.is_autotune(report) and autotune_view.section(report) is None
    assert autotune_view.experiment_rows(report) == []
    with pytest.raises(ValueError, match="no profilers.autotuning section"):
        autotune_view.summary(report)
    page = render(store, f"/run/{AUTOTUNE_SUITE}/{EMPTY_RUN}")
    message = _find(page, "autotune-empty")
    assert isinstance(message, html.P) and "no autotuning results in this run" in message.children
    assert "the run is running" in message.children
    assert not _with_class(page, "error") and _find(page, "autotune-metric") is None
    assert "Traceback" not in str(page)


@pytest.mark.parametrize("breakage, key", [
    (lambda s: s.update(experiments="not a list"), "profilers.autotuning.experiments should be a list"),
    (lambda s: s["experiments"].__setitem__(2, 7), "profilers.autotuning.experiments[2] should be an object"),
    (lambda s: s["experiments"][1].pop("name"), "profilers.autotuning.experiments[1].name"),
    (lambda s: s.update(metric="speed"), "profilers.autotuning.metric should be one of throughput, latency, flops"),
])
def test_a_malformed_section_is_a_warning_naming_the_key(tmp_path, breakage, key):
    data = make_autotune_report()
    breakage(data["profilers"]["autotuning"])
    with pytest.raises(ValueError, match=key.replace("[", r"\[").replace("]", r"\]")):
        autotune_view.experiment_rows(data)
    write_run(tmp_path, data)
    page = render(RunStore(tmp_path), RUN)
    warnings = [str(w.children) for w in _with_class(page, "warning")]
    assert any(key in w for w in warnings), warnings
    assert not _with_class(page, "error") and _find(page, "environment") is not None


def test_a_section_that_is_not_an_object(tmp_path):
    data = copy.deepcopy(make_autotune_report())
    data["profilers"]["autotuning"] = [1, 2]
    write_run(tmp_path, data)
    page = render(RunStore(tmp_path), RUN)
    assert [str(w.children) for w in _with_class(page, "warning")] == [
        "Autotuning: profilers.autotuning should be an object, not list"]


def test_the_runs_page_draws_no_throughput_history_of_the_autotune_suite(store):
    page = render(store, "/")
    assert _find(page, "history-autotune") is None and _find(page, "history-gpt2") is not None
    assert "the tuner's experiments" in _find(page, "history-autotune-note").children
    assert f"/run/{AUTOTUNE_SUITE}/{AUTOTUNE_RUN_ID}" in str(_find(page, "runs-table").rowData)
