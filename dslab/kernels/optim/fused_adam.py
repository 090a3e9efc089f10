"""Adam / AdamW whose step updates every parameter of a group in one multi-tensor Triton launch.

Per element, with ``g`` the gradient, ``lr``, ``beta1``, ``beta2``, ``eps``, ``wd`` the group's
hyperparameters and ``k`` the step count after incrementing:

    AdamW (adam_w_mode=True):  p = p * (1 - lr * wd)              (decoupled decay)
    Adam  (adam_w_mode=False): g = g + wd * p                       (L2 penalty in the gradient)
    m = m + (1 - beta1) * (g - m)                                   (torch's lerp)
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr / (1 - beta1**k) * m / (sqrt(v) / sqrt(1 - beta2**k) + eps)

as ``torch.optim.AdamW`` and ``torch.optim.Adam`` (``bias_correction=False`` drops both
``1 - beta**k`` factors). Parameters, gradients and the states ``exp_avg`` (m) and ``exp_avg_sq``
(v) are fp32. Optional bf16/fp16 copies of the parameters (see :meth:`FusedAdam.set_param_copies`)
are written in the same pass: ``copy = p.to(copy.dtype)`` after the update; when the model
computes with the copies, the gradient ``g`` is the copy's (bf16/fp16, read as it is and computed
with in fp32: 2 bytes read instead of 4). ``optimizer.grad_scale`` (a 0-d fp32 tensor, the
attribute torch's fused Adam reads) divides every gradient as it is read: the engine's clipping.

Multi-tensor launch: the parameters of one group that share a device, a step count and a copy
dtype form a bucket. A device table (int64, cached while the tensors' addresses are unchanged)
holds per tensor the addresses of p, g, m, v and the copy and its numel, and per chunk of
``CHUNK`` elements the tensor index and the chunk's start. Program ``i`` updates chunk ``i``:
it reads its row of the table, casts the addresses with ``tl.pointer_type`` (the interpreter
supports this too, so the CPU tests run the same kernel) and streams the chunk in ``BLOCK``-wide
unmasked, 16-byte-vectorised blocks (masked only in a tensor's last chunk). Traffic per element:
read p, g, m, v (16 B), write p, m, v (12 B) and the copy (2 B): 30 B, ~11 GB for 367M params.

State: ``state[p]`` holds ``"step"`` (a Python float while training; :meth:`state_dict` gives a
0-d fp32 tensor like torch's and :meth:`load_state_dict` accepts either), ``"exp_avg"`` and
``"exp_avg_sq"``.
"""

import math

import torch

from dslab.kernels.dispatch import interpreting, use_triton

from dslab.kernels._triton_compat import cast_rounding as _cast
from dslab.kernels._triton_compat import jit as _jit
from dslab.kernels._triton_compat import tl, triton


_COPY_DTYPES = (torch.bfloat16, torch.float16)
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_TABLE_COLUMNS = 6  # param, grad, exp_avg, exp_avg_sq, copy (0 when none), numel: _adam_kernel


