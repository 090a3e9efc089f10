"""The profilers an engine runs, built from its config sections, and the calls into them."""

from __future__ import annotations

import torch

from dslab.io import events as io_events
from dslab.profilers.base import Profiler
from dslab.profilers.comms import CommsLogger
from dslab.profilers.flops_step import FlopsStepProfiler
from dslab.profilers.memory import MemoryTracer
from dslab.profilers.telemetry import TelemetrySampler
from dslab.profilers.timers import WallClockBreakdown


def build_profilers(config, device: torch.device, measured_peak_tflops: float | None = None) -> list[Profiler]:
    """One profiler per switched-on section (``wall_clock_breakdown``, the profiler sections, and
    the storage I/O of ``aio`` / NVMe offload).

    ``measured_peak_tflops`` (the bf16 matmul peak a benchmark measured) is what the flops
    profiler's MFU divides by, beside the datasheet peak."""
    profilers: list[Profiler] = []
    if config.wall_clock_breakdown:
        profilers.append(WallClockBreakdown(device))
    if config.aio is not None or config.zero_optimization.offload_optimizer.device == "nvme":
        profilers.append(IoProfiler())
    for built in (
        FlopsStepProfiler.from_config(config.flops_profiler, measured_peak_tflops=measured_peak_tflops),
        CommsLogger.from_config(config.comms_logger),
        MemoryTracer.from_config(config.memory_tracer),
        TelemetrySampler.from_config(config.telemetry),
    ):
        if built is not None:
            profilers.append(built)
    return profilers


class IoProfiler(Profiler):
    """The ``io`` section of an engine run: every optimizer swap and checkpoint file written
    through :mod:`dslab.io` in this process while the engine lives, with bytes and GB/s
    (:class:`dslab.io.events.IoRecorder`). Built when the config has an ``aio`` section or
    offloads the optimizer to NVMe."""

    section = "io"

    def __init__(self):
        self.recorder = io_events.IoRecorder()
        io_events.add_observer(self.recorder)

    def records(self) -> dict:
        return self.recorder.records()

    def close(self) -> None:
        io_events.remove_observer(self.recorder)


class ProfilerHooks:
    """Calls the same hook on every profiler; a no-op with none attached."""

    def __init__(self, profilers: list[Profiler]):
        self.profilers = profilers
        self._in_step = False
        self._markers = [p for p in profilers if hasattr(p, "on_mark")]

    def __bool__(self) -> bool:
        return bool(self.profilers)

    def call(self, hook: str, *args) -> None:
        for p in self.profilers:
            getattr(p, hook)(*args)

    def begin_micro_step(self, step: int) -> None:
        if not self._in_step:
            self._in_step = True
            self.call("on_step_begin", step)

    def end_micro_step(self, step: int) -> None:
        if self._in_step:
            self._in_step = False
            self.call("on_step_end", step)

    def mark(self, phase: str) -> None:
        """A point inside a hook-delimited phase, told to the profilers that have an
        ``on_mark(phase)`` method (the comms logger's phase marks). The engine marks
        ``backward_compute_end`` when autograd's backward has returned and before it waits for the
        gradient reductions, so that the wait (communication backward did not hide) can be told
        from backward itself."""
        for p in self._markers:
            p.on_mark(phase)

    def one_off_steps_left(self, global_steps: int) -> int:
        """How many steps from global step ``global_steps`` on until every profiler's one-off
        steps (:meth:`~dslab.profilers.base.Profiler.one_off_steps`) have run: a benchmark warms
        up through them, so that its timed steps run as the run's steady steps do."""
        last = max((s for p in self.profilers for s in p.one_off_steps()), default=-1)
        return max(0, last + 1 - global_steps)

    def find(self, section: str) -> Profiler | None:
        return next((p for p in self.profilers if p.section == section), None)

    def records(self) -> dict[str, dict]:
        """Every profiler's records. With several ranks this is a collective (the comms logger
        gathers every rank's records): call it on all ranks."""
        return {p.section: p.records() for p in self.profilers}

    def set_output_dir(self, path, echo_text: bool = False) -> None:
        """Where the profilers put their files (the memory snapshot) and their text reports (the
        flops profile, the comms logger's verbose lines), which then print only with
        ``echo_text`` (:class:`dslab.profilers.base.Profiler`)."""
        for p in self.profilers:
            p.set_output_dir(path, echo_text=echo_text)

    def close(self) -> None:
        for p in self.profilers:
            p.close()
