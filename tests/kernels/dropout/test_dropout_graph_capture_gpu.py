"""The kernel benchmark's CUDA-graph timing (``common.graph_time_ms``) on the dropout cases, as
``run.py`` runs them: each case eagerly, captured and replayed, then eagerly again.

dslab's dropout kernels (attention with dropout, bias_dropout_residual) draw their Philox seed with
``torch.randint`` on the device, so a capture must record that draw and a replay must draw a new
seed. A capture that fails after a draw (PyTorch's side of a case may not be capturable) leaves
the CUDA generator marked as capturing; every later draw outside a capture then raised "Offset
increment outside graph capture encountered unexpectedly", which is how four dropout cases of one
``run.py`` table printed ERROR. These tests hold that dslab's side captures, that the eager calls
after any capture (failed or not) still run, and that ``graph_time_ms`` puts a failed capture's
generator back.

GPU only (``-m gpu``). They import ``benchmarks/kernels``' harness (``common``) and its case modules.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

KERNEL_BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks" / "kernels"
sys.path.insert(0, str(KERNEL_BENCHMARKS))

from common import graph_time_ms  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _dropout_cases():
    import bench_attention
    import bench_bias_dropout_residual

    attention = [c for c in bench_attention.cases("cuda") if " p0.1" in c.shape]
    return attention + bench_bias_dropout_residual.cases("cuda")


def test_every_dropout_case_runs_eagerly_after_its_captures():
    cases = _dropout_cases()
    assert len(cases) >= 5, [c.shape for c in cases]
    torch_failures = {}
    for case in cases:
        case.dslab()
        case.torch()
        failures: list[str] = []
        times = graph_time_ms(case.dslab, iters=3, failures=failures)
        assert times and not failures, (case.op, case.shape, failures)
        failures = []
        if graph_time_ms(case.torch, iters=3, failures=failures) is None:
            torch_failures[f"{case.op} {case.shape}"] = failures[0]
        case.dslab()  # eagerly after the captures: the generator is outside any capture
        case.torch()
        torch.cuda.synchronize()
    print("PyTorch sides that could not be captured:", torch_failures or "none")


def test_dslab_attention_dropout_replays_draw_new_masks():
    """A captured dslab attention with dropout draws a new mask on each replay, and the same
    sequence of masks again after ``torch.manual_seed``."""
    from dslab.kernels.attention.attention import attention

    q, k, v = (torch.ones(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    v = torch.eye(128, 64, device="cuda", dtype=torch.bfloat16).expand(2, 4, 128, 64).contiguous()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention(q, k, v, dropout_p=0.5)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention(q, k, v, dropout_p=0.5)
    masks = []
    for _ in range(2):
        torch.manual_seed(3)
        for _ in range(2):
            graph.replay()
            masks.append(out != 0)
    assert not torch.equal(masks[0], masks[1])
    assert torch.equal(masks[0], masks[2]) and torch.equal(masks[1], masks[3])
    attention(q, k, v, dropout_p=0.5)  # eagerly after the replays
    torch.cuda.synchronize()


def test_a_failed_capture_leaves_the_generator_usable():
    """A function that draws from the CUDA generator and then synchronises cannot be captured:
    ``graph_time_ms`` returns None with the reason, and draws outside a capture work afterwards."""
    def draws_then_syncs():
        seed = torch.randint(0, 2**62, (1,), device="cuda")
        return seed.item()

    failures: list[str] = []
    assert graph_time_ms(draws_then_syncs, iters=3, failures=failures) is None
    assert len(failures) == 1 and failures[0]
    torch.randint(0, 10, (4,), device="cuda")
    torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5)
    torch.cuda.synchronize()
