"""``dslab bench`` as a new user meets it: its exit codes (0 every arm ran or was skipped, 3 a
partial run, 2 a run that could not start), the summary table on standard output and the progress
lines on standard error, the tiny scale's warning about its ratios, and ``dslab report list``'s
header. Each run is one case, one trial of one step at the tiny scale."""

import json

import pytest

from dslab import cli
from dslab.bench import training
from dslab.bench.common import PART_ENV, ArmSkipped, RunNotStarted
from dslab.bench.runner import run_suite
from dslab.bench.suite import REPO_SUITES
from dslab.report import list_runs, read_report
from dslab.report.summary import RUNS_HEADER, TINY_SCALE_NOTE

TYPO = "gradient_cliping"


def write_suite(folder, name="gpt2_exit", engine=None):
    """A tiny GPT-2 suite of arms dslab and torch; ``engine`` is the dslab arm's engine config."""
    suite = {
        "name": name, "family": "gpt2", "precision": "bf16",
        "engine": engine if engine is not None else {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
        "arms": ["dslab", "torch"],
        "scales": {"tiny": {"preset": "gpt2_tiny", "warmup_steps": 1, "steps": 1, "trials": 1,
                            "cases": [{"name": "b", "seq_len": 16, "micro_batch": 2}]}},
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "suite.json").write_text(json.dumps(suite))
    return folder


def bench(capsys, suite, out, *options):
    code = cli.main(["bench", str(suite), "--out", str(out), *options])
    return code, capsys.readouterr()


def test_a_misspelled_engine_key_makes_a_partial_run_that_exits_3(tmp_path, capsys):
    engine = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, TYPO: 1.0}
    code, printed = bench(capsys, write_suite(tmp_path / "suite", engine=engine), tmp_path / "r")
    assert code == cli.EXIT_BENCH_PARTIAL == 3
    (run,) = list_runs(tmp_path / "r")
    report = read_report(run)
    assert report.status == "partial"
    assert [(r.arm, r.status) for r in report.failed_results()] == [("dslab", "failed")]
    assert report.result("b", "torch").status == "ok"
    error_line = f"    dslab: failed: ValueError: unknown config key '{TYPO}'; did you mean 'gradient_clipping'?"
    assert error_line in printed.out.splitlines()  # the summary names the failing arm's error
    assert "status partial" in printed.out and "partial: 1 arm(s) did not finish: b/dslab (failed)" in printed.out
    assert f"dslab: run {report.run_id} is partial: 1 arm(s) failed: b/dslab (failed)" in printed.err


def test_summary_on_stdout_progress_on_stderr(tmp_path, capsys):
    code, printed = bench(capsys, write_suite(tmp_path / "suite"), tmp_path / "r")
    assert code == 0
    (run,) = list_runs(tmp_path / "r")
    out, err = printed.out.splitlines(), printed.err.splitlines()
    assert out[0] == f"run {run.name}  suite gpt2_exit  status complete"
    assert "gpt2_exit / b" in out and f"report: {run / 'run.json'}" in out
    assert any(line.strip().startswith("arm ") and "dslab/arm" in line for line in out)
    assert err[0] == "no CUDA GPU: running suite gpt2_exit at the 'tiny' scale on the CPU"
    assert any(line.startswith("[gpt2_exit b] trial 1/1 dslab") for line in err)
    assert any(line.startswith("[gpt2_exit b] trial 1/1 torch") for line in err)
    assert not any("dslab/arm" in line or line.startswith("report:") for line in err)
    assert not any(line.startswith("[gpt2_exit b]") for line in out)
    # the tiny scale says, once, that its ratios are not speed measurements
    assert out.count(f"  {TINY_SCALE_NOTE}") == 1 and "not speed measurements" in TINY_SCALE_NOTE


def test_a_skipped_arm_keeps_the_run_complete(tmp_path, capsys, monkeypatch):
    real = training.build_arm

    def build(name, *args, **kwargs):
        if name == "torch":
            raise ArmSkipped("torch is not wanted here")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(training, "build_arm", build)
    code, printed = bench(capsys, write_suite(tmp_path / "suite"), tmp_path / "r")
    assert code == 0, printed.err
    (run,) = list_runs(tmp_path / "r")
    report = read_report(run)
    assert report.status == "complete" and report.result("b", "torch").status == "skipped"


