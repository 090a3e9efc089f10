"""``dslab gate --ab``: run a baseline and a candidate source tree in alternation on one machine
and judge the pairs sequentially, stopping as soon as the verdict is clear.

    dslab gate --ab --suite suites/gpt2 --case 124m --baseline-tree ../main-checkout --threshold 3%

One worker process per tree (``python -m dslab.bench.ab_worker``, :mod:`dslab.bench.ab_worker`),
started with the same Python (``sys.executable``), ``<tree>`` first on ``PYTHONPATH`` and ``<tree>`` as its
working directory, builds the case's arm once and warms it up; the baseline's worker starts
first and is ready before the candidate's starts, so neither warm-up (compilation, autotuning)
runs beside the other. Both run the same suite file (the one named here, resolved from the
current directory), so the comparison is of the code alone. The trials then alternate in ABBA
order (pair k runs the baseline first when k is even, the candidate first when it is odd: a
drift of the machine within a pair falls on each side first equally often), and after every
pair all pairs so far go to :func:`dslab.gate.sequential.judge_pairs`; the run stops at its
verdict or after ``max_pairs``. Both arms stay resident between their trials, so the case must
fit on the device twice.

The statistics treat the two sides' trials as exchangeable apart from the code. Two processes
of the same code can still differ for as long as they live (memory layout, the cores they run
on), and on a CPU shared with other jobs by several percent: A/A runs of this mode on a loaded
2-core machine drifted apart by 5-10% within a run. Check a machine with A/A runs (the candidate
tree as its own baseline) before trusting a threshold on it.

Kernel choices are pinned by default: once the baseline's worker is warm, the choices it made
(its ready line's ``kernel_choices``: Triton's autotuned configs, the cuDNN/cuBLAS flags;
:mod:`dslab.kernels.pinning`) are written beside the result (``<out>.baseline_kernels.json``) and
the candidate's worker replays them before it builds anything (``--pin-kernels``), so that the
two processes do not differ by what each one's autotuner happened to pick. A kernel the candidate
changed (a config the baseline's choice is not among) is autotuned afresh, and the candidate's
ready line lists it (``pinned``). ``pin_kernels=False`` (``--no-pin-kernels``) lets the candidate
choose for itself.

A worker imports dslab from its own tree; its ready line names the package it imported, and a
worker that imported another (an installed dslab ahead of ``PYTHONPATH``) cannot be judged. A
tree without ``dslab/__init__.py`` or without ``dslab/bench/ab_worker.py`` (a checkout older
than this mode) is refused by name before anything starts. ``candidate_env`` sets environment
variables for the candidate's worker only, e.g. ``DSLAB_INJECT_STEP_SLEEP_MS`` to check the gate
with a deliberate slowdown (the baseline tree may then be the candidate tree itself: an A/A or
an A/A-plus-sleep run).

Progress goes to standard error, one line per pair. The result, a JSON object
(``schema: dslab.gate.ab``) with the settings, both workers' ready lines (environment, git
commit, config), every trial of both sides, the verdict and its looks, is written atomically
after every pair and at the end; each worker's standard error goes to a log file beside it.
Exit code as for the rest of the gate: 0 pass (or improvement), 1 regression, 2 cannot judge (a
tree refused, a worker that failed or timed out, the metric missing from a trial).
"""

from __future__ import annotations

import json
import math
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from dslab.gate.sequential import SequentialSettings, judge_pairs
from dslab.gate.verdict import CANNOT_JUDGE, DEFAULT_METRICS, EXIT_CANNOT_JUDGE, EXIT_PASS, EXIT_REGRESSION, REGRESSION
from dslab.report.schema import METRIC_DIRECTIONS
from dslab.report.store import atomic_write_text, utc_now

AB_SCHEMA, AB_VERSION = "dslab.gate.ab", 1
WORKER_MODULE = "dslab.bench.ab_worker"
WORKER_FILE = "dslab/bench/ab_worker.py"
READY_TIMEOUT_S = 3600.0  # building, compiling and warming up one arm
TRIAL_TIMEOUT_S = 1800.0
SIDES = ("baseline", "candidate")


