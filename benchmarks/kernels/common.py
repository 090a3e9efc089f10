"""Shared pieces of the kernel benchmarks: the case description, the bench modules, and the timer.

Each ``bench_<op>.py`` beside this file defines ``cases(device) -> list[Case]``. Two drivers use
them, and both time device work with :class:`EventTimer`:

- ``run.py`` measures the device's ceilings once, times every case's dslab and PyTorch callables
  interleaved, and prints one table (with CUDA-graph replay times and peak memory);
- ``test_kernels_bench.py`` runs every case and arm as a pytest-benchmark test, whose JSON
  ``dslab gate --pytest-benchmark`` judges against a baseline.
"""

from __future__ import annotations

import importlib
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dslab.kernels.dispatch import graphed_launches

HERE = Path(__file__).resolve().parent


@dataclass
class Case:
    """One benchmark row.

    ``dslab`` and ``torch`` are zero-argument callables doing the same work (forward, or forward and
    backward) with dslab's op and with the PyTorch equivalent. ``bytes_moved`` is the fewest bytes
    the work must read and write (for GB/s against the copy bandwidth); ``flops`` the floating-point
    operations it must do (for TFLOP/s against the matmul peak). ``target`` is the ratio
    torch_time / dslab_time the issue asks for. ``check_memory`` records each side's peak extra
    memory during one call.
    """

    op: str
    shape: str
    dslab: Callable[[], object]
    torch: Callable[[], object]
    bytes_moved: int | None = None
    flops: int | None = None
    target: float | None = None
    check_memory: bool = False
    notes: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``"<op> | <shape>"``: what the two arms share (the pytest-benchmark group)."""
        return f"{self.op} | {self.shape}"

    @property
    def slug(self) -> str:
        """The label as a test id: runs of characters other than letters, digits, ``+ . =`` become
        ``_`` (``layer_norm forward | 65536x1024 bf16`` -> ``layer_norm_forward_65536x1024_bf16``)."""
        return re.sub(r"[^0-9A-Za-z+.=]+", "_", f"{self.op} {self.shape}").strip("_")


def bench_ops() -> list[str]:
    """The ``<op>`` of every ``bench_<op>.py`` beside this file, sorted."""
    return sorted(path.stem[len("bench_"):] for path in HERE.glob("bench_*.py"))


def op_cases(op: str, device) -> list[Case]:
    """The cases of ``bench_<op>.py`` with their inputs built on ``device``. The module is imported
    by name: this folder is on ``sys.path`` wherever ``common`` is importable."""
    return importlib.import_module(f"bench_{op}").cases(device)


class EventTimer:
    """Per-call device time from CUDA events, also readable as a clock.

    ``timed(fn)`` returns a callable that runs ``fn`` between two CUDA events recorded on the
    current stream and does not synchronise, so that calls issued back to back queue on the device
    as they would in a training step. ``collect_ms()`` waits for the events recorded so far and
    returns each call's start-to-end time in ms: the device's time for the call when the device is
    the bottleneck, the host's time to issue it when the host is (the time a caller would see).

    ``timer()`` collects and returns, in seconds, the sum of every call collected so far: a clock
    that advances only by intervals CUDA events measured. It is the ``timer`` pytest-benchmark
    reads before and after each round of timed calls (see ``test_kernels_bench.py``).

    Events are taken from a pool and reused. CUDA creates an event at its first ``record``, so
    :meth:`reserve` creates those of the calls about to be timed ahead, and no ``cudaEventCreate``
    falls between a call's start and end events. ``event_type`` is what makes an event
    (``torch.cuda.Event`` unless given; the CPU tests pass a stand-in).
    """

    def __init__(self, event_type: Callable[..., object] | None = None):
        self._event_type = event_type
        self._free: list[tuple] = []
        self._pending: list[tuple] = []
        self._seconds = 0.0

    def __repr__(self) -> str:
        return "EventTimer(CUDA events around each call)"

    def _new_pair(self) -> tuple:
        make = self._event_type or torch.cuda.Event
        return make(enable_timing=True), make(enable_timing=True)

    def reserve(self, calls: int) -> None:
        """Create (by recording each once) the events of ``calls`` timed calls."""
        for _ in range(calls - len(self._free)):
            pair = self._new_pair()
            for event in pair:
                event.record()
            self._free.append(pair)

    def timed(self, fn: Callable[[], object]) -> Callable[[], None]:
        """``fn`` between a start and an end event; the pair is collected by the next
        :meth:`collect_ms` or ``timer()``."""

        def call() -> None:
            start, end = self._free.pop() if self._free else self._new_pair()
            start.record()
            fn()
            end.record()
            self._pending.append((start, end))

        return call

    def collect_ms(self) -> list[float]:
        """Wait for the pending calls' end events; their times in ms, in call order."""
        pending, self._pending = self._pending, []
        times = []
        for start, end in pending:
            end.synchronize()
            times.append(start.elapsed_time(end))
        self._free.extend(pending)
        self._seconds += sum(times) / 1e3
        return times

    def __call__(self) -> float:
        self.collect_ms()
        return self._seconds


