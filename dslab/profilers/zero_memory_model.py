"""How much memory ZeRO's model states take per GPU and per node: the arithmetic, no torch.

Model states are the parameters, their gradients and the optimizer states (Rajbhandari et al.
2020, "ZeRO", §3.1 and §5). With ``Ψ`` parameters, ``N`` data-parallel ranks (GPUs per node ×
nodes) and ``P``, ``G``, ``K`` the bytes per parameter of parameters, gradients and optimizer
states, the bytes each GPU holds are::

    stage 0   P·Ψ   + G·Ψ   + K·Ψ        every rank holds everything
    stage 1   P·Ψ   + G·Ψ   + K·Ψ/N      optimizer states partitioned
    stage 2   P·Ψ   + G·Ψ/N + K·Ψ/N      gradients partitioned too
    stage 3   P·Ψ/N + G·Ψ/N + K·Ψ/N + B  parameters partitioned too

``B``, stage 3's working buffer, is the largest layer (the most parameters one module owns
directly) gathered whole with its whole gradient before the reduce-scatter: ``(P + G)·L`` for
``L`` parameters. Mixed precision (fp16/bf16 parameters with fp32 master weights and Adam's two
moments) is ``P, G, K = 2, 2, 12`` (16 bytes per parameter); fp32 training with Adam is
``4, 4, 8``. In general ``P = G = param_bytes`` (a gradient has its parameter's dtype) and
``K = master_bytes + 4·optimizer_states`` (optimizer states are fp32). dslab's engine trains
bf16/fp16 by autocast over fp32 parameters with no master copy, so its layout is
``param_bytes=4, master_bytes=0`` whatever the precision (:func:`bytes_per_param`): the same 16
bytes per parameter as DeepSpeed's bf16 at stages 0 and 3, but not at stages 1 and 2, where
DeepSpeed's replicated part (2-byte parameters and gradients) is smaller.

Optimizer offload (ZeRO-Offload, stages 1-3, ``offload_optimizer: {"device": "cpu"}``) moves the
optimizer states and each rank's gradient partition, as fp32, to the CPU, where the CPU optimizer
updates them: the GPU keeps its parameters (partitioned at stage 3), and at stage 1 the whole
gradient it all-reduces before copying its partition out. Each node's CPU holds its ranks'
partitions of the copy the optimizer steps and its gradient (``M`` bytes each, ``M`` the master's
bytes, or the parameter's when there is no master) and the states: ``(2·M + 4·k)·Ψ/nodes``.

Parameter offload (ZeRO-Infinity, stage 3 with optimizer offload, ``offload_param: {"device":
"cpu"}``) moves the parameter partitions off the GPU too: the GPU keeps only the gathered
working buffer. The CPU then also holds the parameter partition, unless the stepped copy *is*
the parameter (dslab's layout, no master: ``M = P``), where nothing is added. With ``nvme``
devices the stepped copies (``offload_param: nvme``) and the optimizer states
(``offload_optimizer: nvme``) move from the CPU figure to the ``nvme`` one.

Partial offload (``offload_optimizer.ratio`` ``r`` < 1, ZeRO-Offload++) offloads a fraction
``r`` of the partitions: the GPU keeps ``1 - r`` of the gradient and optimizer-state partitions
(and of the parameter partition under parameter offload), the CPU and NVMe figures are ``r``
times the full offload's.

Without offload the CPU figure is what building the model takes: every process of a node
constructs the whole model in fp32 on the CPU before the engine moves or partitions it,
``4·Ψ·gpus_per_node``. Both CPU figures are multiplied by ``additional_buffer_factor`` (pinned
staging buffers, allocator slack, fragmentation); the CPU holds the larger of the two.

Activations, temporary buffers of the collectives (buckets) and the CUDA context are not model
states and are not counted.
"""

from __future__ import annotations

import dataclasses

STAGES = (0, 1, 2, 3)
PRECISIONS = ("bf16", "fp16", "fp32")
OFFLOAD_DEVICES = ("none", "cpu")
PARAM_OFFLOAD_DEVICES = ("none", "cpu", "nvme")
FP32_BYTES = 4
GIB = 1024 ** 3


