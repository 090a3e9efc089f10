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

A profiler's text reports (the flops profile, the comms logger's per-call lines) go through
:meth:`Profiler.write_text`: to standard output, as DeepSpeed prints them, until an output directory
is set (:meth:`Profiler.set_output_dir`, which a benchmark run does); then into a file of that
directory, and to standard output as well only with ``echo_text``.
"""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn


class Profiler:
    """Base class with no-op hooks. Subclasses override what they need."""

    #: The run report's ``profilers`` section this profiler fills.
    section: str = ""
    #: Where the profiler's files go (None: no files; text reports print to standard output).
    output_dir: Path | None = None
    #: With an output directory, whether text reports print to standard output too.
    echo_text: bool = False

    def set_output_dir(self, path: str | Path, echo_text: bool = False) -> None:
        """Write files (and text reports) under ``path`` from now on; ``echo_text`` prints the
        text reports as well."""
        self.output_dir = Path(path)
        self.echo_text = echo_text

    def text_path(self, filename: str) -> Path | None:
        """Where :meth:`write_text` puts a report named ``filename``; None when it prints it."""
        return None if self.output_dir is None else self.output_dir / filename

    def write_text(self, filename: str, text: str) -> Path | None:
        """Append ``text`` (and a newline) to ``<output_dir>/<filename>``, printing it too with
        ``echo_text``; without an output directory print it. Returns the file written, or None."""
        path = self.text_path(filename)
        if path is None or self.echo_text:
            print(text, flush=True)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(text + "\n")
        return path

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

    def one_off_steps(self) -> tuple[int, ...]:
        """The global steps this profiler instruments once (the flops profiler's counted and
        timed steps, the memory tracer's breakdown), which run slower than a steady step; not
        the steps it samples all along. A benchmark warms up through them
        (:meth:`dslab.engine.profiling.ProfilerHooks.one_off_steps_left`)."""
        return ()

    def records(self) -> dict:
        """What was measured, as JSON-serialisable data for ``report.profilers[section]``."""
        return {}

    def close(self) -> None:
        """Stop threads, remove hooks, flush files."""
