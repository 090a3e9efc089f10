"""Continuous profiling: the flops profiler's per-module device-time profile taken again every
``flops_profiler.every_n_steps`` steps of a training run, kept as a compact series so that the run
report carries MFU and per-module time over the whole run.

When (global steps, 0-based, as ``profile_step``): the first profile of the series is the one
``profile_step`` sets up, counted at ``profile_step`` and device-timed at ``profile_step + 1``
(:mod:`dslab.profilers.flops_step`). The modules are device-timed again every N steps after it, at
steps ``profile_step + 1 + k * N``: with ``profile_step`` 1 and N 3, a run of steps 0..9 is
profiled at steps 2, 5 and 8. Neither DeepSpeed's ``flops_profiler`` nor dslab's has an
``end_profile_step``: the profiles go on until the run ends.

A later profile's step is timed by :class:`dslab.profilers.event_time.EventModuleTimer` (the
default, ``continuous_timer: "events"``): forward hooks on the modules down to ``module_depth``
and gradient hooks for their backward record CUDA events on the stream, with no synchronisation;
the events are read on a later step, once the device has passed them. With ``"kernels"`` it runs
as the first device-timed step does (:class:`dslab.profilers.device_time.ModuleDeviceTimer`: hooks
on every module and ``torch.profiler``, one synchronisation at its begin and one at its end). Either
way the hooks are removed when the step ends; under them a CUDA-graphed layer stack runs eagerly
for that step, and every other step replays its graphs and runs with no hook, no dispatch mode
and no synchronisation. What an unprofiled step may do: record one CUDA event (host clock on a
CPU) at its begin, on the few steps that time a profile's window, and advance the latest
profile's attribution by a few milliseconds of host time (or poll its events), on the steps right
after it (below).

What one profile holds (compact, so that a long run's records stay small)::

    {"step", "forward_ms", "backward_ms", "optimizer_ms", "busy_ms", "span_ms",   # the profiled step
     "timer", "host_lead",
     "step_ms", "window_steps", "achieved_tflops", "mfu": {"measured", "datasheet"},
     "modules": [{"name", "depth", "forward_ms", "backward_ms"}, ...]}

The device times are those of the profiled step (an eager step on a CUDA-graphed model): its
kernels' with ``timer`` "kernels", the stream's time between marks with "events" (``busy_ms`` None:
marks cannot tell busy from idle; ``host_lead`` whether the host had queued the whole step before
the device began it, None on a CPU). ``step_ms`` is the median time of the first :data:`WINDOW_STEPS` unprofiled steps after it
that carry none of its attribution work (below; fewer when the next profile comes first, None when
there are none, as with N = 1), from a CUDA
event at each step's begin, read at a later step's begin once the device has passed them (no step
waits for them; the records read what is left, waiting if they must); ``achieved_tflops`` and ``mfu`` divide the flops counted at ``profile_step`` (the same
every step for a fixed batch shape) by it. ``modules`` holds the model (name ``""``, depth 0) and
the ``top_modules`` modules of most forward + backward device time at each depth up to
``module_depth`` (every depth with -1); a container that is never called (``nn.ModuleList``) has
the sum of its submodules, as in the single profile. A profile whose timing failed has an
``error`` and no device times.

What it costs (GPT-2 124M, batch 16 x 1024, bf16, CUDA graphs, one H200, torch 2.11,
``benchmarks/continuous_profiling.py``, every profiler on against every profiler off, 5 interleaved
trials of 100 steps): a graphed step takes ~32.4 ms. With the events timer a profiled step took
33.1 ms (1.02x a plain step, the host's lead over the device absorbing the eager launches and
hooks), and the run's overhead was -0.02% at N = 100 and 0.03% at N = 20, inside the trials'
noise. Its module times are the stream's time between marks, kernels and the gaps between them:
4-9% above the kernel durations for the model and the layers, 20-40% above for modules of
~20 us (a mark costs the stream a few microseconds). With the kernels timer the profiled step
runs eagerly with every op traced (~7,000 records; the host needs 60-80 ms for it) and the
profiler's stop flushes the records (20-30 ms): 102.8 ms (3.2x), 2.3% at N = 100. Its Python pass
that attributes the records to modules (~70 ms of host time) is not paid in one piece: it advances
by about :data:`WORK_PER_STEP_MS` (one piece of a few milliseconds past it at most) at the begin
of each following step (:meth:`ContinuousProfiles.add_later`), while the device runs the work the
host queued before, so a device-bound run does not wait for it; done on the profiled step it made
that step 4.7x a plain one. Several profiles' work may be pending (oldest first) when the next
profile comes before one is done; it is finished at once when the records are asked for and at
:meth:`ContinuousProfiles.wait`. Not a thread: a second Python
thread takes the interpreter lock from the training thread at each of its op calls (torch releases
the lock inside every op), which stalls a host that is not ahead (measured: 4.1% at N = 100). The
first profile, which the single profile shares, is attributed right away.

How many are kept: at most :data:`MAX_PROFILES` + 1. When one more arrives, every second profile is
dropped (the first and the latest kept) and from then on profiles are taken every 2N steps (then
4N, ...), so the kept profiles stay evenly spaced over the whole run and the records stay bounded
however long it runs; ``interval_steps`` in the records is the spacing at the end, ``taken`` how
many profiles ran.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Generator


from dslab.profilers import timers
from dslab.profilers.event_time import WAITING

WINDOW_STEPS = 4
MAX_PROFILES = 256
WORK_PER_STEP_MS = 4.0


def _module_depth(name: str) -> int:
    return 0 if not name else name.count(".") + 1


def compact_modules(timed: dict, names: list[str], module_depth: int, top_modules: int) -> list[dict]:
    """The model and, per depth up to ``module_depth`` (-1: all), the ``top_modules`` modules of
    most forward + backward time, from :func:`dslab.profilers.device_time.attribute`'s
    ``timed["modules"]``; ``names`` are the model's module names, containers that were never
    called summed from their direct submodules."""
    modules = {name: dict(figures) for name, figures in timed["modules"].items()}
    for name in sorted(set(names) - set(modules), key=lambda n: -n.count(".")):
        prefix = f"{name}." if name else ""
        children = [modules[c] for c in modules
                    if c != name and c.startswith(prefix) and "." not in c[len(prefix):]]
        if children:
            modules[name] = {key: sum(c[key] for c in children) for key in ("forward_ms", "backward_ms")}
    by_depth: dict[int, list[tuple[str, dict]]] = {}
    for name, figures in modules.items():
        depth = _module_depth(name)
        if module_depth == -1 or depth <= module_depth:
            by_depth.setdefault(depth, []).append((name, figures))
    kept = []
    for depth in sorted(by_depth):
        ranked = sorted(by_depth[depth], key=lambda item: -(item[1]["forward_ms"] + item[1]["backward_ms"]))
        for name, figures in ranked[:1 if depth == 0 else top_modules]:
            kept.append({"name": name, "depth": depth, "forward_ms": figures["forward_ms"],
                         "backward_ms": figures["backward_ms"]})
    return kept


def rates(total_flops: int, peaks: dict, step_ms: float | None) -> tuple[float | None, dict]:
    """``(achieved TFLOP/s, {"measured", "datasheet"} MFU)`` of ``total_flops`` in ``step_ms``
    against the peaks of the counted profile (None where a figure is missing)."""
    if not step_ms:
        return None, {"measured": None, "datasheet": None}
    tflops = total_flops / (step_ms * 1e-3) / 1e12
    return tflops, {key: tflops / peaks[f"{key}_tflops"] if peaks.get(f"{key}_tflops") else None
                    for key in ("measured", "datasheet")}


class ContinuousProfiles:
    """The series of one run (module docstring). The flops driver calls :meth:`on_step_begin` at
    the begin of every global step, :meth:`add` or :meth:`add_later` with each profiled step's
    timing, and :meth:`records` for the report; :attr:`next_step` is the step to profile next."""

    def __init__(self, every_n_steps: int, first_step: int, names: list[str], module_depth: int,
                 top_modules: int, cuda: bool):
        self.every_n_steps = every_n_steps
        self.interval = every_n_steps
        self.next_step = first_step
        self.names = names
        self.module_depth = module_depth
        self.top_modules = top_modules
        self.cuda = cuda
        self.profiles: list[dict] = []
        self.taken = 0
        self._window: list[tuple[int, object, bool]] = []  # (step, mark at its begin, unprofiled)
        self._window_open = False
        self._pending: list[tuple[dict, Generator]] = []  # profiles and the work that fills them, oldest first
        self._unfilled: list[tuple[dict, list, dict]] = []  # closed windows whose marks may be unread

    def on_step_begin(self, step: int, clean: bool) -> None:
        """Mark the begin of ``step`` while the latest profile's window is open (``clean``: the
        step runs unprofiled), then advance the pending attribution by about
        :data:`WORK_PER_STEP_MS`. A step that is profiled or carries attribution work is not
        counted in the window."""
        work = bool(self._pending) and step != self.next_step
        if self._window_open:
            counted = sum(1 for _, _, unprofiled in self._window if unprofiled)
            self._window.append((step, self._mark(), clean and not work))
            if counted >= WINDOW_STEPS or step == self.next_step:
                self._window_open = False
        if work:
            self._advance(WORK_PER_STEP_MS / 1e3)
        if self._unfilled:
            self._fill_windows(block=False)

    def _mark(self):
        return timers.mark(self.cuda)

    def _window_times_ms(self, window: list, block: bool = True) -> list[float] | None:
        """The clean steps' times of ``window``; None when ``block`` is False and the device has
        not yet passed its last mark (a CPU's marks are always read)."""
        pairs = [(a, b) for (s, a, clean), (t, b, _) in zip(window, window[1:]) if clean and t == s + 1]
        if self.cuda:
            if pairs:
                if not block and not pairs[-1][1].query():
                    return None
                pairs[-1][1].synchronize()
            return [a.elapsed_time(b) for a, b in pairs]
        return [(b - a) * 1e3 for a, b in pairs]

    def _fill_window(self, profile: dict, window: list, counted: dict, block: bool = True) -> bool:
        """Write ``window``'s step time, TFLOP/s and MFU into ``profile``; False (nothing written)
        when ``block`` is False and its marks are not all passed yet."""
        times = self._window_times_ms(window, block)
        if times is None:
            return False
        step_ms = statistics.median(times) if times else None
        tflops, mfu = rates(counted["total_flops"], counted.get("peaks") or {}, step_ms)
        profile.update(step_ms=step_ms, window_steps=len(times), achieved_tflops=tflops, mfu=mfu)
        return True

    def _fill_windows(self, block: bool) -> None:
        """Fill the closed windows whose marks the device has passed (all of them with ``block``)."""
        self._unfilled = [item for item in self._unfilled if not self._fill_window(*item, block=block)]

    def _begin(self, step: int, counted: dict) -> dict:
        """The new profile of ``step`` in the series (its device times to come). The previous
        profile's window closes here; it is read on a later step once the device has passed its
        marks, so that beginning a profile never waits for the device."""
        if self.profiles:
            self._unfilled.append((self.profiles[-1], self._window, counted))
        self.taken += 1
        profile = {"step": step, "step_ms": None, "window_steps": 0, "achieved_tflops": None,
                   "mfu": {"measured": None, "datasheet": None}}
        self.profiles.append(profile)
        if len(self.profiles) > MAX_PROFILES:
            self.profiles = self.profiles[::2]
            self.interval *= 2
        self.next_step = step + self.interval
        self._window = []
        self._window_open = True
        return profile

    def _fill(self, profile: dict, timed: dict) -> None:
        root = timed["modules"].get("", {})
        profile.update(forward_ms=root.get("forward_ms", 0.0), backward_ms=root.get("backward_ms", 0.0),
                       optimizer_ms=timed["optimizer_ms"], busy_ms=timed["busy_ms"], span_ms=timed["span_ms"],
                       timer=timed.get("method", "kernels"), host_lead=timed.get("host_lead"),
                       modules=compact_modules(timed, self.names, self.module_depth, self.top_modules))

    def add(self, step: int, timed: dict | None, counted: dict, error: str | None = None) -> None:
        """The profile of ``step`` from ``timed`` (:func:`dslab.profilers.device_time.attribute`'s
        figures) or its ``error``; ``counted`` is the counted profile (``total_flops``,
        ``peaks``). Called after the timer stopped (and synchronised)."""
        profile = self._begin(step, counted)
        if error is not None:
            profile["error"] = error
        else:
            self._fill(profile, timed)

    def add_later(self, step: int, work: Generator, counted: dict) -> None:
        """:meth:`add` with the figures that generator ``work`` returns (such as
        :meth:`dslab.profilers.device_time.ModuleDeviceTimer.attribution_steps`), advanced at the
        begin of the next steps (module docstring); an error it raises becomes the profile's
        ``error``."""
        self._pending.append((self._begin(step, counted), work))

    def _advance(self, budget_s: float | None) -> None:
        """Run the pending work, oldest first, one piece at least, until ``budget_s`` seconds have
        passed (None: to its end). Work that yields :data:`WAITING` (marks the device has not
        passed yet) is left for a later step, or polled until done when there is no budget."""
        deadline = None if budget_s is None else time.perf_counter() + budget_s
        while self._pending:
            profile, work = self._pending[0]
            try:
                while True:
                    if next(work) is WAITING:
                        if deadline is not None:
                            return
                        time.sleep(1e-4)
                    elif deadline is not None and time.perf_counter() >= deadline:
                        return
            except StopIteration as done:
                self._pending.pop(0)
                self._fill(profile, done.value)
            except Exception as err:  # the profile must not stop training; the records say why
                self._pending.pop(0)
                profile["error"] = f"{type(err).__name__}: {err}"
            if deadline is not None and time.perf_counter() >= deadline:
                return

    def wait(self) -> None:
        """Finish the pending attribution now."""
        if self._pending:
            self._advance(None)

    def records(self, counted: dict) -> dict:
        """The series for the report (its window figures as far as they are measured)."""
        self.wait()
        self._fill_windows(block=True)
        if self.profiles:  # the latest profile's window, as far as it goes
            self._fill_window(self.profiles[-1], self._window, counted)
        return {
            "every_n_steps": self.every_n_steps,
            "interval_steps": self.interval,
            "max_profiles": MAX_PROFILES,
            "window_steps": WINDOW_STEPS,
            "taken": self.taken,
            "method": ("each profile: one step with module hooks for that step only; its 'timer' says how the "
                       "modules were timed: 'kernels' (the first profile, and every one with continuous_timer "
                       "'kernels'): the kernels' durations attributed to modules through torch.profiler; 'events': "
                       "the stream's time between CUDA events at each module's forward and backward (kernels and "
                       "the gaps between them; 'host_lead' false: they may include time the device waited for the "
                       "host); step_ms: median of the unprofiled steps after it, "
                       + ("CUDA events at each step's begin" if self.cuda else "host clock at each step's begin")),
            "profiles": [dict(p) for p in self.profiles],
        }
