"""The model states one rank holds now, counted by storage, beside the ZeRO estimate.

Model states are the parameters, their gradients and the optimizer states (Rajbhandari et al.
2020, §3.1). A rank's bytes are counted by *storage*, not by tensor: a storage (the
``untyped_storage()`` behind a tensor, identified by device and ``data_ptr``) is counted once, in
full (``nbytes``, padding included), under the first category that reaches it, in this order:

1. ``params``: the model's parameters, the bf16 copies an optimizer keeps of them (the engine's
   weight copies, :mod:`dslab.engine.weight_copies`), then a ZeRO runtime's flat buffers (``unit.full``, which
   the parameters of stages 1-2 and of gathered stage-3 units are views of) and shards
   (``unit.shard``: at stage 3 the only storage a released parameter has; a released parameter
   itself is an empty tensor).
2. ``grads``: the parameters' ``.grad`` and the copies', the runtime's reduced gradient shards
   (``unit.grad_shard``), the CPU gradient buffers of optimizer offload (``runtime.offload``'s
   ``buffers()``) and the gradients of the optimizer's own parameters.
3. ``optimizer_params``: parameters the optimizer updates whose storage no model parameter or
   shard holds (fp32 master copies, offloaded masters in CPU memory). ZeRO's masters without
   offload share the shards' storage, so they land in ``params`` and are not counted again.
4. ``optimizer_states``: every tensor in ``optimizer.state`` (moments, step counters).

``shared`` says, per category, how many bytes of storages it reached that an earlier category
had already counted (the deduplication: ``total`` is exactly the sum of the distinct storages).
With optimizer offload, ``offloaded`` is the part of ``total`` that the offload holds in CPU
memory (the optimizer's masters, their gradient buffers and the optimizer states).

The estimate beside it is the stage-0 arithmetic over the *full* parameters (a ZeRO runtime's
units give the element counts of released stage-3 parameters)::

    estimate = sum over parameters p of numel(p) * bytes(dtype of p) * (1 + g(p) + k(p))

``g(p)`` is 1 if p is trained (the gradient has p's dtype; a parameter with an optimizer-kept
bf16 copy adds the copy's bytes to ``params`` and has the copy's 2-byte gradient instead), ``k(p)`` the optimizer state tensors
kept per parameter in p's dtype (:func:`optimizer_states_per_param`). This is the layout the
optimizer really has: dslab's engine keeps fp32 parameters under bf16/fp16 autocast and no
master copy, so it is :func:`dslab.estimate_zero_memory` with ``param_bytes=4, master_bytes=0``
(for fp32 parameters), not DeepSpeed's 2-byte parameters with a 4-byte master. Its three totals
are partitioned for ZeRO stages 0-3 over the world size with
:func:`dslab.profilers.zero_memory_model.partition_per_gpu`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dslab import comm
from dslab.profilers.zero_memory_model import STAGES, partition_per_gpu

CATEGORIES = ("params", "grads", "optimizer_params", "optimizer_states")


def storage_key(t: torch.Tensor) -> tuple[tuple, int]:
    """(identity, bytes) of the storage behind ``t``; tensors without one count their own size."""
    try:
        storage = t.untyped_storage()
        return (str(t.device), storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, some subclasses
        return ("tensor", id(t)), t.numel() * t.element_size()


def optimizer_states_per_param(group: dict) -> int | None:
    """State tensors of a parameter's size that the optimizer of this param group keeps, from the
    group's hyperparameter keys (torch's Adam/AdamW/Lamb/FusedAdam, SGD, RMSprop, Adagrad); None
    for an optimizer not recognised."""
    if "betas" in group:
        return 3 if group.get("amsgrad") else 2
    if "dampening" in group:
        return 1 if group.get("momentum") else 0
    if "alpha" in group and "centered" in group:
        return 1 + bool(group.get("momentum")) + bool(group.get("centered"))
    if "lr_decay" in group:
        return 1
    return None


class StorageCounter:
    """Bytes of distinct storages by category; a storage counts under the first category that
    adds it."""

    def __init__(self):
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.shared = dict.fromkeys(CATEGORIES, 0)
        self.devices: dict[str, int] = {}
        self.offloaded = 0
        self._owner: dict[tuple, str] = {}
        self._shared_seen: set = set()

    def add(self, t, category: str, offloaded: bool = False) -> None:
        if not isinstance(t, torch.Tensor):
            return
        key, nbytes = storage_key(t)
        if nbytes == 0:  # released stage-3 parameters, empty gradients
            return
        owner = self._owner.get(key)
        if owner is None:
            self._owner[key] = category
            self.bytes[category] += nbytes
            if offloaded:
                self.offloaded += nbytes
            device = str(t.device)
            self.devices[device] = self.devices.get(device, 0) + nbytes
        elif owner != category and (key, category) not in self._shared_seen:
            self._shared_seen.add((key, category))
            self.shared[category] += nbytes

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


def _units(runtime) -> list:
    return list(getattr(runtime, "units", None) or []) if runtime is not None else []


def _offload(runtime):
    return getattr(runtime, "offload", None) if runtime is not None else None


def count_storages(model: nn.Module, optimizer=None, runtime=None) -> StorageCounter:
    """Count the rank's model states by storage (module docstring). ``runtime`` is a ZeRO runtime:
    an object with ``units`` (each with ``full``, ``shard``, ``grad_shard``) and ``masters``, and
    ``offload`` (None, or an object whose ``buffers()`` are CPU gradient buffers)."""
    counter = StorageCounter()
    offload = _offload(runtime)
    params = list(model.parameters())
    units = _units(runtime)
    home = getattr(runtime, "param_home", None) if runtime is not None else None
    for p in params:
        counter.add(p, "params")
    for unit in units:
        counter.add(getattr(unit, "full", None), "params")
        # a shard that parameter offload keeps in CPU memory is held by the offload
        counter.add(getattr(unit, "shard", None), "params",
                    offloaded=home is not None and home.holds(unit))
    # The low-precision copies an optimizer keeps of the parameters (the engine's bf16 weight
    # copies, which the model computes with) are parameters too, and their .grad the gradients.
    copies = list(getattr(optimizer, "param_copies", lambda: [])())
    for c in copies:
        counter.add(c, "params")
    for p in params:
        counter.add(p.grad, "grads")
    for c in copies:
        counter.add(c.grad, "grads")
    for unit in units:
        counter.add(getattr(unit, "grad_shard", None), "grads")
    # what the optimizer offload steps in CPU memory: every master, or with a partial offload
    # (offload_optimizer.ratio) those not stepped on the device
    on_device = getattr(offload, "on_device", None) or []
    masters = list(getattr(runtime, "masters", None) or []) if runtime is not None else []
    kept = {id(m) for m, device in zip(masters, on_device) if device}
    if offload is not None:
        for buffer in offload.buffers():
            counter.add(buffer, "grads", offloaded=True)
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                offloaded = offload is not None and id(p) not in kept
                counter.add(p, "optimizer_params", offloaded=offloaded)
                counter.add(p.grad, "grads", offloaded=offloaded)
        for p, state in optimizer.state.items():
            offloaded = offload is not None and id(p) not in kept
            for value in state.values() if isinstance(state, dict) else ():
                counter.add(value, "optimizer_states", offloaded=offloaded)
    return counter


def offload_layout(runtime) -> dict:
    """``{"offload", "param", "ratio"}`` of a ZeRO runtime: whether the optimizer is offloaded,
    whether parameters are, and the fraction of shard elements the offload steps."""
    offload = _offload(runtime)
    if offload is None:
        return {"offload": False, "param": False, "ratio": 1.0}
    units = _units(runtime)
    on_device = list(getattr(offload, "on_device", None) or [False] * len(units))
    total = sum(u.shard_numel for u in units)
    stepped = sum(u.shard_numel for u, device in zip(units, on_device) if not device)
    return {"offload": True, "param": getattr(runtime, "param_home", None) is not None,
            "ratio": stepped / total if total else 1.0}


def _full_numels(model: nn.Module, runtime) -> tuple[dict[int, int], dict[int, object]]:
    """Each sharded parameter's full element count and its unit's optimizer master, by id."""
    numel_of: dict[int, int] = {}
    master_of: dict[int, object] = {}
    masters = list(getattr(runtime, "masters", None) or []) if runtime is not None else []
    for index, unit in enumerate(_units(runtime)):
        layout = getattr(unit, "layout", None)
        sizes = layout.sizes if layout is not None else [p.numel() for p in unit.params]
        for p, size in zip(unit.params, sizes):
            numel_of[id(p)] = size
            if index < len(masters):
                master_of[id(p)] = masters[index]
    return numel_of, master_of


def _estimate_totals(model: nn.Module, optimizer, runtime) -> tuple[dict, str | None]:
    """Whole-model bytes of params, grads and optimizer states by the stage-0 formula, the largest
    layer's params + grads (stage 3's gather buffer: with a stage 3 ``runtime``, its largest
    released unit), and a note when the optimizer is unknown."""
    moments: dict[int, int | None] = {}
    note = None
    if optimizer is not None:
        for group in optimizer.param_groups:
            k = optimizer_states_per_param(group)
            if k is None:
                note = (f"optimizer {type(optimizer).__name__} not recognised: "
                        "its states per parameter are unknown, so there is no estimate")
            for p in group["params"]:
                moments[id(p)] = k
    numel_of, master_of = _full_numels(model, runtime)

    def numel(p) -> int:
        return numel_of.get(id(p), p.numel())

    # A parameter with a low-precision copy (the engine's weight copies) also holds the copy, and
    # its gradient is the copy's (2 bytes, not the parameter's 4).
    copy_of = {id(p): c for p, c in getattr(optimizer, "copies_by_param", dict)().items()}
    totals = {"num_params": 0, "params": 0, "grads": 0, "optimizer_states": 0}
    for p in model.parameters():
        nbytes = numel(p) * p.element_size()
        k = moments.get(id(master_of[id(p)]) if id(p) in master_of else id(p)) or 0
        copy = copy_of.get(id(p))
        copy_bytes = 0 if copy is None else numel(p) * copy.element_size()
        totals["num_params"] += numel(p)
        totals["params"] += nbytes + copy_bytes
        totals["grads"] += (copy_bytes or nbytes) * int(p.requires_grad)
        totals["optimizer_states"] += nbytes * k
    gathered = [u for u in getattr(runtime, "units", []) if not u.resident]
    if getattr(runtime, "stage", 0) == 3 and gathered:
        # what stage 3 gathers at once is its largest unit (a whole subtree under
        # stage3_module_granularity_threshold), parameters and their gradients
        totals["layer_buffer"] = max(2 * u.numel * u.dtype.itemsize for u in gathered)
    else:
        totals["layer_buffer"] = max(
            (sum(numel(p) * p.element_size() * (1 + int(p.requires_grad))
                 for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return totals, note


def model_state_bytes(model: nn.Module, optimizer=None, world_size: int | None = None, *,
                      runtime=None, stage: int | None = None) -> dict:
    """Bytes of parameters, gradients and optimizer states this rank holds now, and the estimate.

    Returns ``{"num_params", "params", "grads", "optimizer_states", "optimizer_params", "total",
    "shared", "devices", "bytes_per_param", "estimate", "estimate_bytes_per_param",
    "estimate_formula", "estimate_note", "zero_estimate"}`` (bytes; module docstring).
    ``num_params`` counts the full model (a ZeRO ``runtime`` gives the released parameters'
    sizes); ``bytes_per_param`` is this rank's ``total`` over it. ``zero_estimate`` is
    ``{"world_size", "stage", "per_gpu": [{"stage", "params", "grads", "optimizer_states",
    "buffer", "total"}], "compared"}`` over ``world_size`` ranks (default: the process group's), with ``compared``
    (when ``stage`` is given) = ``{"stage", "measured", "estimate_total", "estimate_buffer",
    "estimate_model_states", "ratio"}``: this rank's ``total`` beside the estimate for that stage
    without its transient gather buffer, ``ratio = measured / estimate_model_states``. None where
    ``estimate`` is. With optimizer offload (``runtime.offload`` set) ``compared`` also has
    ``"offload": true``: ``measured`` is then what stays on the device (``total - offloaded``)
    beside the offload layout's per-GPU estimate, and ``cpu_measured`` (``offloaded``) sits
    beside ``cpu_estimate``, this rank's share of the node's CPU estimate (its shard of the
    stepped fp32 copy, of that copy's gradient and of the optimizer states), ``cpu_ratio`` their
    ratio.
    """
    counter = count_storages(model, optimizer, runtime)
    totals, note = _estimate_totals(model, optimizer, runtime)
    n = totals["num_params"]
    estimate = None if note is not None else totals["params"] + totals["grads"] + totals["optimizer_states"]
    zero_estimate = None
    offload = offload_layout(runtime)
    if estimate is not None:
        ranks = comm.get_world_size() if world_size is None else world_size
        rows = [{"stage": s, **partition_per_gpu(s, ranks, totals["params"], totals["grads"],
                                                 totals["optimizer_states"], totals["layer_buffer"])}
                for s in STAGES]
        zero_estimate = {"world_size": ranks, "stage": stage, "per_gpu": rows, "compared": None}
        if stage is not None:
            zero_estimate["compared"] = _compared(counter, totals, stage, ranks, offload)
    return {
        "num_params": n,
        **counter.bytes,
        "total": counter.total,
        "shared": dict(counter.shared),
        "offloaded": counter.offloaded,
        "devices": dict(counter.devices),
        "bytes_per_param": counter.total / n if n else None,
        "estimate": estimate,
        "estimate_bytes_per_param": estimate / n if estimate is not None and n else None,
        "estimate_formula": "sum_p numel(p) * bytes(p.dtype) * (1 + requires_grad(p) + k), "
                            "k = optimizer state tensors per parameter (ZeRO stage 0)",
        "estimate_note": note,
        "zero_estimate": zero_estimate,
    }


def _compared(counter: StorageCounter, totals: dict, stage: int, ranks: int, layout: dict) -> dict:
    """This rank's measured model states beside the estimate of ``stage`` (see
    :func:`model_state_bytes`; ``layout`` from :func:`offload_layout`)."""
    offload, ratio = layout["offload"], layout["ratio"]
    row = partition_per_gpu(stage, ranks, totals["params"], totals["grads"],
                            totals["optimizer_states"], totals["layer_buffer"],
                            offload_optimizer=offload and stage > 0,
                            offload_param=layout["param"], offload_ratio=ratio)
    expected = row["total"] - row["buffer"]
    measured = counter.total - counter.offloaded
    compared = {
        "stage": stage, "measured": measured, "estimate_total": row["total"],
        "estimate_buffer": row["buffer"], "estimate_model_states": expected,
        "ratio": measured / expected if expected else None,
    }
    if offload:
        def shard(total: int) -> int:
            return -(-int(total) // ranks)

        cpu_expected = int(ratio * (2 * shard(totals["grads"]) + shard(totals["optimizer_states"])))
        compared.update(offload=True, offload_param=layout["param"], offload_ratio=ratio,
                        cpu_measured=counter.offloaded, cpu_estimate=cpu_expected,
                        cpu_ratio=counter.offloaded / cpu_expected if cpu_expected else None)
    return compared


def with_grads(states: dict, grads: int) -> dict:
    """``states`` with its ``grads`` replaced by ``grads`` bytes and ``total`` (and the ZeRO
    comparison) following. The difference is taken to be on the device: offload's CPU gradient
    buffers are allocated once and are in every measurement."""
    delta = grads - states["grads"]
    out = {**states, "grads": grads, "total": states["total"] + delta}
    n = out["num_params"]
    out["bytes_per_param"] = out["total"] / n if n else None
    zero = out.get("zero_estimate")
    if zero is not None and zero.get("compared") is not None:
        compared = dict(zero["compared"])
        measured = out["total"] - out.get("offloaded", 0)
        compared["measured"] = measured
        expected = compared["estimate_model_states"]
        compared["ratio"] = measured / expected if expected else None
        out["zero_estimate"] = {**zero, "compared": compared}
    return out