def adam_step_reference(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
    step: float, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    adam_w_mode: bool, bias_correction: bool, copy: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One Adam(W) update of one tensor in place (the formula of the module docstring), with ``g``
    the gradient in fp32 divided by ``grad_scale`` when given; ``grad`` is left as it is."""
    if grad.dtype != torch.float32:
        grad = grad.float()
    if grad_scale is not None:
        grad = grad / grad_scale.to(grad.device)
    if weight_decay != 0.0:
        if adam_w_mode:
            param.mul_(1.0 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    step_size, bias_correction2_sqrt = _bias_corrections(step, lr, beta1, beta2, bias_correction)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if copy is not None:
        copy.copy_(param)


def _bias_corrections(step, lr, beta1, beta2, bias_correction) -> tuple[float, float]:
    """(lr / (1 - beta1**step), sqrt(1 - beta2**step)), or (lr, 1) without bias correction."""
    if not bias_correction:
        return lr, 1.0
    return lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step)


# ---------------------------------------------------------------------------------------------
# The Triton kernel: one program per chunk of one tensor.
# ---------------------------------------------------------------------------------------------


@_jit
def _adam_block(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, copy_ptr, offsets, copy_offsets, limit,
    decay_factor, weight_decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size,
    bias_correction2_sqrt, grad_scale,
    DECOUPLED: tl.constexpr, HAS_COPY: tl.constexpr, MASKED: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
):
    """Update ``BLOCK`` elements at ``offsets`` (those below ``limit`` when ``MASKED``)."""
    if MASKED:
        mask = offsets < limit
        param = tl.load(param_ptr + offsets, mask=mask, other=0.0)
        grad = tl.load(grad_ptr + copy_offsets, mask=mask, other=0.0).to(tl.float32)
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0)
    else:
        param = tl.load(param_ptr + offsets)
        grad = tl.load(grad_ptr + copy_offsets).to(tl.float32)
        exp_avg = tl.load(exp_avg_ptr + offsets)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets)
    if HAS_GRAD_SCALE:
        grad = tl.div_rn(grad, grad_scale)
    if DECOUPLED:
        param = param * decay_factor
    else:
        grad = grad + weight_decay * param
    exp_avg = exp_avg + one_minus_beta1 * (grad - exp_avg)
    exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * (grad * grad)
    denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
    param = param - step_size * tl.div_rn(exp_avg, denom)
    if MASKED:
        tl.store(param_ptr + offsets, param, mask=mask)
        tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
        if HAS_COPY:
            tl.store(copy_ptr + copy_offsets, _cast(param, copy_ptr.dtype.element_ty, BF16_BY_HAND), mask=mask)
    else:
        tl.store(param_ptr + offsets, param)
        tl.store(exp_avg_ptr + offsets, exp_avg)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq)
        if HAS_COPY:
            tl.store(copy_ptr + copy_offsets, _cast(param, copy_ptr.dtype.element_ty, BF16_BY_HAND))


@_jit
def _column(entry, column: tl.constexpr, chunk_start, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    """The address in ``column`` of a table row, as a ``dtype`` pointer advanced to the chunk."""
    ptr = tl.load(entry + column).to(tl.pointer_type(dtype)) + chunk_start
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@_jit
def _adam_kernel(
    tensor_table, chunk_table,
    decay_factor, weight_decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size,
    bias_correction2_sqrt, grad_scale_ptr,
    DECOUPLED: tl.constexpr, HAS_COPY: tl.constexpr, COPY_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
):
    """Chunk ``pid``: ``chunk_table[pid] = (tensor index, start)``; ``tensor_table`` rows are
    ``(param, grad, exp_avg, exp_avg_sq, copy, numel)`` (6 int64). ``ALIGNED`` promises that
    every address is a multiple of 16 bytes, so that the blocks load as 16-byte vectors. The
    gradients are ``GRAD_DTYPE`` (fp32, or the bf16/fp16 gradients of the copies), divided by the
    fp32 scalar at ``grad_scale_ptr`` when ``HAS_GRAD_SCALE``."""
    chunk = tl.program_id(0)
    index = tl.load(chunk_table + 2 * chunk)
    start = tl.load(chunk_table + 2 * chunk + 1)
    entry = tensor_table + 6 * index
    param = _column(entry, 0, start, tl.float32, ALIGNED)
    grad = _column(entry, 1, start, GRAD_DTYPE, ALIGNED)
    exp_avg = _column(entry, 2, start, tl.float32, ALIGNED)
    exp_avg_sq = _column(entry, 3, start, tl.float32, ALIGNED)
    copy = _column(entry, 4, start, COPY_DTYPE, ALIGNED)
    remaining = tl.minimum(tl.load(entry + 5) - start, CHUNK).to(tl.int32)
    grad_scale = 1.0
    if HAS_GRAD_SCALE:
        grad_scale = tl.load(grad_scale_ptr)
    offsets = tl.arange(0, BLOCK)
    # Four elements per thread everywhere: the bf16 store's own choice (8, 16 bytes) would make the
    # compiler shuffle the fp32 results through shared memory between two layouts.
    copy_offsets = tl.max_contiguous(tl.arange(0, BLOCK), 4)
    if remaining >= CHUNK:
        for block in range(0, CHUNK, BLOCK):
            _adam_block(param + block, grad + block, exp_avg + block, exp_avg_sq + block, copy + block,
                        offsets, copy_offsets, BLOCK, decay_factor, weight_decay, one_minus_beta1, beta2,
                        one_minus_beta2, eps, step_size, bias_correction2_sqrt, grad_scale,
                        DECOUPLED, HAS_COPY, MASKED=False, BF16_BY_HAND=BF16_BY_HAND,
                        HAS_GRAD_SCALE=HAS_GRAD_SCALE)
    else:
        # A tensor's last chunk: whole blocks unmasked (vectorised), then one masked block.
        full_end = (remaining // BLOCK) * BLOCK
        for block in range(0, full_end, BLOCK):
            _adam_block(param + block, grad + block, exp_avg + block, exp_avg_sq + block, copy + block,
                        offsets, copy_offsets, BLOCK, decay_factor, weight_decay, one_minus_beta1, beta2,
                        one_minus_beta2, eps, step_size, bias_correction2_sqrt, grad_scale,
                        DECOUPLED, HAS_COPY, MASKED=False, BF16_BY_HAND=BF16_BY_HAND,
                        HAS_GRAD_SCALE=HAS_GRAD_SCALE)
        if full_end < remaining:
            _adam_block(param + full_end, grad + full_end, exp_avg + full_end, exp_avg_sq + full_end,
                        copy + full_end, offsets, copy_offsets, remaining - full_end, decay_factor, weight_decay,
                        one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt,
                        grad_scale, DECOUPLED, HAS_COPY, MASKED=True, BF16_BY_HAND=BF16_BY_HAND,
                        HAS_GRAD_SCALE=HAS_GRAD_SCALE)


def _launch_config() -> tuple[int, int, int]:
    """(CHUNK, BLOCK, num_warps). Under the interpreter small chunks, so that the CPU tests' small
    tensors span several chunks and exercise both the unmasked and the masked path."""
    if interpreting():
        return 512, 128, 4
    return 16384, 2048, 8


class _Bucket:
    """Tensors updated by one launch: params, grads, states and copies, in parallel lists."""

    __slots__ = ("params", "grads", "exp_avgs", "exp_avg_sqs", "copies")

    def __init__(self):
        self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.copies = [], [], [], [], []

    def add(self, param, grad, state, copy):
        self.params.append(param)
        self.grads.append(grad)
        self.exp_avgs.append(state["exp_avg"])
        self.exp_avg_sqs.append(state["exp_avg_sq"])
        self.copies.append(copy)

    def rows(self) -> list[int]:
        """The tensor table, flattened: 6 int64 per tensor (see ``_adam_kernel``)."""
        rows = []
        for p, g, m, v, c in zip(self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.copies):
            rows += (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0 if c is None else c.data_ptr(),
                     p.numel())
        return rows


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        # Pinned and asynchronous: a pageable copy would wait for all queued work (the backward).
        return table.pin_memory().to(device, non_blocking=True)
    return table


def _tensor_table(rows: list[int], device: torch.device) -> torch.Tensor:
    """The tensor table (see ``_adam_kernel``), 6 int64 per tensor, flat on ``device``. Rebuilt
    whenever an address changes: gradients are usually new tensors every step."""
    return _to_device(torch.tensor(rows, dtype=torch.int64), device)


def _chunk_table(numels: tuple[int, ...], chunk: int, device: torch.device) -> torch.Tensor:
    """The chunk table, (tensor index, start) as 2 int64 per chunk, flat on ``device``. It depends
    only on the tensors' sizes, so a step whose gradients moved keeps it (building it took ~3 ms of
    host time per step at GPT-2 124M's 148 tensors)."""
    chunks_per_tensor = (torch.tensor(numels, dtype=torch.int64) + chunk - 1) // chunk
    tensor_index = torch.repeat_interleave(torch.arange(len(numels)), chunks_per_tensor)
    first_chunk = torch.cumsum(chunks_per_tensor, 0) - chunks_per_tensor
    starts = (torch.arange(len(tensor_index)) - first_chunk[tensor_index]) * chunk
    return _to_device(torch.stack([tensor_index, starts], dim=1).flatten(), device)


class FusedAdam(torch.optim.Optimizer):
    """Adam (``adam_w_mode=False``) or AdamW (``adam_w_mode=True``) over fp32 parameters.

    Args:
        params: parameters or parameter groups, as for any ``torch.optim.Optimizer``; fp32 only.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (weight_decay defaults to 0).
        adam_w_mode: decoupled weight decay (AdamW) when true, L2 added to the gradient when false.
        bias_correction: divide by ``1 - beta**step`` as torch does; false drops it.
        amsgrad: accepted for signature compatibility; true raises ``ValueError``.

    ``step`` skips parameters whose ``grad`` is None and raises ``RuntimeError`` on sparse or
    non-fp32 grads. On CUDA (or with the ``triton`` backend under ``TRITON_INTERPRET=1``) each
    group's update is one Triton launch per (device, step count, copy dtype) bucket, usually one;
    otherwise :func:`adam_step_reference` runs per tensor. A parameter whose tensors are not all
    contiguous always takes the reference.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 adam_w_mode=True, bias_correction=True, amsgrad=False):
        if amsgrad:
            raise ValueError("amsgrad=True is not supported by FusedAdam")
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two values in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adam_w_mode=adam_w_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)
        self._copies: dict[torch.Tensor, torch.Tensor] = {}
        self._grads_from_copies = False
        # (group, device, copy dtype, grad dtype, chunk) -> (addresses, aligned, tensor table, chunk table)
        self._tables: dict[tuple, tuple] = {}

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        for param in self.param_groups[-1]["params"]:
            if param.dtype != torch.float32:
                self.param_groups.pop()
                raise ValueError(f"FusedAdam keeps fp32 parameters, got a {param.dtype} parameter of shape "
                                 f"{tuple(param.shape)}; keep fp32 masters and use set_param_copies for bf16")

    def set_param_copies(self, copies: list[torch.Tensor | None], grads_from_copies: bool = False) -> None:
        """Register low-precision copies that every step overwrites with ``param.to(copy.dtype)``.

        ``copies`` is aligned with the parameters of all groups in order (``None`` for a
        parameter without a copy); each copy is a bf16 or fp16 tensor of its parameter's shape on
        its device, e.g. the bf16 weights a model computes with while the optimizer keeps fp32
        masters. Copies are filled from the parameters now, and after each step for the
        parameters that step updated (in the same kernel pass on the Triton path: 2 more bytes
        per element). Calling it again replaces the whole set.

        With ``grads_from_copies`` a parameter with a copy takes its gradient from the copy's
        ``.grad`` (the model computed with the copy, so autograd left the gradient there, in the
        copy's dtype; the kernel reads it as it is and computes in fp32). A parameter whose
        ``.grad`` is set as well is an error at the step: it was read around its copy.
        """
        params = [p for group in self.param_groups for p in group["params"]]
        if len(copies) != len(params):
            raise ValueError(f"copies has {len(copies)} entries for {len(params)} parameters")
        registered = {}
        for i, (param, copy) in enumerate(zip(params, copies)):
            if copy is None:
                continue
            if copy.dtype not in _COPY_DTYPES:
                raise ValueError(f"copies[{i}] must be bfloat16 or float16, got {copy.dtype}")
            if copy.shape != param.shape or copy.device != param.device:
                raise ValueError(f"copies[{i}] must match its parameter's shape {tuple(param.shape)} and "
                                 f"device {param.device}, got {tuple(copy.shape)} on {copy.device}")
            registered[param] = copy
        with torch.no_grad():
            for param, copy in registered.items():
                copy.copy_(param)
        self._copies = registered
        self._grads_from_copies = bool(grads_from_copies)

    def param_copies(self) -> list[torch.Tensor]:
        """The registered copies (the tensors a model computes with), in parameter order."""
        return list(self._copies.values())

    def copies_by_param(self) -> dict[torch.Tensor, torch.Tensor]:
        """``{parameter: its copy}`` for the parameters that have one."""
        return dict(self._copies)

    def refresh_copies(self) -> None:
        """Overwrite every copy with its parameter (after the parameters changed outside a step:
        a checkpoint load, an assignment)."""
        with torch.no_grad():
            for param, copy in self._copies.items():
                copy.copy_(param)

    def _gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        grad = param.grad
        if not self._grads_from_copies:
            return grad
        copy = self._copies.get(param)
        if copy is None:
            return grad
        if grad is not None and copy.grad is not None:
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} has a gradient of its own and one through its "
                f"{copy.dtype} copy: some code read the parameter itself, not dslab.models.weight_cast.weight(p)")
        return copy.grad if grad is None else grad

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        for group_index, group in enumerate(self.param_groups):
            self._step_group(group_index, group, grad_scale)
        return loss

    def _step_group(self, group_index: int, group: dict, grad_scale: torch.Tensor | None) -> None:
        buckets: dict[tuple, _Bucket] = {}
        for param in group["params"]:
            grad = self._gradient(param)
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError("FusedAdam does not support sparse gradients")
            if grad.dtype != torch.float32 and not (self._grads_from_copies and grad.dtype in _COPY_DTYPES
                                                    and param in self._copies):
                raise RuntimeError(f"FusedAdam needs fp32 gradients, got {grad.dtype} for a parameter of "
                                   f"shape {tuple(param.shape)}")
            state = self.state[param]
            if not state:
                state["step"] = 0.0
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["step"] += 1.0
            copy = self._copies.get(param)
            fused = (param.is_contiguous() and grad.is_contiguous() and state["exp_avg"].is_contiguous()
                     and state["exp_avg_sq"].is_contiguous() and (copy is None or copy.is_contiguous()))
            key = (fused, param.device, state["step"], None if copy is None else copy.dtype, grad.dtype)
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = _Bucket()
            bucket.add(param, grad, state, copy)
        for (fused, device, step, copy_dtype, grad_dtype), bucket in buckets.items():
            if fused and use_triton(bucket.params[0], bucket.grads[0]):
                self._launch(group_index, group, step, copy_dtype, grad_dtype, bucket, grad_scale)
            else:
                beta1, beta2 = group["betas"]
                for p, g, m, v, c in zip(bucket.params, bucket.grads, bucket.exp_avgs, bucket.exp_avg_sqs,
                                         bucket.copies):
                    adam_step_reference(p, g, m, v, step=step, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                                        eps=group["eps"], weight_decay=group["weight_decay"],
                                        adam_w_mode=group["adam_w_mode"],
                                        bias_correction=group["bias_correction"], copy=c, grad_scale=grad_scale)

    def _launch(self, group_index: int, group: dict, step: float, copy_dtype, grad_dtype, bucket: _Bucket,
                grad_scale: torch.Tensor | None) -> None:
        chunk, block, num_warps = _launch_config()
        device = bucket.params[0].device
        rows = bucket.rows()
        cache_key = (group_index, device, copy_dtype, grad_dtype, chunk)
        cached = self._tables.get(cache_key)
        addresses = tuple(rows)
        if cached is None or cached[0] != addresses:
            aligned = all(address % 16 == 0 for i, address in enumerate(rows) if i % _TABLE_COLUMNS != 5)
            numels = addresses[5::_TABLE_COLUMNS]
            if cached is not None and cached[0][5::_TABLE_COLUMNS] == numels:
                chunk_table = cached[3]
            else:
                chunk_table = _chunk_table(numels, chunk, device)
            cached = self._tables[cache_key] = (addresses, aligned, _tensor_table(rows, device), chunk_table)
        _, aligned, tensor_table, chunk_table = cached
        lr, eps, weight_decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        beta1, beta2 = (float(b) for b in group["betas"])
        step_size, bias_correction2_sqrt = _bias_corrections(step, lr, beta1, beta2, group["bias_correction"])
        # Python floats reach the kernel as fp32, rounded from the float64 values as torch rounds its
        # scalar arguments.
        _adam_kernel[(len(chunk_table) // 2,)](
            tensor_table, chunk_table,
            1.0 - lr * weight_decay, weight_decay, 1.0 - beta1, beta2, 1.0 - beta2, eps, step_size,
            bias_correction2_sqrt, tensor_table if grad_scale is None else grad_scale,
            DECOUPLED=bool(group["adam_w_mode"]), HAS_COPY=copy_dtype is not None,
            COPY_DTYPE=tl.float16 if copy_dtype == torch.float16 else tl.bfloat16,
            GRAD_DTYPE=_TL_DTYPES[grad_dtype], HAS_GRAD_SCALE=grad_scale is not None, ALIGNED=aligned,
            CHUNK=chunk, BLOCK=block, BF16_BY_HAND=interpreting() and copy_dtype == torch.bfloat16,
            num_warps=num_warps,
        )

    def state_dict(self) -> dict:
        """torch's layout: per-parameter ``step`` as a 0-d fp32 CPU tensor, as torch.optim.Adam."""
        packed = super().state_dict()
        packed["state"] = {
            key: {**value, "step": torch.tensor(float(value["step"]), dtype=torch.float32)}
            if "step" in value else value
            for key, value in packed["state"].items()
        }
        return packed

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._copies = getattr(self, "_copies", {})
        self._grads_from_copies = getattr(self, "_grads_from_copies", False)
        self._tables = {}
        for group in self.param_groups:
            for unsupported in ("amsgrad", "maximize"):
                if group.get(unsupported, False):
                    raise ValueError(f"a loaded param group has {unsupported}=True, "
                                     "which FusedAdam does not support")
            group.setdefault("adam_w_mode", group.get("decoupled_weight_decay", self.defaults["adam_w_mode"]))
            group.setdefault("bias_correction", self.defaults["bias_correction"])
        for value in self.state.values():
            if torch.is_tensor(value.get("step")):
                value["step"] = float(value["step"].item())
