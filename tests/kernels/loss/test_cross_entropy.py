"""softmax_cross_entropy: the Triton kernels (under the interpreter on CPU) against PyTorch.

Errors are measured against float64 ``F.cross_entropy`` and must stay within twice PyTorch's own
error in the same precision (plus a few ulps for fp32, where both are at rounding level).
"""

import pytest
import torch
import torch.nn.functional as F

from dslab.kernels import kernel_backend

from dslab.kernels.loss import cross_entropy as ce
from dslab.kernels.loss.cross_entropy import softmax_cross_entropy
from dispatch_recorder import DispatchRecorder

IGNORE = -100


def _inputs(n_rows, vocab, dtype, seed=0, ignore_every=5):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n_rows, vocab, generator=gen) * 3 + 2).to(dtype)
    target = torch.randint(0, vocab, (n_rows,), generator=gen)
    target[::ignore_every] = IGNORE
    return logits, target


def _loss_and_grad(fn, logits, target, grad_out, **kwargs):
    x = logits.detach().clone().requires_grad_()
    loss = fn(x, target, ignore_index=IGNORE, **kwargs)
    (loss * grad_out).backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_triton_matches_float64_reference(dtype, smoothing):
    logits, target = _inputs(37, 1000, dtype)  # 1000 = 7 blocks of 128 and a masked tail
    grad_out = 2.5
    exact_loss, exact_grad = _loss_and_grad(F.cross_entropy, logits.double(), target, grad_out,
                                            label_smoothing=smoothing)
    torch_loss, torch_grad = _loss_and_grad(F.cross_entropy, logits, target, grad_out, label_smoothing=smoothing)
    with kernel_backend("triton"):
        loss, grad = _loss_and_grad(softmax_cross_entropy, logits, target, grad_out, label_smoothing=smoothing)

    assert loss.dtype == torch.float32 and loss.shape == ()
    assert grad.dtype == dtype
    # fp32: both sides sit at rounding level, so allow a few ulps of the values themselves.
    ulps = 8 * torch.finfo(torch.float32).eps if dtype == torch.float32 else 0.0
    loss_floor, grad_floor = ulps * exact_loss.abs().item(), ulps * exact_grad.abs().max().item()
    torch_loss_err = (torch_loss.double() - exact_loss).abs().item()
    assert (loss.double() - exact_loss).abs().item() <= 2 * torch_loss_err + loss_floor
    torch_grad_err = (torch_grad.double() - exact_grad).abs().max().item()
    assert (grad.double() - exact_grad).abs().max().item() <= 2 * torch_grad_err + grad_floor
    assert torch.all(grad[target == IGNORE] == 0)


def test_fp16_and_strided_rows():
    wide, target = _inputs(9, 300, torch.float16, seed=1, ignore_every=4)
    wide = torch.cat([wide, wide], dim=1)
    logits = wide[:, :300]  # row stride 600, unit column stride: read in place
    target = torch.stack([target, target], dim=1)[:, 0]  # a strided target
    exact_loss, exact_grad = _loss_and_grad(F.cross_entropy, logits.double(), target, 1.0)
    with kernel_backend("triton"):
        loss, grad = _loss_and_grad(softmax_cross_entropy, logits, target, 1.0)
    torch.testing.assert_close(loss.double(), exact_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), exact_grad, rtol=2e-3, atol=1e-5)


def test_all_rows_ignored_gives_nan_and_zero_gradient():
    logits, target = _inputs(6, 200, torch.float32)
    target[:] = IGNORE
    with kernel_backend("triton"):
        loss, grad = _loss_and_grad(softmax_cross_entropy, logits, target, 1.0)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(logits, target))
    assert torch.all(grad == 0)


def test_out_of_range_target_makes_the_loss_nan_on_the_triton_path():
    logits, target = _inputs(4, 200, torch.float32)
    target[1] = 200
    with kernel_backend("triton"):
        loss = softmax_cross_entropy(logits, target)
    assert torch.isnan(loss)


