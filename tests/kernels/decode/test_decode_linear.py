"""decode_linear's Triton kernel (TRITON_INTERPRET=1 on a CPU) against its PyTorch reference on
fresh random inputs at small odd shapes: every prologue (gathered rows, residual add, layer norm),
both weight kinds (the activations' dtype, int8 with per-channel scales), both epilogues (store,
QKV scatter into a KV cache), the batch-1 path and the tensor-core path (3, 5 or 11 rows: one
16-row tile).
fp32 agrees within 1e-5; bf16 within 2 units of its rounding (the kernel sums in another order)."""

from __future__ import annotations

import pytest
import torch

from dslab.kernels import kernel_backend

from dslab.kernels.decode.decode_linear import decode_linear, decode_linear_reference
from dslab.kernels.dispatch import interpreting
from dslab.kernels.quant.int8_linear import quantize_int8

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="the Triton interpreter runs on CPU (TRITON_INTERPRET=1)")

K, N = 70, 45  # two K blocks and three N blocks of the interpreter's tiles, both ragged


def _tolerance(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def _both(**kwargs):
    with kernel_backend("torch"):
        want = decode_linear(**kwargs)
    with kernel_backend("triton"):
        got = decode_linear(**kwargs)
    return got, want


@needs_interpreter
@pytest.mark.parametrize("rows", [1, 5, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", [None, "gelu", "gelu_tanh"])
def test_norm_residual_bias_activation(rows, dtype, activation, prologue):
    g = torch.Generator().manual_seed(rows * 7 + len(str(activation)))
    x = torch.randn(rows, K, generator=g).to(dtype)
    residual = torch.randn(rows, K, generator=g).to(dtype)
    weight = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    norm = (1 + 0.1 * torch.randn(K, generator=g).to(dtype), torch.randn(K, generator=g).to(dtype), 1e-5)
    (y, a), (y_ref, a_ref) = _both(x=x, weight=weight, bias=bias, residual=residual, norm=norm,
                                   activation=activation, return_sum=True)
    prologue.check(rows)
    assert torch.equal(a, a_ref)  # the residual stream is exactly the rounded sum
    torch.testing.assert_close(y.float(), y_ref.float(), **_tolerance(dtype))


@needs_interpreter
@pytest.mark.parametrize("rows", [1, 5, 11])
def test_plain_linear_and_int8(rows):
    g = torch.Generator().manual_seed(3 + rows)
    x = torch.randn(rows, K, generator=g).to(torch.bfloat16)
    weight = torch.randn(N, K, generator=g) / K ** 0.5
    y, y_ref = _both(x=x, weight=weight.to(torch.bfloat16))
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
    qweight, scale = quantize_int8(weight)
    bias = torch.randn(N, generator=g).to(torch.bfloat16)
    y, y_ref = _both(x=x, weight=qweight, scale=scale, bias=bias)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
    # fp32 activations: the int8 weights (the extremes included) convert exactly: fp32 tolerance
    qweight[0, :] = torch.arange(-127, 128)[:K].to(torch.int8)
    qweight[1, :] = torch.arange(-127, 128)[-K:].to(torch.int8)
    y, y_ref = _both(x=x.float(), weight=qweight, scale=scale)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("rows", [1, 5, 11])
def test_gathered_rows_are_embedding_lookups(rows, prologue):
    """x = table[x_rows], residual = positions[residual_rows - offset]: GPT-2's embeddings."""
    g = torch.Generator().manual_seed(11)
    table, positions = torch.randn(30, K, generator=g), torch.randn(20, K, generator=g)
    tokens = torch.randint(0, 30, (rows,), generator=g)
    write_pos = torch.randint(5, 20, (rows,), generator=g)
    start = torch.randint(0, 5, (rows,), generator=g).to(torch.int32)
    weight = torch.randn(N, K, generator=g) / K ** 0.5
    norm = (torch.ones(K), torch.zeros(K), 1e-5)
    (y, a), (y_ref, a_ref) = _both(x=table, weight=weight, x_rows=tokens, residual=positions, residual_rows=write_pos,
                                   residual_row_offset=start, norm=norm, return_sum=True)
    prologue.check(rows)
    torch.testing.assert_close(a, table[tokens] + positions[write_pos - start])
    torch.testing.assert_close(a, a_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("rows", [1, 3, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_scatter_writes_q_and_the_cache_at_each_rows_position(rows, dtype):
    heads, head_dim, batch, max_seq = 3, 8, max(4, rows), 12
    hidden = heads * head_dim
    g = torch.Generator().manual_seed(5 + rows)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = (torch.randn(3 * hidden, hidden, generator=g) / hidden ** 0.5).to(dtype)
    bias = torch.randn(3 * hidden, generator=g).to(dtype)
    write_pos = torch.randperm(max_seq, generator=g)[:rows]
    caches = {}
    for backend in ("torch", "triton"):
        keys = torch.randn(batch, heads, max_seq, head_dim, generator=torch.Generator().manual_seed(9)).to(dtype)
        values = torch.randn(batch, heads, max_seq, head_dim, generator=torch.Generator().manual_seed(10)).to(dtype)
        q = torch.full((rows, hidden), float("nan"), dtype=dtype)
        with kernel_backend(backend):
            out = decode_linear(x, weight, bias, kv=(q, keys, values, write_pos, head_dim))
        assert out is q
        caches[backend] = (q, keys, values)
    tol = _tolerance(dtype)
    for got, want in zip(caches["triton"], caches["torch"]):
        torch.testing.assert_close(got.float(), want.float(), **tol)
    y = decode_linear_reference(x, weight, bias)
    _, keys, values = caches["triton"]
    for r in range(rows):  # the new entries are the k and v thirds of y
        torch.testing.assert_close(keys[r, :, write_pos[r]].reshape(-1).float(), y[r, hidden:2 * hidden].float(), **tol)
        torch.testing.assert_close(values[r, :, write_pos[r]].reshape(-1).float(), y[r, 2 * hidden:].float(), **tol)


def test_bad_arguments_name_the_problem():
    x, w = torch.randn(2, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match="x's last dimension 7 must equal weight's K = 8"):
        decode_linear(torch.randn(2, 7), w)
    with pytest.raises(ValueError, match="an int8 weight needs scale"):
        decode_linear(x, w.to(torch.int8))
    with pytest.raises(ValueError, match="bias must have shape"):
        decode_linear(x, w, torch.randn(5))
    with pytest.raises(ValueError, match="activation must be one of"):
        decode_linear(x, w, activation="relu")
    with pytest.raises(ValueError, match="N = 6 must be 3 \\* heads \\* head_dim"):
        decode_linear(x, w, kv=(torch.empty(2, 2), torch.empty(2, 1, 4, 4), torch.empty(2, 1, 4, 4),
                                torch.zeros(2, dtype=torch.long), 4))
    with pytest.raises(ValueError, match="residual_row_offset needs residual_rows"):
        decode_linear(x, w, residual=x, residual_row_offset=torch.zeros(2, dtype=torch.long))


@needs_interpreter
@pytest.mark.parametrize("rows", [1, 3])
def test_split_k_is_deterministic_and_leaves_its_counters_at_zero(monkeypatch, rows):
    """N = 45 makes 3 column tiles for the interpreter's 4 wanted programs: K splits in 2; the
    last split of each tile adds the partials in split order and resets the tile's counter. One
    row runs the tile kernel here (``ROW_KERNEL = False``; the engine runs the persistent one)."""
    import importlib

    module = importlib.import_module("dslab.kernels.decode.decode_linear")  # the package attribute is the function
    from dslab.kernels.decode.decode_linear_triton import INTERPRETER_BLOCK_K, INTERPRETER_BLOCK_N, plan_split_k

    monkeypatch.setattr(module, "ROW_KERNEL", False)
    assert plan_split_k(-(-N // INTERPRETER_BLOCK_N), K, INTERPRETER_BLOCK_K, 4)[0] == 2
    g = torch.Generator().manual_seed(21)
    x, weight = torch.randn(rows, K, generator=g), torch.randn(N, K, generator=g)
    with kernel_backend("triton"):
        first = decode_linear(x, weight)
        second = decode_linear(x, weight)
    assert torch.equal(first, second)
    torch.testing.assert_close(first, decode_linear_reference(x, weight), rtol=1e-5, atol=1e-5)
    assert not module._counters(x.device).any()


@needs_interpreter
@pytest.mark.parametrize("rows", [1, 5, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_statistics_from_a_single_k_block(rows, dtype):
    """K = 29 fits one of the interpreter's K blocks: the layer norm's statistics come from the
    tile in registers instead of a pass over K (the path GPT-2's widths take on a GPU)."""
    k = 29
    g = torch.Generator().manual_seed(31 + rows)
    x, residual = torch.randn(rows, k, generator=g).to(dtype), torch.randn(rows, k, generator=g).to(dtype)
    weight = (torch.randn(N, k, generator=g) / k ** 0.5).to(dtype)
    norm = (1 + 0.1 * torch.randn(k, generator=g).to(dtype), torch.randn(k, generator=g).to(dtype), 1e-5)
    (y, a), (y_ref, a_ref) = _both(x=x + 3, weight=weight, residual=residual, norm=norm, return_sum=True)
    assert torch.equal(a, a_ref)
    torch.testing.assert_close(y.float(), y_ref.float(), **_tolerance(dtype))