def warm_for(fn: Callable[[], object], seconds: float, timer: EventTimer | None = None, batch: int = 8) -> int:
    """Call ``fn`` until at least ``seconds`` of its device time (CUDA events, :class:`EventTimer`)
    have passed, in batches of ``batch`` calls between reads; the number of calls. Sustained load
    takes a GPU near its power limit through a clock transient about a second in; the kernel
    benchmarks' ``--kernel-warmup-s`` runs this before timing so that the rounds see the steady
    state. ``timer`` replaces the CUDA events (the CPU tests' stand-in)."""
    if seconds <= 0:
        return 0
    timer = timer or EventTimer()
    timer.reserve(batch)
    timed = timer.timed(fn)
    calls, spent_ms = 0, 0.0
    while spent_ms < seconds * 1e3:
        for _ in range(batch):
            timed()
        calls += batch
        spent_ms += sum(timer.collect_ms())
    return calls


def iterations_for(fn: Callable[[], object], round_ms: float, least: int, calls: int = 5,
                   timer: EventTimer | None = None) -> int:
    """Calls per round so that a round spans at least ``round_ms`` of device time: ``round_ms``
    over the median of ``calls`` event-timed calls of ``fn``, and never fewer than ``least``. A
    kernel near the GPU's power limit runs at a clock the power controller moves by several percent
    over about a second; rounds that long each average that swing, where 70 ms rounds sample it.
    ``timer`` replaces the CUDA events (the CPU tests' stand-in)."""
    if round_ms <= 0:
        return least
    timer = timer or EventTimer()
    timer.reserve(calls)
    timed = timer.timed(fn)
    for _ in range(calls):
        timed()
    call_ms = statistics.median(timer.collect_ms())
    return max(least, math.ceil(round_ms / call_ms)) if call_ms > 0 else least


