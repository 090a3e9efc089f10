"""transformers' generate arguments on the injected engine (CPU, fp32, tiny transformers GPT-2 whose
generation config has eos 1): for each argument dslab's decode loop implements, the engine's tokens
equal transformers' ``model.generate`` tokens on the same left-padded prompts (sampling too, both
drawing from torch's default generator seeded alike); ``min_new_tokens`` holds eos back; stopping
criteria stop early (also between two eos checks of the host); ``return_dict_in_generate`` gives
transformers' output with close scores and logits; arguments dslab does not implement go to the
source model's ``generate`` with a warning naming them; bad values raise ValueErrors naming the
argument. The same for a tiny Llama when dslab injects it."""

from __future__ import annotations

import pytest
import torch
from tiny_models import dslab_gpt2, hf_gpt2, prompts

import dslab

PROMPT = 9
PADS = [0, 5, 2]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: torch's intra-op threads only contend on a shared CPU (10x slower under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_model():
    return hf_gpt2()


@pytest.fixture(scope="module")
def engine(hf_model):
    return dslab.init_inference(hf_model, dtype=torch.float32, max_out_tokens=48)


@pytest.fixture(scope="module")
def batch():
    return prompts(len(PADS), PROMPT, pads=PADS)


def _both(hf_model, engine, batch, **kwargs):
    ids, mask = batch
    return hf_model.generate(ids, attention_mask=mask, **kwargs), engine.generate(ids, attention_mask=mask, **kwargs)


def _free_tokens(hf_model, batch, new=16):
    ids, mask = batch
    tokens = hf_model.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    return tokens[:, PROMPT:]


@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=12),
    dict(max_length=PROMPT + 11),
    dict(),  # transformers' default: 20 new tokens, the model's generation config's eos (1)
    dict(max_new_tokens=14, eos_token_id=None),
    dict(max_new_tokens=14, use_cache=True, num_beams=1, num_return_sequences=1, logits_processor=None),
], ids=["max_new_tokens", "max_length", "defaults", "no-eos", "neutral-values"])
def test_lengths_equal_transformers(hf_model, engine, batch, kwargs):
    expected, ours = _both(hf_model, engine, batch, **kwargs)
    assert torch.equal(ours, expected)


def test_eos_list_and_pad_equal_transformers(hf_model, engine, batch):
    free = _free_tokens(hf_model, batch)
    eos = [int(free[0, 3]), int(free[1, 6])]
    expected, ours = _both(hf_model, engine, batch, max_new_tokens=16, eos_token_id=eos, pad_token_id=7)
    assert torch.equal(ours, expected)
    assert ours.shape[1] < PROMPT + 16 and (ours[0, PROMPT + 4:] == 7).all()


def test_min_new_tokens_holds_eos_back(hf_model, engine, batch):
    free = _free_tokens(hf_model, batch)
    eos = int(free[0, 1])  # row 0 would stop after two tokens
    early = engine.generate(batch[0], attention_mask=batch[1], max_new_tokens=16, eos_token_id=eos)
    expected, ours = _both(hf_model, engine, batch, max_new_tokens=16, eos_token_id=eos, min_new_tokens=6)
    assert torch.equal(ours, expected)
    assert not (ours[:, PROMPT:PROMPT + 6] == eos).any()
    assert early[0, PROMPT + 1] == eos and ours.shape[1] > PROMPT + 6
    by_length = engine.generate(batch[0], attention_mask=batch[1], max_new_tokens=16, eos_token_id=eos,
                                min_length=PROMPT + 6)
    assert torch.equal(by_length, ours)


@pytest.mark.parametrize("kwargs", [dict(), dict(eos_token_id=None)], ids=["eos", "no-eos"])
def test_repetition_penalty_equals_transformers(hf_model, engine, batch, kwargs):
    expected, ours = _both(hf_model, engine, batch, max_new_tokens=20, repetition_penalty=1.3, **kwargs)
    assert torch.equal(ours, expected)
    plain = engine.generate(batch[0], attention_mask=batch[1], max_new_tokens=20, **kwargs)
    assert not torch.equal(ours, plain)


