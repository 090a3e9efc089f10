"""The dslab Evoformer's one-pass weight cast (:mod:`dslab.models.weight_cast`): under autocast the
stack casts its Linear weights in one pass and their gradients back in one; the loss and every
gradient are bit-identical to per-weight casts (with and without activation checkpointing), and no
per-weight cast of those weights is left in the forward or the backward."""

import contextlib

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import dslab.models.evoformer as evoformer
from dslab.bench.evoformer import EvoformerTrainModel, evoformer_batch
from dslab.kernels import dispatch, kernel_backend
from dslab.models.evoformer import evoformer_tiny
from dslab.models.evoformer_blocks import OuterProductMean, cast_once_weights
from dslab.models.weight_cast import autocast_dtype, cast_weights, use_casts, weight

needs_interpreter = pytest.mark.skipif(
    not (dispatch.triton_available() and dispatch.interpreting()),
    reason="needs triton and TRITON_INTERPRET=1 (the dslab set's kernels on the CPU)")
# Crops of 3 sequences x 4 residues, one of each padded (bench.evoformer's masks): distinct sizes,
# every attention (row, column, triangle) at few interpreted programs per launch.
N_SEQ, N_RES = 3, 4


def test_weight_outside_a_scope_is_the_parameter():
    p = nn.Parameter(torch.randn(3, 4))
    assert weight(p) is p
    with cast_weights([p], None) as casts:
        assert casts == {} and weight(p) is p
    with cast_weights([p], torch.float32) as casts:
        assert casts == {} and weight(p) is p


def test_cast_values_and_gradients():
    """Each cast equals ``p.to(dtype)``; gradients come back in fp32 equal to the per-weight cast's,
    a weight whose cast is unused gets None, nested scopes resolve innermost first."""
    torch.manual_seed(0)
    a, b, c = (nn.Parameter(torch.randn(*shape)) for shape in ((5, 3), (7,), (2, 2)))
    x = torch.randn(4, 3)
    with cast_weights([a, b, c], torch.bfloat16) as casts:
        assert set(casts) == {id(a), id(b), id(c)}
        for p in (a, b, c):
            assert weight(p).dtype == torch.bfloat16
            assert torch.equal(weight(p), p.detach().to(torch.bfloat16))
        y = (x.to(torch.bfloat16) @ weight(a).t()).float().pow(2).sum() + weight(b).float().sum() * 3
        inner = nn.Parameter(torch.randn(2))
        with cast_weights([inner], torch.float16):
            assert weight(inner).dtype == torch.float16 and weight(a).dtype == torch.bfloat16
        assert weight(inner) is inner
    assert weight(a) is a
    y.backward()
    ref_a = a.detach().to(torch.bfloat16).requires_grad_()
    ((x.to(torch.bfloat16) @ ref_a.t()).float().pow(2).sum()).backward()
    assert a.grad.dtype == torch.float32 and torch.equal(a.grad, ref_a.grad.float())
    assert torch.equal(b.grad, torch.full_like(b, 3.0))
    assert c.grad is None


def test_use_casts_reenters_a_mapping():
    p = nn.Parameter(torch.randn(3))
    with cast_weights([p], torch.bfloat16) as casts:
        cast = weight(p)
    assert weight(p) is p
    with use_casts(casts):
        assert weight(p) is cast


def test_autocast_dtype():
    assert autocast_dtype("cpu") is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_dtype("cpu") == torch.bfloat16


def test_cast_once_weights_leaves_out_the_opm_projection_and_biases():
    model = evoformer.EvoformerStack(evoformer_tiny(blocks=1), kernels="dslab")
    chosen = {id(p) for p in cast_once_weights(model.blocks)}
    opm = next(m for m in model.modules() if isinstance(m, OuterProductMean))
    assert id(opm.linear_out.weight) not in chosen
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(chosen) == len(linears) - 1
    assert all(id(m.bias) not in chosen for m in linears if m.bias is not None)


