"""bias_dropout_residual: the Triton kernels (under the interpreter on CPU) against the PyTorch
reference.

The two backends draw different masks from one seed, so the Triton run's mask is recovered (the
op on x = 1, residual = 0, no bias, same seed and shape: out = keep / (1 - p)) and replayed through
the reference's ``keep_mask``. Errors are measured against that reference in float64 and must stay
within twice PyTorch's own error in the same precision, plus a floor of one unit in the last place
at the output's scale. The keep rate is checked statistically.

Seeds are int64 ``[1]`` tensors on x's device that the kernels read there; ints are accepted and
give the same masks as tensors holding them.
"""

import math

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.kernels.dropout.bias_dropout_residual import (
    bias_dropout_residual,
    bias_dropout_residual_reference,
    draw_seed,
    dropout_keep_mask_reference,
)
from dslab.kernels.dropout.bias_dropout_residual_triton import kernel_p
from dslab.models import ops as model_ops
from philox_reference import sixteen_bit_draws

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _assert_within_torch_error(name, actual, torch_low, exact):
    exact = exact.double()
    err = (actual.double() - exact).abs().max().item()
    torch_err = (torch_low.double() - exact).abs().max().item()
    floor = torch.finfo(actual.dtype).eps * exact.abs().max().item()
    assert err <= 2 * torch_err + floor, f"{name}: error {err:.3g} vs PyTorch's {torch_err:.3g} (floor {floor:.2g})"


def _inputs(shape, dtype, with_bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, residual, dout = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
    bias = torch.randn(shape[-1], generator=gen).to(dtype) if with_bias else None
    return x, bias, residual, dout


def _triton_keep_mask(shape, p, seed, device="cpu"):
    """The Triton kernel's keep mask for (shape, p, seed), read off its output."""
    ones, zeros = torch.ones(shape, device=device), torch.zeros(shape, device=device)
    with kernel_backend("triton"):
        out = bias_dropout_residual(ones, None, zeros, p, True, seed)
    assert torch.all((out == 0) | torch.isclose(out, torch.full_like(out, 1 / (1 - kernel_p(p)))))
    return out != 0


def _run(fn, x, bias, residual, dout, dtype=None, **kwargs):
    """Output and gradients (x, bias, residual) of ``fn`` on leaf copies cast to ``dtype``."""
    dtype = dtype or x.dtype
    leaves = [t.detach().to(dtype).requires_grad_() if t is not None else None for t in (x, bias, residual)]
    out = fn(*leaves, **kwargs)
    grads = torch.autograd.grad(out, [t for t in leaves if t is not None], dout.to(dtype))
    return [out.detach(), *grads]


def _keep_rate_bounds(p, count, sigmas=5):
    spread = sigmas * math.sqrt(p * (1 - p) / count)
    return 1 - p - spread, 1 - p + spread


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(37, 129), (3, 5, 200)], ids=str)
def test_triton_matches_reference_replaying_its_mask(dtype, shape):
    p, seed = 0.3, 1234
    x, bias, residual, dout = _inputs(shape, dtype)
    keep = _triton_keep_mask(shape, p, seed)
    kwargs = dict(p=kernel_p(p), training=True, keep_mask=keep)  # the rate the kernels apply
    exact = _run(bias_dropout_residual_reference, x, bias, residual, dout, dtype=torch.float64, **kwargs)
    low = _run(bias_dropout_residual_reference, x, bias, residual, dout, **kwargs)
    with kernel_backend("triton"):
        got = _run(bias_dropout_residual, x, bias, residual, dout, p=p, training=True, seed=seed)
    for name, a, lo, ex in zip(["out", "dx", "dbias", "dresidual"], got, low, exact):
        assert a.dtype == dtype and a.shape == lo.shape
        _assert_within_torch_error(name, a, lo, ex)


