"""Bad arguments to ``init_inference`` and ``generate`` get errors that name the argument or key."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import hf_gpt2, prompts

import dslab
from dslab.inference.config import resolve_config
from dslab.inference.tensor_parallel import check_divisible


@pytest.fixture(scope="module")
def model():
    return hf_gpt2()


@pytest.fixture(scope="module")
def engine(model):
    return dslab.init_inference(model, dtype=torch.float32, max_out_tokens=20)


def test_keys_resolve_with_deepspeeds_spellings(tmp_path):
    config = resolve_config(None, {"dtype": "bf16", "mp_size": 1, "max_tokens": 77, "kernel_inject": False})
    assert config.dtype == torch.bfloat16 and config.tp_size == 1 and config.max_out_tokens == 77
    assert not config.replace_with_kernel_inject
    assert resolve_config({"tensor_parallel": {"tp_size": 4}}, {}).tp_size == 4
    assert resolve_config(None, {"mp_size": 2}).tp_size == 2
    assert resolve_config(None, {"tensor_parallel": {"enabled": False, "tp_size": 2}}).tp_size == 1
    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"dtype": "fp32", "enable_cuda_graph": False, "use_triton": False}))
    config = resolve_config(str(path), {"dtype": torch.float32})
    assert config.dtype == torch.float32 and not config.enable_cuda_graph


@pytest.mark.parametrize("kwargs,message", [
    ({"dtype": torch.float64}, "dtype=torch.float64 is not supported"),
    ({"dtype": "fp8"}, "dtype='fp8' is not supported"),
    ({"max_out_tokens": 0}, "max_out_tokens"),
    ({"max_out_tokens": 8, "min_out_tokens": 9}, "min_out_tokens=9 must be <= max_out_tokens=8"),
    ({"tensor_parallel": {"tp_size": 2}, "mp_size": 4}, "mp_size=4 .* contradicts tensor_parallel.tp_size=2"),
    ({"tensor_parallel": 2}, "tensor_parallel must be a dict"),
    ({"tensor_paralel": {"tp_size": 2}}, "unknown init_inference key 'tensor_paralel'; did you mean 'tensor_parallel'"),
    ({"use_triton": True}, "'use_triton'=True is a DeepSpeed setting dslab does not implement"),
    ({"quant": {"weight": {"num_bits": 4}}}, "quant.weight.num_bits"),
])
def test_bad_keys(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_config(None, kwargs)


def test_config_and_arguments_must_agree():
    with pytest.raises(ValueError, match="'dtype' is given both in config"):
        resolve_config({"dtype": "fp16"}, {"dtype": torch.bfloat16})
    with pytest.raises(ValueError, match="must be a dict, a path"):
        resolve_config(42, {})


def test_tensor_parallel_needs_a_process_group_and_divisible_heads(model):
    with pytest.raises(ValueError, match="tensor_parallel.tp_size=2 needs a process group"):
        dslab.init_inference(model, dtype=torch.float32, tensor_parallel={"tp_size": 2})
    with pytest.raises(ValueError, match="tensor_parallel.tp_size=3 does not divide the model's 4 attention heads"):
        check_divisible(4, 512, 3)
    with pytest.raises(ValueError, match="does not divide the model's MLP width 102"):
        check_divisible(4, 102, 4)


def test_generate_arguments(engine):
    ids, mask = prompts(2, 8, pads=[0, 2])
    with pytest.raises(ValueError, match=r"prompt \(8 tokens\) \+ max_new_tokens \(13\) = 21 exceeds the KV cache's "
                                         r"20 positions \(max_out_tokens=20"):
        engine.generate(ids, attention_mask=mask, max_new_tokens=13)
    engine.generate(ids, attention_mask=mask, max_new_tokens=12)  # exactly fits
    cases = [
        (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
        (dict(max_new_tokens=1.5), "max_new_tokens must be an int >= 1"),
        (dict(max_new_tokens=2, do_sample=True, temperature=0.0), "temperature must be a number > 0"),
        (dict(max_new_tokens=2, do_sample=True, top_k=-1), "top_k must be an int >= 0"),
        (dict(max_new_tokens=2, do_sample=True, top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(max_new_tokens=2, eos_token_id=10_000), "eos_token_id must be a token id"),
        (dict(max_new_tokens=2, num_beams=0), "num_beams must be an int >= 1"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.generate(ids, attention_mask=mask, **kwargs)
    right_padded = mask.flip(1)
    with pytest.raises(ValueError, match="attention_mask must be left-padded"):
        engine.generate(ids, attention_mask=right_padded, max_new_tokens=2)
    with pytest.raises(ValueError, match="attention_mask must have input_ids' shape"):
        engine.generate(ids, attention_mask=mask[:, :4], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"token ids outside \[0, 256\)"):
        engine.generate(ids + 1000, max_new_tokens=2)
    with pytest.raises(ValueError, match="input_ids must be a non-empty"):
        engine.generate(ids.float(), max_new_tokens=2)


def test_forward_arguments(engine):
    with pytest.raises(ValueError, match="input_ids has seq 65 > the model's 64 positions"):
        engine(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="token_type_ids: transformers.GPT2LMHeadModel has no token types"):
        engine(torch.zeros(1, 4, dtype=torch.long), token_type_ids=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="init_inference needs a torch.nn.Module"):
        dslab.init_inference("gpt2")


def test_frozen_keys_and_arms():
    """What users type (STYLE.md #12): init_inference's keys and spellings, the int8 keys, the
    DeepSpeed keys accepted only at their defaults, and the inference suites' arms."""
    from dslab.bench.inference_suite import INFERENCE_ARMS
    from dslab.config_base import known_keys
    from dslab.inference.config import ALIASES, DEEPSPEED_KEYS_AT_DEFAULT, InferenceConfig, QuantConfig

    assert known_keys(InferenceConfig) == [
        "dtype", "replace_with_kernel_inject", "tensor_parallel", "mp_size", "max_out_tokens", "min_out_tokens",
        "enable_cuda_graph", "checkpoint", "base_dir", "injection_policy", "quant"]
    assert ALIASES == {"kernel_inject": "replace_with_kernel_inject", "max_tokens": "max_out_tokens",
                       "min_tokens": "min_out_tokens", "injection_dict": "injection_policy"}
    assert known_keys(QuantConfig) == ["enabled", "weight", "compute_dtype"]
    assert sorted(DEEPSPEED_KEYS_AT_DEFAULT) == sorted([
        "moe", "ep_size", "moe_experts", "moe_type", "ep_group", "ep_mp_group", "mpu", "training_mp_size",
        "replace_method", "return_tuple", "triangular_masking", "use_triton", "keep_module_on_host",
        "save_mp_checkpoint_path", "set_empty_params", "transposed_mode", "checkpoint_config"])
    assert INFERENCE_ARMS == ("dslab", "dslab-int8", "hf", "hf-static")
