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