class _StopAfter:
    """Stops every row once the sequences reach ``length`` tokens (called as transformers calls it)."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


@pytest.mark.parametrize("eos", [None, "model"], ids=["no-eos", "eos-pads-finished-rows"])
def test_stopping_criteria_equal_transformers(hf_model, engine, batch, eos):
    from transformers import StoppingCriteriaList

    free = _free_tokens(hf_model, batch)
    stop_token = int(free[1, 2])
    per_row = (lambda input_ids, scores: input_ids[:, -1] == stop_token)  # row 1 finishes after 3 tokens
    extra = dict(eos_token_id=None) if eos is None else {}
    ids, mask = batch
    expected = hf_model.generate(ids, attention_mask=mask, max_new_tokens=20,
                                 stopping_criteria=StoppingCriteriaList([per_row, _StopAfter(PROMPT + 11)]), **extra)
    ours = engine.generate(ids, attention_mask=mask, max_new_tokens=20, stopping_criteria=[per_row,
                           _StopAfter(PROMPT + 11)], **extra)
    assert torch.equal(ours, expected) and ours.shape[1] == PROMPT + 11  # 11: between two host checks (8, 16)
    three = engine.generate(ids, attention_mask=mask, max_new_tokens=20, stopping_criteria=[_StopAfter(PROMPT + 3)])
    assert three.shape[1] == PROMPT + 3


def test_return_dict_scores_and_logits_close_to_transformers(hf_model, engine, batch):
    free = _free_tokens(hf_model, batch)
    kwargs = dict(max_new_tokens=12, eos_token_id=int(free[0, 2]), min_new_tokens=4, repetition_penalty=1.2,
                  return_dict_in_generate=True, output_scores=True, output_logits=True)
    expected, ours = _both(hf_model, engine, batch, **kwargs)
    assert type(ours).__name__ == "GenerateDecoderOnlyOutput"
    assert torch.equal(ours.sequences, expected.sequences)
    new = ours.sequences.shape[1] - PROMPT
    assert len(ours.scores) == len(ours.logits) == len(expected.scores) == new
    for mine, theirs in [*zip(ours.scores, expected.scores), *zip(ours.logits, expected.logits)]:
        assert mine.shape == theirs.shape == (len(PADS), hf_model.config.vocab_size) and mine.dtype == torch.float32
        assert torch.equal(torch.isinf(mine), torch.isinf(theirs))
        finite = ~torch.isinf(mine)
        torch.testing.assert_close(mine[finite], theirs[finite], rtol=1e-4, atol=1e-4)
    assert torch.isinf(ours.scores[0][:, kwargs["eos_token_id"]]).all()  # held back by min_new_tokens
    assert ours.scores[4] is not ours.logits[4] and not torch.equal(ours.scores[4], ours.logits[4])  # penalised
    only_sequences = engine.generate(batch[0], attention_mask=batch[1], max_new_tokens=5, return_dict_in_generate=True)
    assert only_sequences.scores is None and only_sequences.logits is None


def test_sampling_equals_transformers_with_the_same_seed(hf_model, engine, batch):
    kwargs = dict(max_new_tokens=16, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.1)
    torch.manual_seed(5)
    expected = hf_model.generate(batch[0], attention_mask=batch[1], **kwargs)
    torch.manual_seed(5)
    ours = engine.generate(batch[0], attention_mask=batch[1], **kwargs)
    assert torch.equal(ours, expected)
    seeded = [engine.generate(batch[0], attention_mask=batch[1], generator=torch.Generator().manual_seed(3), **kwargs)
              for _ in range(2)]
    assert torch.equal(*seeded)


def test_generation_config_is_read_like_transformers(hf_model, engine, batch):
    from transformers import GenerationConfig

    free = _free_tokens(hf_model, batch)
    config = GenerationConfig(max_new_tokens=10, repetition_penalty=1.25, eos_token_id=int(free[2, 4]),
                              min_new_tokens=2, pad_token_id=5)
    expected, ours = _both(hf_model, engine, batch, generation_config=config)
    assert torch.equal(ours, expected)
    expected, ours = _both(hf_model, engine, batch, generation_config=config, max_new_tokens=6)  # argument wins
    assert torch.equal(ours, expected) and ours.shape[1] == PROMPT + 6


@pytest.mark.parametrize("kwargs,named", [
    (dict(num_beams=2), "num_beams"),
    (dict(no_repeat_ngram_size=2, num_return_sequences=2, do_sample=True), "no_repeat_ngram_size, "
                                                                           "num_return_sequences"),
    ("config", "num_beams"),
], ids=["num_beams", "two-arguments", "in-generation-config"])
def test_other_arguments_go_to_the_source_models_generate(hf_model, engine, batch, kwargs, named):
    from transformers import GenerationConfig

    if kwargs == "config":
        kwargs = dict(generation_config=GenerationConfig(num_beams=2, max_new_tokens=6))
    kwargs = {"max_new_tokens": 6, **kwargs}
    ids, mask = batch
    torch.manual_seed(0)
    expected = hf_model.generate(ids, attention_mask=mask, **kwargs)
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=f"does not implement {named}; the call goes to GPT2LMHeadModel.generate"):
        ours = engine.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(ours, expected)


def test_a_handed_off_call_leaves_the_generator_out(hf_model, engine, batch):
    ids, mask = batch
    expected = hf_model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2)
    with pytest.warns(UserWarning, match=r"num_beams; .*generator \(dslab's own argument\) is not passed on"):
        ours = engine.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2, generator=torch.Generator())
    assert torch.equal(ours, expected)


def test_other_arguments_without_a_source_generate_raise():
    model = dslab_gpt2()
    engine = dslab.init_inference(model, dtype=torch.float32, max_out_tokens=32)
    ids, _ = prompts(1, 5, vocab=model.config.vocab_size)
    with pytest.raises(ValueError, match="does not implement num_beams, and GPT2LMHeadModel has no generate"):
        engine.generate(ids, max_new_tokens=3, num_beams=2)
    assert engine.generate(ids, max_new_tokens=3).shape == (1, 8)  # no generation config: no eos, 3 tokens


def test_use_cache_false_is_ignored_with_a_warning(engine, batch):
    with pytest.warns(UserWarning, match="use_cache=False"):
        ours = engine.generate(batch[0], attention_mask=batch[1], max_new_tokens=6, use_cache=False)
    assert torch.equal(ours, engine.generate(batch[0], attention_mask=batch[1], max_new_tokens=6))


def _bad_criterion(input_ids, scores):
    return torch.zeros(2, 2, dtype=torch.bool)


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_length=0), "max_length must be an int >= 1"),
    (dict(max_length=PROMPT), f"max_length={PROMPT} counts the prompt and the new tokens; the prompt already has"),
    (dict(max_new_tokens=4, min_new_tokens=-1), "min_new_tokens must be an int >= 0"),
    (dict(max_new_tokens=4, min_length=1.5), "min_length must be an int >= 0"),
    (dict(max_new_tokens=4, pad_token_id=-2), "pad_token_id must be an int >= 0"),
    (dict(max_new_tokens=4, eos_token_id=[]), "eos_token_id must be a token id"),
    (dict(max_new_tokens=4, repetition_penalty=0.0), "repetition_penalty must be a number > 0"),
    (dict(max_new_tokens=4, do_sample="yes"), "do_sample must be True or False"),
    (dict(max_new_tokens=4, stopping_criteria=[3]), "stopping_criteria must be a StoppingCriteriaList"),
    (dict(max_new_tokens=4, stopping_criteria=[_bad_criterion]),
     r"stopping_criteria: _bad_criterion returned \(2, 2\)"),
    (dict(max_new_tokens=4, return_dict_in_generate="yes"), "return_dict_in_generate must be True or False"),
    (dict(max_new_tokens=4, output_scores=1), "output_scores must be True or False"),
    (dict(max_new_tokens=4, generation_config={"max_new_tokens": 3}), "generation_config must be a transformers"),
    (dict(max_new_tokens=4, generator="seed"), "generator must be a torch.Generator"),
    (dict(max_new_tokens=4, num_beams=1.5), "num_beams must be an int >= 1"),
], ids=lambda value: None if isinstance(value, str) else next(iter(value.keys() - {"max_new_tokens"}), "max_length"))
def test_bad_values_name_the_argument(engine, batch, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(batch[0], attention_mask=batch[1], **kwargs)


def _tiny_llama():
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=1, initializer_range=0.15)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_llama_arguments_equal_transformers(batch):
    model = _tiny_llama()
    try:
        engine = dslab.init_inference(model, dtype=torch.float32, max_out_tokens=48)
    except ValueError as why:
        pytest.skip(f"the tiny Llama is not injectable here: {why}")
    if not engine.injected:
        pytest.skip("dslab has no injection policy for transformers' Llama here")
    ids, mask = batch
    free = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, pad_token_id=0)[:, PROMPT:]
    for kwargs in (dict(max_new_tokens=12), dict(max_new_tokens=12, repetition_penalty=1.3),
                   dict(max_new_tokens=12, eos_token_id=int(free[0, 1]), min_new_tokens=4, pad_token_id=0),
                   dict(max_new_tokens=12, stopping_criteria=[_StopAfter(PROMPT + 5)])):
        expected = model.generate(ids, attention_mask=mask, **kwargs)
        assert torch.equal(engine.generate(ids, attention_mask=mask, **kwargs), expected), kwargs
