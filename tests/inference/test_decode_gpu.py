"""On a GPU: the per-token step replayed from CUDA graphs gives exactly the eager step's tokens
(same kernels, same inputs), and both give transformers' greedy tokens for 32 new tokens in fp32
(bf16 is compared against the graph-free engine only: transformers' bf16 path rounds differently
and near-ties may flip); int8 decode (the Triton weight-streaming GEMM) under graphs equals its
eager run; one capture per batch bucket, one replay per later token. The prefill's flash
attention, launched through cached launches, follows each call's batch: the caller's tensors stay
as they were and the logits equal those of Triton's own launches. The prompt's graph (captured the
second time a shape comes) gives the eager prefill's logits and tokens, GPT-2 and Llama layouts."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_gpt2, hf_llama, prompts

import dslab

pytestmark = pytest.mark.gpu

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def model():
    return hf_gpt2().cuda()


def _engines(model, **kwargs):
    graphed = dslab.init_inference(model, enable_cuda_graph=True, max_out_tokens=64, **kwargs)
    eager = dslab.init_inference(model, enable_cuda_graph=False, max_out_tokens=64, **kwargs)
    return graphed, eager


@pytest.mark.parametrize("pads", [[0], [0, 5, 2]], ids=["batch1", "batch3-left-padded"])
def test_graphs_equal_eager_and_transformers_fp32(model, pads):
    ids, mask = prompts(len(pads), 12, pads=pads)
    ids, mask = ids.cuda(), mask.cuda()
    graphed, eager = _engines(model, dtype=torch.float32)
    # No stop at the model's eos on either side: 32 new tokens each (dslab's generate, like
    # transformers', stops at the generation config's eos unless told otherwise).
    run = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    ours = graphed.generate(ids, **run)
    again = graphed.generate(ids, **run)  # replays the captured graphs
    assert torch.equal(ours, again)
    assert torch.equal(ours, eager.generate(ids, **run))
    expected = model.generate(ids, do_sample=False, **run)
    assert torch.equal(ours, expected)
    stats = graphed.cuda_graph_stats
    decode = {key: value for key, value in stats.items() if not key.startswith("prefill")}
    assert decode == {"captures": 1, "replays": 2 * (NEW_TOKENS - 1)}
    if len(pads) == 1:  # unpadded: the second prompt of the shape is captured and replayed
        assert (stats["prefill eager"], stats["prefill captures"], stats["prefill replays"]) == (1, 1, 1)
    else:  # a padded prompt is never graphed
        assert stats["prefill eager"] == 2 and "prefill captures" not in stats


def test_graphs_equal_eager_bf16_and_int8(model):
    ids, mask = prompts(4, 10, pads=[0, 3, 0, 6])
    ids, mask = ids.cuda(), mask.cuda()
    for kwargs in ({"dtype": torch.bfloat16}, {"dtype": torch.int8}):
        graphed, eager = _engines(model, **kwargs)
        ours = graphed.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
        assert torch.equal(ours, eager.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)), kwargs
        assert graphed.cuda_graph_stats["captures"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_fused_step_matches_the_op_by_op_step(model, dtype):
    """The fused step (decode_linear's autotuned kernels, under graphs) against the op-by-op step
    over several tokens: test_fused_decode's comparison, on the GPU."""
    from test_fused_decode import compare_steps

    compare_steps(model, dtype)


def test_buckets_and_sampling_under_graphs(model):
    engine = dslab.init_inference(model, dtype=torch.bfloat16, max_out_tokens=64)
    for batch in (1, 2, 3, 5):
        ids, mask = prompts(batch, 8)
        engine.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=4)
    assert engine.cuda_graph_stats["captures"] == 4  # buckets 1, 2, 4, 8
    ids, mask = prompts(3, 8, pads=[0, 2, 4])
    ids, mask = ids.cuda(), mask.cuda()

    def sample(seed):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        return engine.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=True, top_k=0,
                               generator=generator)

    assert torch.equal(sample(1), sample(1)) and not torch.equal(sample(1), sample(2))


