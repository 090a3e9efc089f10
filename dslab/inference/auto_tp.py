"""Automatic tensor parallelism (DeepSpeed's AutoTP): a transformers decoder split by its layers' names.

A model dslab has no injection policy for (or one run with ``replace_with_kernel_inject=False``)
is split in place over the ``tp_size`` ranks of its tensor-parallel group, Megatron-LM's scheme
(Shoeybi et al. 2019, §3) read off the module names instead of a policy:

- **Decoder layers** are the items of each ``nn.ModuleList`` whose items share one class and hold a
  row-parallel linear layer (below); a list inside another (MoE experts in a layer) belongs to the
  outer one. A model without such a list is refused (ValueError naming its class).
- **Row-parallel** (the layer's output is added to the residual stream): a linear layer named
  ``o_proj``, ``down_proj``, ``out_proj``, ``fc2``, ``fc_out``, ``c_proj``, ``wo``, ``w2`` or
  ``dense_4h_to_h``, or ``dense`` / ``o`` under an attention module (a path with ``attn`` or
  ``attention``) or an ``output`` module (BERT's ``output.dense``). Rank ``r`` keeps input columns
  ``r * in / tp .. (r + 1) * in / tp - 1`` of ``W [out, in]``; its product is a partial sum,
  completed by an ``all_reduce`` over the group (:mod:`dslab.comm`, where the comms logger sees
  it); the bias is whole on every rank and added once, after the reduce:
  ``y = allreduce(x_r W_r^T) + b`` (:class:`RowParallelLinear`).
- **Kept whole**: MoE routers (``gate``, ``router``), whose outputs are routing logits.
- **Column-parallel**: every other linear layer of a layer (``q_proj``, ``k_proj``, ``v_proj``,
  ``gate_proj``, ``up_proj``, ``fc1``, ``c_fc``, ...). Rank ``r`` keeps output rows
  ``r * out / tp ..`` of the weight and bias; q, k and v rows are head-major, so a rank keeps whole
  heads (``H / tp`` query heads and the ``Hkv / tp`` key/value heads they read under grouped-query
  attention), and gate/up keep the same MLP columns. GPT-2's fused ``c_attn`` (q, k and v blocks
  of equal width) keeps the rank's columns of each block; other fused QKV layers
  (``query_key_value``, ``qkv_proj``, ``Wqkv``, ``W_pack``), whose layouts differ by model, are
  refused by name.

transformers' ``Conv1D`` (GPT-2: ``y = x W + b`` with ``W [in, out]``) is split along the same
dimensions, transposed. Attention modules (in a layer, with an integer attribute in
:data:`HEAD_ATTRIBUTES`, owning a split linear layer) get those head counts and their widths
(:data:`WIDTH_ATTRIBUTES`: ``embed_dim``, ``hidden_size``, ``split_size``, ``all_head_size``)
divided by ``tp``, so their reshapes see this rank's heads. The model's config keeps the whole
model's counts, as transformers' own tensor parallelism does (modules read it when they are built;
the head dim some of them derive from it, ``hidden_size // num_attention_heads``, must stay).
Embeddings, norms, positional tables and the LM head stay whole on every rank (each rank computes
the full logits), so every rank runs ``generate`` in lockstep and chooses the same tokens.

Checks (ValueError naming ``tensor_parallel.tp_size`` and the counts): ``tp`` divides the config's
attention heads and key/value heads, every split dimension, and keeps whole heads of each split
projection; a layer with column-parallel layers has a row-parallel one.

Memory: each rank keeps ``1 / tp`` of every split weight (copies; the whole tensors are freed
with the model's references to them), and the whole embeddings, norms and head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from dslab.inference.tensor_parallel import TensorParallel

ROW_PARALLEL_NAMES = frozenset({"o_proj", "down_proj", "out_proj", "fc2", "fc_out", "c_proj", "wo", "w2",
                                "dense_4h_to_h"})
ROW_PARALLEL_UNDER_ATTENTION = frozenset({"dense", "o"})
ROUTER_NAMES = frozenset({"gate", "router"})
FUSED_QKV_NAMES = frozenset({"query_key_value", "qkv_proj", "Wqkv", "W_pack"})
GPT2_FUSED_QKV = "c_attn"
HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_head", "n_heads",
                   "n_kv_heads")
WIDTH_ATTRIBUTES = ("embed_dim", "hidden_size", "split_size", "all_head_size")
CONFIG_HEADS = ("num_attention_heads", "n_head", "num_heads")
CONFIG_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")


@dataclass
class AutoTPSplit:
    """What :func:`apply_auto_tp` did: qualified names of the split and whole linear layers."""

    tp_size: int
    layers: int = 0
    row_parallel: list[str] = field(default_factory=list)
    column_parallel: list[str] = field(default_factory=list)
    kept_whole: list[str] = field(default_factory=list)
    attention_modules: list[str] = field(default_factory=list)

    @property
    def note(self) -> str:
        return (f"automatic tensor parallelism: {len(self.row_parallel)} row-parallel, {len(self.column_parallel)} "
                f"column-parallel Linear layers in {self.layers} layers over tp_size={self.tp_size} ranks; "
                f"embeddings, norms and lm_head are replicated")


class RowParallelLinear(nn.Module):
    """``y = allreduce(x_r W_r^T) + b``: this rank's input columns ``W_r [out, in / tp]`` of a
    row-parallel layer, the sum over the group, then the whole bias (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (of {self.in_features * self.tp.size}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, tp_size={self.tp.size}")


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (recognised by name: transformers is not imported here)."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers.")


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _block(t: torch.Tensor, dim: int, tp: TensorParallel, blocks: int = 1) -> torch.Tensor:
    """This rank's contiguous share of each of ``blocks`` equal blocks of ``t`` along ``dim``, as
    a new contiguous tensor."""
    parts = t.detach().chunk(blocks, dim=dim)
    return torch.cat([p.chunk(tp.size, dim=dim)[tp.rank] for p in parts], dim=dim)


def linear_role(path: str) -> str:
    """``row``, ``column`` or ``whole`` for the linear layer at ``path`` (relative to its layer)."""
    parts = path.split(".")
    name, parents = parts[-1], [p.lower() for p in parts[:-1]]
    if name in ROW_PARALLEL_NAMES:
        return "row"
    if name in ROW_PARALLEL_UNDER_ATTENTION and any("attn" in p or "attention" in p or p == "output"
                                                    for p in parents):
        return "row"
    if name in ROUTER_NAMES:
        return "whole"
    return "column"


def _config_count(config, names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None


def check_heads(model: nn.Module, tp_size: int) -> None:
    """ValueError naming the counts when ``tp_size`` does not divide the config's attention heads
    or key/value heads."""
    config = getattr(model, "config", None)
    if config is None:
        return
    heads = _config_count(config, CONFIG_HEADS)
    kv = _config_count(config, CONFIG_KV_HEADS)
    if kv is None and getattr(config, "multi_query", False):
        kv = ("multi_query", 1)
    for what, count in (("attention heads", heads), ("key/value heads", kv)):
        if count is not None and count[1] % tp_size:
            raise ValueError(f"tensor_parallel.tp_size={tp_size} does not divide the model's {count[1]} {what} "
                             f"(config.{count[0]}={count[1]}"
                             + (f", config.{heads[0]}={heads[1]}" if what == "key/value heads" and heads else "")
                             + "): automatic tensor parallelism keeps whole heads on each rank")


def find_decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, layer)`` of every decoder layer (see the module docstring);
    ValueError naming the model's class when there is none."""
    lists = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(item) for item in module}) != 1:
            continue
        if any(name.startswith(outer + ".") for outer, _ in lists):
            continue
        if any(_is_linear(m) and linear_role(path) == "row" for path, m in module[0].named_modules() if path):
            lists.append((name, module))
    if not lists:
        raise ValueError(f"automatic tensor parallelism found no decoder layers in {type(model).__name__}: no "
                         f"torch.nn.ModuleList of one block class holding a linear layer named "
                         f"{', '.join(sorted(ROW_PARALLEL_NAMES))} (whose output joins the residual stream)")
    return [(f"{name}.{index}", layer) for name, module in lists for index, layer in enumerate(module)]


