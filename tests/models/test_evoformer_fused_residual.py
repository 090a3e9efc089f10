"""The dslab set's Evoformer block with each residual add fused into the LayerNorm that reads its
result (``dslab.kernels.norm.layer_norm`` with ``residual=``), on the Triton kernels under the
interpreter: the same outputs and gradients as the torch set's block, and no separate add of a
residual-stream tensor forward or backward beyond the block's last one and the accumulation of its
inputs' gradients."""

import pytest
import torch
from test_evoformer import HAVE_DSLAB_ATTENTION, TOL, _assert_close, _config, _inputs, _run, _stacks
from torch.utils._python_dispatch import TorchDispatchMode

from dslab.kernels import dispatch, kernel_backend
from dslab.models.evoformer import AF2_MSA_DROPOUT, AF2_PAIR_DROPOUT

pytestmark = pytest.mark.skipif(
    not (HAVE_DSLAB_ATTENTION and dispatch.triton_available() and dispatch.interpreting()),
    reason="needs dslab.kernels.evoformer.evoformer_attention, triton and TRITON_INTERPRET=1")

# A small odd crop: slow under the interpreter otherwise, and no other tensor of the block shares
# the shape of m [1, 3, 5, 32] or of z [1, 5, 5, 16].
CROP = dict(blocks=1, n_seq=3, n_res=5)
SUBLAYERS = {
    "msa_att_row": lambda block, m, z, mm, pm: block.msa_att_row(m, z, mm),
    "msa_att_col": lambda block, m, z, mm, pm: block.msa_att_col(m, mm),
    "msa_transition": lambda block, m, z, mm, pm: block.msa_transition(m, mm),
    "outer_product_mean": lambda block, m, z, mm, pm: block.outer_product_mean(m, mm),
    "tri_mul_out": lambda block, m, z, mm, pm: block.tri_mul_out(z, pm),
    "tri_mul_in": lambda block, m, z, mm, pm: block.tri_mul_in(z, pm),
    "tri_att_start": lambda block, m, z, mm, pm: block.tri_att_start(z, pm),
    "tri_att_end": lambda block, m, z, mm, pm: block.tri_att_end(z, pm),
    "pair_transition": lambda block, m, z, mm, pm: block.pair_transition(z, pm),
}


@pytest.mark.parametrize("dropout", [False, True])
def test_triton_block_matches_the_torch_set(dropout):
    """Outputs and the gradients of m, z and every parameter. With AF2's dropout both sets draw
    the same masks from one seed (the dslab set applies each to its update before the fused add)."""
    rates = dict(msa_dropout=AF2_MSA_DROPOUT, pair_dropout=AF2_PAIR_DROPOUT) if dropout else {}
    config = _config(**CROP, **rates)
    models = _stacks(config, ["torch", "dslab"])
    inputs = _inputs(12, config, batch=1)
    results = {}
    for name, model in models.items():
        block = model.blocks[0]
        torch.manual_seed(5)
        with kernel_backend("triton" if name == "dslab" else "torch"):
            results[name] = _run(block, block, inputs)
    (ref_out, ref_grads), (out, grads) = results["torch"], results["dslab"]
    for ours, ref, x in zip(out, ref_out, inputs[:2], strict=True):
        torch.testing.assert_close(ours - x, ref - x, **TOL)
    assert grads.keys() == ref_grads.keys() and {"input0", "input1"} <= grads.keys()
    for name, ref in ref_grads.items():
        _assert_close(grads[name], ref, name)


class _AddCounter(TorchDispatchMode):
    """Counts the ``aten.add`` / ``aten.add_`` calls whose output has one of ``shapes``."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes = {tuple(s) for s in shapes}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.add, torch.ops.aten.add_) \
                and isinstance(out, torch.Tensor) and tuple(out.shape) in self.shapes:
            self.count += 1
        return out


def _count_adds(call, module, tensors, shapes) -> tuple[int, int]:
    """Adds of ``shapes`` in the forward of ``call(*tensors)`` and in the backward of a loss of
    all its outputs, with the float 4-D inputs as leaves; on the Triton kernels."""
    leaves = [t.clone().requires_grad_(t.dtype.is_floating_point and t.dim() == 4) for t in tensors]
    module.zero_grad(set_to_none=True)
    with kernel_backend("triton"):
        with _AddCounter(shapes) as forward:
            out = call(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        loss = sum((o * torch.randn_like(o)).sum() for o in outs)
        with _AddCounter(shapes) as backward:
            loss.backward()
    assert any(t.grad is not None for t in leaves)
    return forward.count, backward.count


def test_residual_adds_are_fused_into_the_layer_norms():
    """On the H100 profile at N_seq 128 x N_res 256 the separate residual adds and the backward's
    accumulation of each stream's gradient cost ~1 ms of a 27 ms step. Fused, the forward keeps
    one add of a stream's shape (the block's last, ``z5 + u_pt``, which the next block's first
    LayerNorms read) and the backward two (the gradients of the block's inputs m and z, each read by
    the row attention's LayerNorm and by the first fused add) besides the adds inside the
    sublayers themselves (the triangle attentions read their normalised input twice: the triangle
    bias and the fused q/k/v/gate projections), counted here by running each sublayer alone. The
    unfused block makes 9 adds forward and 10 more backward."""
    config = _config(**CROP)
    block = _stacks(config, ["dslab"])["dslab"].blocks[0]
    inputs = _inputs(13, config, batch=1)
    shapes = [inputs[0].shape, inputs[1].shape]
    torch.manual_seed(0)
    inside = 0
    for name, call in SUBLAYERS.items():
        sub_forward, sub_backward = _count_adds(
            lambda *t, call=call: call(block, *t), getattr(block, name), inputs, shapes)
        assert sub_forward == 0, name
        inside += sub_backward
    assert inside == 2  # the two triangle attentions
    forward, backward = _count_adds(block, block, inputs, shapes)
    assert (forward, backward) == (1, 2 + inside)
