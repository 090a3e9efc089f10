"""``offload_optimizer.overlap_step``: the CPU optimizer step of the units parameter offload holds
runs on a worker thread while the next forward begins.

With ``offload_param: cpu`` the GPU has nothing to do while the CPU optimizer steps: the next
forward fetches every offloaded unit from its home, and a unit's home copy changes only in that
step. So :meth:`dslab.engine.zero.offload.CpuOptimizerOffload.step_in_background` steps, on the
calling thread, the units the step must finish before the engine returns (those kept on the
device, the resident ones, and any other unit no home holds), then hands the home-held units to
:class:`BackgroundStep`, in forward order, and returns. Each such unit is marked updating in its
home (:meth:`dslab.engine.zero.param_offload.ParamHome.begin_updates`); a fetch of it waits until
the worker has stepped it and refreshed its fetch copy, so that the forward of unit ``k`` runs on
the GPU while the CPU steps unit ``k + 1`` onwards. The arithmetic is the serial step's: the same
optimizer, its state, its hyperparameters of the moment (a snapshot: the scheduler's step that
follows at once changes the next step's), chunk by chunk.

Whatever reads the masters, gradients or optimizer states waits for the worker first
(:meth:`BackgroundStep.wait`, through ``engine.zero.settle()``, the next gradients in, and the
checkpoint paths); an error raised on the worker is raised there, and by a fetch that waited for
a unit the worker never finished.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Callable

import torch


def snapshot_optimizer(optimizer: torch.optim.Optimizer) -> tuple[Callable[[], object], torch.optim.Optimizer]:
    """``(step, shadow)``: a shallow copy of ``optimizer`` that shares its parameters and state
    but holds copies of its param groups' hyperparameters as they are now, and a callable that
    steps it through the optimizer's class (an LR scheduler wraps the instance's ``step``, which
    would step the original's groups). Only torch's own optimizers, which keep everything a step
    changes in ``state``, are stepped this way: another class could keep a counter on the
    instance, which the copy's step would leave behind (a ValueError names it)."""
    cls = type(optimizer)
    if not cls.__module__.startswith("torch.optim"):
        raise ValueError(f"zero_optimization.offload_optimizer.overlap_step steps torch.optim optimizers only "
                         f"(a copy sharing their state); {cls.__module__}.{cls.__qualname__} is not one: "
                         f"set overlap_step to false, or pass a torch.optim optimizer")
    shadow = copy.copy(optimizer)
    shadow.param_groups = [dict(group) for group in optimizer.param_groups]
    step = type(optimizer).step
    return (lambda: step(shadow)), shadow


class BackgroundStep:
    """One optimizer step's remainder running on a worker thread: ``work()`` is called there;
    :meth:`wait` joins it and raises what it raised. ``on_error(err)`` runs on the worker when
    ``work`` raises (a home releases the fetches waiting on it)."""

    def __init__(self, work: Callable[[], None], on_error: Callable[[BaseException], None]):
        self.error: BaseException | None = None
        self.seconds = 0.0  # the worker's time for the step
        self.waited_s = 0.0  # the callers' time in wait()

        def run() -> None:
            start = time.perf_counter()
            try:
                work()
            except BaseException as err:  # raised again by wait(), on the caller's thread
                self.error = err
                on_error(err)
            finally:
                self.seconds = time.perf_counter() - start

        self._thread = threading.Thread(target=run, name="dslab-offload-step", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Join the worker; raise its error (once) on this thread."""
        start = time.perf_counter()
        self._thread.join()
        self.waited_s += time.perf_counter() - start
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError("the offloaded optimizer step running in the background "
                               "(offload_optimizer.overlap_step) failed") from err
