"""Pipeline schedules: what one stage does, in order, for one batch of micro-batches.

A schedule is a list of :class:`Step`: ``load`` (the first stage reads a micro-batch's inputs,
the last one its labels), ``forward``, ``backward``, and ``p2p``, a set of sends and receives
between neighbouring stages posted together and completed together (one
``batch_isend_irecv``). A transfer is ``("activation", i)`` (forward, stage s to s + 1) or
``("grad", i)`` (backward, s + 1 to s) of micro-batch ``i``.

:func:`train_schedule` is 1F1B (PipeDream-Flush, Narayanan et al. 2021, as Megatron-LM runs it):
stage ``s`` of ``p`` runs ``w = min(p - s - 1, m)`` warm-up forwards, then alternates one forward
and one backward, then drains the last ``w`` backwards. At most ``w + 1`` micro-batches' activations
are alive on a stage (not ``m``, as in GPipe), and a send is paired with the receive the same
step needs (forward output out, a gradient in; a gradient out, the next input in), which is what
keeps neighbouring stages from waiting on each other forever. The idle fraction of a stage, with
equal forward and backward times per stage and free transfers, is the bubble
``(p - 1) / (m + p - 1)`` (:func:`bubble_fraction`).

:func:`inference_schedule` runs forwards only: receive, forward, send, micro-batch by micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """One step of a stage's schedule (see the module docstring)."""

    kind: str  # "load", "forward", "backward" or "p2p"
    micro_batch: int = -1
    sends: tuple = ()
    recvs: tuple = ()

    def __repr__(self) -> str:
        if self.kind == "p2p":
            return f"p2p(send={list(self.sends)}, recv={list(self.recvs)})"
        return f"{self.kind}({self.micro_batch})"


def _check(stage: int, stages: int, micro_batches: int) -> None:
    if stages < 1 or not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not a stage of a {stages}-stage pipeline")
    if micro_batches < 1:
        raise ValueError(f"a batch needs >= 1 micro-batch, got {micro_batches}")


class _Builder:
    def __init__(self, stage: int, stages: int):
        self.first = stage == 0
        self.last = stage == stages - 1
        self.steps: list[Step] = []

    def _allowed(self, transfer, sending: bool) -> bool:
        kind, _ = transfer
        if kind == "activation":
            return not self.last if sending else not self.first
        return not self.first if sending else not self.last

    def p2p(self, sends=(), recvs=()) -> None:
        sends = tuple(t for t in sends if self._allowed(t, True))
        recvs = tuple(t for t in recvs if self._allowed(t, False))
        if sends or recvs:
            self.steps.append(Step("p2p", sends=sends, recvs=recvs))

    def forward(self, i: int) -> None:
        if self.first or self.last:
            self.steps.append(Step("load", i))
        self.steps.append(Step("forward", i))

    def backward(self, i: int) -> None:
        self.steps.append(Step("backward", i))


def train_schedule(stage: int, stages: int, micro_batches: int) -> list[Step]:
    """1F1B for ``stage`` of ``stages`` over ``micro_batches`` (see the module docstring)."""
    _check(stage, stages, micro_batches)
    b = _Builder(stage, stages)
    m = micro_batches
    warmup = min(stages - stage - 1, m)
    steady = m - warmup
    for i in range(warmup):
        b.p2p(recvs=[("activation", i)])
        b.forward(i)
        b.p2p(sends=[("activation", i)])
    if steady:
        b.p2p(recvs=[("activation", warmup)])
    for k in range(steady):
        i = warmup + k
        b.forward(i)
        b.p2p(sends=[("activation", i)], recvs=[("grad", k)])
        b.backward(k)
        if k == steady - 1:
            b.p2p(sends=[("grad", k)])
        else:
            b.p2p(sends=[("grad", k)], recvs=[("activation", i + 1)])
    for k in range(steady, m):
        b.p2p(recvs=[("grad", k)])
        b.backward(k)
        b.p2p(sends=[("grad", k)])
    return b.steps


def inference_schedule(stage: int, stages: int, micro_batches: int) -> list[Step]:
    """Forwards only, in micro-batch order."""
    _check(stage, stages, micro_batches)
    b = _Builder(stage, stages)
    for i in range(micro_batches):
        b.p2p(recvs=[("activation", i)])
        b.forward(i)
        b.p2p(sends=[("activation", i)])
    return b.steps


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The idle fraction of 1F1B (and GPipe) with equal stage times: ``(p - 1) / (m + p - 1)``."""
    return (stages - 1) / (micro_batches + stages - 1)
