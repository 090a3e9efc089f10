"""``dslab gate``: judge a candidate run against a baseline; exit 0 pass, 1 regression, 2 cannot judge.

    dslab gate --suite bert_large                         # newest run vs its fingerprint's baseline
    dslab gate --suite bert_large --baseline rolling:5    # vs the last 5 runs with its fingerprint
    dslab gate --suite bert_large --candidate RUN --baseline OTHER_RUN --format markdown
    dslab gate --suite bert_large --update-baseline RUN   # write reports/baselines/<suite>/<key>.json
    dslab gate --pytest-benchmark base.json cand.json     # kernel microbenchmarks
    dslab gate --ab --suite suites/gpt2 --case 124m --baseline-tree ../main   # A/B in alternation, here

Anything that stops a judgement (no such run, no baseline for this fingerprint, a malformed file)
is reported in the chosen format as a problem and exits 2, never 1: exit 1 means a regression
was found. A ``partial`` run (one whose ``dslab bench`` exited 3: some arm failed or ran out of
memory) is judged on the arms that ran; a note names its failed arms, and a failed arm that is
judged (``--arm``, default dslab) is a cannot-judge row with its error, so the gate exits 2. Every suite gate also refreshes ``<reports>/<suite>/change_points.json`` (see
:func:`dslab.gate.baseline.history_change_points`), the change points the dashboard shows.

``--ab`` runs a comparison instead of reading one (:mod:`dslab.gate.ab`): the baseline tree
(``--baseline-tree``, default this checkout) and this checkout run one case in alternation on
this machine and :mod:`dslab.gate.sequential` judges the pairs, stopping at a clear verdict; the
defaults are then a 3% threshold and alpha 0.05 (the classic modes keep 5% and 0.01). Options
of one mode given to the other are refused (exit 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dslab.gate.baseline import (
    TrialSet,
    baseline_path,
    history_change_points,
    injected_sleep_ms,
    list_baselines,
    read_baseline,
    rolling_baseline,
    trial_set_from_reports,
    write_baseline,
    write_change_points,
)
from dslab.gate.fingerprint import explain_difference
from dslab.gate.format import FORMATS, render
from dslab.gate.ab import ABRequest, default_out, parse_env_assignments, render_ab, run_ab
from dslab.gate.pytest_benchmark import gate_pytest_benchmark
from dslab.gate.sequential import SequentialSettings
from dslab.gate.verdict import (
    DEFAULT_METRICS,
    EXIT_CANNOT_JUDGE,
    GateReport,
    GateSettings,
    gate_trial_sets,
    trials_needed,
)
from dslab.report import find_run, list_runs, read_report
from dslab.report.store import REPORT_FILE

ROLLING_PREFIX = "rolling:"
# Defaults that differ by mode: (classic gate, --ab).
DEFAULT_THRESHOLD = {False: 0.05, True: 0.03}
DEFAULT_ALPHA = {False: 0.01, True: 0.05}
# The options only --ab takes, and the classic options it refuses.
AB_ONLY = ("case", "scale", "baseline_tree", "max_trials", "min_trials", "out", "candidate_env", "no_pin_kernels")
NOT_WITH_AB = ("baseline", "candidate", "update_baseline", "pytest_benchmark", "run_noise", "strict")
AB_MIN_TRIALS, AB_MAX_TRIALS = 5, 15


def _parse_fraction(text: str, option: str, example: str, zero_ok: bool) -> float:
    value = str(text).strip()
    try:
        number = float(value[:-1]) / 100.0 if value.endswith("%") else float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{option} must be a percentage like {example}% or a fraction like "
                                         f"{float(example) / 100:g}, got {text!r}") from None
    if not value.endswith("%") and number >= 1.0:
        raise argparse.ArgumentTypeError(f"{option} {text!r} is ambiguous: write {value}% or "
                                         f"{number / 100:g}")
    if not (0.0 <= number if zero_ok else 0.0 < number) or not number < 1.0:
        raise argparse.ArgumentTypeError(f"{option} must lie between 0% and 100%, got {text!r}")
    return number


def parse_threshold(text: str) -> float:
    """``"5%"`` -> 0.05, ``"0.05"`` -> 0.05; a bare number >= 1 is refused as ambiguous."""
    return _parse_fraction(text, "--threshold", "5", zero_ok=False)


def parse_run_noise(text: str) -> float:
    """``--run-noise``: ``"0.3%"`` -> 0.003, as :func:`parse_threshold` reads, 0 allowed."""
    return _parse_fraction(text, "--run-noise", "0.3", zero_ok=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", default=None, help="the suite whose runs are judged (default: the candidate's; "
                                                      "without --candidate, the one suite the reports hold)")
    parser.add_argument("--reports", default="reports", help="reports root (default: reports/)")
    parser.add_argument("--baseline", default=None, metavar="PATH",
                        help="a baseline JSON file, a run (id, suite/id or directory), or rolling:N for the last N "
                             "runs with the candidate's fingerprint (default: "
                             "<reports>/baselines/<suite>/<fingerprint>.json)")
    parser.add_argument("--candidate", nargs="+", default=None, metavar="RUN",
                        help="run(s) to judge, pooled (default: the suite's newest run)")
    parser.add_argument("--metric", action="append", default=None, metavar="NAME",
                        help="metric to judge, repeatable (default: samples_per_s, else tokens_per_s)")
    parser.add_argument("--arm", action="append", default=None, metavar="ARM",
                        help="arm to judge, repeatable (default: dslab)")
    parser.add_argument("--threshold", type=parse_threshold, default=None,
                        help="smallest change that counts, e.g. 5%% or 0.05 (default: 5%%; with --ab 3%%)")
    parser.add_argument("--alpha", type=float, default=None,
                        help="significance level of the rank test (default: 0.01); with --ab, the bound on the "
                             "chance of calling an unchanged candidate a regression (default: 0.05)")
    parser.add_argument("--run-noise", type=parse_run_noise, default=None, metavar="PCT",
                        help="the relative spread of a run's median between two processes of unchanged code, which "
                             "the trials of one process cannot show (pytest-benchmark rounds are one process): "
                             "widens the interval by it (default: 0%%; measure it from A/A runs, e.g. 0.3%% for "
                             "benchmarks/kernels on an H200)")
    parser.add_argument("--strict", action="store_true",
                        help="a row with no clear change whose CI still reaches past the threshold on the worse "
                             "side (the trials could not have caught a regression of the threshold's size) is "
                             "cannot-judge, exit 2, instead of a pass")
    parser.add_argument("--format", choices=FORMATS, default="text", help="output format (default: text)")
    parser.add_argument("--update-baseline", nargs="+", default=None, metavar="RUN",
                        help="write the baseline of RUN's fingerprint from RUN (several runs are pooled) and exit")
    parser.add_argument("--pytest-benchmark", nargs=2, default=None, metavar=("BASE_JSON", "CAND_JSON"),
                        help="gate two pytest-benchmark JSON files (saved with --benchmark-save-data) instead")
    parser.add_argument("--ab", action="store_true",
                        help="run the baseline tree and this checkout in alternation on this machine and judge the "
                             "pairs sequentially (--suite is then the suite's folder, --case the case)")
    parser.add_argument("--case", default=None, help="with --ab: the case to run")
    parser.add_argument("--scale", default=None, help="with --ab: the suite's scale (default: full on a CUDA GPU, "
                                                      "else tiny)")
    parser.add_argument("--baseline-tree", default=None, metavar="DIR",
                        help="with --ab: the source tree of the baseline, e.g. a git worktree of origin/main "
                             "(default: this checkout, an A/A run)")
    parser.add_argument("--max-trials", type=int, default=None, metavar="N",
                        help="with --ab: the most trials per side (default: 15)")
    parser.add_argument("--min-trials", type=int, default=None, metavar="N",
                        help="with --ab: the fewest trials per side before a verdict (default: 5)")
    parser.add_argument("--out", default=None, metavar="FILE",
                        help="with --ab: the result JSON (default: <reports>/ab/<suite>/<case>-<arm>-<time>.json)")
    parser.add_argument("--candidate-env", action="append", default=None, metavar="NAME=VALUE",
                        help="with --ab: an environment variable for the candidate's worker only, repeatable "
                             "(e.g. DSLAB_INJECT_STEP_SLEEP_MS=5 to check the gate)")
    parser.add_argument("--no-pin-kernels", action="store_true",
                        help="with --ab: let the candidate's worker pick its own kernels (default: it replays the "
                             "choices the baseline's worker made: Triton autotune configs, cuDNN/cuBLAS flags)")


def _read_runs(root: str, refs: list[str], suite: str | None) -> list:
    reports = [read_report(find_run(root, ref)) for ref in refs]
    for report in reports:
        if suite is not None and report.suite != suite:
            raise ValueError(f"run {report.run_id} is of suite {report.suite!r}, not {suite!r}")
    return sorted(reports, key=lambda r: r.run_id)


def _candidates(args: argparse.Namespace) -> list:
    if args.candidate:
        return _read_runs(args.reports, args.candidate, args.suite)
    suite = args.suite
    if suite is None:  # the newest run of the one suite the reports hold
        suites = sorted({run.parent.name for run in list_runs(args.reports)})
        if len(suites) != 1:
            held = f"runs of {', '.join(suites)}" if suites else "no runs"
            raise ValueError(f"name the suite (--suite S) or the candidate run(s) (--candidate RUN): "
                             f"{args.reports} holds {held}")
        suite = suites[0]
    runs = list_runs(args.reports, suite)
    if not runs:
        raise FileNotFoundError(f"no runs of suite {suite!r} under {args.reports}")
    return [read_report(runs[-1])]


def _missing_baseline_message(root: str, candidate: TrialSet) -> str:
    expected = baseline_path(root, candidate.suite, candidate.fingerprint.key)
    lines = [f"no baseline for this fingerprint: {expected} does not exist "
             f"(write one with: dslab gate --update-baseline RUN)"]
    for path in list_baselines(root, candidate.suite):
        try:
            other = read_baseline(path)
        except (OSError, ValueError) as err:
            lines.append(f"{path.name}: unreadable ({err})")
            continue
        fields = "; ".join(explain_difference(other.fingerprint, candidate.fingerprint, "that baseline", "candidate"))
        lines.append(f"{path.name} differs in {fields or 'nothing it records'}")
    return "; ".join(lines)


def _baseline(args: argparse.Namespace, candidate: TrialSet) -> TrialSet | str:
    """The baseline to judge against, or a message saying why there is none."""
    spec = args.baseline
    if spec is None:
        path = baseline_path(args.reports, candidate.suite, candidate.fingerprint.key)
        return read_baseline(path) if path.is_file() else _missing_baseline_message(args.reports, candidate)
    if spec.startswith(ROLLING_PREFIX):
        count = spec[len(ROLLING_PREFIX):]
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"--baseline {spec!r}: write rolling:N with N a positive whole number")
        return rolling_baseline(args.reports, candidate.suite, candidate.fingerprint.key, int(count),
                                exclude=tuple(candidate.source_runs), before=max(candidate.source_runs))
    path = Path(spec)
    if path.is_file() and path.name != REPORT_FILE:
        return read_baseline(path)
    return trial_set_from_reports(_read_runs(args.reports, [spec], candidate.suite))


def _failed_arms_note(side: str, trial_set: TrialSet) -> str | None:
    """A note naming the (case, arm)s of ``trial_set`` that failed or ran out of memory in every
    run it pools (a partial run's), or None when there are none."""
    failed = [f"{case}/{arm} ({state['status']})" for (case, arm), state in trial_set.status.items()
              if state["status"] not in ("ok", "skipped")]
    if not failed:
        return None
    return (f"the {side} is partial: {', '.join(failed)} did not finish; only the arms that ran are judged "
            f"(a failed arm asked for cannot be judged)")


def _refresh_change_points(args: argparse.Namespace, suite: str, settings: GateSettings, report: GateReport) -> None:
    try:
        if not list_runs(args.reports, suite):
            return
        points = history_change_points(args.reports, suite, tuple(args.metric) if args.metric else None,
                                       settings=settings)
        path = write_change_points(args.reports, suite, points, settings)
    except (OSError, ValueError) as err:
        report.notes.append(f"change points not refreshed: {err}")
        return
    report.notes.append(f"{len(points)} change point(s) over the suite's history, written to {path}")


def _update_baseline(args: argparse.Namespace, settings: GateSettings) -> int:
    reports = _read_runs(args.reports, args.update_baseline, args.suite)
    for report in reports:
        if injected_sleep_ms(report):
            raise ValueError(f"run {report.run_id} ran with DSLAB_INJECT_STEP_SLEEP_MS="
                             f"{injected_sleep_ms(report)} (a deliberate slowdown); it cannot be a baseline")
    trial_set = trial_set_from_reports(reports)
    path = write_baseline(trial_set, args.reports)
    print(f"baseline written: {path} (fingerprint {trial_set.fingerprint.key}, from {trial_set.label})")
    note = _failed_arms_note("baseline", trial_set)
    if note:
        print(f"dslab gate: warning: {note}", file=sys.stderr)
    needed = trials_needed(settings.alpha)
    for (case, arm), metrics in trial_set.trials.items():
        metric = next((m for m in (args.metric or DEFAULT_METRICS) if m in metrics), None)
        if metric is not None and len(metrics[metric]) < needed:
            print(f"dslab gate: warning: {case}/{arm} has {len(metrics[metric])} trial(s) of {metric}; the gate "
                  f"needs at least {needed} per side to ever find a change at alpha {settings.alpha:g}",
                  file=sys.stderr)
    return 0


def checkout_root() -> Path:
    """The source tree this dslab runs from (the folder above the ``dslab`` package)."""
    return Path(__file__).resolve().parents[2]


def _mode_options_error(args: argparse.Namespace) -> str | None:
    """Options of one mode given to the other, named; None when there are none."""
    ab = getattr(args, "ab", False)
    given = ["--" + name.replace("_", "-") for name in (NOT_WITH_AB if ab else AB_ONLY)
             if getattr(args, name, None) not in (None, False)]
    if not given:
        return None
    if ab:
        return f"{', '.join(given)}: not with --ab (its baseline is a source tree: --baseline-tree)"
    return f"{', '.join(given)}: only with --ab"


def _ab_request(args: argparse.Namespace) -> tuple[ABRequest, Path]:
    if not args.suite or not args.case:
        raise ValueError("--ab needs --suite (the suite's folder, e.g. suites/gpt2) and --case")
    suite = Path(args.suite).expanduser().resolve()
    if not suite.exists() and (checkout_root() / "suites" / args.suite).exists():
        suite = checkout_root() / "suites" / args.suite
    if not suite.exists():
        raise ValueError(f"--suite {args.suite}: no such folder or file ({suite}, nor under "
                         f"{checkout_root() / 'suites'})")
    for name in ("metric", "arm"):
        if getattr(args, name) and len(getattr(args, name)) > 1:
            raise ValueError(f"--ab judges one {name}; got --{name} {', '.join(getattr(args, name))}")
    settings = SequentialSettings(
        threshold=DEFAULT_THRESHOLD[True] if args.threshold is None else args.threshold,
        alpha=DEFAULT_ALPHA[True] if args.alpha is None else args.alpha,
        min_pairs=AB_MIN_TRIALS if args.min_trials is None else args.min_trials,
        max_pairs=AB_MAX_TRIALS if args.max_trials is None else args.max_trials)
    here = checkout_root()
    arm = args.arm[0] if args.arm else "dslab"
    request = ABRequest(suite=suite, case=args.case, arm=arm, scale=args.scale,
                        metric=args.metric[0] if args.metric else None,
                        baseline_tree=Path(args.baseline_tree) if args.baseline_tree else here, candidate_tree=here,
                        candidate_env=parse_env_assignments(args.candidate_env), settings=settings,
                        pin_kernels=not args.no_pin_kernels)
    out = Path(args.out) if args.out else default_out(args.reports, suite, args.case, arm)
    return request, out


def _run_ab(args: argparse.Namespace) -> int:
    try:
        request, out = _ab_request(args)
    except ValueError as err:
        message = str(err).replace("min_pairs", "--min-trials").replace("max_pairs", "--max-trials")
        print(f"dslab gate: error: {message}", file=sys.stderr)
        return EXIT_CANNOT_JUDGE
    result = run_ab(request, out)
    print(render_ab(result, args.format), end="")
    if args.format != "json":
        print(f"result: {out}")
    return result["exit_code"]


def run(args: argparse.Namespace) -> int:
    """Run ``dslab gate`` with parsed ``args``; returns the exit code (0 pass, 1 regression, 2 cannot judge)."""
    conflict = _mode_options_error(args)
    if conflict:
        print(f"dslab gate: error: {conflict}", file=sys.stderr)
        return EXIT_CANNOT_JUDGE
    if getattr(args, "ab", False):
        return _run_ab(args)
    try:
        settings = GateSettings(threshold=DEFAULT_THRESHOLD[False] if args.threshold is None else args.threshold,
                                alpha=DEFAULT_ALPHA[False] if args.alpha is None else args.alpha,
                                run_noise=getattr(args, "run_noise", None) or 0.0,
                                strict=bool(getattr(args, "strict", False)))
    except ValueError as err:
        print(f"dslab gate: error: {err}", file=sys.stderr)
        return EXIT_CANNOT_JUDGE
    if args.update_baseline:
        try:
            return _update_baseline(args, settings)
        except (OSError, ValueError) as err:
            print(f"dslab gate: cannot write the baseline: {err}", file=sys.stderr)
            return EXIT_CANNOT_JUDGE
    if args.pytest_benchmark:
        try:
            report = gate_pytest_benchmark(args.pytest_benchmark[0], args.pytest_benchmark[1], settings)
        except (OSError, ValueError) as err:
            report = GateReport("pytest-benchmark", *args.pytest_benchmark, settings=settings, problems=[str(err)])
        print(render(report, args.format), end="")
        return report.exit_code
    suite = args.suite or "unknown"
    try:
        candidates = _candidates(args)
        suite = candidates[0].suite
        candidate = trial_set_from_reports(candidates)
        baseline = _baseline(args, candidate)
    except (OSError, ValueError) as err:
        report = GateReport(suite, args.baseline or "-", ", ".join(args.candidate or ["newest run"]), settings,
                            problems=[str(err)])
    else:
        if isinstance(baseline, str):
            report = GateReport(suite, "-", candidate.label, settings, problems=[baseline])
        else:
            arms = tuple(args.arm) if args.arm else ("dslab",)
            report = gate_trial_sets(baseline, candidate, tuple(args.metric) if args.metric else None, arms, settings)
            for side, trial_set in (("candidate", candidate), ("baseline", baseline)):
                note = _failed_arms_note(side, trial_set)
                if note:
                    report.notes.append(note)
        for r in candidates:
            if injected_sleep_ms(r):
                report.notes.append(f"candidate run {r.run_id} ran with DSLAB_INJECT_STEP_SLEEP_MS="
                                    f"{injected_sleep_ms(r)}: a deliberate slowdown of its dslab arm")
    if suite != "unknown":
        _refresh_change_points(args, suite, settings, report)
    print(render(report, args.format), end="")
    return report.exit_code
