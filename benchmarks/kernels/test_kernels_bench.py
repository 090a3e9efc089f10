"""The kernel benchmarks as pytest-benchmark tests: every case of every ``bench_<op>.py``, its
dslab kernel and its PyTorch reference, for ``dslab gate --pytest-benchmark``.

    pytest benchmarks/kernels -m gpu --benchmark-json=kernels.json --benchmark-save-data
    dslab gate --pytest-benchmark baseline.json kernels.json

The tests carry the ``gpu`` marker (the project's default ``-m 'not gpu'`` deselects them, so
``-m gpu`` is needed) and live outside ``tests/``, so the CPU run never collects them; without
CUDA they are skipped, one per module, saying so. Each (case, arm) is one benchmark: its name
``test_kernel[<op>_<shape>-<arm>]`` says the arm (``dslab`` or ``torch``), its ``group`` is
``"<op> | <shape>"``, shared by the two arms. ``extra_info`` holds the case's bytes and flops and
the median's GB/s or TFLOP/s beside the measured ceilings (``machine_info.gpu.measured_peaks``).
The dslab/PyTorch ratio table, with CUDA-graph replays and peak memory, is ``run.py``'s.

Timing: CUDA events, not the host clock
---------------------------------------
pytest-benchmark times a round as ``end - start`` of two reads of its ``timer`` around the
round's calls; with the default ``time.perf_counter`` that would time only the host's issuing of
asynchronous kernels. Here the timer is :class:`common.EventTimer` (set per test with
``@pytest.mark.benchmark(timer=...)``), and the benchmarked callable is ``DEVICE_CLOCK.timed(fn)``:

- every call of ``fn`` runs between a start and an end CUDA event recorded on the current stream,
  with no synchronisation between calls (they queue on the device as in a training step);
- reading the timer waits for the events of the calls so far and adds their start-to-end times
  to a clock that advances only by those intervals. The read that ends a round therefore
  synchronises (outside any interval), and ``end - start`` is exactly the sum of the round's
  event-measured call times, which pytest-benchmark divides by the round's calls.

What ``fn`` is (``--kernel-timing``): with ``graph`` (the default) the case's call is captured once
in a CUDA graph (:func:`common.graph_replay`) and ``fn`` replays it, so every interval is the
device's work alone, whichever side is slower; a case that cannot be captured runs eagerly, and
``extra_info["timing"]`` says which (``"graph"``, or ``"eager: <why>"``). With ``eager`` the case's
calls are timed as issued. Timing the issue makes a host-bound case (a forward and backward of a
few short kernels) as noisy as the host: in one H200 run two processes of the same code read the
dslab add + layer norm forward + backward 33% apart, which no kernel change caused. The gate
judges a benchmark only against one timed the same way (:mod:`dslab.gate.pytest_benchmark`).

``benchmark.pedantic(DEVICE_CLOCK.timed(fn), rounds=R, iterations=N, warmup_rounds=W)`` fixes the
work instead of letting pytest-benchmark calibrate it against a clock: each of the R values in
``stats.data`` (what the gate compares) is the mean device time per call over N consecutive calls,
after W untimed rounds (Triton compiles and autotunes on the first call). A call's interval is the
device's time when the device is the bottleneck and the host's issue time when the host is, as in
``run.py``, whose per-call times come from the same :class:`common.EventTimer`. The events of a
round are created before it (:meth:`common.EventTimer.reserve`), since CUDA creates an event at its
first record. Rounds of one process are not independent trials: ``dslab.gate.pytest_benchmark``
says what that means for the gate.
"""

from __future__ import annotations

import pytest
import torch

from common import EventTimer, graph_replay, iterations_for, slowed, warm_for

DEVICE_CLOCK = EventTimer()

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark(timer=DEVICE_CLOCK)]


def test_kernel(benchmark, case_ref, arm, case_store, timing, timing_mode, device_peaks, inject_slowdown):
    case = case_store.get(case_ref)
    benchmark.group = case.label
    benchmark.extra_info.update(op=case.op, shape=case.shape, arm=arm, notes=case.notes, target=case.target,
                                bytes_moved=case.bytes_moved, flops=case.flops, device=torch.cuda.get_device_name())
    fn = getattr(case, arm)
    benchmark.extra_info["timing"] = "eager"
    if timing_mode == "graph":
        failures: list[str] = []
        replay = graph_replay(fn, failures)
        if replay is not None:
            fn = replay
            benchmark.extra_info["timing"] = "graph"
        else:
            benchmark.extra_info["timing"] = f"eager: the case could not be captured ({failures[-1]})"
    if timing.warmup_s:
        benchmark.extra_info["warmup_calls"] = warm_for(fn, timing.warmup_s)
    iterations = iterations_for(fn, timing.round_ms, timing.iterations)
    if arm == "dslab" and inject_slowdown:
        # a deliberate slowdown (--kernel-inject-slowdown), held by feedback over blocks as long as a round
        fn = slowed(fn, inject_slowdown, calls=max(20, iterations), base_blocks=max(1, timing.rounds),
                    base_skip=timing.warmup_rounds)
        benchmark.extra_info.update(injected_ms=fn.injected_ms, injected_fraction=fn.injected_fraction,
                                    reference_ms=fn.reference_ms,
                                    injected_history=[round(m, 5) for m in fn.injected_history],
                                    cycles_history=fn.cycles_history,
                                    spin_cycles=fn.spin_cycles, injected_settled=fn.injected_settled)
    benchmark.extra_info["iterations"] = iterations
    DEVICE_CLOCK.reserve(iterations)
    benchmark.pedantic(DEVICE_CLOCK.timed(fn), rounds=timing.rounds, iterations=iterations,
                       warmup_rounds=timing.warmup_rounds)
    if benchmark.stats is None:  # --benchmark-disable: the call ran once, untimed
        return
    seconds = benchmark.stats.stats.median
    if case.bytes_moved:
        benchmark.extra_info["gbps"] = case.bytes_moved / seconds / 1e9
        benchmark.extra_info["pct_copy_bw"] = benchmark.extra_info["gbps"] / device_peaks["copy_gbps"]
    if case.flops:
        benchmark.extra_info["tflops"] = case.flops / seconds / 1e12
        benchmark.extra_info["pct_matmul_peak"] = benchmark.extra_info["tflops"] / device_peaks["bf16_matmul_tflops"]
