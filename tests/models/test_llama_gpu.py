"""dslab's Llama on a GPU: the dslab set (Triton RMSNorm, rope, SwiGLU, GQA flash attention, the
fused loss) with its layer stack replayed from CUDA graphs trains to the torch set's losses under
bf16 autocast, and its graphs are captured and replayed (not silently eager)."""

import dataclasses

import pytest
import torch

from dslab.models.llama import LlamaForCausalLM, llama_tiny

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _train(kernels, config, state, graphs, steps=6):
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, kernels=kernels).cuda()
    model.load_state_dict(state)
    if graphs:
        model.enable_cuda_graphs()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (4, 256), device="cuda", generator=g)
    losses = []
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_dslab_set_with_graphs_trains_to_the_torch_sets_losses(backend):
    """``auto``: attention on cuDNN's kernels on Hopper (dslab.kernels.attention.attention_cudnn);
    ``triton``: on dslab's."""
    from dslab.kernels.dispatch import kernel_backend

    config = dataclasses.replace(llama_tiny(layers=3, hidden=512, heads=8, kv_heads=2, head_dim=64,
                                            intermediate=1376, vocab_size=5000), vocab_pad_multiple=64)
    torch.manual_seed(3)
    state = LlamaForCausalLM(config, kernels="torch").state_dict()
    ref, _ = _train("torch", config, state, graphs=False)
    with kernel_backend(backend):
        ours, model = _train("dslab", config, state, graphs=True)
    assert ref[-1] < ref[0] - 0.5
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=2e-2, atol=0.0)
    stats = model.cuda_graph_stats
    assert stats.get("captures", 0) >= 1 and stats.get("replays", 0) >= 3, stats
