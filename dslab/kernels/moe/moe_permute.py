"""The data movement around a mixture-of-experts layer's experts: tokens into an expert-ordered
buffer (permute) and the experts' outputs back to token order, weighted by the gate (unpermute).

    x_perm[row_index[t, c]] = x[t]                                  x [T, H] -> x_perm [R, H]
    y[t] = sum_{c : row_index[t, c] >= 0} gate_weight[t, c] * y_perm[row_index[t, c]]

``row_index`` [T, k] (int32 or int64) holds the destination row of token t's c-th assignment in
the expert-ordered buffer of ``R = num_rows`` rows (in DeepSpeed-MoE, ``expert * capacity +
position``), or -1 where the assignment is dropped (over capacity). Rows no assignment targets are
zero in ``x_perm`` (capacity padding). A token whose assignments are all dropped gets zeros in
``y``: the MoE layer adds the residual itself. ``y`` is summed in fp32 and returned in
``y_perm``'s dtype; ``gate_weight`` is fp32.

Gradients:

    permute:    dx[t] = sum over kept c of dx_perm[row_index[t, c]]
    unpermute:  dy_perm[row_index[t, c]] = gate_weight[t, c] * dy[t]   (zero rows elsewhere)
                dgate_weight[t, c] = <dy[t], y_perm[row_index[t, c]]>  (fp32; 0 where dropped)

The caller's contract, unchecked on the Triton path (checking would synchronise with the device):
every entry of ``row_index`` is -1 or in ``[0, R)``, and no row is targeted by two assignments.
The Triton path treats an entry >= R as dropped; the reference raises an IndexError for it.

Layers: :func:`moe_permute_reference` / :func:`moe_unpermute_reference` (PyTorch) → the
``dslab::moe_permute`` / ``dslab::moe_unpermute`` custom ops with their autograd
(``dslab::moe_permute_backward``, ``dslab::moe_unpermute_backward``) under ``torch.compile``, and
``autograd.Function``\\ s making the same launches in eager mode (see :mod:`dslab.kernels.norm.layer_norm`)
→ the Triton kernels in :mod:`dslab.kernels.moe.moe_permute_triton` (row gathers and token gather-sums,
no atomics, no host synchronisation). :func:`moe_permute` and :func:`moe_unpermute` pick between
them with :func:`dslab.kernels.dispatch.use_triton`.
"""

from __future__ import annotations

import functools

import torch