def test_same_seed_same_mask_other_seed_other_mask():
    shape, p = (64, 200), 0.5
    first, again = _triton_keep_mask(shape, p, 7), _triton_keep_mask(shape, p, torch.tensor([7]))
    other = _triton_keep_mask(shape, p, torch.tensor([8]))
    assert torch.equal(first, again)
    assert 0.4 < (first == other).float().mean() < 0.6
    assert torch.equal(dropout_keep_mask_reference(shape, p, 7, "cpu"),
                       dropout_keep_mask_reference(shape, p, torch.tensor([7]), "cpu"))
    assert not torch.equal(dropout_keep_mask_reference(shape, p, 7, "cpu"),
                           dropout_keep_mask_reference(shape, p, 8, "cpu"))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_int_and_tensor_seeds_give_the_same_result(backend):
    """Output and gradients, on the Triton path and the reference; a 0-d tensor works as well."""
    x, bias, residual, dout = _inputs((19, 70), torch.float32)
    with kernel_backend(backend):
        from_int = _run(bias_dropout_residual, x, bias, residual, dout, p=0.4, seed=2**40 + 1)
        for seed in (torch.tensor([2**40 + 1]), torch.tensor(2**40 + 1)):
            from_tensor = _run(bias_dropout_residual, x, bias, residual, dout, p=0.4, seed=seed)
            for a, b in zip(from_int, from_tensor):
                assert torch.equal(a, b)
        other = _run(bias_dropout_residual, x, bias, residual, dout, p=0.4, seed=torch.tensor([5]))
    assert not torch.equal(from_int[0], other[0])


def test_backward_regenerates_the_forward_mask_from_the_seed_tensor():
    """dx is zero exactly where the forward dropped, even when the seed tensor given to the forward
    is overwritten before the backward: the op keeps its own reference to the value it read."""
    x = torch.ones(33, 65, requires_grad=True)
    seed = torch.tensor([123])
    with kernel_backend("triton"):
        out = bias_dropout_residual(x, None, torch.zeros(33, 65), 0.5, True, seed)
        out.backward(torch.ones_like(out))
    kept = out.detach() != 0
    assert torch.equal(x.grad != 0, kept)
    torch.testing.assert_close(x.grad[kept], torch.full_like(x.grad[kept], 2.0))
    assert torch.equal(kept, _triton_keep_mask((33, 65), 0.5, 123))


def test_seed_is_read_on_the_device_not_the_host(monkeypatch):
    """The Triton path never turns the seed tensor into a Python number (which on a GPU would be a
    host synchronisation, and a value baked into a captured CUDA graph), and the model op set draws
    its seeds as int64 [1] tensors on the activation's device."""
    x, bias, residual, dout = _inputs((9, 40), torch.float32)
    seed = draw_seed("cpu")
    assert seed.dtype == torch.int64 and seed.shape == (1,)
    for name in ("item", "__int__", "__index__", "tolist"):
        original = getattr(torch.Tensor, name)

        def guarded(self, *args, _original=original, _name=name):
            if self is seed or (self._base is seed):
                raise AssertionError(f"the seed tensor was read on the host ({_name})")
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, guarded)
    with kernel_backend("triton"):
        out, dx, _, _ = _run(bias_dropout_residual, x, bias, residual, dout, p=0.3, seed=seed)
    monkeypatch.undo()
    assert torch.equal(out, _run(bias_dropout_residual_reference, x, bias, residual, dout, p=kernel_p(0.3),
                                 keep_mask=_triton_keep_mask(x.shape, 0.3, seed))[0])
    assert torch.equal(dx != 0, _triton_keep_mask(x.shape, 0.3, seed))
    for device in ("cpu", "meta"):
        drawn = model_ops.draw_seed(torch.empty(2, 3, device=device))
        assert drawn.dtype == torch.int64 and drawn.shape == (1,) and drawn.device.type == device
    torch.manual_seed(4)
    first = model_ops.draw_seed(x)
    torch.manual_seed(4)
    assert torch.equal(first, model_ops.draw_seed(x))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_and_no_visible_structure(p):
    shape = (128, 1024)
    keep = _triton_keep_mask(shape, p, seed=2**40 + 3)
    low, high = _keep_rate_bounds(p, keep.numel())
    assert low < keep.float().mean().item() < high
    reference_keep = dropout_keep_mask_reference(shape, p, 3, "cpu")
    assert low < reference_keep.float().mean().item() < high
    # Neither rows nor the eight draws of one Philox call (two halves of each output) repeat
    # each other.
    agree = p * p + (1 - p) * (1 - p)
    low, high = agree - 0.02, agree + 0.02
    assert low < (keep[0] == keep[1]).float().mean().item() < high
    groups = keep.reshape(-1, 8)
    for j in range(1, 8):
        assert low < (groups[:, 0] == groups[:, j]).float().mean().item() < high, j


