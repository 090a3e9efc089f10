"""The trials a verdict compares: :class:`TrialSet`, the per-trial values of one or more runs
with one fingerprint, and the baseline file's schema it is written in
(:mod:`dslab.gate.baseline` keeps the files; :mod:`dslab.gate.verdict` compares two sets)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dslab.gate.fingerprint import Fingerprint

BASELINE_SCHEMA = "dslab.baseline"
BASELINE_VERSION = 1


@dataclass
class TrialSet:
    """Per-trial values of one or more runs with one fingerprint.

    ``trials[(case, arm)][metric]`` is the list of trial values (pooled over ``source_runs`` in
    run order); ``status[(case, arm)]`` is ``{"status": "ok" | "failed" | "skipped", "error": ...}``
    (failed or skipped only when no source run measured it; the error then names the run);
    ``label`` says where the set came from. ``kernel_choices`` is the kernel choices of the newest
    source run that recorded them (:mod:`dslab.gate.baseline`), kept as plain data; None when none did.
    """

    suite: str
    fingerprint: Fingerprint
    source_runs: list[str]
    label: str
    trials: dict[tuple[str, str], dict[str, list[float]]] = field(default_factory=dict)
    status: dict[tuple[str, str], dict] = field(default_factory=dict)
    created: str | None = None
    kernel_choices: dict | None = None

    def values(self, case: str, arm: str, metric: str) -> list[float]:
        return list(self.trials.get((case, arm), {}).get(metric, []))

    def pairs(self) -> list[tuple[str, str]]:
        return list(dict.fromkeys([*self.status, *self.trials]))

    def to_dict(self) -> dict:
        out = {
            "schema": BASELINE_SCHEMA,
            "schema_version": BASELINE_VERSION,
            "suite": self.suite,
            "created": self.created,
            "label": self.label,
            "source_runs": list(self.source_runs),
            "fingerprint": self.fingerprint.to_dict(),
            "results": [
                {"case": case, "arm": arm, **self.status.get((case, arm), {"status": "ok", "error": None}),
                 "trials": self.trials.get((case, arm), {})}
                for case, arm in self.pairs()
            ],
        }
        if self.kernel_choices is not None:
            out["kernel_choices"] = self.kernel_choices
        return out
