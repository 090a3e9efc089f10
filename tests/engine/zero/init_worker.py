"""One rank of the ``dslab.zero.Init`` tests, started by torchrun (see test_zero_init.py).

``OUT`` (rank 0 writes it): for GPT-2, BERT and GPT-2-MoE (torch kernels) built under
``zero.Init`` from one seed, what each rank held after the build (every parameter's ``data`` and
shard sizes), the whole weights gathered by ``GatheredParameters`` next to a plain build's from
the same seed, and the losses of 3 stage 3 steps next to a plain model's at stage 0. Then for
GPT-2: a write through ``GatheredParameters(modifier_rank=1)`` on the engine's parameters, a
checkpoint consolidated by ``zero-to-fp32``, ``remote_device='cpu'``, NVMe parameter offload of
a built-partitioned model, and the errors for stage 2 and ``remote_device='nvme'``.
"""

import sys
from pathlib import Path

import torch

import dslab
from dslab import comm
from dslab.engine.zero import consolidated_state_dict
from dslab.models.bert import BertForPreTraining, bert_tiny
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny
from dslab.models.gpt2_moe import GPT2MoELMHeadModel, gpt2_moe_tiny

STEPS = 3


def _lm_batch(rank):
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(10 + rank))
    return {"input_ids": ids, "labels": ids.clone()}


def _bert_batch(rank):
    g = torch.Generator().manual_seed(20 + rank)
    ids = torch.randint(0, 1000, (2, 16), generator=g)
    labels = torch.where(torch.rand(2, 16, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    labels[:, 1] = ids[:, 1]
    return {"input_ids": ids, "attention_mask": torch.ones(2, 16, dtype=torch.long),
            "masked_lm_labels": labels, "next_sentence_label": torch.tensor([0, 1])}


MODELS = {
    "gpt2": (lambda: GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels="torch"), _lm_batch),
    "bert": (lambda: BertForPreTraining(bert_tiny(hidden_dropout=0.0, attention_dropout=0.0), kernels="torch"), _bert_batch),
    "gpt2_moe": (lambda: GPT2MoELMHeadModel(gpt2_moe_tiny(dropout=0.0), kernels="torch"),
                 _lm_batch),
}


def config(stage, **zero):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  **zero},
            "steps_per_print": 1000}


def train(engine, batch_fn):
    torch.manual_seed(1234)  # the same random stream (MoE gating noise) in every run
    losses = []
    for step in range(STEPS):
        out = engine(**batch_fn(comm.get_rank() + 2 * step))
        loss = out if torch.is_tensor(out) else out[0]
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def built(name, partitioned, **init):
    torch.manual_seed(0)
    make = MODELS[name][0]
    if not partitioned:
        return make()
    with dslab.zero.Init(**init):
        return make()


def run_models(results):
    for name, (_, batch_fn) in MODELS.items():
        model = built(name, True)
        params = dict(model.named_parameters())
        results[f"{name}/held"] = {
            n: (p.data.numel(), p.ds_tensor.numel(), p.ds_numel, tuple(p.ds_shape),
                str(p.ds_tensor.device)) for n, p in params.items()}
        with dslab.zero.GatheredParameters(list(params.values())):
            whole = {n: p.detach().clone() for n, p in params.items()}
        results[f"{name}/after_read"] = sum(p.data.numel() for p in params.values())
        plain = built(name, False)
        results[f"{name}/whole"] = whole
        results[f"{name}/plain"] = {n: p.detach().clone() for n, p in plain.named_parameters()}
        engine, _, _, _ = dslab.initialize(model=model, config=config(3))
        results[f"{name}/losses/init_stage3"] = train(engine, batch_fn)
        results[f"{name}/state/init_stage3"] = {k: v.cpu() for k, v in engine.module_state_dict().items()}
        engine.destroy()
        reference, _, _, _ = dslab.initialize(model=plain, config=config(0))
        results[f"{name}/losses/plain_stage0"] = train(reference, batch_fn)
        results[f"{name}/state/plain_stage0"] = {k: v.cpu() for k, v in reference.module_state_dict().items()}
        reference.destroy()


def run_engine_access(results, root: Path):
    model = built("gpt2", True)
    engine, _, _, _ = dslab.initialize(model=model, config=config(3))
    train(engine, _lm_batch)
    weight = engine.module.layers[0].mlp.fc_in.weight
    with dslab.zero.GatheredParameters([weight], modifier_rank=1):
        results["access/read_shape"] = tuple(weight.shape)
        results["access/read"] = weight.detach().clone()
        with torch.no_grad():
            weight.fill_(float(comm.get_rank() + 1))  # rank 1's value (2.0) is kept
    results["access/released"] = weight.data.numel()
    state = engine.module_state_dict()
    results["access/after_write"] = state["layers.0.mlp.fc_in.weight"].clone()
    results["access/state"] = {k: v.cpu() for k, v in state.items()}
    engine.save_checkpoint(root / "ckpt", tag="t")
    comm.barrier()
    if comm.get_rank() == 0:
        results["access/consolidated"] = consolidated_state_dict(root / "ckpt", tag="t")
    engine.destroy()


def run_offloaded(results, root: Path):
    """A model built partitioned on the CPU, trained with its shards in files."""
    model = built("gpt2", True, remote_device="cpu")
    results["cpu/devices"] = sorted({str(p.ds_tensor.device) for p in model.parameters()})
    engine, _, _, _ = dslab.initialize(model=model, config=config(
        3, offload_param={"device": "nvme", "nvme_path": str(root / f"nvme{comm.get_rank()}")},
        offload_optimizer={"device": "cpu"}))
    results["nvme/losses"] = train(engine, _lm_batch)
    results["nvme/state"] = {k: v.cpu() for k, v in engine.module_state_dict().items()}
    engine.destroy()


def run_refusals(results):
    model = built("gpt2", True)
    try:
        dslab.initialize(model=model, config=config(2))
        results["refuse/stage2"] = None
    except ValueError as err:
        results["refuse/stage2"] = str(err)
    try:
        dslab.zero.Init(remote_device="nvme")
        results["refuse/nvme"] = None
    except ValueError as err:
        results["refuse/nvme"] = str(err)


def main(out, root):
    comm.init_distributed()
    results = {}
    run_models(results)
    run_engine_access(results, root)
    run_offloaded(results, root)
    run_refusals(results)
    if comm.get_rank() == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
