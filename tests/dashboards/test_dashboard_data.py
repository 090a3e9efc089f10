"""The dashboard without a browser: safe run lookup, tolerant pages over malformed reports, the
tables the pages draw, the trace download route, and loading 500 runs."""

from __future__ import annotations

import os
import time

import pytest
from report_factory import NOT_JSON, PARTIAL, RUN_IDS, SUITE, make_report, make_small_report, write_run

from dashboards import figures, flops_view, pages, runs_page, views
from dashboards.app import DEFAULT_HOST, create_app, render
from dashboards.data import RunStore, parse_ref, resolve_run
from dslab.report import frames, report_from_dict


def _text(components) -> str:
    return str(components)


@pytest.mark.parametrize("suite,run_id", [("..", ".."), ("../../etc", "passwd"), (SUITE, "../../../etc"),
                                          (".", RUN_IDS[0]), ("baselines", "gpt2_medium"), ("", "x"), (SUITE, "/etc")])
def test_bad_run_refs_are_refused(reports_root, suite, run_id):
    with pytest.raises(ValueError):
        resolve_run(reports_root, suite, run_id)


def test_symlink_out_of_the_reports_directory_is_refused(reports_root, tmp_path):
    outside = tmp_path / "outside" / "run"
    outside.mkdir(parents=True)
    (outside / "run.json").write_text("{}")
    link = reports_root / SUITE / "20261130T000000Z-symlnk"
    os.symlink(outside, link)
    try:
        with pytest.raises(ValueError, match="outside the reports directory"):
            resolve_run(reports_root, SUITE, link.name)
        assert "Cannot show this" in _text(render(RunStore(reports_root), f"/run/{SUITE}/{link.name}"))
    finally:
        link.unlink()


def test_parse_ref():
    assert parse_ref(f"{SUITE}/{RUN_IDS[0]}") == (SUITE, RUN_IDS[0])
    for bad in ("", "a", "a/b/c", "../x", "a/.."):
        with pytest.raises(ValueError):
            parse_ref(bad)


@pytest.mark.parametrize("path,search", [("/run/..%2F..%2Fetc/x", None), ("/run/a/b/c/d/e", None), ("/nowhere", None),
                                         ("/compare", "?a=../../etc&b=x/y"), (f"/run/{SUITE}/{RUN_IDS[0]}/bogus", None),
                                         (f"/run/{SUITE}/20991231T000000Z-000000", None)])
def test_bad_addresses_render_an_error_page(reports_root, path, search):
    text = _text(render(RunStore(reports_root), path, search))
    assert "Not found" in text or "Cannot show this" in text


def test_unreadable_report_renders_its_error(reports_root):
    text = _text(render(RunStore(reports_root), f"/run/{SUITE}/{NOT_JSON}"))
    assert "Cannot show this" in text and "not valid JSON" in text


@pytest.mark.parametrize("tab,problem", [("", "this report lacks environment"),
                                         ("flops", "flops.modules should be a list"),
                                         ("comms", "rank 'rank-zero' that is not an integer"),
                                         ("memory", "memory.steps[0] should be an object"),
                                         ("telemetry", "profilers.telemetry should be an object"),
                                         ("io", "read_GBps")])
def test_partial_report_pages_show_what_they_can(reports_root, tab, problem):
    path = f"/run/{SUITE}/{PARTIAL}" + (f"/{tab}" if tab else "")
    text = _text(render(RunStore(reports_root), path))
    assert problem in text
    assert "This page could not be drawn" not in text


