"""``chain_layer_norms``: with the cross-block fusion off, each transformer block reads only its
own parameters (every LayerNorm of block i runs while block i runs), and the model trains exactly
as with it on: same weights, same batch, same seeds, 3 AdamW steps with clipping give the same
losses and parameters bit for bit, on both kernel sets (on CPU each set's ops are PyTorch
references; the dslab set's fused ``dropout_add_layer_norm`` draws the same dropout mask as its
unfused residual add)."""

import pytest
import torch

from dslab.models.bert import BertForPreTraining, bert_tiny
from dslab.models.gpt2 import GPT2Config, GPT2LMHeadModel, gpt2_tiny
from dslab.models.gpt2_moe import GPT2MoELMHeadModel, gpt2_moe_tiny
from dslab.models.ops import LayerNorm

IDS = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
MLM_LABELS = torch.where(IDS % 5 == 0, IDS, torch.full_like(IDS, -100))

MODELS = {
    "gpt2": (lambda chain, kernels: GPT2LMHeadModel(gpt2_tiny(chain_layer_norms=chain), kernels=kernels),
             {"input_ids": IDS, "labels": IDS}),
    "bert_pre_ln": (lambda chain, kernels: BertForPreTraining(bert_tiny(pre_ln=True, chain_layer_norms=chain),
                                                              kernels=kernels),
                    {"input_ids": IDS, "masked_lm_labels": MLM_LABELS}),
    "gpt2_moe": (lambda chain, kernels: GPT2MoELMHeadModel(gpt2_moe_tiny(chain_layer_norms=chain), kernels=kernels),
                 {"input_ids": IDS, "labels": IDS}),
}


def _train(model, batch, steps=3):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        loss = model(**batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses), model.state_dict()


def _norms_run_outside_their_block(model, batch) -> list[str]:
    """The LayerNorms of ``model.layers`` that ran while their own block was not running."""
    running, outside = set(), []
    owner = {id(m): i for i, block in enumerate(model.layers) for m in block.modules() if isinstance(m, LayerNorm)}
    names = {id(m): name for name, m in model.named_modules()}
    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(lambda module, args, i=i: running.add(i))
        block.register_forward_hook(lambda module, args, out, i=i: running.discard(i))
    for module in model.modules():
        if id(module) in owner:
            module.register_forward_pre_hook(
                lambda m, args: None if owner[id(m)] in running else outside.append(names[id(m)]))
    with torch.no_grad():
        model(**batch)
    return outside


@pytest.mark.parametrize("kernels", ["torch", "dslab"])
@pytest.mark.parametrize("family", list(MODELS))
def test_fusion_off_trains_bit_identically(family, kernels):
    build, batch = MODELS[family]
    torch.manual_seed(0)
    chained = build(True, kernels).train()
    torch.manual_seed(0)
    apart = build(False, kernels).train()
    assert _norms_run_outside_their_block(chained, batch) == ["layers.1.attention_norm"]
    assert _norms_run_outside_their_block(apart, batch) == []
    losses, state = _train(chained, batch)
    losses_apart, state_apart = _train(apart, batch)
    assert torch.equal(losses, losses_apart)
    assert losses[-1] < losses[0]
    for name, value in state.items():
        assert torch.equal(value, state_apart[name]), name


def test_post_ln_bert_never_reads_across_blocks():
    model = BertForPreTraining(bert_tiny(), kernels="torch").train()
    assert _norms_run_outside_their_block(model, {"input_ids": IDS, "masked_lm_labels": MLM_LABELS}) == []


def test_option_is_a_checked_bool():
    with pytest.raises(ValueError, match="chain_layer_norms must be a bool"):
        GPT2Config(chain_layer_norms="no")
    with pytest.raises(ValueError, match="chain_layer_norms must be a bool"):
        bert_tiny(chain_layer_norms=0)

