"""dslab.report.frames: run reports as DataFrames (on the checked-in GPU reports and a small report
built here with every profiler section), their export to CSV / Parquet / JSON and back, and
``dslab report export``.

Round trips compare with ``assert_frame_equal`` exactly: the frames fix their dtypes (``string``,
``Int64``, ``boolean``, ``float64``) and ``read_exported`` restores them, so the only
normalisation is the one the frames make themselves (an empty string is read as missing)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")

from dslab import cli  # noqa: E402
from dslab.report import Result, RunReport, Trial, read_report, write_report  # noqa: E402
from dslab.report import frames  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "dashboards" / "fixtures" / "gpu_reports"
FIXTURE_RUNS = sorted(p.parent for p in FIXTURES.glob("*/*/run.json"))
# A 3-rank gloo run on a CPU (tests/dashboards/fixtures/comms_reports/README.md).
COMMS_RUN = FIXTURES.parent / "comms_reports" / "gpt2" / "20261126T020306Z-cbf34f"


def small_report() -> RunReport:
    """Two arms of one case (one failed, without trials) and every section, two ranks of comms
    and of peak memory."""
    r = RunReport(run_id="20261201T120000Z-abc123", suite="tiny", status="complete",
                  created="2026-12-01T12:00:00+00:00", finished=None)
    r.environment = {"torch": {"version": "2.13.0+cpu"}, "dslab": {"version": "0.1.0", "git_dirty": False},
                     "cuda": {"available": False, "device_count": 0, "gpus": []}}
    r.config = {"scale": "tiny", "precision": "fp32", "trials": 3, "steps": 4, "warmup_steps": 1}
    ok = Result(case="c1", arm="dslab", trials=[
        Trial(trial=t, step_times_ms=[10.0 + t] * 4,
              metrics={"samples_per_s": 100.0 / (t + 1), "step_time_ms": 10.0 + t, "graph_pool_bytes": 2.0**40 + t,
                       "peak_memory_bytes_rank0": 2.0**36 + t, "peak_memory_bytes_rank1": 2.0**35})
        for t in range(3)])
    ok.summarize()
    r.results = [ok, Result(case="c1", arm="torch", status="failed", error="out of memory\nline two, \"quoted\"")]
    call = {"op": "all_reduce", "group": "0,1", "group_size": 2, "bytes": 4096, "dtype": "float32",
            "async": False, "step": 0, "latency_ms": 0.25}
    per_rank = {str(rank): [{**call, "seq": s, "arrival_ns": 1795566053992091400 + rank * 7 + s,
                             "host_arrival_ns": 1795566053992091400 + s} for s in range(3)] for rank in (0, 1)}
    r.profilers = {
        "flops": {"c1": {"modules": [{"name": "", "type": "Net", "depth": 0, "params": 10, "forward_flops": 5 * 10**12},
                                     {"name": "fc", "type": "Linear", "depth": 1, "params": 10, "calls": 2}]}},
        "memory": {"c1": {"steps": [{"step": s, "peak_allocated": 1000 + s, "peak_reserved": 2048} for s in range(5)],
                          "activations": [{"module": "fc", "bytes": 4096, "tensors": 1, "storages": 1,
                                           "shared_bytes": 0}],
                          "model_states_per_rank": [{"total": 3 * 2**30}, {"total": 2**30}]}},
        "comms": {"c1": {"rank": 0, "per_rank": per_rank, "stragglers": [1], "clock_offsets_ns": {"0": 0, "1": 7},
                         "ops": [{"op": "all_reduce", "size_bytes": 4096, "count": 3, "timed_count": 3,
                                  "avg_latency_ms": 0.25, "algbw_GBps": 0.016, "busbw_GBps": 0.016,
                                  "algbw_gbps": 0.13}],
                         "straggler": {"stragglers": [1], "ranks": {
                             "0": {"collectives": 3, "times_last": 0, "total_wait_ms": 6.0},
                             "1": {"collectives": 3, "times_last": 3, "caused_wait_ms": 6.0}}}}},
        "telemetry": {"c1": {"gpus": {"GPU-x": {"index": 0, "name": "H100", "samples": [
            {"t": 0.5 * i, "util_gpu": 50.0, "mem_used_bytes": 2**33, "power_w": 300.5, "temp_c": 40.0,
             "throttle": ["sw_power_cap"] if i else []} for i in range(4)]}}}},
        "wall_clock": {"c1": {"phases": {"forward": {"count": 4, "mean_ms": 1.5, "median_ms": 1.25,
                                                     "min_ms": 1.0, "max_ms": 3.0}}}},
        "io": {
            "tune": {"kind": "tune", "configs": [
                {"op": op, "block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 4,
                 "single_submit": False, "overlap_events": True, "label": "bs=1M qd=32", "GBps": 2.5,
                 "spread_pct": 1.5, "trials": [2.4, 2.5, 2.6], "round": 2, "dropped_after_round": None}
                for op in ("read", "write")]},
            "engine": {"kind": "engine",
                       "operations": [{"kind": "swap_in", "count": 2, "bytes": 8192, "seconds": 0.5, "GBps": 1.6e-5,
                                       "median_GBps": None, "min_GBps": None, "max_GBps": None, "wait_s": 0.1}],
                       "events": [{"kind": "swap_in", "path": "/tmp/x.swp", "nbytes": 4096, "seconds": 0.25,
                                   "wait_s": None, "step": s, "extra": {}, "GBps": 1.6e-5} for s in range(2)]},
        },
    }
    return r


def test_frames_of_the_gpu_reports_have_their_columns_and_rows():
    assert len(FIXTURE_RUNS) == 3
    reports = [read_report(p) for p in FIXTURE_RUNS]
    got = frames.all_frames(FIXTURE_RUNS)
    assert list(got) == list(frames.FRAMES)
    for name, frame in got.items():
        assert list(frame.columns)[:len(frames.COLUMNS[name])] == list(frames.COLUMNS[name]), name
    assert len(got["runs"]) == 3 and list(got["runs"]["run_id"]) == [r.run_id for r in reports]
    assert len(got["results"]) == sum(len(r.results) for r in reports)
    assert len(got["trials"]) == sum(len(res.trials) for r in reports for res in r.results)
    for metric in ("step_time_ms", "samples_per_s", "tokens_per_s", "model_tflops", "mfu_measured",
                   "peak_memory_bytes"):
        assert got["trials"][metric].dtype == "float64" and got["trials"][metric].notna().all()
        assert got["results"][metric].notna().all()

    def count(section, rows):
        return sum(len(rows(rec)) for r in reports for rec in r.profilers[section].values())

    assert len(got["flops_modules"]) == count("flops", lambda rec: rec["modules"]) > 0
    assert got["flops_modules"]["name"].isna().sum() == count("flops", lambda rec: [0]), "one model root per case"
    assert len(got["memory_timeline"]) == count("memory", lambda rec: rec["steps"]) > 0
    assert len(got["telemetry_timeline"]) == count(
        "telemetry", lambda rec: [s for g in rec["gpus"].values() for s in g["samples"]]) > 0
    assert len(got["stragglers"]) == count("comms", lambda rec: rec["straggler"]["ranks"]) > 0
    assert len(got["comms_calls"]) == len(got["rank_memory"]) == len(got["io_records"]) == 0  # one GPU, no I/O
    assert len(got["comms_ops"]) == count("comms", lambda rec: rec["ops"])
    assert len(got["memory_activations"]) == count("memory", lambda rec: rec["activations"]) > 0
    assert got["memory_activations"]["bytes"].notna().all()
    assert len(got["wall_clock"]) == count("wall_clock", lambda rec: rec["phases"]) > 0


def test_frames_of_a_small_report():
    report = small_report()
    got = frames.all_frames(report)
    assert got["runs"].loc[0, "hardware"] == "CPU" and pd.isna(got["runs"].loc[0, "finished"])
    assert got["runs"].loc[0, "git_dirty"] == False  # noqa: E712 (a pandas boolean)
    trials = got["trials"]
    assert len(trials) == 3 and list(trials["trial"]) == [0, 1, 2] and list(trials["step_count"]) == [4, 4, 4]
    per_rank = ["peak_memory_bytes_rank0", "peak_memory_bytes_rank1"]
    assert list(trials.columns[7:]) == ["samples_per_s", "step_time_ms", "graph_pool_bytes", *per_rank]
    results = got["results"]
    assert list(results["arm"]) == ["dslab", "torch"] and list(results["trial_count"]) == [3, 0]
    assert results.loc[1, "error"].startswith("out of memory") and pd.isna(results.loc[1, "samples_per_s"])
    assert results.loc[0, "step_time_ms"] == 11.0
    assert not results["best_plain"].any() and results["dslab_over_arm"].isna().all()  # no ratios: torch failed
    assert frames.metric_names(results, "results") == ["samples_per_s", "step_time_ms", "graph_pool_bytes", *per_rank]
    flops = got["flops_modules"]
    assert pd.isna(flops.loc[0, "name"]) and flops.loc[0, "forward_flops"] == 5 * 10**12
    calls = got["comms_calls"]
    assert len(calls) == 6 and list(calls["rank"]) == [0, 0, 0, 1, 1, 1]
    assert calls["arrival_ns"].max() == 1795566053992091400 + 7 + 2  # exact: Int64, not float
    assert list(calls["clock_offset_ns"]) == [0, 0, 0, 7, 7, 7]
    ops = got["comms_ops"]
    assert list(ops["op"]) == ["all_reduce"] and ops.loc[0, "rank"] == 0 and ops.loc[0, "size_bytes"] == 4096
    assert "algbw_gbps" not in ops.columns  # the Gbit/s duplicates are left out
    activations = got["memory_activations"]
    assert list(activations["module"]) == ["fc"] and activations.loc[0, "bytes"] == 4096
    stragglers = got["stragglers"]
    assert list(stragglers["straggler"]) == [False, True] and pd.isna(stragglers.loc[1, "total_wait_ms"])
    assert len(got["memory_timeline"]) == 5
    ranks = got["rank_memory"]
    assert list(ranks["trial"]) == [0, 0, 1, 1, 2, 2] and list(ranks["rank"]) == [0, 1] * 3
    assert set(ranks["kind"]) == {"cuda_peak"} and list(ranks["peak_bytes"][:2]) == [2**36, 2**35]
    assert list(ranks["model_state_bytes"][:2]) == [3 * 2**30, 2**30]
    telemetry = got["telemetry_timeline"]
    assert len(telemetry) == 4 and pd.isna(telemetry.loc[0, "throttle"]) and telemetry.loc[1, "throttle"] == "sw_power_cap"
    io = got["io_records"]
    assert list(io["record"]) == ["config", "config", "operation", "event", "event"]
    assert list(io["kind"]) == ["tune"] * 2 + ["engine"] * 3
    assert list(io.loc[:1, "op"]) == ["read", "write"] and list(io.loc[2:, "op"]) == ["swap_in"] * 3
    assert io.loc[0, "trials"] == 3 and json.loads(io.loc[0, "trials_GBps"]) == [2.4, 2.5, 2.6]
    assert io.loc[0, "block_size"] == 1 << 20 and io.loc[0, "overlap_events"] == True  # noqa: E712
    assert io.loc[3, "bytes"] == 4096 and io.loc[4, "step"] == 1 and io.loc[3, "path"] == "/tmp/x.swp"


def test_missing_sections_give_empty_frames_with_the_documented_columns():
    bare = RunReport(run_id="20261201T120000Z-000000", suite="tiny")
    bare.profilers = {"flops": None, "comms": {"c1": "not an object"}}
    for name, frame in frames.all_frames(bare).items():
        if name == "runs":
            assert len(frame) == 1
            continue
        assert frame.empty, name
        assert {c: str(t) for c, t in frame.dtypes.items()} == {
            c: frames.DTYPES[k] for c, k in frames.COLUMNS[name].items()}, name


def test_accepts_a_report_a_path_a_dict_or_a_list(tmp_path):
    report = small_report()
    run = write_report(report, tmp_path).parent
    expected = frames.trials(report)
    for source in (report, run, str(run / "run.json"), report.to_dict(), [run]):
        pd.testing.assert_frame_equal(frames.trials(source), expected)
    assert len(frames.runs([report, run, FIXTURE_RUNS[0]])) == 3
    with pytest.raises(TypeError):
        frames.runs(42)


def _round_trip(source, out, fmt):
    written = frames.export(source, out, fmt)
    expected = {name: f for name, f in frames.all_frames(source).items() if not f.empty}
    assert sorted(p.name for p in written) == sorted(f"{name}.{fmt}" for name in expected)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in written), "no temp files left"
    back = frames.read_exported(out, fmt)
    assert list(back) == list(expected)
    for name, frame in expected.items():
        pd.testing.assert_frame_equal(back[name], frame, check_exact=True, obj=name)


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_export_round_trips(tmp_path, fmt):
    _round_trip(small_report(), tmp_path / "small", fmt)
    _round_trip(FIXTURE_RUNS, tmp_path / "gpu", fmt)
    _round_trip(COMMS_RUN, tmp_path / "ranks", fmt)
    if fmt == "json":
        records = json.loads((tmp_path / "small" / "results.json").read_text())
        assert records[1]["arm"] == "torch" and records[1]["samples_per_s"] is None


def test_parquet_round_trips_or_names_pyarrow(tmp_path, monkeypatch):
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="pyarrow"):
            frames.export(small_report(), tmp_path, "parquet")
    else:
        _round_trip(small_report(), tmp_path / "small", "parquet")
        monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if it were not installed
        with pytest.raises(ValueError, match="pyarrow"):
            frames.export(small_report(), tmp_path / "none", "parquet")
        assert not (tmp_path / "none").exists()


def test_unknown_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="csv, parquet, json"):
        frames.export(small_report(), tmp_path, "xlsx")
    with pytest.raises(FileNotFoundError):
        frames.read_exported(tmp_path / "nowhere", "csv")


def test_cli_export_writes_the_files(tmp_path, capsys):
    report = small_report()
    run = write_report(report, tmp_path / "reports").parent
    assert cli.main(["report", "export", report.run_id, "--reports", str(tmp_path / "reports")]) == 0
    printed = capsys.readouterr().out.split()
    assert printed and all(Path(p).parent == run / "export" and Path(p).is_file() for p in printed)
    assert {Path(p).name for p in printed} == {f"{name}.csv" for name in frames.FRAMES}
    out = tmp_path / "json"
    assert cli.main(["report", "export", str(run), "--format", "json", "--out", str(out)]) == 0
    assert sorted(capsys.readouterr().out.split()) == sorted(str(out / f"{n}.json") for n in frames.FRAMES)
    pd.testing.assert_frame_equal(frames.read_exported(out, "json")["trials"], frames.trials(report))


@pytest.mark.parametrize("argv, message", [
    (["report", "export", "20991231T000000Z-ffffff"], "no run"),
    (["report", "export", "tiny/20261201T120000Z-abc123", "--format", "xlsx"], "unknown export format 'xlsx'"),
])
def test_cli_export_errors_exit_1(tmp_path, capsys, argv, message):
    write_report(small_report(), tmp_path)
    assert cli.main(argv + ["--reports", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dslab: error: ") and message in err and "Traceback" not in err


def _environment(gpus):
    return {"cuda": {"available": bool(gpus), "gpus": [{"index": i, "name": n} for i, n in enumerate(gpus)]}}


@pytest.mark.parametrize("environment, hardware, count", [
    (_environment([]), "CPU", 0),
    (_environment(["NVIDIA H100 80GB HBM3"]), "NVIDIA H100 80GB HBM3", 1),
    (_environment(["NVIDIA H100 80GB HBM3"] * 8), "8x NVIDIA H100 80GB HBM3", 8),
    (_environment(["NVIDIA H100", "NVIDIA A100"]), "NVIDIA H100, NVIDIA A100", 2),
    ({"torch": {"version": "2.13.0"}}, None, None),  # the environment does not say
])
def test_runs_hardware(environment, hardware, count):
    report = RunReport(run_id="20261201T120000Z-000000", suite="tiny", environment=environment)
    row = frames.records(frames.runs(report))[0]
    assert (row["hardware"], row["gpu_count"]) == (hardware, count)


def test_runs_source_digest_reads_through_and_old_reports_lack_it(tmp_path):
    report = small_report()
    report.environment["dslab"] = {**report.environment["dslab"], "git_commit": "b1c6aad" + "0" * 33,
                                   "source_digest": "f852e14acdedb861"}
    run = write_report(report, tmp_path / "reports").parent
    got = frames.runs([report, run, small_report(), *FIXTURE_RUNS])
    columns = list(got.columns)
    assert columns[columns.index("git_dirty") + 1] == "source_digest" and got["source_digest"].dtype == "string"
    assert list(got["source_digest"][:2]) == ["f852e14acdedb861"] * 2
    assert got["source_digest"][2:].isna().all()  # reports from before the digest was recorded
    assert frames.records(frames.runs(small_report()))[0]["source_digest"] is None
    for fmt in ("csv", "json"):
        _round_trip([report, small_report()], tmp_path / fmt, fmt)


def test_results_carry_the_ratios_and_the_best_plain_arm():
    report = RunReport(run_id="20261201T120000Z-000000", suite="tiny")
    for arm, speed in (("dslab", 120.0), ("torch", 80.0), ("torch-compile", 100.0), ("dslab-int8", 150.0)):
        result = Result(case="c1", arm=arm, trials=[Trial(trial=0, metrics={"samples_per_s": speed})])
        result.summarize()
        report.results.append(result)
    report.compute_ratios()
    rows = {r["arm"]: r for r in frames.records(frames.results(report))}
    assert [arm for arm, r in rows.items() if r["best_plain"]] == ["torch-compile"]
    assert rows["torch"]["dslab_over_arm"] == report.ratios["c1"]["dslab/torch"] == 1.5
    assert rows["dslab"]["dslab_over_arm"] is None


def test_records_are_plain_python_values():
    rows = frames.records(frames.comms_calls(small_report()))
    assert len(rows) == 6 and rows[0]["rank"] == 0 and type(rows[0]["bytes"]) is int
    assert rows[0]["async"] is False and rows[0]["latency_ms"] == 0.25 and rows[0]["host_arrival_ns"] > 0
    assert frames.records(frames.runs(small_report()))[0]["finished"] is None


def test_case_keeps_one_case():
    report = small_report()
    report.profilers["memory"]["c2"] = {"steps": [{"step": 9, "peak_allocated": 1}]}
    assert set(frames.memory_timeline(report)["case"]) == {"c1", "c2"}
    only = frames.memory_timeline(report, case="c2")
    assert list(only["case"]) == ["c2"] and list(only["step"]) == [9]
    assert frames.memory_timeline(report, case="c3").empty


@pytest.mark.parametrize("section, record, frame, message", [
    ("flops", {"modules": "not a list"}, "flops_modules", "flops.modules should be a list, not str"),
    ("flops", {"modules": [{"name": ""}, 3]}, "flops_modules", r"flops.modules\[1\] should be an object, not int"),
    ("comms", {"per_rank": {"rank-zero": []}}, "comms_calls", "rank 'rank-zero' that is not an integer"),
    ("comms", {"per_rank": {"0": "x"}}, "comms_calls", "comms.per_rank.0 should be a list"),
    ("comms", {"ops": [1]}, "comms_ops", r"comms.ops\[0\] should be an object"),
    ("comms", {"straggler": {"ranks": []}}, "stragglers", "comms.straggler.ranks should be an object, not list"),
    ("memory", {"steps": [1, 2]}, "memory_timeline", r"memory.steps\[0\] should be an object, not int"),
    ("memory", {"activations": "x"}, "memory_activations", "memory.activations should be a list"),
    ("memory", {"model_states_per_rank": {"0": {}}}, "rank_memory",
     "memory.model_states_per_rank should be a list, not dict"),
    ("memory", {"model_states_per_rank": [{"total": 1}, None, 3]}, "rank_memory",
     r"memory.model_states_per_rank\[2\] should be an object, not int"),
    ("telemetry", {"gpus": {"GPU-x": {"samples": {}}}}, "telemetry_timeline",
     "telemetry.gpus.GPU-x.samples should be a list, not dict"),
    ("wall_clock", {"phases": {"forward": 3}}, "wall_clock", "wall_clock.phases.forward should be an object"),
    ("io", {"kind": "tune", "configs": {"read": 1}}, "io_records", "io.configs should be a list"),
    ("io", "not an object", "io_records", "profilers.io.c1 should be an object, not str"),
])
def test_strict_names_the_malformed_key(section, record, frame, message):
    report = RunReport(run_id="20261201T120000Z-000000", suite="tiny")
    report.profilers = {section: {"c1": record}}
    build = frames.FRAMES[frame]
    assert len(build(report)) <= 1  # tolerant: what is malformed is skipped
    with pytest.raises(ValueError, match=message):
        build(report, case="c1", strict=True)
    report.profilers = {section: "garbage"}
    with pytest.raises(ValueError, match=f"profilers.{section} should be an object, not str"):
        build(report, strict=True)
    assert build(report).empty


def _ranked_report() -> RunReport:
    """Two cases; in c1 the dslab arm's trials have CUDA peaks of two ranks (the second trial a
    host RSS too) and the torch arm's host RSS of ranks 2 and 10; the memory tracer's model states
    of rank 0 only."""
    report = RunReport(run_id="20261201T120000Z-000000", suite="tiny")
    cuda = {"peak_memory_bytes": 9.0, "peak_memory_bytes_rank1": 2.0**34, "peak_memory_bytes_rank0": 2.0**35}
    report.results = [
        Result(case="c1", arm="dslab", trials=[Trial(trial=0, metrics=cuda),
                                               Trial(trial=1, metrics={**cuda, "peak_rss_bytes_rank0": 5.0})]),
        Result(case="c1", arm="torch", trials=[Trial(trial=0, metrics={"peak_rss_bytes_rank10": 8.0,
                                                                      "peak_rss_bytes_rank2": 7.0})]),
        Result(case="c2", arm="dslab", trials=[Trial(trial=0, metrics={"step_time_ms": 1.0})]),
    ]
    report.profilers = {"memory": {"c1": {"model_states_per_rank": [{"total": 2**30}, None]},
                                   "c2": {"model_states_per_rank": [{"total": 1}]}}}
    return report


def test_rank_memory_has_a_row_per_trial_and_rank():
    rows = frames.records(frames.rank_memory(_ranked_report()))
    assert [(r["arm"], r["trial"], r["rank"], r["kind"], r["peak_bytes"]) for r in rows] == [
        ("dslab", 0, 0, "cuda_peak", 2**35), ("dslab", 0, 1, "cuda_peak", 2**34),
        ("dslab", 1, 0, "cuda_peak", 2**35), ("dslab", 1, 1, "cuda_peak", 2**34),
        ("torch", 0, 2, "host_rss", 7), ("torch", 0, 10, "host_rss", 8)]  # ranks by number
    # the tracer's model states belong to the dslab arm; rank 1's entry is null
    assert [r["model_state_bytes"] for r in rows] == [2**30, None, 2**30, None, None, None]
    assert {r["case"] for r in rows} == {"c1"}  # c2 has no per-rank peaks: one process
    assert frames.rank_memory(_ranked_report(), case="c2").empty
    assert len(frames.rank_memory(_ranked_report(), case="c1", strict=True)) == 6


def test_rank_memory_of_a_three_rank_cpu_run():
    report = read_report(COMMS_RUN)
    ranks = frames.rank_memory(report, case="124m", strict=True)
    (trial,) = report.result("124m", "dslab").trials
    states = report.profilers["memory"]["124m"]["model_states_per_rank"]
    assert list(ranks["rank"]) == [0, 1, 2] and set(ranks["kind"]) == {"host_rss"}
    assert list(ranks["peak_bytes"]) == [trial.metrics[f"peak_rss_bytes_rank{r}"] for r in range(3)]
    assert list(ranks["model_state_bytes"]) == [s["total"] for s in states]