def test_a_page_that_raises_is_caught(reports_root, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(pages, "run_page", broken)
    text = _text(render(RunStore(reports_root), f"/run/{SUITE}/{RUN_IDS[0]}"))
    assert "This page could not be drawn" in text and "boom" in text


def test_summaries_flag_unreadable_runs_and_cache(reports_root):
    store = RunStore(reports_root)
    summaries = store.summaries()
    assert {s.run_id for s in summaries if s.error} == {NOT_JSON, "20261128T100000Z-notobj"}
    first = {s.run_id: s for s in summaries}
    assert first[RUN_IDS[0]].gpu == "2x NVIDIA H100 80GB HBM3" and first[RUN_IDS[0]].commit == "c0ffee0abc"
    assert any("lacks 'environment'" in w for w in first[PARTIAL].warnings)
    again = {s.run_id: s for s in store.summaries()}
    assert again[RUN_IDS[0]] is first[RUN_IDS[0]]


def test_dropped_pages_are_drawn_afresh_from_the_kept_report(reports_root):
    store = RunStore(reports_root)
    path = f"/run/{SUITE}/{RUN_IDS[0]}"
    first = render(store, path)
    report = store.report(SUITE, RUN_IDS[0])
    assert render(store, path) is first  # kept
    store.drop_pages()
    again = render(store, path)
    assert again is not first and str(again) == str(first)
    assert store.report(SUITE, RUN_IDS[0]) is report  # not read again


def test_filters():
    store_rows = [make_small_report(f"20261101T00000{i}Z-00000{i}", suite, "2026-11-01T00:00:00+00:00", 100.0)
                  for i, suite in enumerate(("a", "b", "a"))]
    from dashboards.data import summarize

    summaries = [summarize(report_from_dict(d), d["suite"], d["run_id"]) for d in store_rows]
    assert [s.suite for s in runs_page.filter_summaries(summaries, ["a"], None, None, None)] == ["a", "a"]
    assert runs_page.filter_summaries(summaries, None, ["hf"], None, None) == []
    assert len(runs_page.filter_summaries(summaries, None, ["torch"], None, [summaries[1].commit])) == 1


def test_gate_files_are_read(reports_root):
    store = RunStore(reports_root)
    assert store.change_points(SUITE)[0]["kind"] == "regression"
    assert store.baselines(SUITE)[0]["results"][0]["trials"]["samples_per_s"][1] == 400
    with pytest.raises(ValueError):
        store.baselines("../etc")


def test_flops_tree_sizes_add_up():
    report = report_from_dict(make_report(RUN_IDS[0]))
    nodes = flops_view.flops_tree(frames.flops_modules(report, case="seq128"))
    by_id = {n["id"]: n for n in nodes}
    assert by_id["(root)"]["parent"] == "" and by_id["layers.0.mlp.fc_in"]["parent"] == "layers.0.mlp"
    for node in nodes:
        below = sum(n["flops"] for n in nodes if n["parent"] == node["id"])
        assert node["flops"] >= below
    fc = by_id["layers.0.mlp.fc_in"]
    assert fc["tflops"] == pytest.approx(fc["own_flops"] / (fc["latency_ms"] * 1e-3) / 1e12)
    top = flops_view.top_modules(nodes, per_depth=2)
    assert [r["module"] for r in top if r["depth"] == 1] == ["layers", "lm_head"]
    points = flops_view.roofline_points(nodes, frames.memory_activations(report, case="seq128"), "bf16")
    head = next(p for p in points if p["module"] == "lm_head")
    assert head["bytes"] == 3 * 32000 * 1024 * 2 + 2 * (250 << 20)
    assert flops_view.ceilings(report, views.section(report, "flops")[2]) == {
        "measured_tflops": 700.0, "measured_gbps": 2800.0, "datasheet_tflops": 989.5, "datasheet_gbps": 3350.0}


def test_arm_rows_and_trial_spread():
    report = report_from_dict(make_report(RUN_IDS[0]))
    rows = {(r["case"], r["arm"]): r for r in views.arm_rows(frames.results(report), frames.trials(report))}
    assert rows[("seq128", "torch")]["dslab_over_arm"] == pytest.approx(report.ratios["seq128"]["dslab/torch"])
    assert rows[("seq512", "hf")]["status"] == "failed" and "out of memory" in rows[("seq512", "hf")]["error"]
    assert len(views.trial_spread(frames.trials(report))["seq128"]["dslab"]) == 3


def test_trace_route_serves_only_existing_traces(reports_root):
    client = create_app(reports_root).server.test_client()
    assert client.get(f"/trace/{SUITE}/{RUN_IDS[1]}").status_code == 404  # not written yet
    (reports_root / SUITE / RUN_IDS[1] / "trace.pftrace").write_bytes(b"\x0a\x00")
    try:
        reply = client.get(f"/trace/{SUITE}/{RUN_IDS[1]}")
        assert reply.status_code == 200 and reply.data == b"\x0a\x00"
        assert "trace.pftrace" in _text(render(RunStore(reports_root), f"/run/{SUITE}/{RUN_IDS[1]}"))
    finally:
        (reports_root / SUITE / RUN_IDS[1] / "trace.pftrace").unlink()
    secret = reports_root.parent / "secret" / "trace.pftrace"
    secret.parent.mkdir(exist_ok=True)
    secret.write_bytes(b"SECRET-TRACE")
    rel = os.path.relpath(secret.parent, reports_root / SUITE)
    for bad in (f"/trace/{SUITE}/{rel}", f"/trace/{SUITE}/{rel.replace('/', '%2F')}", "/trace/..%2Fsecret/x",
                f"/trace/{SUITE}/..", "/trace/baselines/x", "/trace/../secret"):
        reply = client.get(bad)
        # 404 from the trace route, or Dash's page shell for an address no route takes: never the file
        assert reply.status_code in (200, 404) and b"SECRET-TRACE" not in reply.data, bad
        assert "attachment" not in reply.headers.get("Content-Disposition", ""), bad


def test_binds_localhost_by_default():
    assert DEFAULT_HOST == "127.0.0.1"
    from dslab.cli import build_parser

    args = build_parser().parse_args(["dashboard"])
    assert (args.host, args.port, args.reports) == ("127.0.0.1", 8050, "reports")


@pytest.mark.serial  # a time limit
def test_500_runs_load_in_under_3_seconds(tmp_path):
    for i in range(500):
        run_id = f"202611{1 + i // 100:02d}T{i % 24:02d}{i % 60:02d}00Z-{i:06x}"
        write_run(tmp_path, make_small_report(run_id, ("bert_large", "gpt2_medium")[i % 2],
                                              f"2026-11-{1 + i // 100:02d}T{i % 24:02d}:{i % 60:02d}:00+00:00", 100.0 + i % 7))
    store = RunStore(tmp_path)
    start = time.perf_counter()
    components = runs_page.runs_page(store)
    elapsed = time.perf_counter() - start
    assert "Runs (500)" in _text(components)
    assert sum(1 for s in store.summaries() if s.error is None) == 500
    assert elapsed < 3.0, f"the Runs page over 500 runs took {elapsed:.2f} s"


def test_best_plain_rows_of_an_old_and_a_current_report():
    old = report_from_dict(make_report(RUN_IDS[0]))  # schema 1: derived on reading
    assert old.schema_version == 1 and not old.missing
    current = report_from_dict(old.to_dict() | {"schema_version": 2})
    for report in (old, current):
        rows = {r["case"]: r for r in views.best_plain_rows(frames.results(report))}
        assert set(rows) == {"seq128", "seq512"}
        for case, row in rows.items():
            assert row["best_plain_arm"] == "torch-compile"  # 0.95x dslab; torch is 0.8x, hf failed
            assert row["dslab_over_best_plain"] == pytest.approx(report.ratios[case]["dslab/torch-compile"])
            speeds = row["dslab_samples_per_s"] / row["best_plain_samples_per_s"]
            assert row["dslab_over_best_plain"] == pytest.approx(speeds)
        flagged = {(r["case"], r["arm"]) for r in views.arm_rows(frames.results(report), frames.trials(report))
                   if r["best_plain"]}
        assert flagged == {("seq128", "torch-compile"), ("seq512", "torch-compile")}
    text = _text(pages._run_tab(current, SUITE, RUN_IDS[0], None))
    assert "best-plain-table" in text and "dslab against the best plain-PyTorch arm" in text
    bar = figures.arms_bar(frames.results(current), frames.trials(current), "seq128")
    assert "dslab/best plain arm (torch-compile)" in str(bar.layout.title.text)


def test_best_plain_compare_rows_and_page(reports_root):
    a = report_from_dict(make_report(RUN_IDS[0], throughput=400))
    b = report_from_dict(make_report(RUN_IDS[1], throughput=400, seed=1))
    b.results = [r for r in b.results if not (r.case == "seq512" and r.arm != "dslab")]
    b.compute_ratios()
    rows = {r["case"]: r for r in views.best_plain_compare_rows(frames.results(a), frames.results(b))}
    assert rows["seq128"]["A_arm"] == rows["seq128"]["B_arm"] == "torch-compile"
    assert rows["seq128"]["B_over_A"] == pytest.approx(rows["seq128"]["B"] / rows["seq128"]["A"])
    assert rows["seq512"]["B_arm"] is None and rows["seq512"]["B_over_A"] is None
    text = _text(render(RunStore(reports_root), "/compare", f"?a={SUITE}/{RUN_IDS[0]}&b={SUITE}/{RUN_IDS[4]}"))
    assert "compare-best-plain" in text and "could not be drawn" not in text


def test_run_page_without_ratios_says_there_is_no_best_plain_arm(reports_root):
    text = _text(render(RunStore(reports_root), f"/run/{SUITE}/{PARTIAL}"))
    assert "no case has both a dslab result and an ok plain-PyTorch arm" in text