class CannotJudge(Exception):
    """The A/B run cannot reach a verdict (the message says why); exit 2."""


@dataclass
class ABRequest:
    """What to compare. ``suite``: the suite's folder (or suite.json); ``case``, ``arm``; ``scale``
    (None: the worker's default); ``metric`` (None: samples_per_s, else tokens_per_s, whichever
    the trials have); the two trees; ``candidate_env``: variables for the candidate's worker
    only; ``steps`` / ``warmup_steps``: None for the scale's; ``settings``: the sequential test's."""

    suite: Path
    case: str
    baseline_tree: Path
    candidate_tree: Path
    arm: str = "dslab"
    scale: str | None = None
    metric: str | None = None
    candidate_env: dict[str, str] = field(default_factory=dict)
    steps: int | None = None
    warmup_steps: int | None = None
    settings: SequentialSettings = field(default_factory=SequentialSettings)
    pin_kernels: bool = True
    ready_timeout_s: float = READY_TIMEOUT_S
    trial_timeout_s: float = TRIAL_TIMEOUT_S


def parse_env_assignments(items: list[str] | None, option: str = "--candidate-env") -> dict[str, str]:
    """``["K=V", ...]`` as a dict; ValueError naming ``option`` for an item without a name."""
    env = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name or not name.replace("_", "").isalnum():
            raise ValueError(f"{option} {item!r}: write NAME=VALUE")
        env[name] = value
    return env


def check_tree(tree: Path, side: str) -> Path:
    """``tree`` resolved, or :class:`CannotJudge` saying what it lacks."""
    root = Path(tree).expanduser().resolve()
    if not root.is_dir():
        raise CannotJudge(f"the {side} tree {root} is not a directory")
    if not (root / "dslab" / "__init__.py").is_file():
        raise CannotJudge(f"the {side} tree {root} has no dslab package (dslab/__init__.py)")
    if not (root / WORKER_FILE).is_file():
        raise CannotJudge(f"the {side} tree {root} lacks {WORKER_FILE}, the A/B worker (a checkout older than "
                          f"dslab gate --ab): update that tree, or compare against a newer one")
    return root


