"""Generation on the CPU: greedy decoding gives transformers' ``generate`` tokens exactly (fp32),
for one prompt and for a left-padded batch run in a larger bucket, with and without an eos token;
sampling is reproducible with a seeded generator and keeps to top-k / top-p."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, dslab_gpt2, hf_gpt2, prompts

import dslab
from dslab.inference.decode import batch_bucket
from dslab.inference.generate import Sampling, filter_logits


@pytest.fixture(scope="module")
def hf_model():
    return hf_gpt2()


@pytest.fixture(scope="module")
def engine(hf_model):
    return dslab.init_inference(hf_model, dtype=torch.float32, max_out_tokens=48)


def _hf_generate(model, ids, mask, new, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **kwargs)


@pytest.mark.parametrize("pads", [[0], [0, 5, 2]], ids=["batch1", "batch3-left-padded"])
def test_greedy_equals_transformers(hf_model, engine, pads):
    ids, mask = prompts(len(pads), 9, pads=pads)
    expected = _hf_generate(hf_model, ids, mask, 24, eos_token_id=None, pad_token_id=0)
    ours = engine.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=None)  # as transformers is asked
    assert ours.shape == expected.shape == (len(pads), 9 + 24)
    assert torch.equal(ours, expected)
    assert len(set(ours[0, 9:].tolist())) > 3  # a varied continuation, not one token repeated
    bucket = batch_bucket(len(pads))
    assert bucket in engine._runner.slots and engine._runner.slots[bucket].cache.batch == bucket


def test_greedy_stops_at_eos_like_transformers(hf_model, engine):
    ids, mask = prompts(3, 9, pads=[0, 5, 2])
    free = _hf_generate(hf_model, ids, mask, 20, eos_token_id=None, pad_token_id=0)[:, 9:]
    # eos: a token that rows 0 and 1 produce within the first few steps, row 2 at some point or never
    eos = int(free[0, 2])
    expected = _hf_generate(hf_model, ids, mask, 20, eos_token_id=eos, pad_token_id=0)
    ours = engine.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(ours, expected)
    finished_rows = (ours[:, 9:] == eos).any(dim=1)
    after = [(row[row.tolist().index(eos) + 1:] == 0).all() for row in ours[:, 9:] if eos in row.tolist()]
    assert finished_rows[0] and all(after)  # padded after its eos


def test_dslab_gpt2_greedy_equals_its_transformers_twin():
    import transformers

    from dslab.models.gpt2 import GPT2LMHeadModel

    model = dslab_gpt2()
    config = model.config
    twin = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=config.vocab_size, n_embd=config.hidden, n_layer=config.layers, n_head=config.heads,
        n_positions=config.n_positions)).eval()
    twin.load_state_dict(model.to_hf_state_dict())
    assert isinstance(model, GPT2LMHeadModel)
    ids, mask = prompts(2, 7, vocab=config.vocab_size, pads=[3, 0])
    expected = _hf_generate(twin, ids, mask, 12, eos_token_id=None, pad_token_id=0)
    ours = dslab.init_inference(model, dtype=torch.float32).generate(ids, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(ours, expected)


def test_sampling_is_reproducible_with_a_seed(engine):
    ids, mask = prompts(2, 6, pads=[0, 2])

    def sample(seed, top_k=0):
        generator = torch.Generator().manual_seed(seed)
        return engine.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=True, top_k=top_k,
                               generator=generator)

    first, again, other = sample(11), sample(11), sample(12)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    greedy = engine.generate(ids, attention_mask=mask, max_new_tokens=16)
    assert torch.equal(sample(5, top_k=1), greedy)  # top-1 sampling is greedy


def _logits_along(engine, sequence, mask, prompt_len):
    """The engine's logits that chose each new token of ``sequence`` (a full forward per step)."""
    full_mask = torch.cat([mask, torch.ones(mask.shape[0], sequence.shape[1] - prompt_len, dtype=mask.dtype)], 1)
    logits = engine(sequence, attention_mask=full_mask)
    return logits[:, prompt_len - 1:-1]  # position t predicts token t + 1


def test_sampling_keeps_to_top_k_and_top_p(engine):
    ids, mask = prompts(2, 6, pads=[0, 1])
    generator = torch.Generator().manual_seed(3)
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=None, do_sample=True, top_k=3,
                          temperature=2.0, generator=generator)
    logits = _logits_along(engine, out, mask, 6)
    ranks = (logits > logits.gather(-1, out[:, 6:, None])).sum(-1)  # how many tokens beat the chosen one
    assert ranks.max() <= 2 and ranks.max() >= 1  # always within the top 3, not always the argmax

    generator = torch.Generator().manual_seed(4)
    top_p = 0.5
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=None, do_sample=True, top_k=0,
                          top_p=top_p, generator=generator)
    logits = _logits_along(engine, out, mask, 6)
    probs = logits.softmax(-1)
    chosen = probs.gather(-1, out[:, 6:, None])
    mass_above = (probs * (probs > chosen)).sum(-1)  # probability of the tokens more likely than the chosen one
    assert (mass_above < top_p).all()  # inside the nucleus


def test_filter_logits_matches_transformers_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    )

    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    sampling = Sampling(do_sample=True, temperature=0.7, top_k=20, top_p=0.6)
    expected = logits.clone()
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.6)):
        expected = warper(None, expected)
    ours = filter_logits(logits, sampling)
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    kept = ~torch.isinf(ours)
    assert torch.allclose(ours[kept], expected[kept])
    assert 1 < kept.sum(-1).min() < 20


def test_token_clock_marks_every_new_token(engine):
    from dslab.inference import TokenClock

    clock = TokenClock("cpu")
    with pytest.raises(ValueError, match="no token was timed"):
        clock.result()
    ids, mask = prompts(2, 6)
    engine.token_clock = clock
    try:
        engine.generate(ids, attention_mask=mask, max_new_tokens=5)
    finally:
        engine.token_clock = None
    timing = clock.result()
    assert timing["new_tokens"] == 5 and len(timing["per_token_ms"]) == 4
    assert timing["prefill_ms"] > 0 and timing["total_ms"] == pytest.approx(timing["prefill_ms"]
                                                                           + sum(timing["per_token_ms"]))


def test_a_mask_that_pads_nothing_is_dropped_and_off_cuda_the_prompt_runs_eagerly(engine):
    """check_prompt returns no mask when no row is padded (the prefill then needs no padding mask,
    and a graphed prefill can take it); without CUDA graphs every prefill runs eagerly, counted."""
    from dslab.inference.generate import check_prompt

    ids, mask = prompts(3, 7)
    _, kept, start = check_prompt(ids, mask, VOCAB, torch.device("cpu"))
    assert kept is None and start.tolist() == [0, 0, 0]
    padded_ids, padded = prompts(3, 7, pads=[0, 2, 0])
    _, kept, start = check_prompt(padded_ids, padded, VOCAB, torch.device("cpu"))
    assert torch.equal(kept, padded) and start.tolist() == [0, 2, 0]
    before = engine.cuda_graph_stats.get("prefill eager", 0)
    first = engine.generate(ids, attention_mask=mask, max_new_tokens=3)
    assert torch.equal(first, engine.generate(ids, max_new_tokens=3))
    assert engine.cuda_graph_stats["prefill eager"] == before + 2
    assert "prefill captures" not in engine.cuda_graph_stats
