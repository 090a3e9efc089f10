import json

import pytest

from dslab.report import Result, RunReport, Trial, find_run, list_runs, new_run_id, read_report, write_report
from dslab.report.schema import SCHEMA_VERSION, report_from_dict
from dslab.report.summary import describe, results_table


def sample_report(suite="bert_large", run_id=None):
    r = RunReport(run_id=run_id or new_run_id(), suite=suite, status="complete", created="2026-11-22T03:00:00+00:00")
    r.environment = {"torch": {"version": "2.13.0"}, "cuda": {"gpus": [{"name": "NVIDIA H100 80GB HBM3"}]}}
    r.config = {"scale": "tiny", "trials": 2, "steps": 3, "warmup_steps": 1, "precision": "bf16"}
    for arm, base in (("dslab", 120.0), ("torch", 100.0)):
        res = Result(case="seq128", arm=arm)
        for t, jitter in enumerate((0.98, 1.02, 1.0)):
            sps = base * jitter
            res.trials.append(Trial(trial=t, step_times_ms=[64 / sps * 1e3] * 3,
                                    metrics={"samples_per_s": sps, "step_time_ms": 64 / sps * 1e3}))
        res.summarize()
        r.results.append(res)
    r.results.append(Result(case="seq128", arm="hf", status="failed", error="out of memory: tried to allocate"))
    r.compute_ratios("dslab", "samples_per_s")
    return r


def test_round_trip(tmp_path):
    r = sample_report()
    path = write_report(r, tmp_path)
    assert path == tmp_path / "bert_large" / r.run_id / "run.json"
    back = read_report(path.parent)
    assert back.to_dict() == r.to_dict()
    assert back.missing == [] and back.warnings == []
    assert back.result("seq128", "dslab").metrics["samples_per_s"] == pytest.approx(120.0)
    assert back.ratios["seq128"]["dslab/torch"] == pytest.approx(1.2)
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION


def test_write_is_atomic_and_leaves_no_temp(tmp_path):
    r = sample_report()
    write_report(r, tmp_path)
    r.status = "incomplete"
    write_report(r, tmp_path)
    files = list((tmp_path / "bert_large" / r.run_id).iterdir())
    assert [f.name for f in files] == ["run.json"]
    assert read_report(files[0]).status == "incomplete"


def test_partial_and_older_reports_load_with_what_is_missing(tmp_path):
    data = sample_report().to_dict()
    for key in ("schema_version", "peaks", "profilers", "ratios", "finished"):
        data.pop(key)
    data["results"].append({"arm": "x"})  # malformed result
    data["results"][0]["trials"].append("garbage")
    back = report_from_dict(data)
    assert "schema_version" in back.missing and "peaks" in back.missing and "profilers" in back.missing
    assert back.profilers == {"flops": None, "memory": None, "comms": None, "telemetry": None, "wall_clock": None}
    assert len(back.results) == 3
    assert any("results[3]" in w for w in back.warnings)
    assert any("trials[3]" in w for w in back.warnings)
    text = describe(back)
    assert "lacks" in text and "schema_version" in text


def test_describe_shows_the_commit_and_the_source_digest():
    r = sample_report()
    r.environment["dslab"] = {"version": "0.1.0", "git_commit": "b1c6aad" + "0" * 33, "git_dirty": True,
                              "source_digest": "f852e14acdedb861"}
    header = describe(r).splitlines()[2]
    assert header.endswith("dslab 0.1.0 @ b1c6aad" + "0" * 33 + " (dirty), source f852e14acdedb861")
    del r.environment["dslab"]["source_digest"]  # a report from before the digest was recorded
    assert describe(r).splitlines()[2].endswith("(dirty)")
    r.environment["dslab"] = {"source_digest": "f852e14acdedb861"}
    assert describe(r).splitlines()[2].endswith("@ unknown commit, source f852e14acdedb861")


def test_unreadable_reports_name_the_file(tmp_path):
    bad = tmp_path / "s" / "20261122T000000Z-aaaaaa"
    bad.mkdir(parents=True)
    (bad / "run.json").write_text('{"schema": "dslab.run", "results": [')
    with pytest.raises(ValueError, match="run.json is not valid JSON"):
        read_report(bad)
    (bad / "run.json").write_text('{"schema": "other"}')
    with pytest.raises(ValueError, match="not a dslab run report"):
        read_report(bad)
    with pytest.raises(FileNotFoundError, match="no run report"):
        read_report(tmp_path / "nowhere")


def test_list_and_find(tmp_path):
    a = sample_report(run_id="20261122T010000Z-aaaaaa")
    b = sample_report(run_id="20261122T020000Z-bbbbbb")
    c = sample_report(suite="gpt2", run_id="20261122T030000Z-cccccc")
    for r in (b, a, c):
        write_report(r, tmp_path)
    assert [p.name for p in list_runs(tmp_path)] == [a.run_id, b.run_id, c.run_id]
    assert [p.name for p in list_runs(tmp_path, "bert_large")] == [a.run_id, b.run_id]
    assert find_run(tmp_path, b.run_id).name == b.run_id
    assert find_run(tmp_path, "20261122T03").name == c.run_id
    assert find_run(tmp_path, f"gpt2/{c.run_id}").name == c.run_id
    with pytest.raises(ValueError, match="ambiguous"):
        find_run(tmp_path, "20261122T0")
    with pytest.raises(ValueError, match="may hold only"):
        find_run(tmp_path, "../../etc/passwd")
    with pytest.raises(ValueError, match="may hold only"):
        find_run(tmp_path, "../x")