@contextlib.contextmanager
def _per_weight_casts():
    """The stack without the one-pass cast: autocast casts each weight where it is used."""
    @contextlib.contextmanager
    def no_cast(params, dtype):
        yield {}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(evoformer, "cast_weights", no_cast)
        yield


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(batch["m"], batch["z"], batch["msa_mask"], batch["pair_mask"])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class _CastCounter(TorchDispatchMode):
    """Counts dtype conversions (``_to_copy``) of tensors shaped like one of ``shapes``."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.count = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_):
            src = args[1] if func.overloadpacket is torch.ops.aten.copy_ else args[0]
            dst_dtype = args[0].dtype if func.overloadpacket is torch.ops.aten.copy_ else (kwargs or {}).get("dtype")
            if tuple(src.shape) in self.shapes and dst_dtype is not None and dst_dtype != src.dtype:
                self.count += 1
        return func(*args, **(kwargs or {}))


def _per_weight_and_one_pass(checkpoint_blocks: bool, counted: bool) -> tuple[dict, int, int]:
    """One bf16 autocast training step of the same model on the same batch (on the Triton kernels),
    with per-weight casts and with the one-pass cast: ``({"per_weight" | "one_pass": (loss,
    gradients, per-weight casts of the chosen weights counted or None)}, chosen weights,
    parameters)``. ``counted`` runs both steps under :class:`_CastCounter`, a dispatch mode, so
    the kernels go through their custom ops; uncounted, through their eager autograd Functions.

    Without checkpointing one block: every chosen weight of a block is cast in the one pass,
    forward and backward, and a second block would only repeat that. With checkpointing two
    blocks, so that the second is recomputed in the backward before the first, both under the
    casts the forward made (``use_casts``)."""
    config = evoformer_tiny(blocks=2 if checkpoint_blocks else 1, n_seq=N_SEQ, n_res=N_RES,
                            checkpoint_blocks=checkpoint_blocks)
    torch.manual_seed(3)
    model = EvoformerTrainModel(config, kernels="dslab")
    batch = evoformer_batch(config, 1, torch.bfloat16, 7, "cpu")
    chosen = cast_once_weights(model.stack.blocks)
    counter_shapes = {tuple(p.shape) for p in chosen}
    runs = {}
    with kernel_backend("triton"):
        for name, ctx in (("per_weight", _per_weight_casts()), ("one_pass", contextlib.nullcontext())):
            counter = _CastCounter(counter_shapes) if counted else contextlib.nullcontext()
            with ctx, counter:
                loss, grads = _step(model, batch)
            runs[name] = (loss, grads, counter.count if counted else None)
    return runs, len(chosen), len(list(model.parameters()))


def _assert_bit_identical(runs: dict, n_params: int) -> None:
    (ref_loss, ref_grads, _), (loss, grads, _) = runs["per_weight"], runs["one_pass"]
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and len(grads) == n_params
    for name, ref in ref_grads.items():
        assert grads[name].dtype == torch.float32, name
        assert torch.equal(grads[name], ref), name


@needs_interpreter
@pytest.mark.parametrize("checkpoint_blocks", [False, True])
def test_bit_identical_to_per_weight_casts(checkpoint_blocks):
    runs, _, n_params = _per_weight_and_one_pass(checkpoint_blocks, counted=False)
    _assert_bit_identical(runs, n_params)


@needs_interpreter
def test_no_per_weight_casts_left():
    """Per-weight casts of the chosen weights, forward and backward: many without the one-pass
    cast, none with it (the flat buffers' casts have other shapes). On this path (the kernels'
    custom ops, under the counting dispatch mode) the one pass is bit-identical too."""
    runs, chosen, n_params = _per_weight_and_one_pass(False, counted=True)
    counts = {name: count for name, (_, _, count) in runs.items()}
    assert counts["per_weight"] >= chosen, counts
    assert counts["one_pass"] == 0, counts
    _assert_bit_identical(runs, n_params)