class Worker:
    """One side's worker process and its line protocol (:mod:`dslab.bench.ab_worker`)."""

    def __init__(self, side: str, tree: Path, request: ABRequest, log_path: Path, pin_file: Path | None = None):
        self.side, self.tree, self.log_path = side, tree, log_path
        command = [sys.executable, "-m", WORKER_MODULE, "--suite", str(request.suite), "--case", request.case,
                   "--arm", request.arm]
        for option, value in (("--scale", request.scale), ("--steps", request.steps),
                              ("--warmup-steps", request.warmup_steps), ("--pin-kernels", pin_file)):
            if value is not None:
                command += [option, str(value)]
        # the tree first, ahead of what the caller's path holds (its other packages stay reachable)
        path = os.pathsep.join([str(tree)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
        env = {**os.environ, "PYTHONPATH": path, **(request.candidate_env if side == "candidate" else {})}
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "wb")
        self.pending = b""
        try:
            self.process = subprocess.Popen(command, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=self.log)
        except OSError as err:
            self.log.close()
            raise CannotJudge(f"the {side} worker could not start ({' '.join(command[:3])}): {err}") from None

    def _tail(self, lines: int = 12) -> str:
        self.log.flush()
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def _fail(self, what: str) -> CannotJudge:
        tail = self._tail()
        return CannotJudge(f"the {self.side} worker ({self.tree}) {what}" +
                           (f"; the end of its log {self.log_path}:\n{tail}" if tail else ""))

    def read(self, timeout_s: float) -> dict:
        """The next protocol line as a dict; :class:`CannotJudge` on an error line, the end of the
        output, a malformed line or the timeout."""
        deadline = time.monotonic() + timeout_s
        stream = self.process.stdout.fileno()
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"sent nothing for {timeout_s:.0f} s")
            ready, _, _ = select.select([stream], [], [], left)
            if not ready:
                continue
            chunk = os.read(stream, 65536)
            if not chunk:
                try:
                    what = f"exited with status {self.process.wait(timeout=30)}"
                except subprocess.TimeoutExpired:
                    what = "closed its output but did not exit"
                raise self._fail(f"{what} before answering")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            raise self._fail(f"wrote a line that is not JSON: {line[:200]!r}") from None
        if "error" in message:
            raise CannotJudge(f"the {self.side} worker ({self.tree}) failed: {message['error']}")
        return message

    def send(self, command: str) -> None:
        try:
            self.process.stdin.write(f"{command}\n".encode())
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._fail("is gone (its input is closed)") from None

    def close(self) -> None:
        """Ask the worker to quit; kill it when it does not within a minute."""
        if self.process.poll() is None:
            try:
                self.send("quit")
                self.process.stdin.close()
                self.process.wait(timeout=60)
            except (CannotJudge, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:  # a pipe the worker broke: nothing left to flush
                pass
        self.log.close()


def _finite(value):
    """JSON without NaN or infinities: such floats become None (a trial's loss may be NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _suite_label(suite: Path) -> str:
    return suite.parent.name if suite.suffix == ".json" else suite.name


def default_out(reports: str | Path, suite: Path, case: str, arm: str) -> Path:
    """``<reports>/ab/<suite>/<case>-<arm>-<UTC time>.json``."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return Path(reports) / "ab" / _suite_label(suite) / f"{case}-{arm}-{stamp}.json"


class ABRun:
    """One A/B comparison: its result (a JSON-ready dict, written to ``out`` as it grows)."""

    def __init__(self, request: ABRequest, out: Path, progress: TextIO):
        self.request, self.out, self.progress = request, Path(out), progress
        self.result = {
            "schema": AB_SCHEMA, "schema_version": AB_VERSION, "created": utc_now(), "finished": None,
            "status": "running", "suite": _suite_label(request.suite), "suite_file": str(request.suite),
            "case": request.case, "arm": request.arm, "scale": request.scale, "metric": request.metric,
            "direction": None, "order": "ABBA",
            "trees": {"baseline": str(request.baseline_tree), "candidate": str(request.candidate_tree)},
            "candidate_env": dict(request.candidate_env), "settings": request.settings.to_dict(),
            "workers": {}, "pairs": [], "verdict": None, "outcome": None, "exit_code": None,
            "problems": [], "notes": [], "logs": {side: str(self.log_path(side)) for side in SIDES},
        }

    def log_path(self, side: str) -> Path:
        return self.out.with_name(f"{self.out.stem}.{side}.log")

    def write(self) -> None:
        atomic_write_text(self.out, json.dumps(_finite(self.result), indent=1) + "\n")

    def line(self, text: str) -> None:
        print(f"[ab {self.result['suite']} {self.request.case} {self.request.arm}] {text}", file=self.progress,
              flush=True)

    def run(self) -> dict:
        workers: dict[str, Worker] = {}
        try:
            trees = {"baseline": check_tree(self.request.baseline_tree, "baseline"),
                     "candidate": check_tree(self.request.candidate_tree, "candidate")}
            self.result["trees"] = {side: str(tree) for side, tree in trees.items()}
            if trees["baseline"] == trees["candidate"]:
                self.result["notes"].append("baseline and candidate are the same tree: an A/A run" +
                                            (", but for the candidate's environment (--candidate-env)"
                                             if self.request.candidate_env else ""))
            pin_file = None
            for side in SIDES:  # one at a time: no warm-up beside the other's
                self.line(f"starting the {side} worker in {trees[side]}" +
                          (f", its kernel choices pinned to the baseline's ({pin_file})" if pin_file else ""))
                workers[side] = Worker(side, trees[side], self.request, self.log_path(side), pin_file)
                ready = workers[side].read(self.request.ready_timeout_s)
                if side == "baseline" and self.request.pin_kernels:
                    pin_file = self._baseline_choices(ready)
                self._check_ready(side, trees[side], ready)
                self.result["workers"][side] = ready
                self.line(f"{side} ready ({ready['device']}, scale {ready['scale']}, {ready['steps']} steps a "
                          f"trial, warm-up {ready['warmup_s']:.1f} s)")
            self._check_alike()
            self.write()
            self._alternate(workers)
        except CannotJudge as err:
            self.result["problems"].append(str(err))
            self.line(f"cannot judge: {str(err).splitlines()[0]}")
        finally:
            for worker in workers.values():
                worker.close()
        self._finish()
        return self.result

    def _baseline_choices(self, ready: dict) -> Path | None:
        """Write the baseline worker's kernel choices beside the result, for the candidate to
        replay; None (with a note) when the baseline's worker reported none."""
        choices = ready.get("kernel_choices")
        if not isinstance(choices, dict):
            self.result["notes"].append("the baseline's worker reported no kernel choices: the candidate picks its own")
            return None
        path = self.out.with_name(f"{self.out.stem}.baseline_kernels.json")
        atomic_write_text(path, json.dumps(choices, indent=1) + "\n")
        self.result["kernel_choices_file"] = str(path)
        return path

    def _check_ready(self, side: str, tree: Path, ready: dict) -> None:
        imported = Path(ready.get("dslab_path", "")).resolve()
        if imported != tree / "dslab":
            raise CannotJudge(f"the {side} worker imported dslab from {imported}, not from its tree {tree / 'dslab'} "
                              f"(an installed dslab ahead of PYTHONPATH?)")
        env = self.request.candidate_env if side == "candidate" else {}
        if "DSLAB_INJECT_STEP_SLEEP_MS" in env and not ready.get("injection_applies"):
            self.result["notes"].append(f"DSLAB_INJECT_STEP_SLEEP_MS is set for the candidate but only the training "
                                        f"kind's dslab arm sleeps; arm {self.request.arm} of this suite does not")
        if ready.get("inject_step_sleep_ms") and ready.get("injection_applies"):
            self.result["notes"].append(f"the {side} ran with DSLAB_INJECT_STEP_SLEEP_MS="
                                        f"{ready['inject_step_sleep_ms']:g}: a deliberate slowdown of its dslab arm")

    def _check_alike(self) -> None:
        base, cand = self.result["workers"]["baseline"], self.result["workers"]["candidate"]
        differ = [f"{key} {base.get(key)!r} vs {cand.get(key)!r}" for key in ("suite", "scale", "device", "steps",
                                                                              "warmup_steps", "settle_steps")
                  if base.get(key) != cand.get(key)]
        if differ:
            raise CannotJudge("the two workers do not run the same measurement: " + "; ".join(differ))
        self.result["scale"], self.result["suite"] = base["scale"], base["suite"]

    def _metric(self, metrics: dict) -> tuple[str, str]:
        metric = self.request.metric or next((m for m in DEFAULT_METRICS if m in metrics), DEFAULT_METRICS[0])
        direction = METRIC_DIRECTIONS.get(metric)
        if direction is None:
            raise CannotJudge(f"metric {metric!r} has no known direction (known: {', '.join(sorted(METRIC_DIRECTIONS))})")
        return metric, direction

    def _alternate(self, workers: dict[str, Worker]) -> None:
        settings = self.request.settings
        values = {side: [] for side in SIDES}
        for k in range(settings.max_pairs):
            order = SIDES if k % 2 == 0 else SIDES[::-1]
            pair = {"pair": k, "first": order[0]}
            for side in order:
                workers[side].send("trial")
                message = workers[side].read(self.request.trial_timeout_s)
                pair[side] = {key: message.get(key) for key in ("trial", "metrics", "step_times_ms")}
            if k == 0:
                self.result["metric"], self.result["direction"] = self._metric(pair["baseline"]["metrics"] or {})
            metric = self.result["metric"]
            for side in SIDES:
                value = (pair[side]["metrics"] or {}).get(metric)
                if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                    raise CannotJudge(f"the {side}'s trial {k + 1} has no positive {metric} (got {value!r}; "
                                      f"metrics: {', '.join(sorted(pair[side]['metrics'] or {})) or 'none'})")
                values[side].append(float(value))
            pair["ratio"] = values["candidate"][-1] / values["baseline"][-1]
            self.result["pairs"].append(pair)
            verdict = judge_pairs(values["baseline"], values["candidate"], self.result["direction"], settings)
            self.result["verdict"] = verdict.to_dict()
            self.line(f"pair {k + 1}/{settings.max_pairs} ({order[0]} first): baseline {values['baseline'][-1]:.6g}, "
                      f"candidate {values['candidate'][-1]:.6g} {metric} ({(pair['ratio'] - 1) * 100:+.2f}%); "
                      f"{verdict.verdict if verdict.finished else 'no verdict yet'}")
            self.write()
            if verdict.finished:
                return

    def _finish(self) -> None:
        result = self.result
        verdict = result["verdict"] or {}
        if result["problems"] or not verdict.get("verdict") or verdict["verdict"] == "continue":
            result["outcome"], result["exit_code"] = CANNOT_JUDGE, EXIT_CANNOT_JUDGE
            if not result["problems"]:
                result["problems"].append("the run ended before the sequential test reached a verdict")
        elif verdict["verdict"] == REGRESSION:
            result["outcome"], result["exit_code"] = REGRESSION, EXIT_REGRESSION
        else:
            result["outcome"], result["exit_code"] = verdict["verdict"], EXIT_PASS
        result["status"], result["finished"] = "finished", utc_now()
        self.write()


def run_ab(request: ABRequest, out: str | Path, progress: TextIO | None = None) -> dict:
    """Run the A/B comparison of ``request`` (module docstring), writing the result to ``out``;
    returns the result, whose ``exit_code`` is 0 pass, 1 regression, 2 cannot judge."""
    return ABRun(request, Path(out), progress or sys.stderr).run()


def render_ab(result: dict, fmt: str = "text") -> str:
    """The result for people (``text``, ``markdown``) or as its JSON (``json``)."""
    if fmt == "json":
        return json.dumps(_finite(result), indent=1) + "\n"
    verdict = result.get("verdict") or {}
    what = f"{result['suite']}/{result['case']} {result['arm']} {result.get('metric') or ''}".rstrip()
    commits = {side: ((w.get("environment") or {}).get("dslab") or {}).get("git_commit")
               for side, w in result.get("workers", {}).items()}
    trees = [f"{side} {result['trees'][side]}" + (f" @ {commits[side][:12]}" if commits.get(side) else "")
             for side in SIDES]
    outcome = f"{str(result['outcome']).upper()} (exit {result['exit_code']})"
    reason = verdict.get("reason") or "; ".join(result["problems"])
    env = " ".join(f"{k}={v}" for k, v in result["candidate_env"].items())
    details = [*trees, *([f"candidate env: {env}"] if env else []),
               *[f"problem: {p}" for p in result["problems"] if verdict.get("reason")],
               *[f"note: {n}" for n in result["notes"]]]
    if fmt != "markdown":
        return "\n".join([f"dslab gate --ab: {what}", *[f"  {d}" for d in details], f"{outcome}: {reason}"]) + "\n"

    def pct(value):
        return "-" if value is None else f"{(value - 1) * 100:+.2f}%"

    lines = [f"**dslab gate --ab**: {what}", "", "| outcome | pairs | median | CI | reason |",
             "| --- | --- | --- | --- | --- |",
             f"| {outcome} | {verdict.get('n', 0)} | {pct(verdict.get('ratio'))} | {pct(verdict.get('ci_low'))} to "
             f"{pct(verdict.get('ci_high'))} | {reason.replace('|', '/')} |", "", *[f"- {d}" for d in details]]
    return "\n".join(lines) + "\n"
