"""decode_linear's Llama-layout additions: the RMSNorm prologue, the SwiGLU epilogue (stacked
[gate; up] weight, output of width I) and the grouped-query QKV epilogue with rotary positions
(q heads, then k heads, then v heads; q and k rotated rotate-half style, k and v scattered into
caches of the key/value heads), with weights in the activations' dtype and int8.

The reference is first held to plain PyTorch written out here (RMSNorm, silu(gate) * up, the
rotate-half formula, indexing into the caches); then the Triton kernel (TRITON_INTERPRET=1 on a
CPU) to the reference on fresh random inputs at small odd shapes, on the batch-1 path and the
tensor-core path (5 or 11 rows: one 16-row tile), with K split across programs where the column tiles
are few. fp32 agrees within 1e-5. In bf16 both round differently (the kernel applies bias, SwiGLU
and rope to its fp32 accumulator and rounds once, the reference rounds after each op): both are
measured against the reference computed in fp32 from the same inputs, and the kernel's error may
be at most twice the reference's own."""

from __future__ import annotations

import importlib

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.kernels.decode.decode_linear import decode_linear, decode_linear_reference
from dslab.kernels.dispatch import interpreting
from dslab.kernels.quant.int8_linear import quantize_int8

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="the Triton interpreter runs on CPU (TRITON_INTERPRET=1)")

K = 70  # three K blocks of the interpreter's 32, the last ragged
EPS = 1e-5
# Grouped-query attention: 4 query heads over 2 key/value heads of 12 (6 rotary pairs a head, so
# the interpreter's 8-pair column tiles straddle heads and the q/k/v boundaries).
HEADS, KV_HEADS, HEAD_DIM, BATCH, MAX_SEQ = 4, 2, 12, 11, 13  # 11 rows: the tensor-core path
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM


def _weight(n, k, g, dtype, kind):
    w = torch.randn(n, k, generator=g) / k ** 0.5
    if kind == "int8":
        qweight, scale = quantize_int8(w)
        return dict(weight=qweight, scale=scale)
    return dict(weight=w.to(dtype))


def _in_fp32(kwargs):
    """The call's 16-bit tensors (nested in tuples too) in fp32; int8 weights and indices stay."""
    def cast(value):
        if isinstance(value, tuple):
            return tuple(cast(v) for v in value)
        if isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16):
            return value.float()
        return value
    return {key: cast(value) for key, value in kwargs.items()}


def _assert_matches(got, want, exact, dtype):
    """fp32: within 1e-5 of the reference; bf16: within twice the reference's error against the
    fp32 computation."""
    got, want = got.float(), want.float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    got_err = (got - exact).abs().max().item()
    want_err = (want - exact).abs().max().item()
    assert 0 < want_err and got_err <= 2 * want_err, (got_err, want_err)


def _rope_tables(rows, g):
    """fp32 [rows, HEAD_DIM / 2] tables of positions up to 50 (angles of several turns)."""
    inv_freq = 1.0 / 100.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    angle = torch.randint(0, 50, (rows, 1), generator=g).float() * inv_freq
    return angle.cos(), angle.sin()


