"""The engine's ``flops_profiler``: three stretches of a training run, each measured the way it can
be measured truthfully.

1. Step ``profile_step`` (its first micro-step) is **counted**: every op under the flops
   profiler's dispatch mode, attributed to modules (:class:`dslab.profilers.flops.FlopsProfiler`).
   The counting costs the host a Python call per op, so this step is never timed for the report.
2. Step ``profile_step + 1`` is **timed by device activity** (``device_time``, on by default):
   each module's forward and backward time is the time of the kernels it ran
   (:class:`dslab.profilers.device_time.ModuleDeviceTimer`), and a module's achieved TFLOP/s is
   its counted flops over that time.
3. Step ``profile_step + 2`` runs as every unprofiled step does (no hooks: CUDA graphs replay)
   under ``torch.profiler`` alone: its device busy time (``device_time.steady_busy_ms``) says how
   far the module-timed step's kernels are from the steady state's, and how long the device idles
   in a steady step.
4. The steps after it, up to :data:`STEADY_STEPS` of them, are the **steady state**: one CUDA
   event at the begin of each (no synchronisation), read at :meth:`FlopsStepProfiler.records`; the whole model's achieved
   TFLOP/s and MFU are its counted flops over their median step time. A benchmark that timed the
   run itself replaces this figure with its own (``steady_state.source`` says whose it is).
5. With ``every_n_steps`` N, steps ``profile_step + 1 + k * N`` (k >= 1) are timed again: by stream
   marks from module and gradient hooks (``continuous_timer`` "events", the default:
   :class:`dslab.profilers.event_time.EventModuleTimer`, no synchronisation, read a few steps
   later) or by device activity as step 2 is ("kernels"), and every timed step, the first included,
   becomes one profile of the
   records' ``continuous`` series (:mod:`dslab.profilers.flops_continuous`). Such a step takes the
   place of step 3's busy-time measurement when they fall together (N = 1), and is left out of the
   steady-state step times.

The profile text is written (rank 0) once step ``profile_step + 2`` is done, or after the counted
step when ``device_time`` is off, or at :meth:`FlopsStepProfiler.close` when the run stops before:
to ``output_file`` when the config names one (DeepSpeed's key, appended to), else into
``flops_profile.txt`` of the engine's profile output directory when one is set
(``engine.set_profile_output_dir``, as ``dslab bench`` does), else to standard output as DeepSpeed
prints it. The records name the file as ``text_file`` (None when the text goes to standard output).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch.nn as nn

from dslab.comm import get_rank
from dslab.config_base import parse_section
from dslab.profilers import flops_output, timers
from dslab.profilers.base import Profiler
from dslab.profilers.device_time import ModuleDeviceTimer
from dslab.profilers.event_time import EventModuleTimer
from dslab.profilers.flops_continuous import ContinuousProfiles
from dslab.profilers.flops import FlopsProfiler, FlopsProfilerConfig

STEADY_STEPS = 8
TEXT_FILE = "flops_profile.txt"


def _module_hooks_present(model: nn.Module) -> bool:
    """Whether any forward hook is on the model now (another profiler instrumenting this step, which
    makes a CUDA-graphed layer stack run eagerly)."""
    from torch.nn.modules import module as module_globals

    if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def timed_step_mode(model: nn.Module, cuda: bool) -> str:
    """How the device-timed step ran, in words for the report."""
    if cuda and any(getattr(m, "_layer_graphs", None) is not None for m in model.modules()):
        return ("eager: the module hooks keep the CUDA-graphed layer stack eager for this step, so "
                "its kernels are the graphs' kernels launched one by one")
    if any(hasattr(m, "_orig_mod") for m in model.modules()):
        return "under torch.compile, with module hooks (the compiled graphs may differ from the hook-free run)"
    return "eager, as every step of this model"


def merge_device_time(records: dict, timed: dict, step: int, mode: str) -> dict:
    """``records`` (from :func:`dslab.profilers.flops_output.build_records`) with each module's
    ``forward_device_ms``, ``backward_device_ms`` and ``device_tflops`` (counted forward + backward
    flops over that time), and a ``device_time`` section with the timed step's totals."""
    modules = dict(timed["modules"])
    # A container that is never called (ModuleList) has no range of its own: its submodules' sum.
    names = {m["name"] for m in records["modules"]}
    for name in sorted(names - set(modules), key=lambda n: -n.count(".")):
        prefix = f"{name}." if name else ""
        children = [modules[c] for c in modules if c != name and c.startswith(prefix)
                    and "." not in c[len(prefix):]]
        if children:
            modules[name] = {key: sum(c[key] for c in children) for key in ("forward_ms", "backward_ms")}
    for m in records["modules"]:
        figures = modules.get(m["name"])
        if figures is None:
            continue
        m["forward_device_ms"] = figures["forward_ms"]
        m["backward_device_ms"] = figures["backward_ms"]
        ms = figures["forward_ms"] + figures["backward_ms"]
        flops = m["forward_flops"] + m["backward_flops"]
        m["device_tflops"] = flops / (ms * 1e-3) / 1e12 if ms > 0 else None
    root = modules.get("", {"forward_ms": 0.0, "backward_ms": 0.0})
    records["device_time"] = {
        "step": step,
        "mode": mode,
        "method": "kernel durations from torch.profiler (CUPTI on CUDA; host ops' self time on a CPU), "
                  "attributed to module ranges through the profiler's correlation ids and autograd "
                  "sequence numbers",
        "forward_ms": root["forward_ms"],
        "backward_ms": root["backward_ms"],
        "optimizer_ms": timed["optimizer_ms"],
        "unattributed_ms": timed["unattributed_ms"],
        "busy_ms": timed["busy_ms"],
        "work_ms": timed["work_ms"],
        "span_ms": timed["span_ms"],
        "records": timed["records"],
    }
    return records


