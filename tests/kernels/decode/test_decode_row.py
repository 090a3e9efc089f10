"""decode_linear's persistent one-row kernel (:mod:`dslab.kernels.decode.decode_row_triton`) under
the Triton interpreter: against the tile-per-program kernel at one row (``ROW_KERNEL = False``),
which sums the same products in the same order (elementwise over the K blocks, one reduction a
tile), so every prologue and epilogue must agree bit for bit; and against the reference. The
interpreter's plan gives 2 programs over 5 or more tiles, so each program streams several tiles
(the next one requested while the current one is reduced), and K of 70 spans 3 blocks of 32 (K of
29 fits one: the prologue runs once a program). Then the launch plan on a GPU's figures."""

from __future__ import annotations

import importlib

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.kernels.decode import decode_row_triton as row
from dslab.kernels.decode.decode_linear import decode_linear, decode_linear_reference
from dslab.kernels.dispatch import interpreting
from dslab.kernels.quant.int8_linear import quantize_int8

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="the Triton interpreter runs on CPU (TRITON_INTERPRET=1)")
linear_module = importlib.import_module("dslab.kernels.decode.decode_linear")  # the package attribute is the function

N = 77  # 5 tiles of the interpreter's 16 rows: no split K in the tile kernel, 2-3 tiles a row-kernel program


def _kernels(monkeypatch, make):
    """``make()``'s outputs from the row kernel and from the tile kernel, each on fresh buffers."""
    outputs = {}
    for row_kernel in (True, False):
        monkeypatch.setattr(linear_module, "ROW_KERNEL", row_kernel)
        with kernel_backend("triton"):
            outputs[row_kernel] = make()
    return outputs[True], outputs[False]


def _equal(got, want):
    for a, b in zip(got, want):
        assert torch.equal(a, b), (a - b).abs().max()


