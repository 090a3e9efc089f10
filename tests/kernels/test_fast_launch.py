"""dslab.kernels._launch.FastJit: the specialisation key (CPU), and on a GPU the direct launches
giving Triton's own results for every wrapped kernel, over shapes that share and do not share a
key (gpu marker)."""

import os

import pytest
import torch

from dslab.kernels._launch import FastJit, specialisation


def test_specialisation_separates_what_triton_specialises_on():
    assert specialisation(1) != specialisation(17)  # == 1
    assert specialisation(32) != specialisation(48 + 1)  # multiple of 16
    assert specialisation(32) == specialisation(4096)  # sizes differing in value only share a kernel
    assert specialisation(17) == specialisation(33)
    assert specialisation(2**31 - 16) != specialisation(2**31 + 16)  # int32 against int64
    assert specialisation(2**63 + 16) != specialisation(2**62)  # uint64
    assert specialisation(True) == specialisation(False) != specialisation(1)
    assert specialisation(1e-5) == specialisation(1e-6) != specialisation(None)
    base = torch.zeros(64, dtype=torch.float32)
    assert specialisation(base) == specialisation(torch.ones(8))
    assert specialisation(base[1:]) != specialisation(base)  # a 4-byte offset breaks 16-byte alignment
    assert specialisation(base.half()) != specialisation(base)


def test_key_holds_constexprs_and_launch_options_by_value(monkeypatch):
    from dslab.kernels.norm.rms_norm_triton import _rms_norm_fwd_kernel

    fast = FastJit(_rms_norm_fwd_kernel)
    assert fast.constexpr == [False] * 13 + [True] * 4
    x = torch.zeros(4, 8)
    common = dict(HAS_RESIDUAL=False, HAS_WEIGHT=True, BLOCK_M=1, BLOCK_N=8)
    args = (x, None, x[0], x, None, x[:, 0], 4, 8, 8, 0, 8, 0, 1e-6)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the key's first part, without a GPU

    def parts(args, kwargs):
        return fast._key(args, kwargs)
    assert parts(args, common) == parts((x, None, x[0], x, None, x[:, 0], 20, 8, 8, 0, 8, 0, 1e-5), common)
    assert parts(args, common) != parts(args, {**common, "BLOCK_N": 16})
    assert parts(args, {**common, "num_warps": 4}) != parts(args, {**common, "num_warps": 8})
    assert parts(args, common) != parts((x, None, x[0], x, None, x[:, 0], 1, 8, 8, 0, 8, 0, 1e-6), common)
    with pytest.raises(TypeError, match="plain @triton.jit"):
        FastJit(object())


def test_cpu_tensors_take_tritons_path_and_keep_nothing():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter runs the kernel on CPU tensors (TRITON_INTERPRET=1)")
    from dslab.kernels.norm import rms_norm_triton

    x = torch.randn(5, 24)
    w = torch.randn(24)
    y, _, _ = rms_norm_triton.forward(x, w, None, 1e-6)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert rms_norm_triton._FAST_RMS_NORM_FWD.entries == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_direct_launches_give_tritons_results_bit_for_bit():
    """Each wrapped kernel through FastJit (first call through Triton, later ones direct) against
    the same call with the fast path off, on shapes that share a key (rows 17 and 33: same
    specialisation, other values) and shapes that do not (1 row, a multiple of 16)."""
    from dslab.kernels._launch import FastJit as Fast
    from dslab.kernels.activation import bias_gelu_triton, swiglu_triton
    from dslab.kernels.attention import rope_triton
    from dslab.kernels.norm import layer_norm_triton, rms_norm_triton

    torch.manual_seed(0)
    dev = torch.device("cuda")

    def cases(rows):
        x = torch.randn(rows, 320, device=dev, dtype=torch.bfloat16)
        r, dy = torch.randn_like(x), torch.randn_like(x)
        w, b = torch.randn(320, device=dev, dtype=torch.bfloat16), torch.randn(320, device=dev, dtype=torch.bfloat16)
        gate_up = torch.randn(rows, 2 * 320, device=dev, dtype=torch.bfloat16)
        q = torch.randn(1, rows, 4, 64, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, rows, 2, 64, device=dev, dtype=torch.bfloat16)
        cos, sin = torch.randn(rows, 32, device=dev), torch.randn(rows, 32, device=dev)
        y, h, rstd = rms_norm_triton.forward(x, w, r, 1e-6)
        out = [y, h, rstd, *rms_norm_triton.backward(dy, h, w, rstd, dy)]
        y, h, mean, rstd = layer_norm_triton.forward(x, w, b, r, 1e-5)
        out += [y, h, mean, rstd, *layer_norm_triton.backward(dy, h, w, b, mean, rstd, None)]
        out += [swiglu_triton.forward(gate_up), swiglu_triton.backward(dy, gate_up)]
        out += [*rope_triton.rotate(q, k, cos, sin, False), *rope_triton.rotate(q, None, cos, sin, True)]
        out += [bias_gelu_triton.forward(x, b, "tanh"), *bias_gelu_triton.backward(dy, x, b, "tanh")]
        return [t for t in out if t is not None]

    for rows in (17, 33, 1, 64, 17):
        torch.manual_seed(rows)
        fast = cases(rows)
        for launcher in Fast.instances:
            launcher.enabled = False
        try:
            torch.manual_seed(rows)
            slow = cases(rows)
        finally:
            for launcher in Fast.instances:
                launcher.enabled = True
        assert len(fast) == len(slow) >= 16
        for a, b in zip(fast, slow):
            assert torch.equal(a, b), rows
    assert sum(len(launcher.entries) for launcher in Fast.instances) > 0
