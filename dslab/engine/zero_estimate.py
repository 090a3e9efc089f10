"""``dslab.estimate_zero_memory``: model-state memory per GPU and per node for ZeRO stages 0-3.

The arithmetic and its assumptions are in :mod:`dslab.profilers.zero_memory_model` (the memory
tracer uses the same partitioning to put its measured figures beside the estimate); this module
takes a model or a parameter count, counts what it needs from a model and prints the table.

Example: 1.3B parameters on one node of 8 GPUs, bf16 with Adam::

    >>> rows = dslab.estimate_zero_memory(1_300_000_000, num_gpus=8, stage=2)
    >>> rows[0].gpu_total / 2**30   # 2·Ψ + (2 + 12)·Ψ/8 bytes
    4.54...

That is DeepSpeed's bf16 layout (2-byte parameters, fp32 master). dslab's engine keeps fp32
parameters under autocast and no master: ``param_bytes=4, master_bytes=0`` (4·Ψ + 12·Ψ/8).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn

from dslab.profilers.zero_memory_model import (
    OFFLOAD_DEVICES,
    STAGES,
    ZeroMemoryRow,
    format_table,
    model_state_row,
)


def count_unique_params(model: nn.Module) -> int:
    """Elements of the model's parameters, each parameter once (tied weights count once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # parameters() already skips repeats of one Parameter
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def largest_layer_params(model: nn.Module) -> int:
    """The most parameter elements one module owns directly (``parameters(recurse=False)``): what
    ZeRO stage 3 gathers at once when it fetches a module's parameters for its forward."""
    return max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)


def _offload_options(offload_optimizer, stages: Iterable[int]) -> list[tuple[int, str]]:
    if offload_optimizer is None:
        return [(s, o) for s in stages for o in OFFLOAD_DEVICES if not (s == 0 and o != "none")]
    if offload_optimizer is True or offload_optimizer is False:
        offload_optimizer = "cpu" if offload_optimizer else "none"
    return [(s, offload_optimizer) for s in stages]


def estimate_zero_memory(
    model_or_num_params: nn.Module | int,
    num_gpus: int = 1,
    stage: int | Iterable[int] | None = None,
    *,
    num_nodes: int = 1,
    offload_optimizer: str | bool | None = "none",
    precision: str = "bf16",
    optimizer_states: int = 2,
    largest_layer: int | None = None,
    additional_buffer_factor: float = 1.5,
    param_bytes: int | None = None,
    master_bytes: int | None = None,
    offload_param: str = "none",
    offload_ratio: float = 1.0,
    accumulate_on: str = "gpu",
    print_table: bool = False,
) -> list[ZeroMemoryRow]:
    """Model-state memory (bytes) per GPU and per node's CPU, one row per option asked for.

    Args:
        model_or_num_params: an ``nn.Module`` (its unique parameters are counted, tied weights
            once, and its largest layer found) or a parameter count.
        num_gpus: GPUs (ranks) per node; the data-parallel world is ``num_gpus * num_nodes``.
        stage: a ZeRO stage 0-3, several, or None for all four.
        num_nodes: nodes.
        offload_optimizer: ``"none"``, ``"cpu"`` (or False/True), ``"nvme"``, or None for
            none and cpu (stages 1-3).
        offload_param: ``"none"``, ``"cpu"`` or ``"nvme"``: stage 3's parameter partitions off
            the GPU (with an offloaded optimizer; rows of other stages are refused).
        offload_ratio: the fraction of the partitions the optimizer offload takes
            (``offload_optimizer.ratio``); the rest stays on the GPU.
        accumulate_on: ``offload_optimizer.accumulate_on``; ``"gpu_resident"`` adds the
            offloaded gradient partition's window sum to the GPU's gradients.
        precision: ``"bf16"``/``"fp16"`` (2 + 2 + 12 bytes per parameter with Adam, fp32 master
            weights in the optimizer: DeepSpeed's layout) or ``"fp32"`` (4 + 4 + 8).
        param_bytes: bytes of a parameter and of its gradient (default: from ``precision``).
        master_bytes: bytes of the optimizer's master copy of a parameter (default: 4 for
            bf16/fp16, 0 for fp32). dslab's own engine trains bf16/fp16 by autocast over fp32
            parameters without a master copy: ``param_bytes=4, master_bytes=0`` estimates it.
        optimizer_states: fp32 tensors per parameter the optimizer keeps (Adam 2, SGD+momentum 1).
        largest_layer: parameters of the largest layer, stage 3's gather buffer; default: found
            from the model, 0 for a count. Under ``stage3_module_granularity_threshold`` pass
            the largest subtree gathered whole.
        additional_buffer_factor: multiplies the CPU figures (staging buffers, slack), >= 1.
        print_table: also print the rows as a table (GiB).

    Returns:
        ``[ZeroMemoryRow]`` in stage order, ``offload_optimizer`` "none" before "cpu"; see
        :mod:`dslab.profilers.zero_memory_model` for what each figure counts.
    """
    if isinstance(model_or_num_params, nn.Module):
        num_params = count_unique_params(model_or_num_params)
        found_largest = largest_layer_params(model_or_num_params)
    elif isinstance(model_or_num_params, int) and not isinstance(model_or_num_params, bool):
        if model_or_num_params < 0:
            raise ValueError(f"model_or_num_params must be an nn.Module or an int >= 0, got {model_or_num_params}")
        num_params, found_largest = model_or_num_params, 0
    else:
        raise ValueError("model_or_num_params must be an nn.Module or an int, got "
                         f"{type(model_or_num_params).__name__}")
    if stage is None:
        stages = list(STAGES)
    elif isinstance(stage, int):
        stages = [stage]
    else:
        stages = list(stage)
    rows = [
        model_state_row(num_params, num_gpus, s, num_nodes=num_nodes, offload_optimizer=offload,
                        precision=precision, optimizer_states=optimizer_states,
                        largest_layer_params=found_largest if largest_layer is None else largest_layer,
                        additional_buffer_factor=additional_buffer_factor,
                        param_bytes=param_bytes, master_bytes=master_bytes,
                        offload_param=offload_param, offload_ratio=offload_ratio,
                        accumulate_on=accumulate_on if offload != "none" else "gpu")
        for s, offload in _offload_options(offload_optimizer, stages)
    ]
    if print_table:
        print(format_table(rows), end="")
    return rows
