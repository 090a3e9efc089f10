import json
import warnings

import pytest

from dslab.engine.config import DslabConfig, load_config
from dslab.engine.zero_config import DslabDeprecationWarning


def resolved(world_size=1, **keys):
    cfg = load_config(keys)
    cfg.resolve_batch_size(world_size)
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


@pytest.mark.parametrize(
    "keys, world, expected",
    [
        (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2), 4, (32, 4, 2)),
        (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4), 2, (32, 4, 4)),
        (dict(train_batch_size=32, gradient_accumulation_steps=2), 4, (32, 4, 2)),
        (dict(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=3), 2, (24, 4, 3)),
        (dict(train_batch_size=16), 4, (16, 4, 1)),
        (dict(train_micro_batch_size_per_gpu=8), 3, (24, 8, 1)),
    ],
)
def test_batch_size_derivation(keys, world, expected):
    assert resolved(world, **keys) == expected


def test_batch_size_inconsistent_names_the_keys():
    with pytest.raises(ValueError, match="train_batch_size.*30.*= 32"):
        resolved(4, train_batch_size=30, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)


def test_batch_size_missing():
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu"):
        resolved(1, gradient_accumulation_steps=2)


def test_batch_size_too_small_for_world():
    with pytest.raises(ValueError, match="smaller"):
        resolved(8, train_batch_size=4, train_micro_batch_size_per_gpu=1)


def test_unknown_top_level_key_names_closest():
    with pytest.raises(ValueError, match=r"unknown config key 'train_batch_sise'; did you mean 'train_batch_size'"):
        load_config({"train_batch_sise": 8})


def test_unknown_nested_key_names_closest():
    with pytest.raises(ValueError, match=r"'fp16.loss_scale_windw'.*'fp16.loss_scale_window'"):
        load_config({"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale_windw": 10}})


def test_bad_value_names_key():
    with pytest.raises(ValueError, match="fp16.hysteresis"):
        load_config({"train_batch_size": 8, "fp16": {"hysteresis": 0}})
    with pytest.raises(ValueError, match="gradient_clipping"):
        load_config({"train_batch_size": 8, "gradient_clipping": -1.0})


def test_unsupported_deepspeed_section_is_explicit():
    with pytest.raises(ValueError, match="'sparse_attention' is a DeepSpeed feature that dslab does not support"):
        load_config({"train_batch_size": 8, "sparse_attention": {"mode": "fixed"}})
    # switched off: accepted
    load_config({"train_batch_size": 8, "flops_profiler": {"enabled": False}, "wandb": {"enabled": False}})


def test_zero_stages_accepted_and_above_three_refused():
    for stage in (1, 2, 3):
        assert load_config({"train_batch_size": 8, "zero_optimization": {"stage": stage}}).zero_optimization.stage == stage
    with pytest.raises(ValueError, match="zero_optimization.stage"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 4}})
    cfg = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 0, "reduce_bucket_size": 1000}})
    assert cfg.zero_optimization.reduce_bucket_size == 1000


def test_zero_true_is_stage_one_with_deprecation():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config({"train_batch_size": 8, "zero_optimization": True})
    assert cfg.zero_optimization.stage == 1
    assert any(issubclass(w.category, DslabDeprecationWarning) for w in caught)
    assert load_config({"train_batch_size": 8, "zero_optimization": False}).zero_optimization.stage == 0


def test_fp16_and_bf16_sections():
    cfg = load_config({"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale": 0,
                                                      "initial_scale_power": 12, "consecutive_hysteresis": True}})
    assert cfg.fp16.enabled and cfg.fp16.initial_scale_power == 12 and cfg.fp16.consecutive_hysteresis
    assert load_config({"train_batch_size": 8, "bf16": {"enabled": True}}).bf16.enabled


# DeepSpeed's ZeRO-2 example config, as its docs print it
DEEPSPEED_ZERO2 = {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                   "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True,
                   "round_robin_gradients": True, "load_from_fp32_weights": True, "elastic_checkpoint": False,
                   "ignore_unused_parameters": True, "memory_efficient_linear": False, "mics_shard_size": -1,
                   "mics_hierarchical_params_gather": False}


def test_deepspeed_zero_keys_with_nothing_to_choose_load():
    zero = load_config({"train_batch_size": 8, "zero_optimization": DEEPSPEED_ZERO2}).zero_optimization
    assert zero.stage == 2 and zero.reduce_bucket_size == 200_000_000 and zero.round_robin_gradients
    top = {"eigenvalue": {"enabled": False}, "progressive_layer_drop": {"enabled": False},
           "graph_harvesting": False, "hybrid_engine": {"enabled": False}, "nebula": {"enabled": False},
           "fp16": {"enabled": True, "auto_cast": False}, "compile": {"enabled": False, "deepcompile": False}}
    assert load_config({"train_batch_size": 8, **top}).fp16.enabled


@pytest.mark.parametrize("section, words", [
    ({"zero_optimization": {"stage": 2, "load_from_fp32_weights": False}},
     "'zero_optimization.load_from_fp32_weights' = False: dslab restores the fp32 masters"),
    ({"zero_optimization": {"stage": 3, "ignore_unused_parameters": False}},
     "'zero_optimization.ignore_unused_parameters' = False"),
    ({"zero_optimization": {"stage": 1, "elastic_checkpoint": True}}, "'zero_optimization.elastic_checkpoint' = True"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 8}}, "'zero_optimization.mics_shard_size' = 8: MiCS"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": "yes"}}, "'zero_optimization.cpu_offload' must be true or false"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
     "'zero_optimization.cpu_offload' \\(the 2021 form\\) and 'zero_optimization.offload_optimizer' are both given"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, "'fp16.auto_cast': a DeepSpeed feature .* set it to false"),
    ({"compile": {"deepcompile": True}}, "'compile.deepcompile': a DeepSpeed feature"),
    ({"progressive_layer_drop": {"enabled": True}}, "'progressive_layer_drop' is a DeepSpeed feature"),
])
def test_deepspeed_keys_dslab_cannot_honour_are_refused_by_name(section, words):
    with pytest.raises(ValueError, match=words):
        load_config({"train_batch_size": 8, **section})


def test_cpu_offload_true_is_optimizer_offload_with_deprecation():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zero = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": True}}).zero_optimization
    assert zero.offload_optimizer.device == "cpu"
    assert any(issubclass(w.category, DslabDeprecationWarning) and "cpu_offload" in str(w.message) for w in caught)
    zero = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": False}}).zero_optimization
    assert zero.offload_optimizer.device == "none"


def test_config_from_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    cfg = load_config(path)
    assert isinstance(cfg, DslabConfig) and cfg.optimizer.params["lr"] == 1e-3
    assert load_config(str(path)).train_batch_size == 8


def test_config_file_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        load_config(bad)


def test_kernels_key():
    assert load_config({"train_batch_size": 8, "kernels": "torch"}).kernels == "torch"
    with pytest.raises(ValueError, match="kernels"):
        load_config({"train_batch_size": 8, "kernels": "cuda"})
