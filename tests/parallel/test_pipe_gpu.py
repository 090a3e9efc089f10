"""On a GPU: the pipeline engine with one stage trains dslab's GPT-2 (dslab kernels, bf16 autocast)
as the plain engine does, from the same weights on the same batches."""

import pytest
import torch

import dslab
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny
from dslab.models.gpt2_pipe import gpt2_pipeline_module, load_dense_state_dict

pytestmark = pytest.mark.gpu


def test_one_stage_pipeline_trains_as_the_plain_engine_in_bf16():
    config = gpt2_tiny(dropout=0.0, layers=4, hidden=256, heads=4, vocab_size=512, n_positions=128)
    torch.manual_seed(0)
    dense = GPT2LMHeadModel(config, "dslab")
    pipe = gpt2_pipeline_module(config, "dslab", num_stages=1)
    load_dense_state_dict(pipe, dense.state_dict())
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
           "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}
    plain, _, _, _ = dslab.initialize(model=dense, config=cfg)
    piped, _, _, _ = dslab.initialize(model=pipe, config=cfg)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 512, (4, 128), generator=g).cuda() for _ in range(4)]
    plain_losses, pipe_losses = [], []
    for _ in range(6):
        total = 0.0
        for ids in batches:
            loss = plain(ids, labels=ids)
            plain.backward(loss)
            plain.step()
            total += float(loss.detach())
        plain_losses.append(total / len(batches))
        pipe_losses.append(float(piped.train_batch(iter([(ids, ids) for ids in batches]))))
    assert plain_losses[-1] < plain_losses[0] - 0.05  # the same batches: the loss falls
    torch.testing.assert_close(torch.tensor(pipe_losses), torch.tensor(plain_losses), rtol=1e-2, atol=1e-2)
    stats = piped.pipeline_stats()
    assert len(stats["batches"]) == 6 and 0 < stats["busy_ms"] <= stats["wall_ms"]