def _caches(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (BATCH, KV_HEADS, MAX_SEQ, HEAD_DIM)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


# --- the reference against plain PyTorch -------------------------------------------------------


def test_reference_rms_norm_and_swiglu_are_the_plain_ops():
    g = torch.Generator().manual_seed(1)
    rows, inner = 3, 9
    x, residual = torch.randn(rows, K, generator=g), torch.randn(rows, K, generator=g)
    norm_weight = 0.5 + torch.rand(K, generator=g)
    weight, bias = torch.randn(2 * inner, K, generator=g), torch.randn(2 * inner, generator=g)
    y, a = decode_linear_reference(x, weight, bias, residual=residual, rms_norm=(norm_weight, EPS),
                                   activation="swiglu", return_sum=True)
    a_plain = x + residual
    h_plain = a_plain * torch.rsqrt(a_plain.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight
    gate_up = h_plain @ weight.T + bias
    gate, up = gate_up[:, :inner], gate_up[:, inner:]
    assert torch.equal(a, a_plain)
    torch.testing.assert_close(y, gate * torch.sigmoid(gate) * up, rtol=1e-6, atol=1e-6)


def test_reference_rotary_gqa_kv_is_rotate_half_and_a_scatter():
    g = torch.Generator().manual_seed(2)
    rows, hidden = 3, 40
    x = torch.randn(rows, hidden, generator=g)
    weight, bias = torch.randn(QKV, hidden, generator=g), torch.randn(QKV, generator=g)
    cos, sin = _rope_tables(rows, g)
    write_pos = torch.tensor([4, 0, 10])
    keys, values = _caches(torch.float32, 3)
    keys_before, values_before = keys.clone(), values.clone()
    q = torch.empty(rows, HEADS * HEAD_DIM)
    out = decode_linear_reference(x, weight, bias, kv=(q, keys, values, write_pos, HEAD_DIM, (cos, sin)))
    assert out is q
    qkv = x @ weight.T + bias
    half = HEAD_DIM // 2

    def rotate(t, heads):  # [rows, heads * D]: columns j and j + D/2 of each head turn together
        t = t.view(rows, heads, HEAD_DIM)
        t1, t2 = t[..., :half], t[..., half:]
        c, s = cos[:, None], sin[:, None]
        return torch.cat([t1 * c - t2 * s, t2 * c + t1 * s], dim=-1)

    q_plain = rotate(qkv[:, :HEADS * HEAD_DIM], HEADS).reshape(rows, -1)
    k_plain = rotate(qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM], KV_HEADS)
    v_plain = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(rows, KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(q, q_plain, rtol=1e-5, atol=1e-5)
    for row in range(rows):
        keys_before[row, :, write_pos[row]] = k_plain[row]
        values_before[row, :, write_pos[row]] = v_plain[row]
    torch.testing.assert_close(keys, keys_before, rtol=1e-5, atol=1e-5)  # the new entries, nothing else
    torch.testing.assert_close(values, values_before, rtol=1e-5, atol=1e-5)


# --- the kernel against the reference ----------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("rows", [1, 5, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [K, 29])
def test_rms_norm_prologue(rows, dtype, k, prologue):
    """K = 70 takes the statistics pass over K blocks; K = 29 fits one block (its statistics from
    the tile in registers). The residual stream is exactly the rounded sum."""
    g = torch.Generator().manual_seed(rows + k + len(str(dtype)))
    n = 37
    call = dict(x=torch.randn(rows, k, generator=g).to(dtype) + 2, residual=torch.randn(rows, k, generator=g).to(dtype),
                rms_norm=((0.5 + torch.rand(k, generator=g)).to(dtype), EPS), return_sum=True,
                **_weight(n, k, g, dtype, "dtype"))
    with kernel_backend("triton"):
        y, a = decode_linear(**call)
    prologue.check(rows)
    y_ref, a_ref = decode_linear_reference(**call)
    assert torch.equal(a, a_ref)
    _assert_matches(y, y_ref, decode_linear_reference(**_in_fp32(call))[0], dtype)


@needs_interpreter
@pytest.mark.parametrize("rows", [1, 5, 11])
@pytest.mark.parametrize("dtype,kind", [(torch.float32, "dtype"), (torch.bfloat16, "dtype"),
                                        (torch.bfloat16, "int8"), (torch.float32, "int8")])
def test_swiglu_epilogue(rows, dtype, kind):
    """I = 20: 3 column tiles of 8 pairs at batch 1 (2 of 16 at 5 rows) for the interpreter's 4
    wanted programs, so K splits in two and the last split adds both rows' partials of each pair."""
    module = importlib.import_module("dslab.kernels.decode.decode_linear")  # the package attribute is the function
    inner = 20
    g = torch.Generator().manual_seed(40 + rows + len(kind))
    call = dict(x=torch.randn(rows, K, generator=g).to(dtype), residual=torch.randn(rows, K, generator=g).to(dtype),
                rms_norm=((0.5 + torch.rand(K, generator=g)).to(dtype), EPS), activation="swiglu", return_sum=True,
                bias=torch.randn(2 * inner, generator=g).to(dtype), **_weight(2 * inner, K, g, dtype, kind))
    with kernel_backend("triton"):
        y, a = decode_linear(**call)
    y_ref, a_ref = decode_linear_reference(**call)
    assert y.shape == (rows, inner) and torch.equal(a, a_ref)
    _assert_matches(y, y_ref, decode_linear_reference(**_in_fp32(call))[0], dtype)
    assert not module._counters(y.device).any()


def _rotary_call(rows, dtype, kind, seed, rope=True):
    g = torch.Generator().manual_seed(seed)
    hidden = 40
    write_pos = torch.randperm(MAX_SEQ, generator=g)[:rows]
    return dict(x=torch.randn(rows, hidden, generator=g).to(dtype),
                residual=torch.randn(rows, hidden, generator=g).to(dtype),
                rms_norm=((0.5 + torch.rand(hidden, generator=g)).to(dtype), EPS),
                bias=torch.randn(QKV, generator=g).to(dtype), **_weight(QKV, hidden, g, dtype, kind)), \
        (write_pos, _rope_tables(rows, g) if rope else None)


def _run_rotary(call, write_pos, rope, dtype, backend):
    """(q, keys, values) after the call on fresh copies of the same caches."""
    keys, values = _caches(dtype, 7)
    rows = call["x"].shape[0]
    q = torch.full((rows, HEADS * HEAD_DIM), float("nan"), dtype=dtype)
    kv = (q, keys, values, write_pos, HEAD_DIM, rope)
    if backend is None:
        out = decode_linear_reference(**call, kv=kv)
    else:
        with kernel_backend(backend):
            out = decode_linear(**call, kv=kv)
    assert out is q
    return q, keys, values


@needs_interpreter
@pytest.mark.parametrize("rows", [1, 5, 11])
@pytest.mark.parametrize("dtype,kind", [(torch.float32, "dtype"), (torch.bfloat16, "dtype"),
                                        (torch.bfloat16, "int8")])
def test_rotary_gqa_kv_epilogue(rows, dtype, kind):
    call, (write_pos, rope) = _rotary_call(rows, dtype, kind, 60 + rows + len(kind))
    got = _run_rotary(call, write_pos, rope, dtype, "triton")
    want = _run_rotary(call, write_pos, rope, dtype, None)
    exact = _run_rotary(_in_fp32(call), write_pos, rope, torch.float32, None)
    written = torch.zeros(BATCH, MAX_SEQ, dtype=torch.bool)
    written[torch.arange(rows), write_pos] = True

    def new_values(q, keys, values):  # q, and the cache entries at each row's write_pos
        return q, keys.transpose(1, 2)[written], values.transpose(1, 2)[written]

    for got_part, want_part, exact_part in zip(*(new_values(*out) for out in (got, want, exact))):
        _assert_matches(got_part, want_part, exact_part, dtype)
    for got_cache, want_cache in zip(got[1:], want[1:]):  # nothing else written
        assert torch.equal(got_cache.transpose(1, 2)[~written], want_cache.transpose(1, 2)[~written])


@needs_interpreter
def test_grouped_kv_without_rope_and_int8_with_fp32_activations():
    """``rope=None`` stores q, k and v of the grouped layout unrotated; int8 weights with fp32
    activations convert exactly, so the rotary epilogue holds fp32's tolerance."""
    call, (write_pos, _) = _rotary_call(1, torch.float32, "dtype", 81, rope=False)
    for got, want in zip(_run_rotary(call, write_pos, None, torch.float32, "triton"),
                         _run_rotary(call, write_pos, None, torch.float32, None)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    call, (write_pos, rope) = _rotary_call(1, torch.float32, "int8", 82)
    for got, want in zip(_run_rotary(call, write_pos, rope, torch.float32, "triton"),
                         _run_rotary(call, write_pos, rope, torch.float32, None)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_arguments_name_the_problem():
    x, w = torch.randn(2, 8), torch.randn(6, 8)
    norm = (torch.ones(8), torch.zeros(8), EPS)
    with pytest.raises(ValueError, match="norm \\(LayerNorm\\) and rms_norm are exclusive"):
        decode_linear(x, w, norm=norm, rms_norm=(torch.ones(8), EPS))
    with pytest.raises(ValueError, match="rms_norm must be \\(weight \\[8\\], eps\\)"):
        decode_linear(x, w, rms_norm=(torch.ones(7), EPS))
    with pytest.raises(ValueError, match="swiglu' needs the stacked \\[gate; up\\] weight"):
        decode_linear(x, torch.randn(5, 8), activation="swiglu")
    q, caches = torch.empty(2, 2 * 4), torch.empty(2, 1, 5, 4)
    with pytest.raises(ValueError, match="N = 6 must be \\(heads \\+ 2 \\* kv_heads\\) \\* head_dim = 8 \\+ 2 \\* 1"):
        decode_linear(x, w, kv=(q, caches, caches, torch.zeros(2, dtype=torch.long), 4, None))
    w = torch.randn(16, 8)
    with pytest.raises(ValueError, match="swiglu' and kv are exclusive"):
        decode_linear(x, w, activation="swiglu", kv=(q, caches, caches, torch.zeros(2, dtype=torch.long), 4, None))
    with pytest.raises(ValueError, match="rope's cos must be fp32 \\[2, 2\\]"):
        decode_linear(x, w, kv=(q, caches, caches, torch.zeros(2, dtype=torch.long), 4,
                                (torch.ones(2, 4), torch.zeros(2, 2))))
