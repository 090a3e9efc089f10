"""How ``dslab bench`` runs a kind of suite: the protocol between the runner and each kind.

The runner (:mod:`dslab.bench.runner`) owns what every suite does alike: the processes, the
scale, the trial counts, the run report (written atomically after every trial), the arms'
interleaved trials with the order rotated, an arm's failure (recorded, its arm dropped, the
others going on), Ctrl-C, and the summary. A kind of suite implements :class:`SuiteKind` in a
module of its own and never calls back into the runner:

- training (:mod:`dslab.bench.training`): a model trained by each arm, one optimizer step a step;
- inference (:mod:`dslab.bench.inference`): greedy generation by each arm, one ``generate`` call
  a step.

The flow, for ``dslab bench SUITE``::

    kind = SuiteKind for the suite's "kind"
    world = kind.join_world()
    plan = kind.plan(scale, arms, cases, counts, world, device)     # config, data, cases
    for each case in plan.cases:
        case_run = kind.open_case(case, context)                    # None: the case cannot run
        for each arm: case_run.build_arm(arm)
        case_run.before_trials()
        for each trial, each live arm in rotated order:
            step_times, metrics = case_run.run_trial(arm, built, warmup, steps, trial)
        case_run.finish(built arms)                                 # records into the report
        close the arms; case_run.close()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from dslab.bench.common import Progress, World
from dslab.report import RunReport, run_dir


@dataclass(frozen=True)
class Counts:
    """Trials per arm, timed steps per trial, and warm-up steps before an arm's first trial."""

    trials: int
    steps: int
    warmup_steps: int


@dataclass
class Plan:
    """What a kind makes of a suite at one scale: the arms, the cases (the kind's own objects,
    handed back to :meth:`SuiteKind.open_case`), the report's ``config`` and ``data``, the notes
    the run starts with, and the word for a step in the progress lines."""

    arms: list[str]
    cases: list[Any]
    config: dict
    data: dict
    notes: list[str] = field(default_factory=list)
    step_noun: str = "steps"


@dataclass
class RunContext:
    """What a case sees of the run: the report it adds to, the device, the processes, the
    progress lines, where reports go, and the counts."""

    report: RunReport
    device: torch.device
    world: World
    progress: Progress
    out: Path
    counts: Counts
    arms: list[str]

    @property
    def run_path(self) -> Path:
        return run_dir(self.out, self.report.suite, self.report.run_id)

    def write(self) -> Path:
        return self.world.write(self.report, self.out)


class Arm(Protocol):
    def close(self) -> None: ...


class CaseRun(Protocol):
    """One case of a suite being run."""

    name: str
    # warm-up steps of an arm's later trials (at most the run's warm-up): the arm settles after
    # the other arms ran
    settle_steps: int

    def build_arm(self, name: str) -> Arm:
        """The arm ``name``, ready to time; raises :class:`~dslab.bench.common.ArmSkipped` when it
        cannot run here (recorded as skipped), anything else when it fails."""

    def before_trials(self) -> None:
        """Called once the arms are built, before the first trial."""

    def run_trial(self, name: str, arm: Arm, warmup: int, steps: int, trial: int) -> tuple[list[float], dict]:
        """Trial ``trial`` (from 0) of arm ``name``: ``warmup`` untimed steps, then ``steps`` timed
        ones; returns the trial's step times (ms) and metrics. Raises :class:`~dslab.bench.common.TrialFailed` with the report's error text, or
        any exception (the runner words it)."""

    def trial_line(self, name: str, metrics: dict) -> str:
        """The progress line's text for one trial of arm ``name``."""

    def finish(self, arms: dict[str, Arm]) -> None:
        """Called after the last trial with the arms still standing (not yet closed): the case's
        records go into the report."""

    def close(self) -> None:
        """Called after the runner closed the arms: release what the case holds."""


class SuiteKind(Protocol):
    """A kind of suite (``"kind"`` in suite.json)."""

    def join_world(self) -> World:
        """The processes of the run: join the process group, or refuse a multi-process run."""

    def plan(self, scale: str, arms: list[str] | None, cases: list[str] | None, counts: Counts, world: World,
             device: torch.device) -> Plan:
        """The arms, cases and report settings of ``scale`` (checked: ValueError naming the problem)."""

    def open_case(self, case: Any, context: RunContext) -> CaseRun | None:
        """Prepare ``case`` (one of the plan's); None when it cannot run at all (the case recorded
        why in the report)."""
