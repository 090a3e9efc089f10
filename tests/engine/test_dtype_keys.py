"""DeepSpeed's ``data_types.grad_accum_dtype``: accepted where it names what dslab does, refused by
name otherwise (``gradient_predivide_factor`` and ``prescale_gradients``: test_gradient_scaling.py)."""

import pytest
import torch

import dslab
from dslab.engine.config import load_config
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _model(dtype=torch.float32):
    return GPT2LMHeadModel(gpt2_tiny(dropout=0.0, layers=2), kernels="torch").to(dtype)


def test_grad_accum_dtype_matching_the_parameters_trains():
    engine, *_ = dslab.initialize(model=_model(), config={**BASE, "data_types": {"grad_accum_dtype": "fp32"},
                                                         "bf16": {"enabled": True}})
    ids = torch.randint(0, 1000, (2, 16))
    for _ in range(2):  # one optimizer step of two micro-steps
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
    assert engine.global_steps == 1
    engine.destroy()


def test_grad_accum_dtype_other_than_the_parameters_is_refused_naming_both():
    with pytest.raises(ValueError, match="'data_types.grad_accum_dtype' is 'bf16', but .* a trainable parameter "
                                         "is float32"):
        dslab.initialize(model=_model(), config={**BASE, "data_types": {"grad_accum_dtype": "bf16"}})
    with pytest.raises(ValueError, match="'data_types.grad_accum_dtype' is 'fp32', .* is bfloat16"):
        dslab.initialize(model=_model(torch.bfloat16), config={**BASE, "data_types": {"grad_accum_dtype": "fp32"}})
    with pytest.raises(ValueError, match="data_types.grad_accum_dtype"):
        load_config({**BASE, "data_types": {"grad_accum_dtype": "int8"}})