def slowed(fn: Callable[[], object], fraction: float, calls: int = 20, timer: EventTimer | None = None,
           spin: Callable[[int], object] | None = None,
           cycles_for_ms: Callable[[float], int] | None = None, base_blocks: int = 3, base_skip: int = 0,
           min_blocks: int = 8,
           max_blocks: int = 30, stable: int = 4, tolerance: float = 0.1, gain: float = 0.7) -> Callable[[], None]:
    """``fn`` followed by a device-side spin that makes each call ``fraction`` slower: a deliberate,
    known slowdown for checking the kernel gate (``--kernel-inject-slowdown``). The spin is
    ``torch.cuda._sleep``, queued on the same stream with no synchronisation, so each timed call
    grows by device time.

    Every reading is a block's mean call time (its calls' total over their count), the statistic a
    benchmark round reports. A median would not do: near the power limit a plain kernel's calls
    have a tail of clock dips that spun calls lose (on an H200 the fused linear cross-entropy's
    plain block medians sat 0.4-0.7% under the plain rounds' means, and rounds slowed to a 3%
    median read 2.2-2.4%).

    A spin's cycles are first set from ``fraction`` of the reference and the cycle rate
    :func:`dslab.bench.arms.device_spin_cycles` measures on an idle device. That rate does not hold
    under load, and near the power limit a spin is partly paid back: the GPU runs cooler through it
    and the next matmuls run at a higher clock, a payback that builds up over seconds. On an H200 a
    3% spin after each fused linear cross-entropy read 3.9% in the second block of slowed calls
    (about 1.4 s after the first spin) and 1.8% in the benchmark's rounds that followed; plain
    blocks interleaved with slowed ones read it larger still, since a plain block right after a
    slowed one runs at the clock the spins bought. So the spin is held at the fraction by feedback,
    in steady state. The reference is the median over ``base_blocks`` blocks of ``calls`` plain
    calls (each block's mean) after ``base_skip`` more, run before any spin: a benchmark passes its
    warm-up rounds and its rounds, so that the reference spans the time after the warm-up that a
    plain run's rounds span. A plain kernel near the power limit keeps slowing for seconds after
    the warm-up (an H200's fused linear cross-entropy ran 1.5-2.6% faster in the 2 s after a 1.5 s
    warm-up than in the rounds after them), and a reference taken too early counts that drift as
    injected. Then blocks of ``calls`` slowed calls run back to back, each timed, and after each
    the cycles are scaled by ``(fraction / measured) ** gain`` (damped: the payback lags the
    spin). It stops once at least ``min_blocks`` ran and the last ``stable`` blocks all read within
    ``tolerance`` (relative) of ``fraction`` while their cycles differed by at most half that (the
    feedback has come to rest, not just passed by), or after ``max_blocks``; the benchmark's
    rounds follow at once, in the same regime. Single 700 ms blocks of that kernel read the
    slowdown with an SD of about 0.5 points, and each moves the cycles by most of its error, so a
    run that did not settle takes the median cycles of its last ``2 * stable`` blocks into the
    rounds. The returned callable's ``injected_fraction`` is the mean slowdown of the last
    ``stable`` blocks, ``injected_settled`` whether it stopped on the criterion,
    ``injected_history`` every block's (``cycles_history`` their cycles), ``reference_ms`` the
    reference, ``injected_ms`` the spin's length at the first calibration's rate and
    ``spin_cycles`` the final cycles. ``timer``, ``spin`` and ``cycles_for_ms`` replace the CUDA
    pieces (the CPU tests' stand-ins).
    """
    if fraction <= 0:
        return fn
    if not (base_blocks >= 1 and base_skip >= 0 and 1 <= stable <= min_blocks <= max_blocks):
        raise ValueError(f"slowed: need base_blocks >= 1 and 1 <= stable <= min_blocks <= max_blocks, got "
                         f"{base_blocks}, {stable}, {min_blocks}, {max_blocks}")
    timer = timer or EventTimer()
    timer.reserve(calls)
    timed = timer.timed(fn)
    base_means = []
    for _ in range(base_skip + base_blocks):
        for _ in range(calls):
            timed()
        base_means.append(statistics.fmean(timer.collect_ms()))
    base_ms = statistics.median(base_means[base_skip:])
    injected_ms = fraction * base_ms
    if cycles_for_ms is None:
        from dslab.bench.arms import device_spin_cycles as cycles_for_ms
    spin = spin or torch.cuda._sleep
    state = {"cycles": cycles_for_ms(injected_ms)}

    def call() -> None:
        fn()
        spin(state["cycles"])

    history: list[float] = []
    cycles_run: list[int] = []
    timed_call = timer.timed(call)
    for block in range(max_blocks):
        cycles_run.append(state["cycles"])
        for _ in range(calls):
            timed_call()
        measured = statistics.fmean(timer.collect_ms()) / base_ms - 1.0
        history.append(measured)
        last, last_cycles = history[-stable:], cycles_run[-stable:]
        if (block + 1 >= min_blocks and all(abs(m - fraction) <= tolerance * fraction for m in last)
                and max(last_cycles) <= (1.0 + tolerance / 2) * min(last_cycles)):
            break
        if block + 1 < max_blocks:
            scale = min(max(fraction / measured, 0.25), 4.0) if measured > 0 else 4.0
            state["cycles"] = max(1, int(round(state["cycles"] * scale ** gain)))
    settled = block + 1 < max_blocks or (
        all(abs(m - fraction) <= tolerance * fraction for m in history[-stable:]))
    if not settled:  # the blocks' noise moved the cycles to the end: the rounds take their median
        state["cycles"] = int(statistics.median(cycles_run[-2 * stable:]))

    call.injected_ms = injected_ms
    call.reference_ms = base_ms
    call.injected_fraction = statistics.fmean(history[-stable:])
    call.injected_settled = settled
    call.injected_history = history
    call.cycles_history = cycles_run
    call.spin_cycles = state["cycles"]
    return call