def test_mask_is_the_documented_philox_draw():
    """Element (r, c) is kept when draw ``c % 8`` of the Philox call with counter (c // 8, r, 0, 0)
    reaches ``p * 2**16``: computed here from the generator's definition, at a width that is not
    a multiple of 8 or of the kernels' block."""
    seed, p, shape = 2**35 + 77, 0.3, (6, 37)
    keep = _triton_keep_mask(shape, p, seed)
    threshold = round(kernel_p(p) * 2**16)
    expected = torch.empty(shape, dtype=torch.bool)
    for r in range(shape[0]):
        for group in range(-(-shape[1] // 8)):
            for j, draw in enumerate(sixteen_bit_draws(seed, (group, r, 0, 0))):
                if 8 * group + j < shape[1]:
                    expected[r, 8 * group + j] = draw >= threshold
    assert torch.equal(keep, expected)
    assert kernel_p(0.1) == 6554 / 2**16 and kernel_p(1.0) == 1.0 and kernel_p(0.0) == 0.0


def test_backward_without_bias_and_with_strided_rows():
    p, seed = 0.2, 99
    x_wide = torch.randn(300, 96)
    x = x_wide[:, :48]  # row stride 96, read in place
    residual, dout = torch.randn(300, 48), torch.randn(300, 48)
    keep = _triton_keep_mask((300, 48), p, seed)
    exact = _run(bias_dropout_residual_reference, x, None, residual, dout, dtype=torch.float64,
                 p=kernel_p(p), keep_mask=keep)
    with kernel_backend("triton"):
        got = _run(bias_dropout_residual, x, None, residual, dout, p=p, training=True, seed=seed)
    assert len(got) == 3
    for a, ex in zip(got, exact):
        torch.testing.assert_close(a.double(), ex, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("training, p", [(False, 0.3), (True, 0.0)])
def test_no_dropout_when_evaluating_or_p_is_zero(training, p):
    x, bias, residual, dout = _inputs((9, 70), torch.float32)
    exact = _run(bias_dropout_residual_reference, x, bias, residual, dout, dtype=torch.float64,
                 p=p, training=training)
    with kernel_backend("triton"):
        got = _run(bias_dropout_residual, x, bias, residual, dout, p=p, training=training, seed=None)
    for a, ex in zip(got, exact):
        torch.testing.assert_close(a.double(), ex, rtol=1e-6, atol=1e-6)


def test_p_one_drops_everything():
    x, bias, residual, dout = _inputs((5, 40), torch.float32)
    with kernel_backend("triton"):
        out, dx, dbias, dresidual = _run(bias_dropout_residual, x, bias, residual, dout, p=1.0, seed=5)
    assert torch.equal(out, residual) and torch.equal(dresidual, dout)
    assert torch.all(dx == 0) and torch.all(dbias == 0)


def test_torch_backend_and_cpu_auto_run_the_reference():
    x, bias, residual, _ = _inputs((6, 16), torch.float32)
    expected = bias_dropout_residual_reference(x, bias, residual, 0.25, True, seed=11)
    keep = dropout_keep_mask_reference(x.shape, 0.25, 11, "cpu")
    torch.testing.assert_close(expected, residual + (x + bias) * keep / 0.75)
    for name in ("torch", "auto"):
        with kernel_backend(name):
            assert torch.equal(bias_dropout_residual(x, bias, residual, 0.25, True, 11), expected)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(seed=None), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(seed=-1), "seed"),
        (dict(seed=torch.tensor([3], dtype=torch.int32)), "seed"),
        (dict(seed=torch.tensor([3, 4])), "seed"),
        (dict(seed=torch.tensor([3], device="meta")), "seed"),
        (dict(p=1.5), "p"),
        (dict(bias=torch.ones(7)), "bias"),
        (dict(residual=torch.ones(3, 7)), "residual"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    args = dict(bias=None, residual=torch.ones(3, 8), p=0.1, training=True, seed=0) | kwargs
    with pytest.raises(ValueError, match=match):
        bias_dropout_residual(torch.ones(3, 8), **args)


@pytest.mark.parametrize("with_bias, p", [(True, 0.3), (False, 0.0)])
def test_custom_op_passes_opcheck(with_bias, p):
    x, bias, residual, _ = _inputs((7, 33), torch.float32, with_bias)
    bias = bias.requires_grad_() if bias is not None else None
    args = (x.requires_grad_(), bias, residual.requires_grad_(), p, torch.tensor([5]) if p > 0 else None)
    torch.library.opcheck(torch.ops.dslab.bias_dropout_residual.default, args)


def test_torch_compile_traces_the_custom_op():
    x, bias, residual, dout = _inputs((6, 40), torch.float32)

    def sublayer_end(x, bias, residual, p, seed):
        return bias_dropout_residual(x, bias, residual, p, True, seed) * 2

    compiled = torch.compile(sublayer_end, backend="aot_eager", fullgraph=True)
    with kernel_backend("triton"):
        for seed in (torch.tensor([3]), torch.tensor([4])):  # a new seed each step: one graph
            eager = _run(sublayer_end, x, bias, residual, dout, p=0.2, seed=seed)
            got = _run(compiled, x, bias, residual, dout, p=0.2, seed=seed)
            for a, b in zip(got, eager):
                torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, dtype",
    [((65536, 1024), torch.bfloat16), ((8192, 4096), torch.bfloat16), ((4096, 1002), torch.float32)],
    ids=str,
)
def test_gpu_real_sizes(shape, dtype):
    p, seed = 0.1, 2024
    x, bias, residual, dout = (t.cuda() for t in _inputs(shape, dtype))
    keep = _triton_keep_mask(shape, p, seed, device="cuda")
    low_rate, high_rate = _keep_rate_bounds(p, keep.numel())
    assert low_rate < keep.float().mean().item() < high_rate
    kwargs = dict(p=kernel_p(p), training=True, keep_mask=keep)
    exact = _run(bias_dropout_residual_reference, x, bias, residual, dout, dtype=torch.float64, **kwargs)
    low = _run(bias_dropout_residual_reference, x, bias, residual, dout, **kwargs)
    got = _run(bias_dropout_residual, x, bias, residual, dout, p=p, training=True, seed=seed)
    for name, a, lo, ex in zip(["out", "dx", "dbias", "dresidual"], got, low, exact):
        _assert_within_torch_error(name, a, lo, ex)
    again = _run(bias_dropout_residual, x, bias, residual, dout, p=p, training=True, seed=seed)
    for a, b in zip(got, again):
        assert torch.equal(a, b), "two runs with one seed differ"


@pytest.mark.gpu
def test_gpu_no_host_sync_and_cuda_graph_replays_draw_new_masks():
    """The model op set's dropout (seed drawn on the device, read by the kernels) runs forward and
    backward with CUDA's sync debug mode set to error, the backward dropping what the forward
    dropped; captured in a CUDA graph, every replay draws a new mask, and torch.manual_seed replays
    the sequence."""
    dslab_ops = model_ops.op_set("dslab")
    ones, zeros = torch.ones(512, 256, device="cuda"), torch.zeros(256, device="cuda")
    x = ones.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = dslab_ops.bias_dropout_residual(x, zeros, ones * 0, 0.3, True)
        (dx,) = torch.autograd.grad(out, (x,), ones)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out != 0, dx != 0)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        dslab_ops.bias_dropout_residual(ones, zeros, ones * 0, 0.5, True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dslab_ops.bias_dropout_residual(ones, zeros, ones * 0, 0.5, True)
    masks = []
    for manual_seed in (1, 1):
        torch.manual_seed(manual_seed)
        for _ in range(2):
            graph.replay()
            masks.append(captured != 0)
    assert not torch.equal(masks[0], masks[1])
    assert torch.equal(masks[0], masks[2]) and torch.equal(masks[1], masks[3])
