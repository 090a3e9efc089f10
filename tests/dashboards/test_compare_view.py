"""The Compare page's verdicts and the Runs page's history, on constructed runs whose gate verdict
is known (:mod:`compare_factory`) and on the committed training reports: a 10% slowdown is flagged
and identical trials are not, runs on other GPUs are not comparable and never share a history
line, each case has its own axis, and the default pair is two runs of one suite."""

from __future__ import annotations

from pathlib import Path

import pytest
from compare_factory import H100, H200, THROUGHPUT, TRIALS, make_trial_report, trial_pattern
from report_factory import make_small_report, write_run

from dashboards import compare_view, history_view, runs_page
from dashboards.app import render
from dashboards.data import RunStore, summarize
from dslab.report import report_from_dict

FIXTURES = Path(__file__).parent / "fixtures" / "training_reports"
A_ID, B_ID, C_ID = "20261201T100000Z-aaaaaa", "20261202T100000Z-bbbbbb", "20261203T100000Z-cccccc"


def _report(run_id: str, day: int, **kwargs):
    return report_from_dict(make_trial_report(run_id, created=f"2026-12-{day:02d}T10:00:00+00:00", **kwargs))


def _judge(a, b):
    metric = compare_view.judged_metric(a, b)
    verdict = compare_view.gate_verdict(a, b, f"gpt2/{a.run_id}", f"gpt2/{b.run_id}", metric)
    rows = compare_view.verdict_rows(a, b, verdict, metric)
    return verdict, {(r["case"], r["arm"]): r for r in rows}


def test_a_ten_percent_slowdown_in_one_case_is_a_regression():
    a, b = _report(A_ID, 1), _report(B_ID, 2, slowdown={"124m": 0.9})
    verdict, rows = _judge(a, b)
    slowed = rows[("124m", "dslab")]
    assert slowed["verdict"] == "regression" and "reaches the 5% threshold" in slowed["reason"]
    assert slowed["A"] == pytest.approx(900.0) and slowed["B"] == pytest.approx(810.0)
    assert slowed["B_over_A"] == pytest.approx(0.9)
    low, high = (float(x) for x in slowed["ci"].split(" to "))
    assert low <= 0.9 <= high < 0.95 and slowed["p_value"] < 0.01
    assert slowed["A_trials"] == f"891 to 909 (n={TRIALS})" and slowed["B_trials"] == f"801.9 to 818.1 (n={TRIALS})"
    for key in (("1.5b", "dslab"), ("124m", "torch"), ("1.5b", "torch")):
        assert rows[key]["verdict"] == "no change" and rows[key]["B_over_A"] == pytest.approx(1.0), key
    text = compare_view.outcome_text(verdict, list(rows.values()))
    assert "regression: 124m/dslab" in text and "1.5b/dslab" not in text

    fig = compare_view.change_figure(list(rows.values()), "samples_per_s", "gpt2/A", "gpt2/B")
    by_name = {(t.name, t.meta): t for t in fig.data}
    mark = by_name[("gate: regression", "124m")]  # on B, relative to A's median
    assert list(mark.x) == ["dslab"] and list(mark.y) == pytest.approx([0.9]) and mark.yaxis == "y"
    b_trace = by_name[("B: gpt2/B", "124m")]
    assert list(b_trace.y) == pytest.approx([0.9, 1.0]) and list(b_trace.text) == ["0.900", "1.000"]
    assert list(b_trace.error_y.arrayminus) == pytest.approx([(810 - 801.9) / 900, (720 - 712.8) / 720])
    a_trace = by_name[("A: gpt2/A", "124m")]
    assert list(a_trace.y) == [1.0, 1.0] and list(a_trace.error_y.array) == pytest.approx([0.01, 0.01])
    assert ("gate: regression", "1.5b") not in by_name and by_name[("A: gpt2/A", "1.5b")].yaxis == "y2"
    assert [(s.y0, s.y1, s.yref) for s in fig.layout.shapes] == [(0.95, 1.05, "y"), (0.95, 1.05, "y2")]
    assert fig.layout.yaxis.range[0] < 0.9 * 0.99 and fig.layout.yaxis2.range[0] > 0.9  # fitted, not from 0


def test_identical_trials_are_no_change():
    verdict, rows = _judge(_report(A_ID, 1), _report(B_ID, 2))
    assert {r["verdict"] for r in rows.values()} == {"no change"}
    assert all(r["p_value"] == pytest.approx(1.0) for r in rows.values())
    assert "no change in any case and arm" in compare_view.outcome_text(verdict, list(rows.values()))
    fig = compare_view.change_figure(list(rows.values()), "samples_per_s", "A", "B")
    assert not any(t.name.startswith("gate:") for t in fig.data)


def test_runs_on_another_gpu_are_not_comparable_and_say_why():
    verdict, rows = _judge(_report(A_ID, 1, gpu=H100), _report(B_ID, 2, gpu=H200, slowdown={"124m": 0.5}))
    assert {r["verdict"] for r in rows.values()} == {"not comparable"}
    reason = rows[("124m", "dslab")]["reason"]
    assert "hardware.gpu_names[0]" in reason and H100 in reason and H200 in reason
    assert rows[("124m", "dslab")]["B_over_A"] == pytest.approx(0.5)  # shown, not judged
    assert compare_view.outcome_text(verdict, list(rows.values())).startswith("The gate cannot compare these runs")


