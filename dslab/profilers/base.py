"""What every profiler is to the engine: built from its config section, told where the step is,
and asked for plain data for the run report.

The engine calls the hooks in this order for each micro-step::

    on_step_begin(step) -> on_forward_begin() -> on_forward_end() -> on_backward_begin()
    -> on_backward_end() -> [on the accumulation boundary: on_optimizer_step_begin()
    -> on_optimizer_step_end()] -> on_step_end(step)

``step`` is the engine's ``global_steps`` at the start of the micro-step (0-based, counted in
optimizer steps). Hooks must not synchronise the device on the steady-state path; a profiler that
needs a synchronisation (to read CUDA events, say) does it on the one step it profiles or at
:meth:`Profiler.records`.
"""

from __future__ import annotations

import torch.nn as nn


class Profiler:
    """Base class with no-op hooks. Subclasses override what they need."""

    #: The run report's ``profilers`` section this profiler fills.
    section: str = ""

    def attach(self, model: nn.Module, optimizer=None) -> None:
        """Called once by the engine with the wrapped model and the optimizer."""

    def on_step_begin(self, step: int) -> None: ...

    def on_forward_begin(self) -> None: ...

    def on_forward_end(self) -> None: ...

    def on_backward_begin(self) -> None: ...

    def on_backward_end(self) -> None: ...

    def on_optimizer_step_begin(self) -> None: ...

    def on_optimizer_step_end(self) -> None: ...

    def on_step_end(self, step: int) -> None: ...

    def records(self) -> dict:
        """What was measured, as JSON-serialisable data for ``report.profilers[section]``."""
        return {}

    def close(self) -> None:
        """Stop threads, remove hooks, flush files."""