def test_a_launched_part_leaves_the_verdict_to_its_launcher(tmp_path, capsys, monkeypatch):
    """A process that ``dslab bench`` launched for a data-parallel suite writes its part and exits
    0 even when an arm failed: the launching process merges the parts and judges the whole run."""
    monkeypatch.setenv(PART_ENV, "n1")
    engine = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, TYPO: 1.0}
    code, printed = bench(capsys, write_suite(tmp_path / "suite", engine=engine), tmp_path / "r", "--arms", "dslab")
    assert code == 0
    (part,) = (tmp_path / "r" / "gpt2_exit").glob("*/part-n1.json")
    assert read_report(part).status == "partial" and "is partial" not in printed.err


def test_a_missing_suite_exits_2_and_lists_the_suites_beside_it(tmp_path, capsys):
    suites = tmp_path / "suites"
    write_suite(suites / "alpha", name="alpha")
    write_suite(suites / "beta", name="beta")
    (suites / "notes").mkdir()  # a folder without a suite.json is not a suite
    code, printed = bench(capsys, suites / "nonexistent", tmp_path / "r")
    assert code == cli.EXIT_BENCH_NOT_STARTED == 2
    assert printed.err == (f"dslab: error: no suite at {suites / 'nonexistent'} (expected "
                           f"{suites / 'nonexistent' / 'suite.json'}); suites under {suites}: alpha, beta\n")
    assert not (tmp_path / "r").exists()


def test_a_missing_suite_elsewhere_lists_the_repositorys_suites(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, printed = bench(capsys, "suites/nonexistent", tmp_path / "r")
    repo_suites = sorted(d.name for d in REPO_SUITES.iterdir() if (d / "suite.json").is_file())
    assert code == 2 and "bert_large" in repo_suites
    assert printed.err.rstrip().endswith(f"suites under {REPO_SUITES}: {', '.join(repo_suites)}")


@pytest.mark.parametrize("options, words", [
    (["--cases", "zzz"], "unknown case(s) zzz; this scale has b"),
    (["--arms", "jax"], "unknown arm(s) jax"),
    (["--scale", "full"], "suite gpt2_exit has no scale 'full'; it has tiny"),
    (["--nprocs", "1,x"], "'x' is not a process count"),
])
def test_options_refused_before_the_run_exit_2_without_a_report(tmp_path, capsys, options, words):
    code, printed = bench(capsys, write_suite(tmp_path / "suite"), tmp_path / "r", *options)
    last = printed.err.splitlines()[-1]
    assert code == 2 and last.startswith("dslab: error: ") and words in last
    assert not (tmp_path / "r").exists()


def test_an_invalid_suite_file_exits_2(tmp_path, capsys):
    suite = write_suite(tmp_path / "suite")
    (suite / "suite.json").write_text('{"name": "x", "family": "gpt2", "scales": {"tiny": {"preset": "gpt2_tiny", '
                                      '"cases": [{"name": "a", "seq_len": 8, "micro_batch": 1}], "step": 3}}}')
    code, printed = bench(capsys, suite, tmp_path / "r")
    assert code == 2 and "unknown config key 'scales.tiny.step'" in printed.err
    with pytest.raises(RunNotStarted, match="scales.tiny.step"):  # a ValueError too, for callers of run_suite
        run_suite(suite, out=tmp_path / "r")


def test_report_list_has_a_header(tmp_path, capsys):
    for name in ("gpt2_exit", "gpt2_exit_with_a_long_name"):
        assert bench(capsys, write_suite(tmp_path / name, name=name), tmp_path / "r", "--arms", "dslab")[0] == 0
    assert cli.main(["report", "list", "--reports", str(tmp_path / "r")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert [h.strip() for h in lines[0].split("  ") if h.strip()] == RUNS_HEADER
    starts = [lines[0].index(h) for h in RUNS_HEADER]
    for line, run in zip(lines[1:], list_runs(tmp_path / "r")):
        report = read_report(run)
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None])]  # aligned under the header
        assert cells[:4] == [report.suite, report.run_id, "complete", "CPU"]
        assert cells[4] == f"{report.result('b', 'dslab').metrics['samples_per_s']:,.1f} (b)"