def test_an_incomplete_run_or_a_failed_arm_is_not_comparable():
    _, rows = _judge(_report(A_ID, 1), _report(B_ID, 2, status="incomplete"))
    assert "run B (gpt2/20261202T100000Z-bbbbbb)" in rows[("124m", "dslab")]["reason"]
    assert "incomplete" in rows[("124m", "dslab")]["reason"]
    data = make_trial_report(B_ID, created="2026-12-02T10:00:00+00:00")
    data["results"][2] |= {"status": "oom", "error": "CUDA out of memory", "trials": [], "metrics": {}}
    _, rows = _judge(_report(A_ID, 1), report_from_dict(data))
    failed = rows[("1.5b", "dslab")]
    assert failed["verdict"] == "not comparable" and "1.5b/dslab oom" in failed["reason"]
    assert "CUDA out of memory" in failed["reason"]
    assert failed["B_trials"] == "oom" and failed["B"] is None and failed["B_over_A"] is None


def _store(tmp_path: Path, runs: list[dict]) -> RunStore:
    for data in runs:
        write_run(tmp_path, data)
    return RunStore(tmp_path)


def _runs(tmp_path: Path) -> RunStore:
    """H100 run, H200 run, H100 run 10% slower at 124m, H100 run as fast as that one."""
    return _store(tmp_path, [
        make_trial_report(A_ID, created="2026-12-01T10:00:00+00:00", gpu=H100),
        make_trial_report(B_ID, created="2026-12-02T10:00:00+00:00", gpu=H200, throughput={"124m": 1200.0, "1.5b": 80.0}),
        make_trial_report(C_ID, created="2026-12-03T10:00:00+00:00", gpu=H100, slowdown={"124m": 0.9}),
        make_trial_report("20261204T100000Z-dddddd", created="2026-12-04T10:00:00+00:00", gpu=H100,
                          slowdown={"124m": 0.9}),
    ])


def test_history_has_a_line_per_gpu_an_axis_per_case_and_a_band_of_trials(tmp_path):
    store = _runs(tmp_path)
    fig = history_view.history_figure_of(store, "gpt2", store.summaries(), set())
    lines = {(t.name, t.meta): t for t in fig.data if t.mode == "lines+markers"}
    assert set(lines) == {(f"{arm} on {gpu}", case) for arm in ("dslab", "torch") for gpu in (H100, H200)
                          for case in THROUGHPUT}
    assert list(lines[(f"dslab on {H100}", "124m")].y) == pytest.approx([900.0, 810.0, 810.0])
    assert list(lines[(f"dslab on {H200}", "124m")].y) == pytest.approx([1200.0])
    assert list(lines[(f"dslab on {H100}", "1.5b")].y) == pytest.approx([60.0, 60.0, 60.0])
    assert {t.yaxis for (_, case), t in lines.items() if case == "124m"} == {"y"}
    assert {t.yaxis for (_, case), t in lines.items() if case == "1.5b"} == {"y2"}
    assert fig.layout.yaxis2.matches is None and fig.layout.xaxis.matches == "x2"  # own y ranges, one time axis
    assert [a.text for a in fig.layout.annotations] == ["124m", "1.5b"]
    assert lines[(f"torch on {H100}", "124m")].visible == "legendonly" and lines[(f"dslab on {H100}", "124m")].visible
    band = next(t for t in fig.data if t.name == f"dslab on {H100}: trial min-max" and t.meta == "124m")
    extremes = [900 * min(trial_pattern()), 810 * min(trial_pattern())]
    assert list(band.y)[-3:] == pytest.approx([extremes[1], extremes[1], extremes[0]])
    assert list(band.y)[0] == pytest.approx(900 * max(trial_pattern()))


def test_history_marks_the_run_the_gate_flags_against_the_previous_run_of_its_fingerprint(tmp_path):
    store = _runs(tmp_path)
    marks = history_view.gate_marks(store, store.summaries(), "samples_per_s")
    # C is judged against A (B ran on another GPU); D against C: the same speed, no mark
    assert [(m.ref, m.case, m.arm, m.verdict) for m in marks] == [(f"gpt2/{C_ID}", "124m", "dslab", "regression")]
    assert f"against {A_ID}" in marks[0].text
    fig = history_view.history_figure_of(store, "gpt2", store.summaries(), set())
    mark = next(t for t in fig.data if t.name == "gate: regression against the previous run")
    assert list(mark.y) == pytest.approx([810.0]) and mark.yaxis == "y"
    without_a = [s for s in store.summaries() if s.run_id != A_ID]  # judged over the whole history all the same
    mark = next(t for t in history_view.history_figure_of(store, "gpt2", without_a, set()).data
                if t.name == "gate: regression against the previous run")
    assert list(mark.y) == pytest.approx([810.0])
    h200 = runs_page.filter_summaries(store.summaries(), None, None, [H200], None)
    assert not any(t.name.startswith("gate:") for t in history_view.history_figure_of(store, "gpt2", h200, set()).data)
    torch_only = history_view.history_figure_of(store, "gpt2", store.summaries(), {"torch"})
    assert not any(t.name.startswith("gate:") for t in torch_only.data)  # the torch arm did not change