def test_results_table_shows_arms_ratios_and_failures():
    text = results_table(sample_report())
    lines = text.splitlines()
    assert lines[0] == "bert_large / seq128"
    torch_row = next(line for line in lines if line.strip().startswith("torch"))
    assert "1.200" in torch_row
    hf_row = next(line for line in lines if line.strip().startswith("hf"))
    assert "failed" in hf_row
    assert "    hf: failed: out of memory: tried to allocate" in lines


def five_arm_report() -> RunReport:
    """dslab beside the four plain arms on one case; the fastest plain arm by samples/s (hf) failed
    in its last trial, so the best plain arm is the fastest one that finished: torch-compile-ro."""
    r = RunReport(run_id="20261122T040000Z-5a5a5a", suite="gpt2", status="complete")
    for arm, sps, status in (("dslab", 120.0, "ok"), ("torch", 90.0, "ok"), ("torch-compile", 110.0, "ok"),
                             ("torch-compile-ro", 115.0, "ok"), ("hf", 130.0, "failed")):
        res = Result(case="124m", arm=arm, status=status, error="out of memory" if status == "failed" else None)
        res.trials.append(Trial(trial=0, step_times_ms=[4 / sps * 1e3], metrics={"samples_per_s": sps,
                                                                              "step_time_ms": 4 / sps * 1e3}))
        res.summarize()
        r.results.append(res)
    r.compute_ratios("dslab", "samples_per_s")
    return r


def test_best_plain_ratio_is_against_the_fastest_arm_that_finished(tmp_path):
    r = five_arm_report()
    assert r.best_plain == {"124m": "torch-compile-ro"}
    assert r.ratios["124m"]["dslab/best_plain"] == pytest.approx(120 / 115)
    assert r.ratios["124m"]["dslab/torch-compile-ro"] == pytest.approx(120 / 115)
    assert r.ratios["124m"]["dslab/hf"] == pytest.approx(120 / 130)  # per-arm ratios keep every arm
    assert r.best_plain_ratio("124m") == ("torch-compile-ro", pytest.approx(120 / 115))
    assert r.best_plain_ratio("nope") is None
    back = read_report(write_report(r, tmp_path).parent)
    assert back.schema_version == SCHEMA_VERSION == 3 and back.missing == [] and back.warnings == []
    assert back.best_plain_ratio("124m") == r.best_plain_ratio("124m")
    text = results_table(r)
    assert "  dslab/best plain arm (torch-compile-ro): 1.043" in text.splitlines()
    assert next(line for line in text.splitlines() if line.strip().startswith("hf ")).split()[1] == "failed"


def test_no_best_plain_without_a_finished_plain_arm():
    r = sample_report()
    r.results = [x for x in r.results if x.arm != "torch"]  # only dslab and the failed hf arm
    r.compute_ratios("dslab", "samples_per_s")
    assert r.best_plain == {} and r.best_plain_ratio("seq128") is None
    assert "best plain" not in results_table(r)


def test_version_1_report_reads_with_its_best_plain_arm_derived():
    data = five_arm_report().to_dict()
    data["schema_version"] = 1
    del data["best_plain"]
    for ratios in data["ratios"].values():
        del ratios["dslab/best_plain"]
    stored = dict(data["ratios"]["124m"])
    back = report_from_dict(data)
    assert back.missing == [] and back.warnings == [] and back.schema_version == 1
    assert back.best_plain_ratio("124m") == ("torch-compile-ro", pytest.approx(120 / 115))
    assert {k: v for k, v in back.ratios["124m"].items() if k != "dslab/best_plain"} == stored
    assert "dslab/best plain arm (torch-compile-ro)" in results_table(back)
    assert "lacks" not in describe(back)
    # cut short before the ratios were taken: nothing derived, still readable
    data["ratios"] = {}
    assert report_from_dict(data).best_plain_ratio("124m") is None


def test_malformed_best_plain_is_ignored_with_a_warning():
    data = five_arm_report().to_dict()
    data["best_plain"] = ["torch"]
    back = report_from_dict(data)
    assert any("'best_plain' should be dict" in w for w in back.warnings)
    assert back.best_plain_ratio("124m") is None
    data["best_plain"] = {"124m": 7}
    assert report_from_dict(data).best_plain_ratio("124m") is None


def test_run_ids_sort_by_time_within_one_second_and_keep_their_shape():
    import datetime

    from dslab.report.store import RUN_ID_PATTERN

    second = datetime.datetime(2026, 11, 29, 21, 53, 14, tzinfo=datetime.timezone.utc)
    times = [second + datetime.timedelta(microseconds=us) for us in (0, 300, 1_000, 250_000, 999_999)]
    times.append(second + datetime.timedelta(seconds=1))
    for _ in range(20):  # the random half never reorders them
        ids = [new_run_id(t) for t in times]
        assert all(RUN_ID_PATTERN.match(i) for i in ids), ids
        assert sorted(ids) == ids, ids
    assert len({new_run_id(second) for _ in range(200)}) > 150  # unique across hosts and calls