def time_ms(fn: Callable[[], object], warmup: int = 10, iters: int = 50) -> list[float]:
    """Per-call times in ms from CUDA events around each call (:class:`EventTimer`), ``iters``
    calls back to back after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    timer = EventTimer()
    timer.reserve(iters)
    torch.cuda.synchronize()
    timed = timer.timed(fn)
    for _ in range(iters):
        timed()
    return timer.collect_ms()


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def peak_extra_memory_bytes(fn: Callable[[], object]) -> int:
    """Peak memory allocated during one call of ``fn`` beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return peak - before


def reset_cuda_generators() -> None:
    """Give every CUDA device's default generator a fresh copy of its own state (same seed and
    offset). A capture that fails after drawing from a generator leaves it marked as capturing, and
    every later draw outside a capture then raises "Offset increment outside graph capture
    encountered unexpectedly"; the copy starts outside any capture, so the cases after a failed
    capture run as they would on their own."""
    for generator in torch.cuda.default_generators:
        generator.graphsafe_set_state(generator.clone_state())


def graph_replay(fn: Callable[[], object], failures: list[str] | None = None) -> Callable[[], None] | None:
    """``fn`` captured once in a CUDA graph (after three warm-up calls on a side stream), as a
    callable that replays it: the device work of one call of ``fn`` without the host's launch
    overhead. None when ``fn`` cannot be captured, with the reason appended to ``failures``; the
    CUDA generators are reset after a failed capture (:func:`reset_cuda_generators`) so that the
    failure cannot reach the next case. The callable holds the graph (and its memory pool).

    The warm-ups and the capture run inside :func:`dslab.kernels.dispatch.graphed_launches`, as a
    model's graphs do: a dslab kernel whose launch plan differs inside a graph (attention's
    backward at BERT-large's seq 512) compiles and autotunes that plan in the warm-ups, never
    inside the capture, where Triton's compile or autotune would fail it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with graphed_launches():
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
    except Exception as err:  # not capturable (host syncs, CPU-side state): no graph figure
        torch.cuda.synchronize()
        reset_cuda_generators()
        if failures is not None:
            failures.append(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        return None

    def replay() -> None:
        graph.replay()

    replay.graph = graph
    return replay


def graph_time_ms(fn: Callable[[], object], iters: int = 30, failures: list[str] | None = None) -> list[float] | None:
    """Per-replay times in ms of ``fn`` captured once in a CUDA graph (:func:`graph_replay`): the
    device time of its kernels without the host's launch overhead. None when ``fn`` cannot be
    captured, with the reason appended to ``failures``."""
    replay = graph_replay(fn, failures)
    if replay is None:
        return None
    return time_ms(replay, warmup=3, iters=iters)
