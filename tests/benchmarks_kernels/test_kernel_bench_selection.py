"""Selecting kernel benchmarks with ``-k``: on a GPU the ids name each case (``adamw_step_...``),
and a module's name still selects its cases. The GPU is stood in for at collection: a plugin
loaded before the folder's conftest reports CUDA and gives each ``bench_<op>.py`` two made-up
cases, so nothing is built or run."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("pytest_benchmark")

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]
KERNEL_BENCHMARKS = REPO / "benchmarks" / "kernels"

STAND_IN_GPU = f'''
import sys
import torch
sys.path.insert(0, {str(KERNEL_BENCHMARKS)!r})
import common

torch.cuda.is_available = lambda: True
OPS = {{"fused_adam": "adamw step", "llama_ops": "rms_norm forward", "cross_entropy": "cross_entropy forward",
        "linear_cross_entropy": "linear_cross_entropy forward"}}

def op_cases(op, device):
    name = OPS.get(op, op + " forward")
    return [common.Case(op=name, shape=shape, dslab=None, torch=None) for shape in ("8x8 bf16", "16x16 bf16")]

common.op_cases = op_cases
'''


def _collected(pytester, expression: str) -> list[str]:
    pytester.makepyfile(stand_in_gpu=STAND_IN_GPU)
    result = pytester.runpytest_subprocess(
        "-p", "stand_in_gpu", str(KERNEL_BENCHMARKS), "--rootdir", str(REPO), "-c", str(REPO / "pyproject.toml"),
        "-p", "no:cacheprovider", "-p", "no:xdist", "-m", "gpu", "-k", expression, "--collect-only", "-q",
        "--import-mode=prepend",
    )
    assert result.ret in (0, 5), result.stdout.str() + result.stderr.str()
    return sorted(line.split("[", 1)[1].rstrip("]") for line in result.stdout.lines if "::test_kernel[" in line)


@pytest.fixture
def on_path(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(pytester.path) + ":" + ":".join(p for p in sys.path if p))
    return pytester


def test_a_modules_name_selects_its_cases_whose_ids_name_the_op(on_path):
    assert _collected(on_path, "fused_adam") == ["adamw_step_16x16_bf16-dslab", "adamw_step_16x16_bf16-torch",
                                                 "adamw_step_8x8_bf16-dslab", "adamw_step_8x8_bf16-torch"]
    assert _collected(on_path, "llama_ops and 8x8") == ["rms_norm_forward_8x8_bf16-dslab",
                                                        "rms_norm_forward_8x8_bf16-torch"]


def test_case_names_still_select_and_a_modules_name_can_be_excluded(on_path):
    assert _collected(on_path, "adamw and dslab") == ["adamw_step_16x16_bf16-dslab", "adamw_step_8x8_bf16-dslab"]
    assert _collected(on_path, "cross_entropy and not linear and 8x8") == ["cross_entropy_forward_8x8_bf16-dslab",
                                                                          "cross_entropy_forward_8x8_bf16-torch"]
