"""Kernel choices recorded in one process and replayed in another (dslab.kernels.pinning).

The autotuned kernels are :mod:`pinning_kernels`'s, whose benchmarker returns scripted times (the
interpreter has no device to time on), so each test knows which config a benchmark would pick; and
dslab's own autotuners, found and named where its kernel modules keep them. A replay runs in a
fresh process (a subprocess), as a candidate run does.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import pinning_kernels as kernels  # noqa: E402  (tests/kernels is on sys.path: conftest.py)

from dslab.kernels import pinning  # noqa: E402

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
KERNEL_BENCHMARKS = REPO / "benchmarks" / "kernels"
SCALE = "pinning_kernels:scale"
FACTORY = "pinning_kernels:scale_for(64, wide_warps=True)"
KEY_100 = [100, "torch.float32", "torch.float32"]  # n, then the dtypes of X and Y

REPLAY = r"""
import json, sys
import torch
import pinning_kernels as kernels
from dslab.kernels import pinning

summary = pinning.replay_kernel_choices(json.load(open(sys.argv[1])), source=sys.argv[1])
kernels.TIMES[:] = [1.0, 2.0] * 2  # had they been benchmarked here, the 16-wide blocks would win
x = torch.randn(100)
scaled = kernels.run(kernels.scale, x, 2.0)
factory = kernels.scale_for(64, wide_warps=True)
kernels.run(factory, x, 3.0)
pinned_calls = len(kernels.BENCH_CALLS)
chosen = [kernels.scale.best_config.kwargs, factory.best_config.kwargs]
kernels.TIMES[:] = [3.0, 1.0]
kernels.run(kernels.scale, torch.randn(77), 1.0)  # a key the recording never saw
print(json.dumps({"summary": summary, "pinned_calls": pinned_calls, "chosen": chosen,
                  "correct": torch.equal(scaled, x * 2.0), "calls": len(kernels.BENCH_CALLS),
                  "misses": pinning.pinning_misses(), "backends": pinning.backend_flags()}))
"""

RECORD_NEW_TF32_API = r"""
import json
import torch
torch.backends.cuda.matmul.fp32_precision = "tf32"
torch.backends.cudnn.conv.fp32_precision = "ieee"
from dslab.kernels import pinning
print(json.dumps(pinning.record_kernel_choices()))
"""

REPLAY_FLAGS = r"""
import json, sys
from dslab.kernels import pinning
summary = pinning.replay_kernel_choices(json.load(open(sys.argv[1])))
print(json.dumps({"summary": summary, "backends": pinning.backend_flags()}))
"""


def run_python(script: str, *args: str) -> dict:
    """Run ``script`` in a fresh interpreter (the Triton interpreter on, this folder importable);
    its last line of output, as JSON."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]), TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def fresh_kernels():
    kernels.reset()
    yield
    kernels.reset()


@pytest.fixture
def restore_backends():
    """Replays in this process set flags; put them back as they were."""
    before = pinning.backend_flags()
    yield
    pinning.set_backend_flags(before)


def _record_scripted_choices() -> dict:
    """Run both autotuners here with the second config winning each benchmark; the record."""
    kernels.TIMES[:] = [2.0, 1.0, 2.0, 1.0]
    x = torch.randn(100)
    assert torch.equal(kernels.run(kernels.scale, x, 2.0), x * 2.0)
    kernels.run(kernels.scale_for(64, wide_warps=True), x, 3.0)
    assert len(kernels.BENCH_CALLS) == 4
    return pinning.record_kernel_choices(modules=["pinning_kernels"])