def steady_state(records: dict, step_times_ms: list[float], source: str) -> dict:
    """The whole model's figures at the median of ``step_times_ms``: ``{"step_ms", "steps",
    "source", "achieved_tflops", "mfu": {"measured", "datasheet"}}``, with the timed step's device
    busy time beside it (``device_busy_over_step``) and an unhooked step's (``steady_busy_over_step``: the share of a
    steady step the device is busy) when the records have them."""
    step_ms = statistics.median(step_times_ms)
    peaks = records.get("peaks") or {}
    total = records["total_flops"]
    tflops = total / (step_ms * 1e-3) / 1e12 if step_ms > 0 else None
    mfu = {"measured": None, "datasheet": None}
    if tflops is not None and peaks.get("measured_tflops"):
        mfu["measured"] = tflops / peaks["measured_tflops"]
    if tflops is not None and peaks.get("datasheet_tflops"):
        mfu["datasheet"] = tflops / peaks["datasheet_tflops"]
    out = {"step_ms": step_ms, "steps": len(step_times_ms), "source": source, "achieved_tflops": tflops,
           "mfu": mfu}
    device = records.get("device_time") or {}
    if device.get("busy_ms") is not None and step_ms > 0:
        out["device_busy_over_step"] = device["busy_ms"] / step_ms
    if device.get("steady_busy_ms") is not None and step_ms > 0:
        out["steady_busy_over_step"] = device["steady_busy_ms"] / step_ms
    return out


