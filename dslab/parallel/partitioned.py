"""Parameters built already partitioned over a data-parallel group (DeepSpeed's ``zero.Init``)
and gathered whole on request (``zero.GatheredParameters``).

Under :class:`Init`, each module's parameters are partitioned as soon as the module's own
``__init__`` has returned (every ``nn.Module`` subclass's ``__init__`` is wrapped while the
context is open): the parameter is broadcast from rank 0 of the group, so every rank cuts its
shard from the same values, and then holds only that shard. A partitioned parameter ``p`` has:

- ``p.data``: an empty tensor (of the parameter's dtype, on the compute device);
- ``p.ds_tensor``: this rank's shard, elements ``[r * S, (r + 1) * S)`` of the flattened
  parameter padded with zeros to ``S * W`` elements (``W`` ranks), on ``remote_device``
  (the compute device, or CPU memory, pinned with ``pin_memory``);
- ``p.ds_numel``, ``p.ds_shape``: the whole parameter's element count and shape;
- ``p.ds_group``: the group it is partitioned over (None: the default group).

No rank ever holds more than one module's whole parameters: the largest moment is one module's
construction (before its partition) or one :class:`GatheredParameters` block.

Code that reads or writes whole parameters after construction (a model's weight
initialisation walking its modules, loading weights) runs inside
``GatheredParameters(params, modifier_rank=r)``: every rank gathers the parameters whole, and
when the block exits, rank ``r``'s values are broadcast and every rank keeps its shard of them
(``modifier_rank=None``: a read; changes are dropped). dslab's models initialise their weights
this way (``dslab.models.ops.init_normal_``), so a model built under ``Init`` starts from the
same weights as one built without it from the same seed.

The training engine takes such a model at ZeRO stage 3: it gathers one unit at a time into its
own layout (:mod:`dslab.engine.zero.partition`) and the ``ds_*`` attributes go. After that,
``GatheredParameters`` still works on the engine's parameters through the access the engine
attaches to each (``p.ds_access``, with ``gather()`` and ``release(modifier_rank)``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading

import torch
import torch.nn as nn

from dslab import comm


def is_deepspeed_partitioned(p: torch.Tensor) -> bool:
    """True for a parameter DeepSpeed's ``zero.Init`` partitioned (its ``ds_status`` and
    ``ds_id``, which dslab's partitions do not carry)."""
    return hasattr(p, "ds_status") and hasattr(p, "ds_id") and not getattr(p, "_dslab_partitioned", False)


def is_partitioned(p: torch.Tensor) -> bool:
    """True for a parameter that holds only its shard (built under :class:`Init`; DeepSpeed's
    own partitioned parameters, which carry the same ``ds_*`` names, are not dslab's)."""
    return getattr(p, "_dslab_partitioned", False) and getattr(p, "ds_tensor", None) is not None


def full_shape(p: torch.Tensor) -> torch.Size:
    """The whole parameter's shape, partitioned or not."""
    return torch.Size(p.ds_shape) if is_partitioned(p) else p.shape


def full_numel(p: torch.Tensor) -> int:
    return p.ds_numel if is_partitioned(p) else p.numel()


def _compute_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def partition_(p: nn.Parameter, group=None, remote_device: str | None = None,
               pin_memory: bool = False, dtype: torch.dtype | None = None,
               device: torch.device | None = None) -> None:
    """Make ``p`` hold only this rank's shard of rank 0's values (a collective over ``group``)."""
    device = torch.device(device) if device is not None else _compute_device()
    world, rank = comm.get_world_size(group), comm.get_rank(group)
    with torch.no_grad():
        full = p.detach().to(device=device, dtype=dtype or p.dtype)
        if world > 1:
            comm.broadcast(full, src=comm.get_global_rank(group, 0), group=group)
        shard_numel = math.ceil(full.numel() / world)
        flat = torch.zeros(shard_numel * world, dtype=full.dtype, device=device)
        flat[:full.numel()].copy_(full.reshape(-1))
        shard = flat[rank * shard_numel:(rank + 1) * shard_numel].clone()
        if remote_device == "cpu":
            host = torch.empty(shard_numel, dtype=shard.dtype,
                               pin_memory=pin_memory and torch.cuda.is_available())
            shard = host.copy_(shard)
    p.ds_numel = full.numel()
    p.ds_shape = tuple(full.shape)
    p.ds_group = group
    p.ds_tensor = shard
    p._dslab_partitioned = True
    p.data = torch.empty(0, dtype=full.dtype, device=device)