def test_the_committed_reports_draw_h100_and_h200_apart():
    store = RunStore(FIXTURES)
    fig = history_view.history_figure_of(store, "gpt2", store.summaries(), set())
    dslab = {(t.name, t.meta): t for t in fig.data if t.mode == "lines+markers" and t.name.startswith("dslab")}
    assert set(dslab) == {(f"dslab on {gpu}", case) for gpu in (H100, H200) for case in ("124m", "1.5b")}
    assert len(dslab[(f"dslab on {H100}", "124m")].y) == 1 and len(dslab[(f"dslab on {H200}", "124m")].y) == 5
    assert dslab[(f"dslab on {H100}", "124m")].yaxis != dslab[(f"dslab on {H100}", "1.5b")].yaxis


def _summaries(specs: list[tuple[str, str]]):
    return [summarize(report_from_dict(make_small_report(run_id, suite, "2026-11-01T00:00:00+00:00", 100.0)),
                      suite, run_id) for suite, run_id in specs]


def test_default_pair_is_two_runs_of_one_suite():
    ids = [f"2026110{i}T000000Z-00000{i}" for i in range(1, 6)]
    newest_alone = _summaries([("a", ids[0]), ("b", ids[1]), ("a", ids[2]), ("c", ids[3])])
    assert compare_view.default_pair(newest_alone) == (f"a/{ids[0]}", f"a/{ids[2]}")
    newest_has_two = _summaries([("a", ids[0]), ("a", ids[1]), ("b", ids[2]), ("b", ids[3]), ("c", ids[4])])
    assert compare_view.default_pair(newest_has_two) == (f"b/{ids[2]}", f"b/{ids[3]}")
    unreadable = _summaries([("a", ids[0]), ("a", ids[1]), ("a", ids[2])])
    unreadable[-1].error = "not valid JSON"
    assert compare_view.default_pair(unreadable) == (f"a/{ids[0]}", f"a/{ids[1]}")
    assert compare_view.default_pair(_summaries([("a", ids[0]), ("b", ids[1])])) == (None, f"b/{ids[1]}")
    assert compare_view.default_pair([]) == (None, None)


def test_runs_page_links_the_default_pair_and_the_compare_page_labels_a_and_b(tmp_path):
    store = _runs(tmp_path)
    write_run(tmp_path, make_small_report("20261205T100000Z-eeeeee", "bert_large", "2026-12-05T10:00:00+00:00", 50.0))
    text = str(runs_page.runs_page(store))
    assert f"href='/compare?a=gpt2/{C_ID}&b=gpt2/20261204T100000Z-dddddd'" in text  # not the newest, bert_large
    page = render(store, "/compare", f"?a=gpt2/{A_ID}&b=gpt2/{C_ID}")
    header = next(c for c in page if getattr(c, "id", None) == "compare-runs")
    head = [th.children for th in header.children[0].children.children]
    assert head == ["", "A (baseline)", "B (candidate)"]
    body = {tr.children[0].children: (tr.children[1].children, tr.children[2].children)
            for tr in header.children[1].children}
    assert body["suite"] == ("gpt2", "gpt2") and body["GPU"] == (H100, H100)
    assert (body["run"][0].children, body["run"][1].children) == (A_ID, C_ID)
    grid = next(c for c in page if getattr(c, "id", None) == "compare-verdicts")
    verdicts = {(r["case"], r["arm"]): r["verdict"] for r in grid.rowData}
    assert verdicts[("124m", "dslab")] == "regression" and verdicts[("1.5b", "dslab")] == "no change"
    headers = [c["headerName"] for c in grid.columnDefs]
    assert "A: samples/s (median)" in headers and "B/A" in headers and "gate verdict" in headers
    assert "could not be drawn" not in str(page)


def test_spread_trials_are_unresolved_not_no_change():
    """B's dslab trials of 124m scatter by +-15%: the gate sees no clear change but cannot rule out
    a 5% one, and the page says so rather than "no change"."""
    spread = make_trial_report(B_ID, created="2026-12-02T10:00:00+00:00")
    for result in spread["results"]:
        if (result["case"], result["arm"]) == ("124m", "dslab"):
            for trial, factor in zip(result["trials"], trial_pattern(len(result["trials"]))):
                value = trial["metrics"]["samples_per_s"]
                trial["metrics"]["samples_per_s"] = value * (1 + 15 * (factor - 1))
    verdict, rows = _judge(_report(A_ID, 1), report_from_dict(spread))
    row = rows[("124m", "dslab")]
    assert row["verdict"] == "unresolved" and "unresolved" in row["reason"], row
    assert rows[("1.5b", "dslab")]["verdict"] == "no change"
    assert "unresolved: 124m/dslab" in compare_view.outcome_text(verdict, list(rows.values()))
