"""Timing one ``generate`` call token by token, the same way for every implementation.

``start()`` marks the call's start, ``tick()`` each new token once it is chosen (for transformers'
``generate``, a stopping criterion calls it: it runs after every token). From the marks:

- ``prefill_ms``: start to the first new token (the prompt's forward and the first choice);
- ``per_token_ms``: the gaps between consecutive new tokens (one decode step and its choice each);
- ``total_ms``: start to the last token.

On CUDA the marks are events recorded on the current stream (no synchronisation per token; the
times are read once, in :meth:`TokenClock.result`, after the last event completes). On a CPU the
work is synchronous and the host clock is read at each mark.
"""

from __future__ import annotations

import time

import torch


class TokenClock:
    """Marks of one generation (see the module docstring); reusable: ``start()`` resets it."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._marks: list = []

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [self._mark()]

    def tick(self) -> None:
        if not self._marks:
            raise RuntimeError("TokenClock.tick() before start()")
        self._marks.append(self._mark())

    @property
    def tokens(self) -> int:
        return max(len(self._marks) - 1, 0)

    def result(self) -> dict:
        """``{"prefill_ms", "per_token_ms": [...], "total_ms", "new_tokens"}``; ValueError when no
        token was marked."""
        if len(self._marks) < 2:
            raise ValueError("no token was timed: call start() and then tick() after each new token")
        if self.cuda:
            self._marks[-1].synchronize()
            gaps = [a.elapsed_time(b) for a, b in zip(self._marks, self._marks[1:])]
        else:
            gaps = [(b - a) * 1e3 for a, b in zip(self._marks, self._marks[1:])]
        return {"prefill_ms": gaps[0], "per_token_ms": gaps[1:], "total_ms": sum(gaps), "new_tokens": len(gaps)}