def gather_(p: nn.Parameter) -> None:
    """Point a partitioned parameter's ``data`` at its whole value (a collective)."""
    shard = p.ds_tensor.to(p.data.device, non_blocking=True)
    world = comm.get_world_size(p.ds_group)
    flat = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)
    comm.all_gather_into_tensor(flat, shard, group=p.ds_group)
    p.data = flat[:p.ds_numel].view(p.ds_shape)


def release_(p: nn.Parameter, modifier_rank: int | None = None) -> None:
    """After :func:`gather_`: keep this rank's shard of ``modifier_rank``'s values (None: of the
    values as they were) and free the whole one."""
    if modifier_rank is not None:
        with torch.no_grad():
            full = p.data.contiguous()
            if comm.get_world_size(p.ds_group) > 1:
                comm.broadcast(full, src=comm.get_global_rank(p.ds_group, modifier_rank),
                               group=p.ds_group)
            rank = comm.get_rank(p.ds_group)
            n = p.ds_tensor.numel()
            flat = full.reshape(-1)
            lo, hi = rank * n, min((rank + 1) * n, p.ds_numel)
            p.ds_tensor.zero_()
            if hi > lo:
                p.ds_tensor[:hi - lo].copy_(flat[lo:hi])
    p.data = torch.empty(0, dtype=p.dtype, device=p.data.device)


def forget_partition(p: nn.Parameter) -> None:
    """Drop the ``ds_*`` attributes (the engine took the parameter into its own layout)."""
    for name in ("ds_tensor", "ds_numel", "ds_shape", "ds_group", "_dslab_partitioned"):
        if hasattr(p, name):
            delattr(p, name)


