"""ZeRO stage 3 empties a released parameter, and records its whole size where DeepSpeed does
(``ds_numel``, ``ds_shape``): the flops profiler's parameter counts, per module and in total,
are the model's at stage 3 as at stage 0, and the text profile says so."""

from __future__ import annotations

import torch

import dslab
from dslab.models import GPT2LMHeadModel, gpt2_tiny


def _profile(stage: int) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels="torch")
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "steps_per_print": 10**9, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "flops_profiler": {"enabled": True, "profile_step": 1, "detailed": False, "module_depth": 2,
                                 "top_modules": 3}}
    engine, *_ = dslab.initialize(model=model, config=config)
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        engine.backward(engine(input_ids=ids, labels=ids))
        engine.step()
    records = engine.profiler_records()["flops"]
    engine.destroy()
    return model, records


def test_stage3_profile_counts_whole_parameters(capsys):
    plain_model, plain = _profile(0)
    model, records = _profile(3)
    whole = sum(p.numel() for p in plain_model.parameters())
    assert sum(p.numel() for p in model.parameters()) < whole  # emptied between uses
    assert all(p.ds_numel == q.numel() and tuple(p.ds_shape) == tuple(q.shape)
               for p, q in zip(model.parameters(), plain_model.parameters()))
    assert records["params"] == plain["params"] == whole
    by_name = {m["name"]: m["params"] for m in plain["modules"]}
    assert {m["name"]: m["params"] for m in records["modules"]} == by_name
    assert by_name["layers.0"] > 0
    assert f"params per GPU: {whole / 1e3:.2f} k" in capsys.readouterr().out
