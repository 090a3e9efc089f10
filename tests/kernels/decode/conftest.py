"""Fixtures of the decode kernels' tests."""

from __future__ import annotations

import importlib

import pytest


class PrologueLaunches:
    """Where the fixture put a launch's norm, and the prologue kernel's launches (their rows)."""

    def __init__(self, where: str):
        self.where = where
        self.launches: list[int] = []

    def check(self, rows: int) -> None:
        """One prologue launch over ``rows`` when the norm has its own kernel and rows > 1, else none."""
        assert self.launches == ([rows] if self.where == "own kernel" and rows > 1 else []), self.launches


@pytest.fixture(params=["own kernel", "in the linear"])
def prologue(request, monkeypatch):
    """Where a launch of several rows computes its norm: in a kernel of its own first (the
    default from PROLOGUE_KERNEL_MIN_ROWS rows) or in every program's prologue."""
    module = importlib.import_module("dslab.kernels.decode.decode_linear")  # the package attribute is the function
    from dslab.kernels.decode import decode_prologue_triton

    if request.param == "in the linear":
        monkeypatch.setattr(module, "PROLOGUE_KERNEL_MIN_ROWS", module.MAX_ROWS + 1)
    seen, launch = PrologueLaunches(request.param), decode_prologue_triton.launch
    monkeypatch.setattr(decode_prologue_triton, "launch",
                        lambda interpret, m, *args: (seen.launches.append(m), launch(interpret, m, *args)))
    return seen
