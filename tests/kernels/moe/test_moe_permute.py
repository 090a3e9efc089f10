"""moe_permute / moe_unpermute: the Triton kernels (under the interpreter on CPU) against the
PyTorch references, with dropped assignments (-1), capacity padding rows and odd widths.

Permute copies rows, so its output must equal the reference's bit for bit; the sums (dx, y) are
computed in fp32 by both and rounded once, so they may differ by one unit in the last place of the
output's dtype; the gate-weight gradient is an fp32 dot product over H in a different order.
"""

import pytest
import torch

from dslab.kernels import kernel_backend

from dslab.kernels.moe import moe_permute_triton
from dslab.kernels.moe.moe_gating import moe_gating
from dslab.kernels.moe.moe_permute import (
    moe_permute,
    moe_permute_reference,
    moe_unpermute,
    moe_unpermute_reference,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _row_index(tokens, k, num_rows, drop=0.25, index_dtype=torch.int32, seed=0):
    """Distinct destination rows for each (t, c) among ``num_rows``, a ``drop`` share of them -1,
    and the last token's assignments all dropped."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(num_rows, generator=gen)[: tokens * k].view(tokens, k)
    rows = rows.masked_fill(torch.rand(tokens, k, generator=gen) < drop, -1)
    rows[-1] = -1
    return rows.to(index_dtype)


def _tensors(tokens, hidden, k, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate_weight = torch.rand(tokens, k, generator=gen)
    dy = torch.randn(tokens, hidden, generator=gen).to(dtype)
    return x, gate_weight, dy


def _pipeline(permute, unpermute, x, row_index, num_rows, gate_weight, dy, dx_perm_extra):
    """x_perm, y and the gradients of x, gate_weight and y_perm (an interior leaf) for the loss
    <y, dy> + <x_perm, dx_perm_extra>, with y_perm = 3 * x_perm + 1 standing in for the experts."""
    x = x.detach().clone().requires_grad_()
    gate_weight = gate_weight.detach().clone().requires_grad_()
    x_perm = permute(x, row_index, num_rows)
    y_perm = (3 * x_perm + 1).detach().requires_grad_()
    y = unpermute(y_perm, row_index, gate_weight)
    loss = (y.float() * dy.float()).sum() + (x_perm.float() * dx_perm_extra).sum()
    dx, dgate, dy_perm = torch.autograd.grad(loss, [x, gate_weight, y_perm])
    return {"x_perm": x_perm.detach(), "y": y.detach(), "dx": dx, "dgate": dgate, "dy_perm": dy_perm}


def _assert_within_one_ulp(name, actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
    eps = torch.finfo(actual.dtype).eps
    torch.testing.assert_close(actual, expected, rtol=eps, atol=eps * expected.abs().max().item(), msg=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [70, 129])
@pytest.mark.parametrize("k", [1, 2])
def test_triton_matches_reference(dtype, hidden, k):
    tokens = 37
    num_rows = tokens * k + 11  # padding rows nothing targets
    row_index = _row_index(tokens, k, num_rows)
    x, gate_weight, dy = _tensors(tokens, hidden, k, dtype)
    extra = torch.randn(num_rows, hidden)
    ref = _pipeline(moe_permute_reference, moe_unpermute_reference, x, row_index, num_rows, gate_weight, dy, extra)
    with kernel_backend("triton"):
        got = _pipeline(moe_permute, moe_unpermute, x, row_index, num_rows, gate_weight, dy, extra)
    assert torch.equal(got["x_perm"], ref["x_perm"])
    kept = row_index.reshape(-1)[row_index.reshape(-1) >= 0].long()
    padding = torch.ones(num_rows, dtype=torch.bool).index_fill_(0, kept, False)
    assert padding.sum() >= 11 and not got["x_perm"][padding].any()
    assert not got["y"][-1].any() and not got["dgate"][-1].any()
    for name in ("y", "dx", "dy_perm"):
        _assert_within_one_ulp(name, got[name], ref[name])
    torch.testing.assert_close(got["dgate"], ref["dgate"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_wide_rows_span_column_tiles(index_dtype):
    # H = 2100: three 1024-wide column tiles, and three steps of the gate gradient's loop over H.
    tokens, k, hidden = 9, 2, 2100
    num_rows = 24
    row_index = _row_index(tokens, k, num_rows, index_dtype=index_dtype, seed=4)
    x, gate_weight, dy = _tensors(tokens, hidden, k, torch.bfloat16, seed=5)
    extra = torch.randn(num_rows, hidden)
    ref = _pipeline(moe_permute_reference, moe_unpermute_reference, x, row_index, num_rows, gate_weight, dy, extra)
    with kernel_backend("triton"):
        got = _pipeline(moe_permute, moe_unpermute, x, row_index, num_rows, gate_weight, dy, extra)
    assert torch.equal(got["x_perm"], ref["x_perm"])
    for name in ("y", "dx", "dy_perm"):
        _assert_within_one_ulp(name, got[name], ref[name])
    torch.testing.assert_close(got["dgate"], ref["dgate"], rtol=1e-5, atol=1e-4)


def test_strided_inputs_and_broadcast_gradients():
    tokens, k, hidden, num_rows = 21, 2, 40, 50
    row_index = _row_index(tokens, k, num_rows, seed=6).t().contiguous().t()  # column-major
    wide = torch.randn(tokens, 2 * hidden)
    x = wide[:, :hidden]  # row stride 2 * hidden
    gate_weight = torch.rand(k, tokens).t()

    def run(permute, unpermute):
        leaf = x.clone().requires_grad_()
        y = unpermute(permute(leaf, row_index, num_rows) * 2, row_index, gate_weight)
        (dx,) = torch.autograd.grad(y.sum(), leaf)  # an expanded (stride 0) gradient reaches y
        return y.detach(), dx

    expected = run(moe_permute_reference, moe_unpermute_reference)
    with kernel_backend("triton"):
        got = run(moe_permute, moe_unpermute)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("wrt", ["y_perm", "gate_weight"])
def test_unpermute_gradient_to_one_input_alone(wrt):
    tokens, k, hidden, num_rows = 13, 2, 33, 30
    row_index = _row_index(tokens, k, num_rows, seed=7)
    y_perm = torch.randn(num_rows, hidden, requires_grad=wrt == "y_perm")
    gate_weight = torch.rand(tokens, k, requires_grad=wrt == "gate_weight")
    dy = torch.randn(tokens, hidden)
    leaf = y_perm if wrt == "y_perm" else gate_weight
    (expected,) = torch.autograd.grad(moe_unpermute_reference(y_perm, row_index, gate_weight), leaf, dy)
    with kernel_backend("triton"):
        (got,) = torch.autograd.grad(moe_unpermute(y_perm, row_index, gate_weight), leaf, dy)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_row_map_ignores_stale_memory(monkeypatch):
    # The row -> assignment map is never initialised: whatever it held before, only entries that
    # row_index confirms count. Fill it with values that point at real assignments of other rows.
    tokens, k, hidden, num_rows = 30, 2, 16, 70
    row_index = _row_index(tokens, k, num_rows, seed=8)
    x, gate_weight, dy = _tensors(tokens, hidden, k, torch.float32, seed=9)
    gen = torch.Generator().manual_seed(10)

    def stale_map(row_index, num_rows):
        stale = torch.randint(-3, row_index.numel() + 3, (num_rows,), generator=gen, dtype=torch.int32)
        return moe_permute_triton._invert_row_index(row_index, stale)

    monkeypatch.setattr(moe_permute_triton, "_row_sources", stale_map)
    extra = torch.randn(num_rows, hidden)
    ref = _pipeline(moe_permute_reference, moe_unpermute_reference, x, row_index, num_rows, gate_weight, dy, extra)
    with kernel_backend("triton"):
        got = _pipeline(moe_permute, moe_unpermute, x, row_index, num_rows, gate_weight, dy, extra)
    assert torch.equal(got["x_perm"], ref["x_perm"])
    torch.testing.assert_close(got["dy_perm"], ref["dy_perm"], rtol=1e-6, atol=1e-6)


def test_empty_cases():
    with kernel_backend("triton"):
        assert moe_permute(torch.randn(4, 8), torch.full((4, 2), -1), 5).eq(0).all()
        assert moe_permute(torch.randn(0, 8), torch.empty(0, 2, dtype=torch.int32), 3).eq(0).all()
        assert moe_permute(torch.randn(4, 8), torch.full((4, 2), -1), 0).shape == (0, 8)
        assert moe_unpermute(torch.randn(0, 8), torch.full((4, 1), -1), torch.ones(4, 1)).eq(0).all()


def test_torch_backend_and_cpu_auto_run_the_reference():
    row_index = _row_index(10, 2, 25)
    x, gate_weight, _ = _tensors(10, 12, 2, torch.float32)
    y_perm = torch.randn(25, 12)
    for name in ("torch", "auto"):
        with kernel_backend(name):
            assert torch.equal(moe_permute(x, row_index, 25), moe_permute_reference(x, row_index, 25))
            assert torch.equal(moe_unpermute(y_perm, row_index, gate_weight),
                               moe_unpermute_reference(y_perm, row_index, gate_weight))


@pytest.mark.parametrize(
    "fn, args, match",
    [
        (moe_permute, (torch.ones(3, 4, 2), torch.zeros(3, 2, dtype=torch.int32), 6), "x must be"),
        (moe_permute, (torch.ones(3, 4), torch.zeros(3, 2), 6), "row_index must be int32"),
        (moe_permute, (torch.ones(3, 4), torch.zeros(3, dtype=torch.int32), 6), r"row_index must be \[T, k\]"),
        (moe_permute, (torch.ones(3, 4), torch.zeros(4, 2, dtype=torch.int32), 6), "one row per token"),
        (moe_permute, (torch.ones(3, 4), torch.zeros(3, 2, dtype=torch.int32), -1), "num_rows"),
        (moe_unpermute, (torch.ones(6), torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2)), "y_perm must be"),
        (moe_unpermute, (torch.ones(6, 4, dtype=torch.int32), torch.zeros(3, 2, dtype=torch.int32),
                         torch.ones(3, 2)), "floating"),
        (moe_unpermute, (torch.ones(6, 4), torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 1)), "gate_weight"),
        (moe_unpermute, (torch.ones(6, 4), torch.zeros(3, 2, dtype=torch.int32),
                         torch.ones(3, 2, dtype=torch.bfloat16)), "gate_weight must be float32"),
    ],
)
def test_bad_arguments_raise_value_error(fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(*args)


def test_custom_ops_pass_opcheck():
    row_index = _row_index(9, 2, 23)
    x, gate_weight, _ = _tensors(9, 10, 2, torch.float32)
    torch.library.opcheck(torch.ops.dslab.moe_permute.default, (x.requires_grad_(), row_index, 23))
    y_perm = torch.randn(23, 10, requires_grad=True)
    torch.library.opcheck(torch.ops.dslab.moe_unpermute.default, (y_perm, row_index, gate_weight.requires_grad_()))


def _moe_layer(x, gate_logits, capacity):
    """Top-2 gating, capacity dropping, permute, a stand-in expert, unpermute: the MoE data path."""
    experts = gate_logits.shape[1]
    gate = moe_gating(gate_logits, 2)
    row_index = torch.where(gate.position < capacity, gate.expert_index * capacity + gate.position, -1)
    x_perm = moe_permute(x, row_index, experts * capacity)
    y_perm = torch.tanh(x_perm) * 2
    aux_loss = (gate.probs.mean(dim=0) * gate.expert_counts.float()).sum()
    return moe_unpermute(y_perm, row_index, gate.gate_weight), aux_loss


def test_torch_compile_traces_the_moe_data_path():
    gen = torch.Generator().manual_seed(11)
    x, logits = torch.randn(37, 24, generator=gen), torch.randn(37, 4, generator=gen)
    dy = torch.randn(37, 24, generator=gen)
    compiled = torch.compile(_moe_layer, backend="aot_eager", fullgraph=True)

    def run(fn):
        leaves = x.clone().requires_grad_(), logits.clone().requires_grad_()
        y, aux = fn(*leaves, 16)  # 16 slots per expert for ~18.5 assignments each: some dropped
        return [y.detach(), aux.detach(), *torch.autograd.grad((y * dy).sum() + aux, leaves)]

    expected = run(_moe_layer)
    with kernel_backend("triton"):
        eager, got = run(_moe_layer), run(compiled)
    for a, b, c in zip(got, eager, expected):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_flops_profiler_prices_the_custom_ops():
    """Under the profiler's dispatch mode the custom ops run and are priced as elementwise work:
    gating 5 / 4 per logit, unpermute 2k-1 per output element and 3k backward (both gradients),
    permute's backward k-1, permute itself nothing."""
    from dslab.profilers.flops import FlopsProfiler

    tokens, experts, hidden, k = 37, 4, 24, 2
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
    logits = torch.randn(tokens, experts, generator=gen, requires_grad=True)

    class Layer(torch.nn.Module):
        def forward(self, x, logits):
            return _moe_layer(x, logits, 16)

    model = Layer()
    profiler = FlopsProfiler(model)
    with kernel_backend("triton"):
        profiler.start_profile()
        y, aux = model(x, logits)
        (y.sum() + aux).backward()
        profiler.stop_profile()
    by_op = profiler.records()["flops_by_op"]
    assert by_op["dslab::moe_gating"] == {"figure": "elementwise", "flops": 5 * tokens * experts}
    assert by_op["dslab::moe_gating_backward"]["flops"] == 4 * tokens * experts
    assert by_op["dslab::moe_unpermute"]["flops"] == (2 * k - 1) * tokens * hidden
    assert by_op["dslab::moe_unpermute_backward"]["flops"] == 3 * k * tokens * hidden
    assert by_op["dslab::moe_permute_backward"]["flops"] == (k - 1) * tokens * hidden
    assert "dslab::moe_permute" not in by_op
