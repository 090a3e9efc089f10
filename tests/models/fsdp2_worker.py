"""One rank of the FSDP2 wrapping tests, started by torchrun (see test_fsdp2_wrap.py).

``OUT``: for each scenario, the model is built from one seed, ``fully_shard`` is applied to each
``model.layers[i]`` and then to the root, and 3 AdamW steps with clipping run on a batch every
rank shares (dropout on, the torch seed set before each step). A second build from the seed trains
the same way in this process without any sharding: the reference. Rank 0 saves the losses of
both and the final full parameters (``full_tensor()``) of both, per scenario, to ``OUT``.

A scenario that keeps the cross-block LayerNorm fusion on (``chain_layer_norms=True``) records
the error FSDP2 raises instead, so the tests can show why the option exists.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from dslab.models.bert import BertForPreTraining, bert_tiny
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny
from dslab.models.gpt2_moe import GPT2MoELMHeadModel, gpt2_moe_tiny

STEPS = 3
LR = 1e-2
CLIP = 1.0


def _lm_batch():
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def _bert_batch():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 1000, (2, 16), generator=g)
    labels = torch.where(torch.rand(2, 16, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    labels[:, 1] = ids[:, 1]  # at least one labelled position per row
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0
    return {"input_ids": ids, "attention_mask": mask, "masked_lm_labels": labels,
            "next_sentence_label": torch.tensor([0, 1])}


# name -> (build(chain_layer_norms), batch, MixedPrecisionPolicy or None)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
SCENARIOS = {
    "gpt2/torch": (lambda chain: GPT2LMHeadModel(gpt2_tiny(chain_layer_norms=chain), kernels="torch"), _lm_batch, None),
    "gpt2/dslab": (lambda chain: GPT2LMHeadModel(gpt2_tiny(chain_layer_norms=chain), kernels="dslab"), _lm_batch, None),
    "bert/torch": (lambda chain: BertForPreTraining(bert_tiny(chain_layer_norms=chain), kernels="torch"),
                   _bert_batch, None),
    "bert_pre_ln/dslab": (lambda chain: BertForPreTraining(bert_tiny(pre_ln=True, chain_layer_norms=chain),
                                                           kernels="dslab"), _bert_batch, None),
    "gpt2_moe/torch": (lambda chain: GPT2MoELMHeadModel(gpt2_moe_tiny(chain_layer_norms=chain), kernels="torch"),
                       _lm_batch, None),
    "gpt2_moe/dslab": (lambda chain: GPT2MoELMHeadModel(gpt2_moe_tiny(chain_layer_norms=chain), kernels="dslab"),
                       _lm_batch, None),
    "gpt2/torch/bf16": (lambda chain: GPT2LMHeadModel(gpt2_tiny(chain_layer_norms=chain), kernels="torch"),
                        _lm_batch, BF16),
}


def _train(model, batch, steps=STEPS):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        loss = model(**batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def _full_state(model):
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def _shard(model, policy):
    options = {} if policy is None else {"mp_policy": policy}
    for layer in model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def run_scenario(name):
    build, batch_fn, policy = SCENARIOS[name]
    torch.manual_seed(0)
    model = build(False).train()
    torch.manual_seed(0)  # the same weights again (a deep copy cannot copy the MoE's process groups)
    reference = build(False).train()
    batch = batch_fn()
    sharded_losses = _train(_shard(model, policy), batch)
    reference_losses = _train(reference, batch)
    every_param_sharded = all(isinstance(p, DTensor) for p in model.parameters())
    return {"losses": sharded_losses, "reference_losses": reference_losses, "state": _full_state(model),
            "reference_state": _full_state(reference), "every_param_sharded": every_param_sharded}


def chained_error():
    """The error FSDP2 raises on GPT-2 with the cross-block fusion on (None if it trains)."""
    torch.manual_seed(0)
    model = _shard(GPT2LMHeadModel(gpt2_tiny(chain_layer_norms=True), kernels="torch").train(), None)
    try:
        _train(model, _lm_batch(), steps=1)
    except RuntimeError as err:
        return str(err).splitlines()[0]
    return None


def main(out):
    dist.init_process_group("gloo")
    results = {name: run_scenario(name) for name in SCENARIOS}
    results["chained_error"] = chained_error()
    results["world_size"] = dist.get_world_size()
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