def _out_dim(module: nn.Module) -> int:
    return 1 if _is_conv1d(module) else 0


def _linears(layer: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(path, module, role)`` of the linear layers of ``layer``."""
    return [(path, m, linear_role(path)) for path, m in layer.named_modules() if path and _is_linear(m)]


def _fused_blocks(module: nn.Module, name: str) -> int:
    """3 for GPT-2's fused ``c_attn`` (three equal q, k, v blocks), 1 for any other layer."""
    if name.rsplit(".", 1)[-1] != GPT2_FUSED_QKV:
        return 1
    if not _is_conv1d(module) or module.weight.shape[1] != 3 * module.weight.shape[0]:
        raise ValueError(f"automatic tensor parallelism: {name} is a fused QKV projection of "
                         f"{tuple(module.weight.shape)}, not GPT-2's three equal q, k, v blocks")
    return 3


def _head_counts(module: nn.Module) -> list[str]:
    return [a for a in HEAD_ATTRIBUTES if isinstance(getattr(module, a, None), int)
            and not isinstance(getattr(module, a), bool)]


def _attention_attributes(module: nn.Module) -> list[str]:
    """The head counts and widths of an attention module (none when it has no head count)."""
    counts = _head_counts(module)
    if not counts:
        return []
    widths = [a for a in WIDTH_ATTRIBUTES if isinstance(getattr(module, a, None), int)
              and not isinstance(getattr(module, a), bool)]
    return counts + widths


def _owners(layer: nn.Module, linears) -> dict[str, tuple[nn.Module, list[nn.Module]]]:
    """The modules that own column-parallel layers, by path, with those layers."""
    owners = {}
    for path, module, role in linears:
        if role == "column":
            parent_path = path.rpartition(".")[0]
            parent = layer.get_submodule(parent_path) if parent_path else layer
            owners.setdefault(parent_path, (parent, []))[1].append(module)
    return owners


def _check_layer(layer: nn.Module, layer_name: str, tp: TensorParallel) -> None:
    """Every ValueError :func:`_split_layer` could meet, before anything is changed."""
    linears = _linears(layer)
    roles = {role for _, _, role in linears}
    if "column" in roles and "row" not in roles:
        raise ValueError(f"automatic tensor parallelism: {layer_name} ({type(layer).__name__}) has no linear layer "
                         f"whose output joins the residual stream; its column-parallel outputs would stay split")
    for path, module, role in linears:
        full = f"{layer_name}.{path}"
        if path.rsplit(".", 1)[-1] in FUSED_QKV_NAMES:
            raise ValueError(f"automatic tensor parallelism: {full} is a fused QKV projection whose q, k, v layout "
                             f"differs by model; dslab splits separate q/k/v projections (and GPT-2's c_attn) only")
        if role == "column":
            blocks = _fused_blocks(module, full)
            out_features = module.weight.shape[_out_dim(module)] // blocks
            if out_features % tp.size:
                raise ValueError(f"tensor_parallel.tp_size={tp.size} does not divide the {out_features} output "
                                 f"features of {full}")
        elif role == "row":
            in_features = module.weight.shape[1 - _out_dim(module)]
            if in_features % tp.size:
                raise ValueError(f"tensor_parallel.tp_size={tp.size} does not divide the {in_features} input "
                                 f"features of {full}")
    for parent_path, (parent, columns) in _owners(layer, linears).items():
        name = f"{layer_name}.{parent_path}" if parent_path else layer_name
        for attribute in _attention_attributes(parent):
            value = getattr(parent, attribute)
            if value % tp.size:
                raise ValueError(f"tensor_parallel.tp_size={tp.size} does not divide {name}.{attribute}={value}")
        head_dim = getattr(parent, "head_dim", None)
        if not (_head_counts(parent) or "attn" in name.lower() or "attention" in name.lower()):
            continue
        for column in columns:
            width = column.weight.shape[_out_dim(column)] // tp.size
            if isinstance(head_dim, int) and head_dim > 0 and width % head_dim:
                raise ValueError(f"tensor_parallel.tp_size={tp.size} splits {name}'s projections inside a head "
                                 f"(head_dim={head_dim}, {width} features per rank)")


def _split_column(module: nn.Module, name: str, tp: TensorParallel) -> None:
    blocks = _fused_blocks(module, name)
    module.weight = nn.Parameter(_block(module.weight, _out_dim(module), tp, blocks), requires_grad=False)
    if module.bias is not None:
        module.bias = nn.Parameter(_block(module.bias, 0, tp, blocks), requires_grad=False)
    if _is_conv1d(module):
        module.nf = module.weight.shape[1]
    else:
        module.out_features = module.weight.shape[0]


def _row_parallel(module: nn.Module, tp: TensorParallel) -> RowParallelLinear:
    weight = module.weight.detach().t() if _is_conv1d(module) else module.weight.detach()  # [out, in]
    bias = module.bias.detach().clone() if module.bias is not None else None
    return RowParallelLinear(_block(weight, 1, tp), bias, tp)


def _split_layer(layer: nn.Module, layer_name: str, tp: TensorParallel, split: AutoTPSplit) -> None:
    linears = _linears(layer)
    owners = _owners(layer, linears)
    for path, module, role in linears:
        parent_path, _, child = path.rpartition(".")
        full = f"{layer_name}.{path}"
        if role == "row":
            parent = layer.get_submodule(parent_path) if parent_path else layer
            setattr(parent, child, _row_parallel(module, tp))
            split.row_parallel.append(full)
        elif role == "column":
            _split_column(module, full, tp)
            split.column_parallel.append(full)
        else:
            split.kept_whole.append(full)
    for parent_path, (parent, _) in owners.items():
        attributes = _attention_attributes(parent)
        for attribute in attributes:
            setattr(parent, attribute, getattr(parent, attribute) // tp.size)
        if attributes:
            split.attention_modules.append(f"{layer_name}.{parent_path}" if parent_path else layer_name)


def apply_auto_tp(model: nn.Module, tp: TensorParallel) -> AutoTPSplit:
    """Split ``model`` in place over ``tp``'s group (see the module docstring); returns what was
    split. Nothing changes when ``tp.size`` is 1."""
    split = AutoTPSplit(tp.size)
    if tp.size == 1:
        return split
    check_heads(model, tp.size)
    layers = find_decoder_layers(model)
    split.layers = len(layers)
    for name, layer in layers:
        _check_layer(layer, name, tp)
    with torch.no_grad():
        for name, layer in layers:
            _split_layer(layer, name, tp, split)
    return split