def bytes_per_param(precision: str, optimizer_states: int = 2, *, param_bytes: int | None = None,
                    master_bytes: int | None = None) -> tuple[int, int, int]:
    """``(P, G, K)``: bytes per parameter of parameters, gradients and optimizer states.

    ``optimizer_states`` is the number of fp32 tensors of a parameter's size the optimizer keeps
    (Adam/AdamW/Lamb: 2; SGD with momentum: 1). ``param_bytes`` (default: 2 for bf16/fp16, 4 for
    fp32) is the parameters' and gradients' element size; ``master_bytes`` (default: 4 for
    bf16/fp16, 0 for fp32) the fp32 master copy the optimizer keeps, added to K. dslab's engine
    (autocast over fp32 parameters) is ``param_bytes=4, master_bytes=0`` in every precision."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if isinstance(optimizer_states, bool) or not isinstance(optimizer_states, int) or optimizer_states < 0:
        raise ValueError(f"optimizer_states must be an int >= 0, got {optimizer_states!r}")
    half = precision != "fp32"
    param_bytes = (2 if half else FP32_BYTES) if param_bytes is None else param_bytes
    master_bytes = (FP32_BYTES if half else 0) if master_bytes is None else master_bytes
    for name, value, low in (("param_bytes", param_bytes, 1), ("master_bytes", master_bytes, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return param_bytes, param_bytes, master_bytes + FP32_BYTES * optimizer_states


def check_layout(stage: int, num_gpus: int, num_nodes: int = 1, offload_optimizer: str = "none",
                 offload_param: str = "none", offload_ratio: float = 1.0) -> None:
    """Raise ValueError naming the argument for a stage, GPU count, node count, offload device or
    ratio ZeRO cannot have."""
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(map(str, STAGES))} (ZeRO stages), got {stage!r}")
    for name, value in (("num_gpus", num_gpus), ("num_nodes", num_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if offload_optimizer not in PARAM_OFFLOAD_DEVICES:
        raise ValueError(f"offload_optimizer must be one of {', '.join(PARAM_OFFLOAD_DEVICES)}, "
                         f"got {offload_optimizer!r}")
    if offload_param not in PARAM_OFFLOAD_DEVICES:
        raise ValueError(f"offload_param must be one of {', '.join(PARAM_OFFLOAD_DEVICES)}, "
                         f"got {offload_param!r}")
    if offload_param != "none" and (stage != 3 or offload_optimizer == "none"):
        raise ValueError("offload_param needs ZeRO stage 3 and offload_optimizer 'cpu' or 'nvme': "
                         "only stage 3 partitions the parameters, and the CPU optimizer steps them")
    if isinstance(offload_ratio, bool) or not isinstance(offload_ratio, (int, float)) \
            or not 0.0 < offload_ratio <= 1.0:
        raise ValueError(f"offload_ratio must be a number in (0, 1], got {offload_ratio!r}")
    if offload_optimizer != "none" and stage == 0:
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3: stage 0 does not partition "
                         "the optimizer states it would offload")


def partition_per_gpu(stage: int, world_size: int, params: float, grads: float, optimizer_states: float,
                      layer_buffer: float = 0.0, offload_optimizer: bool = False,
                      offload_param: bool = False, offload_ratio: float = 1.0,
                      resident_grads: bool = False) -> dict[str, int]:
    """Bytes one GPU holds of whole-model totals ``params``, ``grads``, ``optimizer_states``
    (bytes, summed over every parameter) at ZeRO ``stage`` over ``world_size`` ranks.

    ``layer_buffer`` is stage 3's gathered-layer buffer (ignored below stage 3). With
    ``offload_optimizer`` the fraction ``offload_ratio`` of the gradient (stages 2-3) and
    optimizer-state partitions leaves the GPU, and with ``offload_param`` (stage 3) that fraction
    of the parameter partition too; ``resident_grads`` (``offload_optimizer.accumulate_on:
    "gpu_resident"``) keeps the offloaded fraction's gradient sum on the GPU while a window lasts
    (at stage 1, beside the whole gradients). Returns ``{"params", "grads", "optimizer_states",
    "buffer", "total"}``; partitions round up, as a rank's shard of a padded flat buffer does."""
    def shard(total: float, partitioned: bool) -> int:
        return -(-int(total) // world_size) if partitioned else int(total)

    kept = 1.0 - offload_ratio if offload_optimizer else 1.0
    row = {
        "params": int(shard(params, stage >= 3) * (kept if offload_param and stage >= 3 else 1.0)),
        "grads": int(shard(grads, True) * kept) if offload_optimizer and stage >= 2
        else shard(grads, stage >= 2),
        "optimizer_states": int(shard(optimizer_states, stage >= 1) * kept),
        "buffer": int(layer_buffer) if stage >= 3 else 0,
    }
    if offload_optimizer and resident_grads and stage >= 1:
        row["grads"] += int(shard(grads, True) * offload_ratio)
    row["total"] = sum(row.values())
    return row


@dataclasses.dataclass(frozen=True)
class ZeroMemoryRow:
    """One option's model-state memory (bytes). ``gpu_*`` are per GPU; ``cpu_*`` per node, with
    ``cpu_total`` = ``additional_buffer_factor`` × the larger of ``cpu_init`` and ``cpu_offload``."""

    stage: int
    offload_optimizer: str
    num_gpus: int
    num_nodes: int
    precision: str
    num_params: int
    largest_layer_params: int
    param_bytes: int
    master_bytes: int
    gpu_params: int
    gpu_grads: int
    gpu_optimizer_states: int
    gpu_buffer: int
    gpu_total: int
    cpu_init: int
    cpu_offload: int
    cpu_total: int
    offload_param: str = "none"
    offload_ratio: float = 1.0
    nvme_total: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def model_state_row(num_params: int, num_gpus: int, stage: int, *, num_nodes: int = 1,
                    offload_optimizer: str = "none", precision: str = "bf16", optimizer_states: int = 2,
                    largest_layer_params: int = 0, additional_buffer_factor: float = 1.5,
                    param_bytes: int | None = None, master_bytes: int | None = None,
                    offload_param: str = "none", offload_ratio: float = 1.0,
                    accumulate_on: str = "gpu") -> ZeroMemoryRow:
    """The model-state memory of ``num_params`` parameters at one ZeRO option (module docstring;
    ``param_bytes``/``master_bytes`` as in :func:`bytes_per_param`; ``accumulate_on`` is
    ``offload_optimizer.accumulate_on``, whose ``"gpu_resident"`` keeps the offloaded gradients'
    window sum on the GPU)."""
    check_layout(stage, num_gpus, num_nodes, offload_optimizer, offload_param, offload_ratio)
    if accumulate_on not in ("gpu", "cpu", "gpu_resident"):
        raise ValueError(f"accumulate_on must be 'gpu', 'cpu' or 'gpu_resident', got {accumulate_on!r}")
    for name, value in (("num_params", num_params), ("largest_layer_params", largest_layer_params)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if largest_layer_params > num_params:
        raise ValueError(f"largest_layer_params ({largest_layer_params}) exceeds num_params ({num_params})")
    if not isinstance(additional_buffer_factor, (int, float)) or additional_buffer_factor < 1:
        raise ValueError(f"additional_buffer_factor must be a number >= 1, got {additional_buffer_factor!r}")
    p, g, k = bytes_per_param(precision, optimizer_states, param_bytes=param_bytes,
                              master_bytes=master_bytes)
    master = k - FP32_BYTES * optimizer_states
    world_size = num_gpus * num_nodes
    offload = offload_optimizer != "none"
    ratio = offload_ratio if offload else 1.0
    gpu = partition_per_gpu(stage, world_size, p * num_params, g * num_params, k * num_params,
                            layer_buffer=(p + g) * largest_layer_params, offload_optimizer=offload,
                            offload_param=offload_param != "none", offload_ratio=ratio,
                            resident_grads=accumulate_on == "gpu_resident")
    cpu_init = FP32_BYTES * num_params * num_gpus
    stepped = master or p  # the copy the CPU optimizer steps, and its gradient, in its dtype
    cpu_offload = nvme = 0
    if offload:
        per_node = num_params * ratio / num_nodes
        states = (k - master) * per_node
        copy = stepped * per_node
        # the parameter partition beside a master (a parameter without master is the copy)
        param_copy = p * per_node if offload_param != "none" and master else 0
        on_disk = (states if offload_optimizer == "nvme" else 0) + \
            (copy + param_copy if offload_param == "nvme" else 0)
        cpu_offload = int(stepped * per_node + copy + states + param_copy - on_disk)
        nvme = int(on_disk)
    return ZeroMemoryRow(
        stage=stage, offload_optimizer=offload_optimizer, num_gpus=num_gpus, num_nodes=num_nodes,
        precision=precision, num_params=num_params, largest_layer_params=largest_layer_params,
        param_bytes=p, master_bytes=master, gpu_params=gpu["params"], gpu_grads=gpu["grads"], gpu_optimizer_states=gpu["optimizer_states"],
        gpu_buffer=gpu["buffer"], gpu_total=gpu["total"], cpu_init=cpu_init, cpu_offload=cpu_offload,
        cpu_total=int(additional_buffer_factor * max(cpu_init, cpu_offload)),
        offload_param=offload_param, offload_ratio=ratio, nvme_total=nvme,
    )


def format_table(rows: list[ZeroMemoryRow]) -> str:
    """A text table of ``rows`` in GiB: per GPU (total and its parts) and per node's CPU."""
    if not rows:
        return "no ZeRO options to estimate\n"
    first = rows[0]
    lines = [
        "Estimated memory for model states (parameters, gradients, optimizer states):",
        f"HW: {first.num_nodes} node(s) x {first.num_gpus} GPU(s) per node",
        f"SW: {first.num_params / 1e6:,.2f}M parameters, largest layer "
        f"{first.largest_layer_params / 1e6:,.2f}M, {first.precision} "
        f"({first.param_bytes}-byte parameters and gradients, {first.master_bytes}-byte master copy)",
        f"{'stage':>5}  {'offload':<7}  {'per GPU':>9}  {'params':>9}  {'grads':>9}  {'optim':>9}  "
        f"{'buffer':>9}  {'per CPU':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r.stage:>5}  {r.offload_optimizer:<7}  " + "  ".join(
                f"{value / GIB:>6.2f}GiB" for value in (r.gpu_total, r.gpu_params, r.gpu_grads,
                                                        r.gpu_optimizer_states, r.gpu_buffer, r.cpu_total)))
    return "\n".join(lines) + "\n"
