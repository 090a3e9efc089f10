"""Programmatic dependent launch of the decode kernels, on a CPU: when it is asked for and when it
is refused (never on a CPU, under the interpreter, or before Hopper; by default one-row launches
only), that a dependent launch of decode_linear's two kernels and of decode attention passes
``launch_pdl`` with the kernels' ``USE_GDC`` and an ordinary one passes neither. The kernels
with ``USE_GDC`` off are the ones the interpreter tests of this folder check against the
reference; whether dependent launches give the same results on a GPU is
tests/inference/test_dependent_launch_gpu.py's."""

from __future__ import annotations

import pytest
import torch

import dslab.kernels.decode.decode_attention_triton as attention_triton
import dslab.kernels.decode.decode_linear_triton as linear_triton
import dslab.kernels.decode.decode_row_triton as row_triton
from dslab.kernels import dispatch
from dslab.kernels.dispatch import dependent_launch, dependent_launches, set_dependent_launch


def test_asked_for_by_the_variable_the_setter_or_the_block(monkeypatch):
    monkeypatch.setattr(dispatch, "_dependent_override", None)
    monkeypatch.delenv(dispatch.DEPENDENT_LAUNCH_ENV, raising=False)
    # the default, auto: one-row launches only
    assert dispatch._dependent_launch_wanted(1)
    assert not dispatch._dependent_launch_wanted(8) and not dispatch._dependent_launch_wanted()
    monkeypatch.setenv(dispatch.DEPENDENT_LAUNCH_ENV, "1")
    assert dispatch._dependent_launch_wanted() and dispatch._dependent_launch_wanted(8)
    with dependent_launches(False):
        assert not dispatch._dependent_launch_wanted(1)
    with dependent_launches("auto"):
        assert dispatch._dependent_launch_wanted(1) and not dispatch._dependent_launch_wanted(3)
    assert dispatch._dependent_launch_wanted(3)
    set_dependent_launch(False)
    assert not dispatch._dependent_launch_wanted(1)
    set_dependent_launch(None)
    monkeypatch.setenv(dispatch.DEPENDENT_LAUNCH_ENV, "0")
    assert not dispatch._dependent_launch_wanted(1)
    monkeypatch.setenv(dispatch.DEPENDENT_LAUNCH_ENV, "yes")
    with pytest.raises(ValueError, match="DSLAB_DEPENDENT_LAUNCH='yes'.*auto"):
        dispatch._dependent_launch_wanted(1)
    with pytest.raises(ValueError, match="give True, False, 'auto' or None, got 'on'"):
        set_dependent_launch("on")


def test_auto_makes_one_row_launches_dependent_on_a_hopper(monkeypatch):
    monkeypatch.setattr(dispatch, "_dependent_override", None)
    monkeypatch.delenv(dispatch.DEPENDENT_LAUNCH_ENV, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(dispatch, "_dependent_supported", {0: True})
    assert dependent_launch(torch.device("cuda", 0), 1)
    assert not dependent_launch(torch.device("cuda", 0), 8)
    assert not dependent_launch(torch.device("cpu"), 1)


def test_never_on_a_cpu_or_under_the_interpreter_or_before_hopper(monkeypatch):
    with dependent_launches(True):
        assert not dependent_launch(torch.device("cpu"))
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not dependent_launch(torch.device("cuda", 0))
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        monkeypatch.setattr(dispatch, "_dependent_supported", {})
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
        assert not dependent_launch(torch.device("cuda", 0))  # an A100 has no dependent launch
        monkeypatch.setattr(dispatch, "_dependent_supported", {})
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
        from triton.language.extra import cuda as triton_cuda

        assert dependent_launch(torch.device("cuda", 0)) == hasattr(triton_cuda, "gdc_wait")
    assert not dependent_launch(torch.device("cuda", 0))  # the block is over: off again


class Recorded:
    """A kernel stand-in: records each launch's grid and keyword arguments."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
        return launch


@pytest.mark.parametrize("dependent", [False, True])
def test_decode_linear_launch_passes_the_dependent_launch(monkeypatch, dependent):
    kernel = Recorded()
    monkeypatch.setattr(linear_triton, "_decode_linear_kernel", kernel)
    meta = dict(PAIRED=False, INT8=False, HAS_NORM=True)
    linear_triton.launch(1, False, 1, 2048, 2048, 264, (), meta, dependent)
    (grid, kwargs), = kernel.launches
    assert kwargs.get("launch_pdl", False) is dependent and kwargs.get("USE_GDC", False) is dependent
    assert kwargs["num_warps"] == 4 and grid[0] == 1024
    kernel.launches.clear()
    linear_triton.launch(1, True, 1, 64, 64, 8, (), meta, dependent)  # the interpreter: never
    (_, kwargs), = kernel.launches
    assert "launch_pdl" not in kwargs and "USE_GDC" not in kwargs


@pytest.mark.parametrize("dependent", [False, True])
def test_row_kernel_launch_passes_the_dependent_launch(monkeypatch, dependent):
    kernel = Recorded()
    monkeypatch.setattr(row_triton, "_decode_row_kernel", kernel)
    meta = dict(PAIRED=False, INT8=False, HAS_NORM=True)
    row_triton.launch(False, 2048, 2048, 132, (), meta, dependent)
    (grid, kwargs), = kernel.launches
    assert kwargs.get("launch_pdl", False) is dependent and kwargs.get("USE_GDC", False) is dependent
    assert kwargs["num_warps"] == 8 and grid == (512,)  # 512 tiles of 4 rows, under 4 programs an SM
    kernel.launches.clear()
    row_triton.launch(True, 64, 64, 8, (), meta, dependent)  # the interpreter: never
    (_, kwargs), = kernel.launches
    assert "launch_pdl" not in kwargs and "USE_GDC" not in kwargs


@pytest.mark.parametrize("dependent", [False, True])
def test_decode_attention_launches_pass_the_dependent_launch(monkeypatch, dependent):
    split, combine = Recorded(), Recorded()
    monkeypatch.setattr(attention_triton, "_decode_split_kernel", split)
    monkeypatch.setattr(attention_triton, "_decode_combine_kernel", combine)
    monkeypatch.setattr(attention_triton, "dependent_launch", lambda device, rows=None: dependent)
    q = torch.zeros(1, 4, 32)
    cache = torch.zeros(1, 2, 64, 32)
    bounds = torch.zeros(1, dtype=torch.int32)
    attention_triton.decode_attention(q, cache, cache, bounds, bounds + 5, 0.1, splits=2, block_n=16, combine="kernel")
    for kernel in (split, combine):
        (_, kwargs), = kernel.launches
        assert kwargs.get("launch_pdl", False) is dependent and kwargs.get("USE_GDC", False) is dependent
    split.launches.clear()
    attention_triton.decode_attention(q, cache, cache, bounds, bounds + 5, 0.1, splits=2, block_n=16)  # fused
    (_, kwargs), = split.launches
    assert kwargs["FUSED_COMBINE"] and kwargs.get("launch_pdl", False) is dependent and len(combine.launches) == 1
