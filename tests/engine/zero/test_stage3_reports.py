"""What the profilers report of a model at ZeRO stage 3, against the same run at stage 0. Stage 3
empties a released parameter, records its whole size where DeepSpeed does (``ds_numel``,
``ds_shape``) and gathers it into a buffer made during the forward: the flops profiler's parameter
counts (per module, in total, in the text) and the memory tracer's activations (parameters saved
for backward are not activations) are the stage 0 run's."""

from __future__ import annotations

import torch

import dslab
from dslab.models import GPT2LMHeadModel, gpt2_tiny


def _profile(stage: int) -> tuple[torch.nn.Module, dict, dict]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels="torch")
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "steps_per_print": 10**9, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "flops_profiler": {"enabled": True, "profile_step": 1, "detailed": False, "module_depth": 2,
                                 "top_modules": 3},
              "memory_tracer": {"enabled": True, "profile_step": 1}}
    engine, *_ = dslab.initialize(model=model, config=config)
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        engine.backward(engine(input_ids=ids, labels=ids))
        engine.step()
    records = engine.profiler_records()
    engine.destroy()
    return model, records["flops"], records["memory"]


def test_stage3_profile_counts_whole_parameters(capsys):
    plain_model, plain, _ = _profile(0)
    model, records, _ = _profile(3)
    whole = sum(p.numel() for p in plain_model.parameters())
    assert sum(p.numel() for p in model.parameters()) < whole  # emptied between uses
    assert all(p.ds_numel == q.numel() and tuple(p.ds_shape) == tuple(q.shape)
               for p, q in zip(model.parameters(), plain_model.parameters()))
    assert records["params"] == plain["params"] == whole
    by_name = {m["name"]: m["params"] for m in plain["modules"]}
    assert {m["name"]: m["params"] for m in records["modules"]} == by_name
    assert by_name["layers.0"] > 0
    assert f"params per GPU: {whole / 1e3:.2f} k" in capsys.readouterr().out


def test_stage3_activations_are_stage0_activations():
    _, _, plain = _profile(0)
    _, _, memory = _profile(3)
    assert plain["activations"] and memory["activations"] == plain["activations"]