class FlopsStepProfiler(Profiler):
    """The engine driver of the ``flops_profiler`` section (module docstring). Every step other
    than the counted and the timed one runs without dispatch modes, hooks or synchronisation."""

    section = "flops"

    def __init__(self, config: FlopsProfilerConfig, measured_peak_tflops: float | None = None):
        self.config = config
        self.measured_peak_tflops = measured_peak_tflops
        self.profiler: FlopsProfiler | None = None
        self.model: nn.Module | None = None
        self._records: dict | None = None
        self._profiling_step: int | None = None
        self._timer: ModuleDeviceTimer | None = None
        self._timing_step: int | None = None
        self._busy_timer: ModuleDeviceTimer | None = None
        self._printed = False
        # (global step, mark at its first micro-step's begin, whether that step ran unprofiled)
        self._steady_marks: list[tuple] = []
        self._cuda = False
        self._last_begin: int | None = None
        self.continuous: ContinuousProfiles | None = None

    @classmethod
    def from_config(cls, cfg: FlopsProfilerConfig | dict | None, measured_peak_tflops: float | None = None
                    ) -> FlopsStepProfiler | None:
        """The driver for a ``flops_profiler`` section (a model or its dict), None when disabled."""
        if cfg is None:
            return None
        if not isinstance(cfg, FlopsProfilerConfig):
            cfg = parse_section(FlopsProfilerConfig, cfg, prefix="flops_profiler")
        return cls(cfg, measured_peak_tflops) if cfg.enabled else None

    def attach(self, model: nn.Module, optimizer=None) -> None:
        self.model = model
        self.profiler = FlopsProfiler(model, measured_peak_tflops=self.measured_peak_tflops)
        first = next((t for t in (*model.parameters(), *model.buffers())), None)
        self._cuda = first is not None and first.device.type == "cuda"
        if self.config.every_n_steps is not None:
            self.continuous = ContinuousProfiles(
                self.config.every_n_steps, self.config.profile_step + 1, [name for name, _ in model.named_modules()],
                self.config.module_depth, self.config.top_modules, self._cuda)

    def one_off_steps(self) -> tuple[int, ...]:
        """The counted step and, with ``device_time``, the module-timed and the busy-time steps
        after it (the continuous series' later profiles are part of the run, not one-off)."""
        first = self.config.profile_step
        return (first, first + 1, first + 2) if self.config.device_time else (first,)

    # -- hooks ----------------------------------------------------------------------------------

    def on_step_begin(self, step: int) -> None:
        # Only a step's first micro-step begins anything: the later ones run as they come.
        if self.profiler is None or step == self._last_begin:
            return
        self._last_begin = step
        cfg = self.config
        if self._records is None:
            if step == cfg.profile_step:
                self._profiling_step = step
                self.profiler.start_profile()
            return
        timed = cfg.device_time and self._timer is None and (
            (self._timing_step is None and step == cfg.profile_step + 1)
            or (self.continuous is not None and step == self.continuous.next_step))
        busy = not timed and cfg.device_time and step == cfg.profile_step + 2 and self._busy_timer is None \
            and "steady_busy_ms" not in (self._records.get("device_time") or {})
        # The marks first: each ends the step before this one.
        if step > cfg.profile_step + 2 * int(cfg.device_time) and len(self._steady_marks) <= STEADY_STEPS:
            self._steady_marks.append((step, self._mark(), not timed))
        if self.continuous is not None:
            self.continuous.on_step_begin(step, clean=not (timed or busy))
        if timed:
            first = self._timing_step is None
            self._timing_step = step
            if first or cfg.continuous_timer == "kernels":
                self._timer = ModuleDeviceTimer(self.model)
            else:  # a later profile of the continuous series, by stream marks
                self._timer = EventModuleTimer(self.model, max_depth=cfg.module_depth)
            self._timer.start()
        elif busy:
            self._busy_timer = ModuleDeviceTimer(self.model, hooks=False)
            self._busy_timer.start()

    def on_optimizer_step_begin(self) -> None:
        if self._profiling_step is not None:
            self.profiler.set_phase("optimizer")
        if self._timer is not None:
            self._timer.phase("optimizer")

    def on_optimizer_step_end(self) -> None:
        if self._profiling_step is not None:
            self.profiler.set_phase(None)
        if self._timer is not None:
            self._timer.phase(None)

    def on_step_end(self, step: int) -> None:
        if self._profiling_step is not None:
            self.profiler.stop_profile()
            self._records = self.profiler.records(self._profiling_step)
            self.profiler.end_profile()
            self._profiling_step = None
            if not self.config.device_time:
                self._print()
        elif self._timer is not None and self._timing_step != self.config.profile_step + 1:
            timer, self._timer = self._timer, None  # a profile of the continuous series
            try:
                if isinstance(timer, EventModuleTimer):
                    timer.stop()
                    work = timer.attribution_steps()
                else:
                    work = timer.attribution_steps(timer.stop_profiling())
            except Exception as err:
                self.continuous.add(self._timing_step, None, self._records, error=f"{type(err).__name__}: {err}")
            else:
                self.continuous.add_later(self._timing_step, work, self._records)
        elif self._timer is not None:  # the first device-timed step: the single profile's
            timer, self._timer = self._timer, None
            try:
                timed = timer.stop()
            except Exception as err:  # the profile must not stop training; the report says why
                error = f"{type(err).__name__}: {err}"
                self._records["device_time"] = {"step": self._timing_step, "error": error}
                if self.continuous is not None:
                    self.continuous.add(self._timing_step, None, self._records, error=error)
            else:
                merge_device_time(self._records, timed, self._timing_step, timed_step_mode(self.model, self._cuda))
                if self.continuous is not None:
                    self.continuous.add(self._timing_step, timed, self._records)
            if self.continuous is not None and self.config.every_n_steps == 1:
                self._print()  # no unprofiled step profile_step + 2 follows to print after
        elif self._busy_timer is not None:
            timer, self._busy_timer = self._busy_timer, None
            device = self._records.setdefault("device_time", {})
            device["steady_busy_hooked"] = _module_hooks_present(self.model)
            try:
                busy = timer.stop()
            except Exception as err:
                device["steady_busy_error"] = f"{type(err).__name__}: {err}"
            else:
                device["steady_busy_step"] = step
                device["steady_busy_ms"] = busy["busy_ms"]
                device["steady_span_ms"] = busy["span_ms"]
            self._print()

    # -- results --------------------------------------------------------------------------------

    def _mark(self):
        return timers.mark(self._cuda)

    def steady_step_times_ms(self) -> list[float]:
        """The steady-state step times so far: from the begin of one global step to the begin of
        the next (every micro-step of it and the optimizer step), read from their CUDA events."""
        pairs = [(a, b) for (s, a, unprofiled), (t, b, _) in zip(self._steady_marks, self._steady_marks[1:])
                 if unprofiled and t == s + 1]
        if self._cuda:
            if pairs:
                pairs[-1][1].synchronize()
            return [a.elapsed_time(b) for a, b in pairs]
        return [(b - a) * 1e3 for a, b in pairs]

    def text_file(self) -> Path | None:
        """Where this rank's profile text goes (module docstring); None for standard output or,
        on a rank other than 0, for no text at all."""
        if get_rank() != 0:
            return None
        if self.config.output_file:
            return Path(self.config.output_file)
        return self.text_path(TEXT_FILE)

    def _print(self) -> None:
        if self._printed or get_rank() != 0:
            return
        self._printed = True
        text = flops_output.render_text(self.records_now(), self.config.module_depth, self.config.top_modules,
                                        self.config.detailed)
        if self.config.output_file:
            with open(self.config.output_file, "a", encoding="utf-8") as f:
                f.write(text + "\n")
            if self.echo_text:
                print(text, flush=True)
        else:
            self.write_text(TEXT_FILE, text)

    def records_now(self) -> dict:
        records = dict(self._records)
        times = self.steady_step_times_ms()
        if times:
            records["steady_state"] = steady_state(records, times, f"the engine: CUDA events around {len(times)} "
                                                   f"unprofiled step(s) after the timed one, median"
                                                   if self._cuda else f"the engine: host clock around "
                                                   f"{len(times)} unprofiled step(s), median")
        return records

    def records(self) -> dict:
        if self._records is None:
            return {"profiled": False, "profile_step": self.config.profile_step}
        text_file = self.text_file()
        records = {"profiled": True, **self.records_now(), "text_file": None if text_file is None else str(text_file)}
        if self.continuous is not None:
            records["continuous"] = self.continuous.records(self._records)
        return records

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.end_profile()
        if self.continuous is not None:
            self.continuous.wait()
        for timer in (self._timer, self._busy_timer):
            if timer is not None and timer.running:
                try:
                    timer.stop()
                except Exception:  # closing must release the hooks even when the profile failed
                    pass
        self._timer = self._busy_timer = None
        self._profiling_step = None
        if self._records is not None:
            self._print()


def from_config(cfg: FlopsProfilerConfig | dict | None, measured_peak_tflops: float | None = None
                ) -> FlopsStepProfiler | None:
    """:meth:`FlopsStepProfiler.from_config`: the engine driver, or None when disabled."""
    return FlopsStepProfiler.from_config(cfg, measured_peak_tflops)