from dslab.kernels.dispatch import use_custom_op, use_triton

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _scratch_rows(row_index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``row_index`` flattened token-major as int64, dropped entries sent to a scratch row
    ``num_rows`` past the end."""
    flat = row_index.reshape(-1).long()
    return torch.where(flat >= 0, flat, num_rows)


def moe_permute_reference(x: torch.Tensor, row_index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The PyTorch reference: ``index_copy`` of each token's k copies into a zero buffer with one
    scratch row for the dropped assignments, which is then cut off."""
    k = row_index.shape[1]
    padded = x.new_zeros((num_rows + 1, x.shape[1]))
    padded = padded.index_copy(0, _scratch_rows(row_index, num_rows), x.repeat_interleave(k, dim=0))
    return padded[:num_rows]


def moe_unpermute_reference(
    y_perm: torch.Tensor, row_index: torch.Tensor, gate_weight: torch.Tensor
) -> torch.Tensor:
    """The PyTorch reference in fp32: dropped assignments read an appended zero row."""
    tokens, k = row_index.shape
    rows = torch.cat([y_perm.float(), y_perm.new_zeros((1, y_perm.shape[1]), dtype=torch.float32)])
    chosen = rows.index_select(0, _scratch_rows(row_index, y_perm.shape[0])).view(tokens, k, -1)
    return (gate_weight.unsqueeze(-1) * chosen).sum(dim=1).to(y_perm.dtype)


@torch.library.custom_op("dslab::moe_permute", mutates_args=())
def _moe_permute_op(x: torch.Tensor, row_index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """x_perm [num_rows, H] from ``x`` [T, H] and ``row_index`` [T, k]."""
    from dslab.kernels.moe import moe_permute_triton

    return moe_permute_triton.permute(x, row_index, num_rows)


@_moe_permute_op.register_fake
def _(x, row_index, num_rows):
    return x.new_empty((num_rows, x.shape[1]))


@torch.library.custom_op("dslab::moe_permute_backward", mutates_args=())
def _moe_permute_backward_op(dx_perm: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
    """dx [T, H] from ``dx_perm`` [R, H] and ``row_index`` [T, k]."""
    from dslab.kernels.moe import moe_permute_triton

    return moe_permute_triton.permute_backward(dx_perm, row_index)


@_moe_permute_backward_op.register_fake
def _(dx_perm, row_index):
    return dx_perm.new_empty((row_index.shape[0], dx_perm.shape[1]))


def _setup_permute(ctx, inputs, output):
    _x, row_index, _num_rows = inputs
    ctx.save_for_backward(row_index)


def _backward_permute(ctx, dx_perm):
    (row_index,) = ctx.saved_tensors
    return _moe_permute_backward_op(dx_perm, row_index), None, None


_moe_permute_op.register_autograd(_backward_permute, setup_context=_setup_permute)


@torch.library.custom_op("dslab::moe_unpermute", mutates_args=())
def _moe_unpermute_op(y_perm: torch.Tensor, row_index: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """y [T, H] from ``y_perm`` [R, H], ``row_index`` [T, k] and ``gate_weight`` [T, k]."""
    from dslab.kernels.moe import moe_permute_triton

    return moe_permute_triton.unpermute(y_perm, row_index, gate_weight)


@_moe_unpermute_op.register_fake
def _(y_perm, row_index, gate_weight):
    return y_perm.new_empty((row_index.shape[0], y_perm.shape[1]))


@torch.library.custom_op("dslab::moe_unpermute_backward", mutates_args=())
def _moe_unpermute_backward_op(
    dy: torch.Tensor,
    y_perm: torch.Tensor,
    row_index: torch.Tensor,
    gate_weight: torch.Tensor,
    need_y_perm_grad: bool,
    need_gate_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy_perm [R, H], dgate_weight [T, k] fp32); an empty tensor for each one not needed."""
    from dslab.kernels.moe import moe_permute_triton

    dy_perm, dgate = moe_permute_triton.unpermute_backward(
        dy, y_perm, row_index, gate_weight, need_y_perm_grad, need_gate_grad
    )
    return (dy_perm if dy_perm is not None else y_perm.new_empty(0),
            dgate if dgate is not None else gate_weight.new_empty(0))


@_moe_unpermute_backward_op.register_fake
def _(dy, y_perm, row_index, gate_weight, need_y_perm_grad, need_gate_grad):
    return (y_perm.new_empty(y_perm.shape) if need_y_perm_grad else y_perm.new_empty(0),
            gate_weight.new_empty(gate_weight.shape) if need_gate_grad else gate_weight.new_empty(0))


def _setup_unpermute(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward_unpermute(ctx, dy):
    y_perm, row_index, gate_weight = ctx.saved_tensors
    need_y_perm_grad, need_gate_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    dy_perm, dgate = _moe_unpermute_backward_op(dy, y_perm, row_index, gate_weight, need_y_perm_grad, need_gate_grad)
    return (dy_perm if need_y_perm_grad else None), None, (dgate if need_gate_grad else None)


_moe_unpermute_op.register_autograd(_backward_unpermute, setup_context=_setup_unpermute)


@functools.cache
def _triton_module():
    from dslab.kernels.moe import moe_permute_triton

    return moe_permute_triton


class _EagerMoePermute(torch.autograd.Function):
    """``dslab::moe_permute``'s launches for eager mode."""

    @staticmethod
    def forward(ctx, x, row_index, num_rows):
        ctx.save_for_backward(row_index)
        return _triton_module().permute(x, row_index, num_rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dx_perm):
        (row_index,) = ctx.saved_tensors
        return _triton_module().permute_backward(dx_perm, row_index), None, None


class _EagerMoeUnpermute(torch.autograd.Function):
    """``dslab::moe_unpermute``'s launches for eager mode."""

    @staticmethod
    def forward(ctx, y_perm, row_index, gate_weight):
        ctx.save_for_backward(y_perm, row_index, gate_weight)
        return _triton_module().unpermute(y_perm, row_index, gate_weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        y_perm, row_index, gate_weight = ctx.saved_tensors
        dy_perm, dgate = _triton_module().unpermute_backward(
            dy, y_perm, row_index, gate_weight, ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        )
        return dy_perm, None, dgate


def _check_row_index(row_index: torch.Tensor) -> None:
    if row_index.dim() != 2:
        raise ValueError(f"row_index must be [T, k], got shape {tuple(row_index.shape)}")
    if row_index.dtype not in INDEX_DTYPES:
        raise ValueError(f"row_index must be int32 or int64, got {row_index.dtype}")


def _check_device(name: str, t: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    if t.device != like.device:
        raise ValueError(f"{name} must be on {like_name}'s device {like.device}, got {t.device}")


def moe_permute(x: torch.Tensor, row_index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Tokens ``x`` [T, H] into the expert-ordered buffer ``x_perm`` [num_rows, H] (x's dtype).

    ``row_index`` [T, k] (int32/int64): destination row of each assignment, -1 when dropped; rows
    nothing targets are zero. Gradients flow to x. The Triton path runs on CUDA tensors (or under
    the ``triton`` backend with ``TRITON_INTERPRET=1``) for fp32/fp16/bf16; otherwise the reference
    runs. See the module docstring for the contract on ``row_index``.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    _check_row_index(row_index)
    if row_index.shape[0] != x.shape[0]:
        raise ValueError(f"row_index must have one row per token of x ({x.shape[0]}), got {row_index.shape[0]}")
    _check_device("row_index", row_index, x, "x")
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    if not (x.dtype in TRITON_DTYPES and use_triton(x, row_index)):
        return moe_permute_reference(x, row_index, num_rows)
    if use_custom_op():
        return _moe_permute_op(x, row_index, num_rows)
    return _EagerMoePermute.apply(x, row_index, num_rows)


def moe_unpermute(y_perm: torch.Tensor, row_index: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """Expert outputs ``y_perm`` [R, H] back to token order, ``y`` [T, H] in y_perm's dtype.

    ``y[t] = sum over kept c of gate_weight[t, c] * y_perm[row_index[t, c]]``, in fp32, with
    ``row_index`` [T, k] (int32/int64, -1 when dropped) and ``gate_weight`` [T, k] fp32. Gradients
    flow to y_perm and gate_weight. The Triton path runs on CUDA tensors (or under the ``triton``
    backend with ``TRITON_INTERPRET=1``) for fp32/fp16/bf16; otherwise the reference runs.
    """
    if y_perm.dim() != 2:
        raise ValueError(f"y_perm must be [R, H], got shape {tuple(y_perm.shape)}")
    if not y_perm.is_floating_point():
        raise ValueError(f"y_perm must be a floating-point tensor, got {y_perm.dtype}")
    _check_row_index(row_index)
    if gate_weight.shape != row_index.shape:
        raise ValueError(
            f"gate_weight must have row_index's shape {tuple(row_index.shape)}, got {tuple(gate_weight.shape)}"
        )
    if gate_weight.dtype != torch.float32:
        raise ValueError(f"gate_weight must be float32, got {gate_weight.dtype}")
    _check_device("row_index", row_index, y_perm, "y_perm")
    _check_device("gate_weight", gate_weight, y_perm, "y_perm")
    if not (y_perm.dtype in TRITON_DTYPES and use_triton(y_perm, row_index, gate_weight)):
        return moe_unpermute_reference(y_perm, row_index, gate_weight)
    if use_custom_op():
        return _moe_unpermute_op(y_perm, row_index, gate_weight)
    return _EagerMoeUnpermute.apply(y_perm, row_index, gate_weight)
