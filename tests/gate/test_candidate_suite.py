"""``dslab gate`` without ``--suite`` or ``--candidate``: the newest run of the one suite the
reports hold, or an error that lists the suites there."""

from dslab import cli
from dslab.report import Result, RunReport, Trial, write_report
from dslab.report.environment import collect_environment


def _run(reports, suite, run_id):
    report = RunReport(run_id=run_id, suite=suite, status="complete", environment=collect_environment())
    trials = [Trial(trial=t, step_times_ms=[10.0 + t, 10.5], metrics={"samples_per_s": 100.0 + t})
              for t in range(3)]
    report.results.append(Result(case="c", arm="dslab", trials=trials))
    report.results[0].summarize()
    write_report(report, reports)


def test_the_one_suite_of_the_reports_is_judged(tmp_path, capsys):
    reports = tmp_path / "reports"
    _run(reports, "alpha", "20261130T000000Z-aaaaaa")
    _run(reports, "alpha", "20261130T000100Z-bbbbbb")
    code = cli.main(["gate", "--reports", str(reports)])
    out = capsys.readouterr().out
    assert code == 2  # no baseline yet: cannot judge, but for the right suite and run
    assert out.startswith("dslab gate: alpha: CANNOT JUDGE") and "run 20261130T000100Z-bbbbbb" in out
    assert "no baseline for this fingerprint" in out and "baselines/alpha/" in out


def test_reports_of_several_suites_or_none_need_the_suite_named(tmp_path, capsys):
    reports = tmp_path / "reports"
    code = cli.main(["gate", "--reports", str(reports)])
    assert code == 2 and f"{reports} holds no runs" in capsys.readouterr().out
    _run(reports, "beta", "20261130T000000Z-aaaaaa")
    _run(reports, "alpha", "20261130T000100Z-bbbbbb")
    code = cli.main(["gate", "--reports", str(reports)])
    out = capsys.readouterr().out
    assert code == 2 and "name the suite (--suite S)" in out and f"{reports} holds runs of alpha, beta" in out
    assert cli.main(["gate", "--reports", str(reports), "--suite", "beta"]) == 2
    assert capsys.readouterr().out.startswith("dslab gate: beta: CANNOT JUDGE")