def test_a_fresh_process_takes_the_recorded_configs_without_benchmarking(tmp_path, fresh_kernels):
    choices = _record_scripted_choices()
    assert choices["fingerprint"] == pinning.fingerprint()
    assert [entry["key"] for entry in choices["triton"][SCALE]] == [KEY_100]
    assert choices["triton"][SCALE][0]["config"]["kwargs"] == {"BLOCK": 32}
    assert choices["triton"][SCALE][0]["config"]["num_warps"] == 2
    assert choices["triton"][FACTORY][0]["config"]["kwargs"] == {"BLOCK": 64}
    assert choices["triton"][FACTORY][0]["config"]["num_warps"] == 4
    # Flags a baseline may have run with; the replay must set each (cudnn.benchmark: off).
    wanted = {"cudnn.deterministic": True, "cudnn.benchmark": True, "float32_matmul_precision": "medium",
              "cuda.matmul.allow_tf32": True, "cuda.matmul.allow_bf16_reduced_precision_reduction": False,
              "deterministic_algorithms": "warn"}
    choices["backends"].update(wanted)
    choices["backends"]["env"]["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    path = tmp_path / "choices.json"
    path.write_text(json.dumps(choices))

    out = run_python(REPLAY, str(path))
    assert out["correct"]
    assert out["pinned_calls"] == 0, "the autotuner benchmarked a key the replay had pinned"
    assert out["chosen"] == [{"BLOCK": 32}, {"BLOCK": 64}]
    assert out["summary"]["pinned"] == 2 and out["summary"]["kernels"] == 2 and out["summary"]["stale"] == []
    # The key the recording never saw was autotuned as usual (both configs timed) and counted.
    assert out["calls"] == 2
    assert out["misses"] == {SCALE: [[77, "torch.float32", "torch.float32"]]}
    for name, value in wanted.items():
        assert out["backends"][name] == (False if name == "cudnn.benchmark" else value), name
    assert out["backends"]["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert out["summary"]["cudnn_benchmark_recorded"] is True
    assert out["summary"]["backends_changed"]["cudnn.deterministic"] == [False, True]


def test_flags_set_through_torchs_newer_tf32_api_round_trip(tmp_path):
    recorded = run_python(RECORD_NEW_TF32_API)
    backends = recorded["backends"]
    # The legacy getters refuse in such a process, so the record holds the new switches only.
    assert "cuda.matmul.allow_tf32" not in backends and "cudnn.allow_tf32" not in backends
    assert backends["cuda.matmul.fp32_precision"] == "tf32" and backends["cudnn.conv.fp32_precision"] == "ieee"
    path = tmp_path / "choices.json"
    path.write_text(json.dumps(recorded))
    out = run_python(REPLAY_FLAGS, str(path))
    assert out["backends"] == backends
    assert set(out["summary"]["backends_changed"]) == {"cuda.matmul.fp32_precision", "cudnn.conv.fp32_precision"}


@pytest.mark.parametrize(("field", "value"), [("device_name", "NVIDIA H200"), ("triton", "0.0.1"),
                                              ("torch", "1.0.0"), ("cuda", "12.8")])
def test_a_recording_from_another_device_or_version_is_refused_naming_the_field(field, value, restore_backends):
    choices = pinning.record_kernel_choices()
    choices["fingerprint"][field] = value
    choices["backends"]["cudnn.deterministic"] = True
    with pytest.raises(ValueError, match=rf'pins\.json: fingerprint\.{field} is "{value}" there'):
        pinning.replay_kernel_choices(choices, source="pins.json")
    assert torch.backends.cudnn.deterministic is False  # refused before anything was set
    lenient = pinning.replay_kernel_choices(choices, strict=False)
    assert lenient["fingerprint_differences"] == [[field, value, pinning.fingerprint()[field]]]
    assert torch.backends.cudnn.deterministic is True


DSLAB_GROUPED_GEMM = "dslab.kernels.moe.grouped_gemm_triton"


def test_dslab_autotuners_are_found_under_their_keys_and_replayed(restore_backends):
    assert {f"dslab.kernels.{name}" for name in (
        "attention.attention_triton", "attention.attention_triton_bwd", "attention.attention_triton_dq",
        "evoformer.evoformer_attention_triton", "evoformer.evoformer_attention_triton_bwd",
        "evoformer.outer_product_linear_triton", "moe.grouped_gemm_triton")} == set(pinning.autotuned_modules())
    from dslab.kernels.attention import attention_triton

    attention_triton.fwd_launcher(32)  # a CachedLaunch around the autotuner _fwd_kernel_for(32) made
    found = pinning.autotuned_kernels()
    assert found["dslab.kernels.attention.attention_triton:_fwd_kernel_for(32)"] is attention_triton._fwd_kernel_for(32)
    assert not [key for key in found if ":fwd_launcher(" in key]  # one autotuner, named once
    tuned = ("_forward_tuned", "_input_grad_tuned", "_forward_activation_tuned", "_input_grad_activation_tuned",
             "_weight_grad_tuned")
    assert {f"{DSLAB_GROUPED_GEMM}:{name}" for name in tuned} <= set(found)

    kernel_key = f"{DSLAB_GROUPED_GEMM}:_forward_tuned"
    autotuner = found[kernel_key]
    candidate = autotuner.configs[1]
    key = [96, 64, False, "torch.bfloat16", "torch.bfloat16", "torch.bfloat16", "torch.int32"]
    choices = pinning.record_kernel_choices()
    choices["triton"] = {
        kernel_key: [{"key": key, "config": pinning.config_dict(candidate)},
                     {"key": [1, 2], "config": {"kwargs": {"BLOCK_M": 7}, "num_warps": 4, "num_stages": 3}}],
        f"{DSLAB_GROUPED_GEMM}:_no_such_kernel": [{"key": [1], "config": {"num_warps": 4, "num_stages": 3}}],
    }
    try:
        summary = pinning.replay_kernel_choices(choices)
        assert autotuner.cache[tuple(key)] is candidate
        assert (1, 2) not in autotuner.cache
        assert summary["pinned"] == 1 and len(summary["stale"]) == 2
        assert "is not one of its candidates here" in summary["stale"][0]
        assert summary["stale"][1].startswith(f"{DSLAB_GROUPED_GEMM}:_no_such_kernel: AttributeError")
        recorded = pinning.record_kernel_choices()["triton"][kernel_key]
        assert recorded == [{"key": key, "config": pinning.config_dict(candidate)}]
        assert kernel_key not in pinning.pinning_misses()
        autotuner.cache[(128, 64, False, "torch.float32")] = candidate  # as if autotuned here
        assert pinning.pinning_misses()[kernel_key] == [[128, 64, False, "torch.float32"]]
    finally:
        autotuner.cache.pop(tuple(key), None)
        autotuner.cache.pop((128, 64, False, "torch.float32"), None)


def _choices() -> dict:
    return {"schema": pinning.SCHEMA, "schema_version": 1, "fingerprint": pinning.fingerprint(),
            "backends": {"cudnn.deterministic": False, "env": {"CUBLAS_WORKSPACE_CONFIG": None}},
            "triton": {SCALE: [{"key": KEY_100, "config": {"kwargs": {"BLOCK": 32}, "num_warps": 2, "num_stages": 3}}]},
            "notes": []}


def test_choices_load_from_each_kind_of_file(tmp_path):
    choices = _choices()
    files = {
        "choices.json": choices,
        "baseline.json": {"schema": "dslab.baseline", "schema_version": 1, "results": [], "kernel_choices": choices},
        "run.json": {"schema": "dslab.run", "profilers": {"flops": None, "kernel_choices": {"_run": choices}}},
        "pytest-benchmark.json": {"machine_info": {"node": "x", "kernel_choices": choices}, "benchmarks": []},
    }
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
        assert pinning.load_kernel_choices(tmp_path / name) == choices, name

    with pytest.raises(FileNotFoundError, match="no kernel-choices file"):
        pinning.load_kernel_choices(tmp_path / "missing.json")
    old = tmp_path / "old-baseline.json"
    old.write_text(json.dumps({"schema": "dslab.baseline", "schema_version": 1, "results": []}))
    with pytest.raises(ValueError, match="old-baseline.json holds no kernel choices"):
        pinning.load_kernel_choices(old)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "something.else"}))
    with pytest.raises(ValueError, match="neither kernel choices"):
        pinning.load_kernel_choices(other)


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: c.pop("fingerprint"), "'fingerprint' must be an object"),
    (lambda c: c["triton"][SCALE][0]["config"].pop("num_warps"), rf"'triton\.{SCALE}\[0\]'\.config\.num_warps"),
    (lambda c: c["triton"].update({"not a key": []}), "'triton' key 'not a key'"),
    (lambda c: c["backends"]["env"].update({"LD_PRELOAD": "x.so"}), r"'backends\.env\.LD_PRELOAD' is not a variable"),
    (lambda c: c["backends"].update({"deterministic_algorithms": "maybe"}), "deterministic_algorithms"),
    (lambda c: c.update({"schema_version": 99}), "'schema_version' 99"),
])
def test_malformed_choices_are_refused_naming_the_key(change, message):
    choices = _choices()
    change(choices)
    with pytest.raises(ValueError, match=message):
        pinning.check_kernel_choices(choices, "pins.json")


