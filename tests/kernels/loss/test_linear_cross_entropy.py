"""linear_cross_entropy: the fused LM head + cross-entropy (Triton under the interpreter on CPU)
against PyTorch.

Errors are measured against float64 ``F.linear`` + ``F.cross_entropy`` and must stay within twice
PyTorch's own error in the same precision (``F.linear`` in that dtype, the fp32-upcast slice and
``F.cross_entropy``), plus a floor: a few fp32 ulps for the loss, one ulp of the compute dtype at
the tensor's scale for the gradients (the op rounds the logits' gradient before the backward's
matmuls and applies the incoming gradient after them, PyTorch the other way round).
"""

import pytest
import torch
import torch.nn.functional as F

from dslab.kernels import kernel_backend

from dslab.kernels.loss.linear_cross_entropy import linear_cross_entropy
from dslab.kernels.loss.linear_cross_entropy import linear_cross_entropy_forward_triton, linear_cross_entropy_reference
from dispatch_recorder import DispatchRecorder

IGNORE = -100
OP_NAME = "dslab::linear_cross_entropy_forward"


def _inputs(n_rows, hidden, vocab, padded, dtype, seed, ignore_every=5, bias=True, weight_dtype=None):
    """Fresh random hidden [N, H], weight [Vp, H], bias [Vp] (or None) and target [N] (every
    ``ignore_every``-th row ignored). Logits come out at a scale of a few units, as an LM head's."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n_rows, hidden, generator=gen).to(dtype)
    w = (torch.randn(padded, hidden, generator=gen) * 2 / hidden**0.5).to(weight_dtype or dtype)
    b = (torch.randn(padded, generator=gen) * 0.5).to(weight_dtype or dtype) if bias else None
    target = torch.randint(0, vocab, (n_rows,), generator=gen)
    if ignore_every:
        target[::ignore_every] = IGNORE
    return h, w, b, target


def _torch_loss(h, w, target, vocab, b=None, ignore_index=IGNORE, label_smoothing=0.0):
    """What a PyTorch user writes: F.linear, the slice, F.cross_entropy on the fp32 upcast."""
    logits = F.linear(h, w, b)[:, :vocab]
    return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, label_smoothing=label_smoothing)


def _loss_and_grads(fn, h, w, b, target, vocab, grad_out=1.0, cast=None, **kwargs):
    """(loss, grad_h, grad_w, grad_b) of ``fn`` on leaf copies of the inputs (cast by ``cast``)."""
    leaves = [None if t is None else (t.detach().clone() if cast is None else t.detach().to(cast)).requires_grad_()
              for t in (h, w, b)]
    loss = fn(leaves[0], leaves[1], target, vocab, b=leaves[2], ignore_index=IGNORE, **kwargs)
    (loss * grad_out).backward()
    return (loss.detach(), *(None if t is None else t.grad for t in leaves))


def _dslab(h, w, target, vocab, b=None, **kwargs):
    return linear_cross_entropy(h, w, target, vocab, bias=b, **kwargs)


def _assert_within_twice_torch_error(ours, low, exact, ulp, what):
    """Each of ours' entries within 2x the error of PyTorch's ``low`` (same precision) against
    ``exact``, plus a floor: for the gradients ``ulp`` times the entry's largest magnitude, for the
    fp32 loss (reduced from the same rounded logits as PyTorch's) a few fp32 ulps."""
    names = ("loss", "grad_hidden", "grad_weight", "grad_bias")
    for name, got, torch_value, ref in zip(names, ours, low, exact):
        if ref is None:
            assert got is None, name
            continue
        err = (got.double() - ref).abs().max().item()
        torch_err = (torch_value.double() - ref).abs().max().item()
        floor = (8 * torch.finfo(torch.float32).eps if name == "loss" else ulp) * ref.abs().max().item()
        assert err <= 2 * torch_err + floor, f"{what} {name}: {err:.3g} vs torch's {torch_err:.3g} (+{floor:.2g})"


# 250 of 256: full chunks of 128, a masked tail holding the padding; 300 of 300: no padding;
# 250 of 300: the padding [250, 300) crosses the chunk boundary at 256; 256 of 320: vocab ends a
# full chunk and the next chunk is padding only.
SHAPES = [(250, 256), (300, 300), (250, 300), (256, 320)]


@pytest.mark.parametrize("vocab,padded", SHAPES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_bf16_matches_float64_reference(vocab, padded, smoothing):
    h, w, b, target = _inputs(37, 48, vocab, padded, torch.bfloat16, seed=vocab + padded + int(10 * smoothing))
    grad_out = 2.5
    exact = _loss_and_grads(_torch_loss, h, w, b, target, vocab, grad_out, cast=torch.float64,
                            label_smoothing=smoothing)
    low = _loss_and_grads(_torch_loss, h, w, b, target, vocab, grad_out, label_smoothing=smoothing)
    with kernel_backend("triton"), DispatchRecorder() as recorder:
        ours = _loss_and_grads(_dslab, h, w, b, target, vocab, grad_out, label_smoothing=smoothing)

    assert OP_NAME in recorder.names()
    loss, grad_h, grad_w, grad_b = ours
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert grad_h.dtype == grad_w.dtype == grad_b.dtype == torch.bfloat16
    _assert_within_twice_torch_error(ours, low, exact, torch.finfo(torch.bfloat16).eps, f"V={vocab}/{padded}")
    assert torch.all(grad_w[vocab:] == 0) and torch.all(grad_b[vocab:] == 0)  # padding rows: exactly zero
    assert torch.all(grad_h[target == IGNORE] == 0)  # ignored rows contribute nothing
    assert grad_w[:vocab].abs().sum() > 0 and grad_h[target != IGNORE].abs().sum() > 0


def test_fp16_without_bias():
    vocab, padded = 250, 300
    h, w, _, target = _inputs(29, 40, vocab, padded, torch.float16, seed=3, ignore_every=3, bias=False)
    exact = _loss_and_grads(_torch_loss, h, w, None, target, vocab, 0.5, cast=torch.float64)
    low = _loss_and_grads(_torch_loss, h, w, None, target, vocab, 0.5)
    with kernel_backend("triton"), DispatchRecorder() as recorder:
        ours = _loss_and_grads(_dslab, h, w, None, target, vocab, 0.5)
    assert OP_NAME in recorder.names()
    assert ours[1].dtype == ours[2].dtype == torch.float16
    _assert_within_twice_torch_error(ours, low, exact, torch.finfo(torch.float16).eps, "fp16")
    assert torch.all(ours[2][vocab:] == 0)


def test_vocab_defaults_to_the_weight_rows():
    h, w, b, target = _inputs(11, 32, 200, 200, torch.bfloat16, seed=4)
    with kernel_backend("triton"):
        default = _loss_and_grads(lambda *a, **k: linear_cross_entropy(a[0], a[1], a[2], bias=k["b"],
                                                                       ignore_index=IGNORE), h, w, b, target, None)
        explicit = _loss_and_grads(_dslab, h, w, b, target, 200)
    for a, e in zip(default, explicit):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_forward_writes_the_logits_gradient_in_place():
    """The forward's buffer holds d loss / d logits for an incoming gradient of 1: softmax minus
    the smoothed one-hot over n_valid on [0, vocab), zeros on the padding columns and ignored rows,
    rounded once to the compute dtype. Checked against float64 arithmetic on the same bf16 logits
    (the op's matmul is PyTorch's), so that only the kernel's fp32 math and one rounding differ."""
    vocab, padded, smoothing = 250, 300, 0.1
    h, w, b, target = _inputs(37, 48, vocab, padded, torch.bfloat16, seed=5)
    with DispatchRecorder() as recorder:
        loss, grad_logits = linear_cross_entropy_forward_triton(h, w, b, target, vocab, IGNORE, smoothing)
    logits = torch.addmm(b, h, w.t()).double().requires_grad_()
    exact_loss = F.cross_entropy(logits[:, :vocab], target, ignore_index=IGNORE, label_smoothing=smoothing)
    (exact_grad,) = torch.autograd.grad(exact_loss, logits)
    assert grad_logits.shape == (37, padded) and grad_logits.dtype == torch.bfloat16 and grad_logits.is_contiguous()
    assert torch.all(grad_logits[:, vocab:] == 0) and torch.all(grad_logits[target == IGNORE] == 0)
    torch.testing.assert_close(grad_logits.double(), exact_grad, rtol=2**-8, atol=1e-9)
    torch.testing.assert_close(loss.double(), exact_loss, rtol=1e-6, atol=0)
    # The logits' one [N, Vp] buffer is the matmul's output, overwritten: no other op makes a
    # tensor of N * vocab elements or more, in fp32 or otherwise (views of the weight aside; the
    # interpreter's own copies of the arguments show up as set_ and as uint8 bytes).
    big = [(name, shape, dtype) for name, outputs in recorder.ops for shape, dtype in outputs
           if name not in ("aten::t", "aten::set_") and dtype != torch.uint8
           and torch.Size(shape).numel() >= 37 * vocab]
    assert big == [("aten::addmm", (37, padded), torch.bfloat16)]


@pytest.mark.parametrize("compiled", [False, True])
def test_backward_is_the_matmuls_alone(compiled):
    """The backward reads the saved buffer in two matmuls (and a column sum with a bias): no
    [N, Vp] tensor is made, not even a zero-filled gradient for the non-differentiable buffer."""
    vocab, padded = 250, 300
    h, w, b, target = _inputs(37, 48, vocab, padded, torch.bfloat16, seed=15)
    h, w, b = h.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    fn = torch.compile(linear_cross_entropy, backend="aot_eager", fullgraph=True) if compiled else linear_cross_entropy
    with kernel_backend("triton"):
        loss = fn(h, w, target, vocab, bias=b)
        with DispatchRecorder() as recorder:
            loss.backward()
    big = [(name, shape) for name, outputs in recorder.ops for shape, _ in outputs
           if name not in ("aten::t", "aten::transpose", "aten::permute") and torch.Size(shape).numel() >= 37 * vocab
           and shape not in ((37, 48), (padded, 48))]
    assert big == []
    if not compiled:  # (compiled, the partitioner may move d hidden = G W into the forward graph)
        assert recorder.names().count("aten::mm") == 2


def test_all_rows_ignored_gives_nan_and_zero_gradients():
    h, w, b, target = _inputs(6, 32, 200, 256, torch.bfloat16, seed=6)
    target[:] = IGNORE
    with kernel_backend("triton"):
        loss, grad_h, grad_w, grad_b = _loss_and_grads(_dslab, h, w, b, target, 200)
    assert torch.isnan(loss) and torch.isnan(_torch_loss(h, w, target, 200, b))
    assert torch.all(grad_h == 0) and torch.all(grad_w == 0) and torch.all(grad_b == 0)


def test_empty_batch_gives_nan_like_pytorch():
    h, w, b, target = _inputs(0, 32, 200, 256, torch.bfloat16, seed=7)
    with kernel_backend("triton"):
        loss, grad_h, grad_w, _ = _loss_and_grads(_dslab, h, w, b, target, 200)
    assert torch.isnan(loss) and torch.isnan(_torch_loss(h, w, target, 200, b))
    assert grad_h.shape == (0, 32) and torch.all(grad_w == 0)


def test_out_of_range_target_makes_the_loss_nan_on_the_triton_path():
    h, w, b, target = _inputs(4, 32, 200, 256, torch.bfloat16, seed=8, ignore_every=0)
    target[1] = 200  # a padding column: still outside [0, vocab)
    with kernel_backend("triton"):
        loss = linear_cross_entropy(h, w, target, 200, bias=b)
    assert torch.isnan(loss)
    with pytest.raises((IndexError, RuntimeError)):
        linear_cross_entropy_reference(h.float(), w.float(), target, 200, b.float())


@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float32])
def test_fp32_weights_under_cpu_autocast_compute_in_bf16(hidden_dtype):
    """Under torch.autocast("cpu", bf16), with an fp32 head and bias, the op computes in bf16 as
    F.linear would (hidden of either dtype), and each gradient comes back in its input's dtype."""
    vocab, padded = 250, 256
    h, w, b, target = _inputs(37, 48, vocab, padded, hidden_dtype, seed=9, weight_dtype=torch.float32)
    exact = _loss_and_grads(_torch_loss, h, w, b, target, vocab, 1.5, cast=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = _loss_and_grads(_torch_loss, h, w, b, target, vocab, 1.5)
        with kernel_backend("triton"), DispatchRecorder() as recorder:
            ours = _loss_and_grads(_dslab, h, w, b, target, vocab, 1.5)
    op_outputs = [outputs for name, outputs in recorder.ops if name == OP_NAME]
    assert op_outputs == [[((), torch.float32), ((37, padded), torch.bfloat16)]]  # one op, in bf16
    loss, grad_h, grad_w, grad_b = ours
    assert grad_h.dtype == hidden_dtype and grad_w.dtype == grad_b.dtype == torch.float32
    _assert_within_twice_torch_error(ours, low, exact, torch.finfo(torch.bfloat16).eps, "autocast")
    assert torch.all(grad_w[vocab:] == 0) and torch.all(grad_b[vocab:] == 0)


def test_fp32_takes_the_unfused_cross_entropy_and_fp64_the_reference():
    """Outside autocast, fp32 compute on the triton backend makes the logits with F.linear and
    hands the slice to softmax_cross_entropy (its Triton kernels); fp64 takes the PyTorch
    reference. Both compute what F.linear, the slice and F.cross_entropy do."""
    for dtype in (torch.float32, torch.float64):
        h, w, b, target = _inputs(13, 24, 90, 96, dtype, seed=10)
        expected = _loss_and_grads(_torch_loss, h, w, b, target, 90, 2.0, label_smoothing=0.2)
        with kernel_backend("triton"), DispatchRecorder() as recorder:
            got = _loss_and_grads(_dslab, h, w, b, target, 90, 2.0, label_smoothing=0.2)
        assert OP_NAME not in recorder.names()
        assert ("dslab::cross_entropy_forward" in recorder.names()) == (dtype == torch.float32)
        for a, e in zip(got, expected):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
        assert torch.all(got[2][90:] == 0) and torch.all(got[3][90:] == 0)


def test_reference_runs_on_cpu_by_default():
    h, w, b, target = _inputs(7, 16, 100, 128, torch.bfloat16, seed=11)
    with kernel_backend("auto"), DispatchRecorder() as recorder:
        loss = linear_cross_entropy(h, w, target, 100, bias=b, ignore_index=IGNORE, label_smoothing=0.2)
    assert OP_NAME not in recorder.names()
    torch.testing.assert_close(loss, _torch_loss(h, w, target, 100, b, label_smoothing=0.2), rtol=0, atol=0)


def test_custom_op_registration():
    h, w, b, target = _inputs(5, 16, 40, 64, torch.bfloat16, seed=12)
    for t in (h, w, b):
        t.requires_grad_()
    torch.library.opcheck(torch.ops.dslab.linear_cross_entropy_forward.default, (h, w, b, target, 40, IGNORE, 0.1),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("autocast", [False, True])
def test_torch_compile_traces_through_the_op(autocast):
    """One graph (fullgraph), the same loss and gradients as eager; under autocast too, where the
    compute dtype is read from the autocast state while tracing."""
    vocab, padded = 250, 300
    weight_dtype = torch.float32 if autocast else torch.bfloat16
    h, w, b, target = _inputs(11, 32, vocab, padded, torch.bfloat16, seed=13, weight_dtype=weight_dtype)

    def step(h, w, t, vocab, b=None, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return linear_cross_entropy(h, w, t, vocab, bias=b, ignore_index=IGNORE, label_smoothing=0.05) * 3.0

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    with kernel_backend("triton"):
        eager = _loss_and_grads(lambda *a, **k: step(*a, b=k["b"]), h, w, b, target, vocab)
        got = _loss_and_grads(lambda *a, **k: compiled(*a, b=k["b"]), h, w, b, target, vocab)
    for a, e in zip(got, eager):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert got[2].dtype == weight_dtype


@pytest.mark.parametrize("bad,match", [
    (dict(hidden=torch.zeros(2, 3, 4)), "hidden"),
    (dict(hidden=torch.zeros(2, 4, dtype=torch.int32)), "hidden"),
    (dict(weight=torch.zeros(6, 5)), "weight"),
    (dict(weight=torch.zeros(6)), "weight"),
    (dict(weight=torch.zeros(6, 4, dtype=torch.bfloat16)), "weight"),
    (dict(bias=torch.zeros(5)), "bias"),
    (dict(bias=torch.zeros(6, dtype=torch.float16)), "bias"),
    (dict(target=torch.zeros(3, dtype=torch.int64)), "target"),
    (dict(target=torch.zeros(2, dtype=torch.int32)), "target"),
    (dict(vocab=7), "vocab"),
    (dict(vocab=0), "vocab"),
    (dict(vocab=2.0), "vocab"),
    (dict(label_smoothing=1.5), "label_smoothing"),
    (dict(label_smoothing=-0.1), "label_smoothing"),
])
def test_bad_inputs_raise_value_error(bad, match):
    args = dict(hidden=torch.zeros(2, 4), weight=torch.zeros(6, 4), target=torch.zeros(2, dtype=torch.int64),
                vocab=5, bias=torch.zeros(6), label_smoothing=0.0)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(**args)


@pytest.mark.gpu
def test_gpu_matches_reference_at_gpt2_shape():
    """bf16 at GPT-2's padded vocabulary (BLOCK 8192: a masked tail chunk holding the padding)."""
    vocab, padded = 50257, 50304
    h, w, b, target = _inputs(2048, 768, vocab, padded, torch.bfloat16, seed=14, ignore_every=7)
    h, w, b, target = h.cuda(), w.cuda(), b.cuda(), target.cuda()
    exact = _loss_and_grads(_torch_loss, h, w, b, target, vocab, 2.0, cast=torch.float64, label_smoothing=0.1)
    low = _loss_and_grads(_torch_loss, h, w, b, target, vocab, 2.0, label_smoothing=0.1)
    ours = _loss_and_grads(_dslab, h, w, b, target, vocab, 2.0, label_smoothing=0.1)
    _assert_within_twice_torch_error(ours, low, exact, torch.finfo(torch.bfloat16).eps, "gpu")
    assert torch.all(ours[2][vocab:] == 0) and torch.all(ours[3][vocab:] == 0)


@pytest.mark.gpu
def test_gpu_extra_memory_is_one_logits_buffer():
    n_rows, hidden, vocab, padded = 16384, 768, 50257, 50304
    h = torch.randn(n_rows, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(padded, hidden, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, vocab, (n_rows,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(linear_cross_entropy(h, w, target, vocab), (h, w))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    grad_bytes = sum(g.numel() * g.element_size() for g in grads)
    # The bf16 [N, Vp] buffer, the two gradients and their unscaled products, a few [N] vectors, and
    # cuBLAS's workspace where this is the process's first matmul. No second [N, Vp] tensor (as a
    # zero-filled gradient for the buffer would be).
    assert extra <= n_rows * padded * 2 + 2 * grad_bytes + 16 * n_rows * 4 + (64 << 20)