class GatheredParameters:
    """``with GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True):``
    inside the block, every rank holds ``params`` (a parameter or an iterable of them) whole;
    on exit each keeps its shard of ``modifier_rank``'s values (None: nothing written back).
    Parameters that are not partitioned are left alone. Parameters DeepSpeed partitioned (a model
    built under ``deepspeed.zero.Init``, as a peer arm builds dslab's models) are handed to
    DeepSpeed's own ``GatheredParameters`` with the same ``modifier_rank``, so that a model's
    initialisation reaches them too. A collective: every rank of the parameters' group enters it
    with the same parameters."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None,
                 enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if p is not None]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._entered: list = []
        self._deepspeed = None

    def __enter__(self):
        if not self.enabled:
            return self
        theirs = [p for p in self.params if is_deepspeed_partitioned(p)]
        if theirs:
            import deepspeed  # such parameters exist only where DeepSpeed was imported

            self._deepspeed = deepspeed.zero.GatheredParameters(theirs, modifier_rank=self.modifier_rank)
            self._deepspeed.__enter__()
        seen = {id(p) for p in theirs}
        for p in self.params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            access = getattr(p, "ds_access", None)
            if access is not None:
                if access.gather():
                    self._entered.append((p, access))
            elif is_partitioned(p):
                gather_(p)
                self._entered.append((p, None))
        return self

    def __exit__(self, *exc):
        released = set()
        for p, access in reversed(self._entered):
            if access is not None:
                if id(access) not in released:
                    released.add(id(access))
                    access.release(self.modifier_rank)
            else:
                release_(p, self.modifier_rank)
        self._entered = []
        if self._deepspeed is not None:
            theirs, self._deepspeed = self._deepspeed, None
            theirs.__exit__(*exc)
        return False


def _subclasses(cls) -> list[type]:
    found, stack = [], [cls]
    while stack:
        c = stack.pop()
        found.append(c)
        stack.extend(c.__subclasses__())
    return found


class Init:
    """``with Init(config_dict_or_path=None, remote_device=None, pin_memory=False, enabled=True,
    dtype=None, data_parallel_group=None):`` modules built inside hold only their shards
    (module docstring).

    ``remote_device``: where the shards live until the engine takes them: None (the compute
    device: the current CUDA device, else the CPU) or ``"cpu"``. ``"nvme"`` is refused: the
    engine's ``offload_param.device: nvme`` moves the shards to files when it takes the model.
    Without ``remote_device`` a config's ``zero_optimization.offload_param.device`` picks
    ``"cpu"`` when it says cpu. ``dtype``: the parameters' dtype (default: as built).
    ``enabled=False`` builds modules as usual. With CUDA, tensors created inside the block are
    created on the current CUDA device (parameters are built and initialised there, then
    partitioned), as DeepSpeed's ``Init`` does."""

    _lock = threading.Lock()
    _active = 0

    def __init__(self, config_dict_or_path=None, remote_device: str | None = None,
                 pin_memory: bool = False, enabled: bool = True, dtype: torch.dtype | None = None,
                 data_parallel_group=None, module=None, mpu=None, config=None):
        if config is not None and config_dict_or_path is None:
            config_dict_or_path = config  # DeepSpeed's earlier keyword
        if mpu is not None:
            raise ValueError("zero.Init: mpu (model parallelism) is not supported by dslab; "
                             "pass data_parallel_group to choose the partition group")
        if remote_device is None and config_dict_or_path is not None:
            remote_device = _offload_device(config_dict_or_path)
        if remote_device not in (None, "cpu", "cuda"):
            raise ValueError(
                f"zero.Init: remote_device {remote_device!r} is not supported; use None (the "
                "compute device) or 'cpu' (offload_param.device 'nvme' moves the shards to files "
                "when the engine takes the model)")
        self.remote_device = None if remote_device == "cuda" else remote_device
        self.pin_memory = pin_memory
        self.enabled = enabled
        self.dtype = dtype
        self.group = data_parallel_group
        self._patched: list[tuple[type, object]] = []
        self._depth: dict[int, int] = {}
        if module is not None and enabled:
            self._partition_module(module)

    def _partition_module(self, module: nn.Module) -> None:
        for p in module.parameters():
            if not is_partitioned(p):
                partition_(p, self.group, self.remote_device, self.pin_memory, self.dtype)

    def _wrap(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "_dslab_zero_init", False):
            return

        @functools.wraps(original)
        def init(module, *args, **kwargs):
            key = id(module)
            self._depth[key] = self._depth.get(key, 0) + 1
            try:
                original(module, *args, **kwargs)
            finally:
                self._depth[key] -= 1
                outermost = self._depth[key] == 0
                if outermost:
                    del self._depth[key]
            if outermost:
                self._partition_module(module)

        init._dslab_zero_init = True
        cls.__init__ = init
        self._patched.append((cls, original))

    def __enter__(self):
        if not self.enabled:
            return self
        with Init._lock:
            if Init._active:
                raise RuntimeError("zero.Init contexts do not nest")
            Init._active = 1
        for cls in _subclasses(nn.Module):
            self._wrap(cls)
        owner = self
        original_hook = nn.Module.__dict__.get("__init_subclass__")

        def init_subclass(cls, **kwargs):
            super(nn.Module, cls).__init_subclass__(**kwargs)
            owner._wrap(cls)

        nn.Module.__init_subclass__ = classmethod(init_subclass)
        self._subclass_hook = original_hook
        # tensors made inside the block are made on the compute device, as DeepSpeed's Init
        # does: a module's parameters are built and initialised there, then partitioned
        self._device_context = torch.device(_compute_device()) if torch.cuda.is_available() else None
        if self._device_context is not None:
            self._device_context.__enter__()
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        if self._device_context is not None:
            self._device_context.__exit__(None, None, None)
            self._device_context = None
        for cls, original in reversed(self._patched):
            cls.__init__ = original
        self._patched = []
        if self._subclass_hook is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._subclass_hook
        with Init._lock:
            Init._active = 0
        return False


def _offload_device(config_dict_or_path) -> str | None:
    """``zero_optimization.offload_param.device`` of a config dict or JSON file, when cpu."""
    config = config_dict_or_path
    if not isinstance(config, dict):
        import json
        from pathlib import Path

        config = json.loads(Path(config).read_text())
    device = (config.get("zero_optimization") or {}).get("offload_param", {}).get("device")
    return "cpu" if device == "cpu" else None


@contextlib.contextmanager
def gathered_for_init(module: nn.Module):
    """Gather ``module``'s own parameters for writing (rank 0's values are kept)."""
    with GatheredParameters(list(module.parameters(recurse=False)), modifier_rank=0):
        yield