def test_memory_records_on_gpu(model):
    engine = dslab.init_inference(model, dtype=torch.bfloat16, max_out_tokens=64)
    ids, mask = prompts(2, 8)
    engine.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=4)
    records = engine.memory_records()
    assert records["kv_cache_bytes"] == 2 * 2 * 2 * 4 * 64 * 32 * 2  # K and V, 2 layers, bucket 2, 4 heads, bf16
    # the record is the device memory the caches hold: their tensors, on the GPU
    caches = [slot.cache for slot in engine._runner.slots.values()]
    tensors = [t for cache in caches for t in (*cache.keys, *cache.values)]
    assert all(t.is_cuda for t in tensors)
    assert sum(t.untyped_storage().nbytes() for t in tensors) == records["kv_cache_bytes"]


def test_prefill_attention_follows_each_calls_batch(model):
    """bf16, where the prompt's flash attention runs on Triton through cached launches
    (``attention_triton.CachedLaunch``), whose key (strides of the packed ``[batch, seq, 3 *
    hidden]`` projection, heads, lengths) is the same for every batch of one prompt length.
    Batch 1, then 4, then single rows again: the logits of each call equal those of Triton's own
    launch path (launch caches emptied; a grid kept from the batch-1 call left batches 1 .. 3 of
    the batch-4 attention unwritten), and the caller's int64 ids and mask are bit-for-bit as they
    were (a grid kept from batch 32 launched 32 batches' programs for a batch-1 call on an H100,
    whose stores past the attention output zeroed rows of the caller's mask)."""
    from dslab.kernels.attention import attention_triton

    engine = dslab.init_inference(model, dtype=torch.bfloat16, max_out_tokens=64)
    ids, mask = prompts(4, 12, seed=7)
    ids, mask = ids.cuda(), mask.cuda()
    kept_ids, kept_mask = ids.clone(), mask.clone()
    attention_triton.clear_launch_caches()
    small = engine(ids[:1], attention_mask=mask[:1])
    big = engine(ids, attention_mask=mask)
    tokens = engine.generate(ids, attention_mask=mask, max_new_tokens=8)
    rows = [engine.generate(ids[r:r + 1], attention_mask=mask[r:r + 1], max_new_tokens=8) for r in range(4)]
    torch.cuda.synchronize()
    assert torch.equal(ids, kept_ids) and torch.equal(mask, kept_mask)
    attention_triton.clear_launch_caches()
    assert torch.equal(engine(ids, attention_mask=mask), big)
    assert torch.equal(engine(ids[:1], attention_mask=mask[:1]), small)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=8), tokens)
    for r, row in enumerate(rows):
        attention_triton.clear_launch_caches()
        assert torch.equal(engine.generate(ids[r:r + 1], attention_mask=mask[r:r + 1], max_new_tokens=8), row), r


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_graphed_prefill_equals_the_eager_prefill(family):
    source = (hf_gpt2() if family == "gpt2" else hf_llama("llama")).cuda()
    ids, mask = prompts(2, 16, vocab=source.config.vocab_size, pads=[0, 0])
    ids, mask = ids.cuda(), mask.cuda()
    graphed, eager = _engines(source, dtype=torch.bfloat16)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, return_dict_in_generate=True, output_logits=True)
    runs = [graphed.generate(ids, **kwargs) for _ in range(3)]  # eager, captured + replayed, replayed
    reference = eager.generate(ids, **kwargs)
    stats = graphed.cuda_graph_stats
    assert (stats["prefill eager"], stats["prefill captures"], stats["prefill replays"]) == (1, 1, 2), stats
    for run in runs:
        assert torch.equal(run.sequences, reference.sequences)
        torch.testing.assert_close(run.logits[0], reference.logits[0], rtol=2e-2, atol=2e-2)
