"""DeepSpeed's ``PipelineModule``: a model written as a list of layers, cut into pipeline stages.

Each rank builds only the layers of its own stage. A layer is given as

- a :class:`LayerSpec` (the class and its arguments; built on the stages that hold it, so no
  rank ever builds the whole model),
- a :class:`TiedLayerSpec` (a layer whose weights are shared by several positions of the list,
  such as GPT-2's token embedding and its LM head: every stage holding one of the positions
  builds the module once, under its ``key``),
- an ``nn.Module`` already built (the same object on every rank), or
- any callable without parameters (a reshape, a lambda).

The forward of a stage feeds its input through its layers in order, a layer taking the whole
output of the one before (a tensor or a tuple); with ``activation_checkpoint_interval = k`` the
layers run in activation checkpoints of ``k`` layers each.

Partitioning (``partition_method``): ``"parameters"`` balances the parameter counts of the
stages (each layer counted by building it on the meta device), ``"uniform"`` the number of
layers, ``"type:<regex>"`` the number of layers whose class name matches the regex
(case-insensitive; e.g. ``type:TransformerLayer`` balances the blocks and lets the embeddings and
the head ride with the first and last of them). Each stage gets at least one layer.

``seed_layers=True`` seeds torch's RNG with ``base_seed + index`` before building each layer, so
a layer's initial weights depend only on its index: one, two and four stages start from the same
model. Tied modules are then made equal on every stage holding them (broadcast from the first
such stage), and their gradients are summed across those stages before each optimizer step
(:meth:`PipelineModule.reduce_tied_gradients`); the stage that first holds a tied module owns it:
it alone steps it, and hands the new weights to the others (:meth:`broadcast_tied_weights`).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable

import torch
import torch.nn as nn

from dslab import comm
from dslab.parallel.topology import PipeDataParallelTopology, PipelineParallelGrid, ProcessTopology


class LayerSpec:
    """A layer to build later: ``typename(*module_args, **module_kwargs)``."""

    def __init__(self, typename: type, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise ValueError(f"LayerSpec needs an nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer sharing its module (and so ``tied_weight_attr``'s parameters) with every other
    :class:`TiedLayerSpec` of the same ``key``. ``forward_fn(module, inputs)``, when given, is
    how this position uses the module (e.g. the LM head's ``hidden @ embedding.weight.T``);
    otherwise the module is called."""

    def __init__(self, key: str, typename: type, *module_args, forward_fn: Callable | None = None,
                 tied_weight_attr: str | list[str] = "weight", **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries (``num_parts + 1`` of them) cutting ``num_items`` into parts whose sizes differ
    by at most one, the larger parts first."""
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return bounds


def partition_balanced(weights: list[int], num_parts: int) -> list[int]:
    """Boundaries cutting ``weights`` into ``num_parts`` contiguous non-empty parts whose largest
    sum is the smallest possible (binary search on that sum, then a greedy cut that leaves at
    least one item for each remaining part)."""
    n = len(weights)
    if n < num_parts:
        raise ValueError(f"{n} layers cannot fill {num_parts} pipeline stages (each needs >= 1)")

    def cut(limit: int) -> list[int] | None:
        bounds, total = [0], 0  # bounds: the start of each part opened so far
        for i, w in enumerate(weights):
            nonempty = i > bounds[-1]
            to_open = num_parts - len(bounds)  # parts still to open after the current one
            if nonempty and to_open and (total + w > limit or n - i == to_open):
                bounds.append(i)
                total = 0
            total += w
            if total > limit:
                return None
        return bounds + [n]

    lo, hi = max(weights, default=0), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        if cut(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return cut(lo)


def _count_parameters(spec) -> int:
    """Parameters of one layer entry, a :class:`LayerSpec` built on the meta device (no memory)."""
    if isinstance(spec, nn.Module):
        return sum(p.numel() for p in spec.parameters())
    if isinstance(spec, LayerSpec):
        with torch.device("meta"):
            built = spec.build()
        return sum(p.numel() for p in built.parameters())
    return 0


class PipelineModule(nn.Module):
    """The layers of this rank's pipeline stage (see the module docstring).

    ``num_stages`` or ``topology`` (a :class:`ProcessTopology` with a ``pipe`` axis; with
    ``num_stages`` alone, the world is ``num_stages`` stages times ``world / num_stages``
    data-parallel replicas), or ``grid`` (a :class:`PipelineParallelGrid` built beforehand, whose
    topology is then used). ``loss_fn(outputs, labels)`` makes the last stage's loss.
    """

    def __init__(self, layers, num_stages: int | None = None, topology: ProcessTopology | None = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn=None,
                 base_seed: int = 1234, partition_method: str = "parameters",
                 activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = None,
                 checkpointable_layers: list[str] | None = None,
                 grid: PipelineParallelGrid | None = None):
        super().__init__()
        if grid is not None:  # built beforehand, e.g. to hand its tensor-parallel group to the layers
            if topology is not None and topology is not grid.topology():
                raise ValueError("grid= and topology= disagree: pass the grid's own topology or none")
            topology = grid.topology()
        if num_stages is None and topology is None:
            raise ValueError("PipelineModule needs num_stages or topology")
        world = comm.get_world_size()
        if topology is None:
            if num_stages < 1 or world % num_stages:
                raise ValueError(f"num_stages={num_stages} must divide the world size {world}")
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
        elif num_stages is not None and topology.get_dim("pipe") != num_stages:
            raise ValueError(f"num_stages={num_stages} but the topology has "
                             f"{topology.get_dim('pipe')} pipeline stages")
        if isinstance(activation_checkpoint_interval, bool) or activation_checkpoint_interval < 0:
            raise ValueError(f"activation_checkpoint_interval must be an int >= 0, "
                             f"got {activation_checkpoint_interval!r}")
        self.layer_specs = list(layers)
        if not self.layer_specs:
            raise ValueError("PipelineModule needs at least one layer")
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self._topo = topology
        self._grid = grid if grid is not None else PipelineParallelGrid(topology)
        self.num_stages = self._grid.get_pipe_parallel_world_size()
        self.stage_id = self._grid.get_stage_id()
        self.global_rank = comm.get_rank()
        self.partition_method = partition_method
        self.parts = self._partition(partition_method)
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.forward_funcs: list = []
        self._build()
        self.tied_comms = self._tie_groups()
        self._synchronize_tied_weights()

    # -- building -----------------------------------------------------------------------------

    def _partition(self, method: str) -> list[int]:
        specs, stages = self.layer_specs, self.num_stages
        if len(specs) < stages:
            raise ValueError(f"{len(specs)} layers cannot fill {stages} pipeline stages")
        method_l = method.lower()
        if method_l == "uniform":
            return partition_uniform(len(specs), stages)
        if method_l == "parameters":
            return partition_balanced([_count_parameters(s) for s in specs], stages)
        if method_l.startswith("type:"):
            pattern = re.compile(method[5:], re.IGNORECASE)
            weights = [1 if pattern.search(self._layer_name(s)) else 0 for s in specs]
            if sum(weights) == 0:
                raise ValueError(f"partition_method={method!r} matches none of the layers "
                                 f"({sorted({self._layer_name(s) for s in specs})})")
            return partition_balanced(weights, stages)
        raise ValueError(f"partition_method={method!r}: use 'parameters', 'uniform' or 'type:<regex>'")

    @staticmethod
    def _layer_name(spec) -> str:
        if isinstance(spec, LayerSpec):
            return spec.typename.__name__
        if isinstance(spec, nn.Module):
            return type(spec).__name__
        return getattr(spec, "__name__", type(spec).__name__)

    def _seed(self, index: int) -> None:
        if self.seed_layers:
            (self.seed_fn or torch.manual_seed)(self.base_seed + index)

    def _build(self) -> None:
        start, stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
        self._local_start = start
        for index in range(start, stop):
            spec = self.layer_specs[index]
            name = str(index)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self._seed(self._first_index(spec.key))
                    self.tied_modules[spec.key] = spec.build()
                    self.tied_weight_attrs[spec.key] = spec.tied_weight_attr
                module = self.tied_modules[spec.key]
                if spec.forward_fn is None:
                    self.forward_funcs.append(module)
                else:
                    self.forward_funcs.append(_TiedForward(module, spec.forward_fn))
            elif isinstance(spec, LayerSpec):
                self._seed(index)
                module = spec.build()
                self.add_module(name, module)
                self.forward_funcs.append(module)
            elif isinstance(spec, nn.Module):
                self.add_module(name, spec)
                self.forward_funcs.append(spec)
            elif callable(spec):
                self.forward_funcs.append(spec)
            else:
                raise ValueError(f"layer {index} is {spec!r}: a LayerSpec, an nn.Module or a callable")

    def _first_index(self, key: str) -> int:
        return next(i for i, s in enumerate(self.layer_specs) if isinstance(s, TiedLayerSpec) and s.key == key)

    def stage_of_layer(self, index: int) -> int:
        return next(s for s in range(self.num_stages) if self.parts[s] <= index < self.parts[s + 1])

    def _tie_groups(self) -> dict[str, dict]:
        """For each tied key: the stages holding it and, for this rank's replica (its other
        coordinates), the process group over those stages; every rank builds every group."""
        keys = []
        for spec in self.layer_specs:
            if isinstance(spec, TiedLayerSpec) and spec.key not in keys:
                keys.append(spec.key)
        topo = self._topo
        others = [a for a in topo.axes if a != "pipe"]
        ties = {}
        for key in keys:
            stages = sorted({self.stage_of_layer(i) for i, s in enumerate(self.layer_specs)
                             if isinstance(s, TiedLayerSpec) and s.key == key})
            lines = []
            for point in _product([topo.get_dim(a) for a in others]):
                fixed = dict(zip(others, point))
                lines.append([topo.get_rank(pipe=stage, **fixed) for stage in stages])
            for ranks in lines:
                group = comm.new_group(ranks) if len(ranks) > 1 else None
                if self.global_rank in ranks:
                    ties[key] = {"ranks": ranks, "group": group, "stages": stages,
                                 "owner": ranks[0]}
        return ties

    def _tied_parameters(self, key: str) -> list[nn.Parameter]:
        module = self.tied_modules[key]
        return [module.get_parameter(attr) for attr in self.tied_weight_attrs[key]]

    def _synchronize_tied_weights(self) -> None:
        self.broadcast_tied_weights()

    # -- what the engine calls ----------------------------------------------------------------

    def tied_parameters_not_owned(self) -> list[nn.Parameter]:
        """The tied parameters this stage holds but does not own (their gradient goes to the
        owning stage; the owner's update comes back through :meth:`broadcast_tied_weights`)."""
        return [p for key, tie in self.tied_comms.items() if tie["owner"] != self.global_rank
                and tie["group"] is not None for p in self._tied_parameters(key)]

    def reduce_tied_gradients(self) -> None:
        """Sum each tied parameter's gradient over the stages holding it, into the owner's."""
        for key, tie in self.tied_comms.items():
            if tie["group"] is None:
                continue
            for p in self._tied_parameters(key):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                comm.all_reduce(p.grad, group=tie["group"])

    def broadcast_tied_weights(self) -> None:
        """Every stage holding a tied module takes its owner's weights."""
        with torch.no_grad():
            for key, tie in self.tied_comms.items():
                if tie["group"] is None:
                    continue
                for p in self._tied_parameters(key):
                    # a module still on the host, under nccl: through the current GPU and back
                    staging = comm.staging_device(p.data, tie["group"])
                    data = p.data if staging is None else p.data.to(staging)
                    comm.broadcast(data, src=tie["owner"], group=tie["group"])
                    if staging is not None:
                        p.data.copy_(data)

    def topology(self) -> ProcessTopology:
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        """The grid of process groups (an mpu for ``dslab.initialize``)."""
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    # -- forward ------------------------------------------------------------------------------

    def forward(self, inputs):
        funcs = self.forward_funcs
        interval = self.activation_checkpoint_interval
        x = inputs
        if interval == 0 or not self.training or not torch.is_grad_enabled():
            for func in funcs:
                x = func(x)
            return x
        checkpoint = self.activation_checkpoint_func
        if checkpoint is None:
            raise ValueError("activation_checkpoint_interval > 0 needs an activation_checkpoint_func "
                             "(the pipeline engine sets dslab.checkpointing.checkpoint)")
        for start in range(0, len(funcs), interval):
            chunk = funcs[start:start + interval]
            if any(_has_parameters(f) for f in chunk):
                x = checkpoint(_RunChunk(chunk), *(x if isinstance(x, tuple) else (x,)))
            else:
                for func in chunk:
                    x = func(x)
        return x


class _TiedForward:
    """A tied position's call: ``forward_fn(module, inputs)`` (the module lives in
    ``tied_modules``)."""

    def __init__(self, module: nn.Module, forward_fn: Callable):
        self.tied = module
        self.forward_fn = forward_fn

    def __call__(self, inputs):
        return self.forward_fn(self.tied, inputs)


class _RunChunk:
    """Layers run in turn on the unpacked inputs of one checkpoint."""

    def __init__(self, funcs):
        self.funcs = funcs

    def __call__(self, *inputs):
        x = inputs if len(inputs) != 1 else inputs[0]
        for func in self.funcs:
            x = func(x)
        return x


def _has_parameters(func) -> bool:
    module = func.tied if isinstance(func, _TiedForward) else func
    return isinstance(module, nn.Module) and any(True for _ in module.parameters())


def _product(dims: list[int]):
    return itertools.product(*[range(d) for d in dims])