def test_the_launches_of_a_run_merge_into_one_record():
    first, second = _choices(), _choices()
    second["triton"][SCALE][0]["config"]["kwargs"] = {"BLOCK": 16}  # the same key, chosen otherwise
    second["triton"][FACTORY] = [{"key": KEY_100, "config": {"kwargs": {"BLOCK": 64}, "num_warps": 4,
                                                              "num_stages": 3}}]
    merged = pinning.merge_kernel_choices([first, second])
    assert merged["triton"][SCALE] == first["triton"][SCALE]
    assert merged["triton"][FACTORY] == second["triton"][FACTORY]
    assert any("1 autotune key(s) chose different configs" in note for note in merged["notes"])
    elsewhere = copy.deepcopy(second)
    elsewhere["fingerprint"]["device_name"] = "NVIDIA H200"
    with pytest.raises(ValueError, match="fingerprint.device_name"):
        pinning.merge_kernel_choices([first, elsewhere])


class _PytestConfig:
    """The part of pytest's config the kernel benchmarks' hooks read: options and the stash."""

    def __init__(self, **options):
        self.options = options
        self.stash = pytest.Stash()

    def getoption(self, name, default=None):
        return self.options.get(name, default)


def _kernel_bench_conftest():
    pytest.importorskip("pytest_benchmark")
    spec = importlib.util.spec_from_file_location("kernel_bench_conftest", KERNEL_BENCHMARKS / "conftest.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernel_benchmarks_replay_pins_and_record_choices_in_machine_info(tmp_path, fresh_kernels, restore_backends):
    conftest = _kernel_bench_conftest()
    choices = _record_scripted_choices()
    kernels.reset()  # as in a new session
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"machine_info": {"kernel_choices": choices}, "benchmarks": []}))
    config = _PytestConfig(kernel_pins=str(baseline))
    conftest.pytest_configure(config)
    kernels.TIMES[:] = [1.0, 2.0]  # a benchmark here would pick the 16-wide block
    kernels.run(kernels.scale, torch.randn(100), 2.0)
    assert kernels.BENCH_CALLS == [] and kernels.scale.best_config.kwargs == {"BLOCK": 32}

    machine_info = {}
    conftest.pytest_benchmark_update_machine_info(config, machine_info)
    recorded = machine_info["kernel_choices"]
    assert recorded["triton"][SCALE] == choices["triton"][SCALE]
    assert recorded["triton"][FACTORY] == choices["triton"][FACTORY]
    assert recorded["replay"]["source"] == str(baseline) and recorded["replay"]["pinned"] == 2
    assert SCALE not in recorded["replay"]["misses"]
    candidate = tmp_path / "candidate.json"  # what this session writes pins the next one
    candidate.write_text(json.dumps({"machine_info": machine_info, "benchmarks": []}))
    assert pinning.load_kernel_choices(candidate)["triton"] == recorded["triton"]

    choices["fingerprint"]["device_name"] = "NVIDIA H200"
    baseline.write_text(json.dumps({"machine_info": {"kernel_choices": choices}, "benchmarks": []}))
    with pytest.raises(pytest.UsageError, match="--kernel-pins: .*fingerprint.device_name"):
        conftest.pytest_configure(_PytestConfig(kernel_pins=str(baseline)))
    unpinned = {}
    conftest.pytest_benchmark_update_machine_info(_PytestConfig(), unpinned)
    assert unpinned["kernel_choices"]["replay"] is None


def test_the_kernel_benchmarks_refuse_pins_of_another_gpu_before_collecting(tmp_path, pytester):
    pytest.importorskip("pytest_benchmark")
    choices = pinning.record_kernel_choices()
    choices["fingerprint"]["device_name"] = "NVIDIA H200"
    pins = tmp_path / "pins.json"
    pins.write_text(json.dumps(choices))
    result = pytester.runpytest_inprocess(str(KERNEL_BENCHMARKS), "--rootdir", str(REPO), "-c",
                                          str(REPO / "pyproject.toml"), "-p", "no:cacheprovider", "-m", "gpu",
                                          "--kernel-pins", str(pins))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(['*--kernel-pins: *fingerprint.device_name is "NVIDIA H200" there*'])
