"""step_tables (a rotary decode step's valid ends and rotary tables, one launch) under the Triton
interpreter against its op-by-op reference on fresh random positions (rows at different
positions, left padding, long-context angles, an odd half width), and its input checks."""

from __future__ import annotations

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.kernels.decode.step_tables import step_tables, step_tables_reference
from dslab.kernels.dispatch import interpreting

needs_interpreter = pytest.mark.skipif(not interpreting(),
                                       reason="the Triton interpreter runs on CPU (TRITON_INTERPRET=1)")


@needs_interpreter
@pytest.mark.parametrize("rows, half", [(1, 32), (5, 24), (3, 7)])
def test_step_tables_match_the_reference(rows, half):
    g = torch.Generator().manual_seed(rows * 100 + half)
    write_pos = torch.randint(0, 130_000, (rows,), generator=g)
    valid_start = torch.randint(0, 9, (rows,), generator=g, dtype=torch.int64).to(torch.int32)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 2 * half, 2).float() / (2 * half)))
    inv_freq = inv_freq * (1 + 0.01 * torch.rand(half, generator=g))
    with kernel_backend("triton"):
        valid_end, cos, sin = step_tables(write_pos, valid_start, inv_freq)
    want_end, want_cos, want_sin = step_tables_reference(write_pos, valid_start, inv_freq)
    assert valid_end.dtype == torch.int32 and torch.equal(valid_end, want_end)
    assert cos.shape == (rows, half) and cos.dtype == torch.float32
    # the same fp32 angles; cos and sin within an ulp or two of the reference's
    torch.testing.assert_close(cos, want_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, want_sin, atol=1e-6, rtol=0)
    assert (want_cos.abs() < 0.5).any()  # angles spread over the circle, not all near zero


def test_bad_inputs_name_the_problem():
    inv_freq = torch.ones(4)
    with pytest.raises(ValueError, match="write_pos and valid_start"):
        step_tables(torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32), inv_freq)
    with pytest.raises(ValueError, match="integers"):
        step_tables(torch.zeros(2), torch.zeros(2, dtype=torch.int32), inv_freq)
    with pytest.raises(ValueError, match="inv_freq"):
        step_tables(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32), inv_freq.double())


PTX = '''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dslab.kernels.decode.step_tables import _step_tables_kernel
signature = {"WRITE_POS": "*i64", "VALID_START": "*i32", "INV_FREQ": "*fp32", "VALID_END": "*i32", "COS": "*fp32",
             "SIN": "*fp32", "half": "i32", "BLOCK": "constexpr"}
compiled = triton.compile(ASTSource(fn=_step_tables_kernel, signature=signature, constexprs={(7,): 32}),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
print(compiled.asm["ptx"])
'''


def test_the_tables_use_the_accurate_cos_and_sin_on_hopper():
    """Compiled for sm_90 on this CPU (a child process without the interpreter): no approximate
    ``cos.approx``/``sin.approx`` instructions, which lose accuracy at long-context angles."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", PTX], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ptx = proc.stdout
    assert ".entry _step_tables_kernel" in ptx
    assert "cos.approx" not in ptx and "sin.approx" not in ptx


@pytest.mark.gpu
def test_step_tables_on_a_gpu_equal_pytorchs_ops():
    """On a GPU, the kernel's tables are PyTorch's bit for bit (the same fp32 angles, the same
    libdevice cosf and sinf), so the fused step's rotary epilogue sees the op-by-op step's tables."""
    g = torch.Generator().manual_seed(7)
    write_pos = torch.randint(0, 130_000, (6,), generator=g).cuda()
    valid_start = torch.randint(0, 9, (6,), generator=g).to(torch.int32).cuda()
    inv_freq = (1.0 / (500000.0 ** (torch.arange(0, 64, 2).float() / 64))).cuda()
    got = step_tables(write_pos, valid_start, inv_freq)
    want = step_tables_reference(write_pos, valid_start, inv_freq)
    for a, b in zip(got, want):
        assert torch.equal(a, b), (a.double() - b.double()).abs().max()