def test_no_fp32_copy_of_the_logits():
    n_rows, vocab = 8, 300
    logits, target = _inputs(n_rows, vocab, torch.bfloat16)
    with DispatchRecorder() as recorder:
        _, lse = ce.cross_entropy_forward_triton(logits, target, IGNORE, 0.1)
        grad = ce.cross_entropy_backward_triton(torch.tensor(1.0), logits, target, lse, IGNORE, 0.1)
    # (The interpreter's own byte copies of the arguments show up too, as uint8.)
    fp32_sizes = [torch.Size(shape).numel() for shape, dtype in recorder.outputs if dtype == torch.float32]
    assert max(fp32_sizes) < n_rows * vocab
    assert ((n_rows, vocab), torch.bfloat16) in recorder.outputs  # the gradient, in the logits' dtype
    assert lse.shape == (n_rows,) and lse.dtype == torch.float32 and grad.dtype == torch.bfloat16


def test_custom_op_registration():
    logits, target = _inputs(5, 50, torch.float32)
    logits.requires_grad_()
    torch.library.opcheck(torch.ops.dslab.cross_entropy_forward.default, (logits, target, IGNORE, 0.1),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_torch_compile_traces_through_the_op():
    logits, target = _inputs(11, 257, torch.bfloat16)

    def step(x, t):
        return softmax_cross_entropy(x, t, ignore_index=IGNORE, label_smoothing=0.05) * 3.0

    with kernel_backend("triton"):
        eager_loss, eager_grad = _loss_and_grad(lambda x, t, **_: step(x, t), logits, target, 1.0)
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        loss, grad = _loss_and_grad(lambda x, t, **_: compiled(x, t), logits, target, 1.0)
    torch.testing.assert_close(loss, eager_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, eager_grad, rtol=0, atol=0)


def test_reference_runs_on_cpu_by_default():
    logits, target = _inputs(7, 100, torch.float32)
    with kernel_backend("auto"):
        loss = softmax_cross_entropy(logits, target, ignore_index=IGNORE, label_smoothing=0.2)
    torch.testing.assert_close(loss, F.cross_entropy(logits, target, ignore_index=IGNORE, label_smoothing=0.2))


@pytest.mark.parametrize("bad", [
    dict(logits=torch.zeros(2, 3, 4)),
    dict(logits=torch.zeros(2, 3, dtype=torch.float64)),
    dict(target=torch.zeros(3, dtype=torch.int64)),
    dict(target=torch.zeros(2, dtype=torch.int32)),
    dict(label_smoothing=1.5),
])
def test_bad_inputs_raise_value_error(bad):
    args = dict(logits=torch.zeros(2, 3), target=torch.zeros(2, dtype=torch.int64), label_smoothing=0.0)
    args.update(bad)
    with pytest.raises(ValueError):
        softmax_cross_entropy(args["logits"], args["target"], label_smoothing=args["label_smoothing"])


@pytest.mark.gpu
def test_gpu_matches_reference_at_vocabulary_size():
    logits, target = _inputs(2048, 50304, torch.bfloat16, ignore_every=7)
    logits, target = logits.cuda(), target.cuda()
    exact_loss, exact_grad = _loss_and_grad(F.cross_entropy, logits.double(), target, 1.0, label_smoothing=0.1)
    torch_loss, torch_grad = _loss_and_grad(F.cross_entropy, logits, target, 1.0, label_smoothing=0.1)
    loss, grad = _loss_and_grad(softmax_cross_entropy, logits, target, 1.0, label_smoothing=0.1)
    assert (loss.double() - exact_loss).abs() <= 2 * (torch_loss.double() - exact_loss).abs() + 1e-5
    assert (grad.double() - exact_grad).abs().max() <= 2 * (torch_grad.double() - exact_grad).abs().max()


@pytest.mark.gpu
def test_gpu_extra_memory_is_the_gradient_only():
    n_rows, vocab = 16384, 50304
    logits = torch.randn(n_rows, vocab, device="cuda", dtype=torch.bfloat16).requires_grad_()
    target = torch.randint(0, vocab, (n_rows,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    (grad,) = torch.autograd.grad(softmax_cross_entropy(logits, target), logits)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert grad.dtype == torch.bfloat16
    grad_bytes = n_rows * vocab * 2
    assert extra <= grad_bytes + 16 * n_rows * 4 + (1 << 20)  # the bf16 gradient and a few [N] vectors