@needs_interpreter
@pytest.mark.parametrize("k", [29, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_kind", ["rms", "layer", None])
def test_prologues_match_the_tile_kernel_bit_for_bit(monkeypatch, k, dtype, norm_kind):
    g = torch.Generator().manual_seed(k + len(str(norm_kind)))
    x, residual = torch.randn(1, k, generator=g).to(dtype), torch.randn(1, k, generator=g).to(dtype)
    weight = (torch.randn(N, k, generator=g) / k ** 0.5).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    gamma, beta = 1 + 0.1 * torch.randn(k, generator=g).to(dtype), torch.randn(k, generator=g).to(dtype)
    norms = {"rms": dict(rms_norm=(gamma, 1e-5)), "layer": dict(norm=(gamma, beta, 1e-5)), None: {}}[norm_kind]
    call = dict(x=x, weight=weight, bias=bias, residual=residual, return_sum=True, activation="gelu", **norms)
    got, want = _kernels(monkeypatch, lambda: decode_linear(**call))
    _equal(got, want)
    reference = decode_linear_reference(**call)
    assert torch.equal(got[1], reference[1])  # the residual stream, stored by the program of tile 0
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[0].float(), reference[0].float(), **tolerance)


@needs_interpreter
@pytest.mark.parametrize("k", [29, 70])
def test_swiglu_pairs_and_int8_weights_match(monkeypatch, k):
    g = torch.Generator().manual_seed(40 + k)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    gate_up = (torch.randn(2 * N, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    gamma = 1 + 0.1 * torch.randn(k, generator=g).to(torch.bfloat16)
    call = dict(x=x, weight=gate_up, rms_norm=(gamma, 1e-5), activation="swiglu")
    got, want = _kernels(monkeypatch, lambda: decode_linear(**call))
    assert got.shape == (1, N) and torch.equal(got, want)
    torch.testing.assert_close(got.float(), decode_linear_reference(**call).float(), rtol=2e-2, atol=2e-2)
    qweight, scale = quantize_int8(torch.randn(N, k, generator=g))
    call = dict(x=x.float(), weight=qweight, scale=scale, bias=torch.randn(N, generator=g))
    got, want = _kernels(monkeypatch, lambda: decode_linear(**call))
    assert torch.equal(got, want)
    torch.testing.assert_close(got, decode_linear_reference(**call), rtol=1e-5, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("rope", [True, False])
def test_rotary_gqa_and_gathered_rows_write_the_same_cache(monkeypatch, rope):
    """Llama's QKV (8 q heads, 2 kv heads of 8, rope pairs) with RMSNorm in front, and an embedding
    lookup for x: q, the caches and the residual stream equal the tile kernel's."""
    heads, kv_heads, head_dim, vocab, max_seq = 8, 2, 8, 50, 12
    hidden = heads * head_dim
    g = torch.Generator().manual_seed(3 + rope)
    table = torch.randn(vocab, hidden, generator=g)
    weight = torch.randn((heads + 2 * kv_heads) * head_dim, hidden, generator=g) / hidden ** 0.5
    gamma = 1 + 0.1 * torch.randn(hidden, generator=g)
    token, write_pos = torch.tensor([17]), torch.tensor([9])
    angles = write_pos[:, None].float() * torch.rand(head_dim // 2, generator=g)
    tables = (angles.cos(), angles.sin()) if rope else None

    def make():
        q = torch.full((1, hidden), float("nan"))
        keys, values = torch.zeros(2, kv_heads, max_seq, head_dim), torch.zeros(2, kv_heads, max_seq, head_dim)
        _, a = decode_linear(table, weight, x_rows=token, rms_norm=(gamma, 1e-6), return_sum=True,
                             kv=(q, keys, values, write_pos, head_dim, tables))
        return q, keys, values, a

    got, want = _kernels(monkeypatch, make)
    _equal(got, want)
    assert not got[0].isnan().any() and got[1][0, :, 9].abs().sum() > 0
    torch.testing.assert_close(got[3], table[17:18])


def test_plan_streams_whole_rows_in_strided_tiles():
    # Llama-3.2-1B's projections on 132 SMs, whole rows of K a block
    # programs as many as the SMs hold (known once compiled: the plan's grid is the bound of 32 an SM)
    qkv = row.plan(False, 3072, 2048, 132, False, True)  # rotary QKV: 1 rope pair (2 rows) a tile
    assert qkv["constexprs"] == dict(BLOCK_N=1, BLOCK_K=2048, SINGLE_BLOCK=True) and qkv["tiles"] == 1536
    assert qkv["per_sm"] == row.RESIDENT and qkv["options"] == dict(num_warps=4, num_stages=1)
    o_proj = row.plan(False, 2048, 2048, 132, False, False)
    assert o_proj["constexprs"]["BLOCK_N"] == 4 and o_proj["grid"] == (512,)  # 512 tiles: one each
    gate_up = row.plan(False, 16384, 2048, 132, False, True)  # SwiGLU: 1 pair (2 rows) a tile
    assert gate_up["constexprs"]["BLOCK_N"] == 1 and gate_up["tiles"] == 8192 and gate_up["per_sm"] == row.RESIDENT
    assert gate_up["options"]["num_warps"] == 4
    down = row.plan(False, 2048, 8192, 132, False, False)
    assert down["constexprs"] == dict(BLOCK_N=2, BLOCK_K=8192, SINGLE_BLOCK=True) and down["tiles"] == 1024
    assert down["per_sm"] == row.RESIDENT and down["options"]["num_warps"] == 8
    wide = row.plan(False, 4096, 14336, 132, True, False)  # K past 8192: blocks of 8192
    assert wide["constexprs"] == dict(BLOCK_N=2, BLOCK_K=8192, SINGLE_BLOCK=False)
    with row.forced_row_config((8, 0, 4, 2)):
        forced = row.plan(False, 128256, 2048, 132, False, False)
    assert forced["grid"] == (264,) and forced["constexprs"]["BLOCK_N"] == 8 and forced["options"]["num_warps"] == 4
    small = row.plan(True, 45, 70, 132, False, False)  # the interpreter's blocks and 2 programs
    assert small["grid"] == (2,) and small["constexprs"] == dict(BLOCK_N=16, BLOCK_K=32, SINGLE_BLOCK=False)


def test_resident_programs_follow_registers_threads_and_shared_memory():
    # registers go a warp at a time in units of 256: 176 a thread of 8 warps is 5632 a warp, 11 warps of 65536
    assert row.resident_per_sm(176, 8, 0) == 1
    assert row.resident_per_sm(102, 8, 0) == 2  # 3328 a warp: 19 warps
    assert row.resident_per_sm(64, 8, 0) == 4
    assert row.resident_per_sm(32, 4, 0) == 16  # threads bound it as well: 2048 / 128
    assert row.resident_per_sm(32, 1, 0) == 32  # at most 32 blocks an SM
    assert row.resident_per_sm(40, 4, 100 * 1024) == 2  # shared memory: 1 KB reserved a block
    assert row.resident_per_sm(255, 32, 0) == 1  # never fewer than one


def test_a_resident_configuration_plans_its_programs_at_launch():
    with row.forced_row_config((2, 0, 8, row.RESIDENT)):
        shape = row.plan(False, 16384, 2048, 132, False, True)
    assert shape["per_sm"] == row.RESIDENT and shape["tiles"] == 8192
    assert shape["grid"] == (32 * 132,)  # an upper bound until the compiled kernel's registers are known
