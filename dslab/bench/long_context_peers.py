"""The ``torch-cp`` arm of a long-context suite: PyTorch's own context parallelism on the same Llama,
the configuration a PyTorch user would pick for one long sequence over the GPUs of a host
(torchtitan's recipe: ``context_parallel`` for attention, FSDP2 for the model states).

- The model is :class:`dslab.bench.torch_llama.TorchLlama` holding the weights the suite's seed
  gives dslab's Llama (built once as dslab's model with the ``torch`` op set, its tensors handed
  over), so it starts where ``dslab-ulysses`` starts. Its blocks checkpoint in segments of
  ``checkpoint_layers`` as dslab's do.
- One ``DeviceMesh`` of the launch's N processes, dimension ``cp``. FSDP2 ``fully_shard`` on each
  block and then the root over that mesh (the ZeRO-3 analogue of the dslab arm's stage 3 over the
  same N ranks), ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (the blocks compute
  in bf16 from fp32 sharded parameters; no autocast). AdamW fused on CUDA with the suite's
  settings, ``clip_grad_norm_`` over the DTensor gradients when the suite clips.
- A step enters ``torch.distributed.tensor.experimental.context_parallel(mesh, buffers=[ids,
  targets, cos, sin], buffer_seq_dims=[1, 1, 0, 0])`` around the forward and the backward (the
  backward recomputes checkpointed attention, which must run the ring too). The context shards the
  buffers in place along the sequence, with its head-tail load balancer when ``seq_len`` divides by
  ``2N`` (each rank two chunks, one from each end, so that causal work is even), and replaces
  ``F.scaled_dot_product_attention`` with ring attention: q, k, v become DTensors sharded on the
  sequence and the key/value chunks travel round the ranks inside SDPA's flash, memory-efficient
  or cuDNN kernel, the partial outputs merged by their log-sum-exps. The ids and targets are
  fresh copies each step (the context leaves them sharded); the rotary tables are restored.
  Grouped-query attention stays native (``enable_gqa``): the ring carries the key/value heads.
- The loss: each rank's sum over its targets divided by the whole sequence's target count, so the
  ranks' values add up to the whole sequence's mean; backward runs on N times that, because
  FSDP2's reduce-scatter averages over the N ranks where the sum is wanted. The step returns the
  whole sequence's mean (one scalar all-reduce), the value dslab's arm returns.

CUDA only: on a CPU, SDPA runs ``aten._scaled_dot_product_flash_attention_for_cpu``, which the
ring dispatcher does not handle (DTensor raises ``NotImplementedError``: no sharding strategy), so
the arm is skipped there with that reason (:data:`CPU_REASON`).
"""

from __future__ import annotations

import torch

from dslab import comm
from dslab.bench.arms import PRECISION_DTYPES
from dslab.bench.common import ArmSkipped, free_memory
from dslab.bench.long_context_suite import check_sequence_split
from dslab.bench.peers import _adamw
from dslab.bench.torch_llama import IGNORE_INDEX, build_torch_llama, rotary_tables, shifted_targets
from dslab.bench.workloads import Workload

CPU_REASON = ("PyTorch's context parallelism needs CUDA: its ring attention handles SDPA's flash, memory-efficient "
              "and cuDNN kernels only, and on a CPU SDPA runs aten._scaled_dot_product_flash_attention_for_cpu, "
              "which has no context-parallel sharding strategy (DTensor raises NotImplementedError)")


class TorchContextParallelArm:
    """``torch-cp`` (module docstring): ``step()`` is one optimizer step over the case's sequences
    and returns the whole sequence's mean loss."""

    name = "torch-cp"

    def __init__(self, workload: Workload, device: torch.device, precision: str, engine_cfg: dict, world: int):
        if device.type != "cuda":
            raise ArmSkipped(CPU_REASON)
        if not comm.is_initialized():
            raise ArmSkipped("torch-cp needs an initialized torch.distributed process group (the suite's launches "
                             "start one)")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        case = workload.case
        check_sequence_split(case.seq_len, world, self.name)
        self.device = device
        self.world = world
        config = workload.model_config()
        self.mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
        seeded = workload.build_model(kernels="torch", device=device)  # dslab's Llama: the suite seed's weights
        model = build_torch_llama(config, seeded.state_dict()).train()
        del seeded
        dtype = PRECISION_DTYPES[precision]
        options = {"mesh": self.mesh}
        if dtype is not None:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, **options)
        fully_shard(model, **options)
        self.model = model
        self.optimizer = _adamw(model.parameters(), engine_cfg, device)
        self.clip = float(engine_cfg.get("gradient_clipping", 0.0))
        batch = workload.make_batch(device)
        self.input_ids = batch["input_ids"]
        self.targets = shifted_targets(batch["labels"])
        self.count = int((self.targets != IGNORE_INDEX).sum())
        self.cos, self.sin = rotary_tables(config, case.seq_len, device)
        self.first_loss: torch.Tensor | None = None

    def step(self) -> torch.Tensor:
        from torch.distributed.tensor.experimental import context_parallel

        ids, targets = self.input_ids.clone(), self.targets.clone()
        with context_parallel(self.mesh, buffers=[ids, targets, self.cos, self.sin], buffer_seq_dims=[1, 1, 0, 0],
                              no_restore_buffers={ids, targets}):
            local_sum = self.model(ids, targets, self.cos, self.sin)
            (local_sum * (self.world / self.count)).backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = local_sum.detach() / self.count
        comm.all_reduce(loss)
        if self.first_loss is None:
            self.first_loss = loss.clone()
        return loss

    def close(self) -> None:
        del self.model, self.optimizer, self.input_ids, self.targets, self.cos, self.sin
        free_memory(self.device)
