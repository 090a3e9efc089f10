"""suites/llama: its cases and arms, the tiny scale end to end on the CPU (our model on both kernel
sets and transformers' Llama; the ``liger`` arm skipped off CUDA with its reason), and the
``liger`` arm's patching, which must leave transformers' module globals (and so the ``hf`` arm)
as they were."""

from __future__ import annotations

import io
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from dslab.bench.common import ArmSkipped
from dslab.bench.runner import run_suite
from dslab.bench.suite import load_suite
from dslab.bench.workloads import workloads_for
from dslab.models.llama import LlamaForCausalLM, llama_parameter_count
from dslab.report import read_report

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "suites" / "llama"


def test_suite_cases_arms_and_models():
    suite, _ = load_suite(SUITE)
    assert suite.family == "llama" and suite.precision == "bf16"
    assert suite.arms == ["dslab", "torch", "torch-compile", "torch-compile-ro", "hf", "liger"]
    full = {w.case.name: w for w in workloads_for(suite, "full")}
    assert {n: (w.preset, w.case.seq_len, w.case.micro_batch) for n, w in full.items()} == {
        "1b": ("llama3_1b", 2048, 8), "3b": ("llama3_3b", 2048, 4)}
    assert llama_parameter_count(full["1b"].model_config()) == 1_235_814_400
    tiny = workloads_for(suite, "tiny")[0]
    ours = tiny.build_model("torch")
    hf = tiny.build_hf_model()
    assert isinstance(ours, LlamaForCausalLM) and isinstance(hf, transformers.LlamaForCausalLM)
    config = tiny.model_config()
    assert ours.embed.weight.shape[0] == 1024  # vocab_pad_multiple 64 from the suite
    assert hf.config.num_key_value_heads == config.kv_heads < hf.config.num_attention_heads
    batch = tiny.make_batch(torch.device("cpu"))
    assert torch.equal(batch["labels"], batch["input_ids"])
    loss = tiny.loss_fn(hf=True)(hf, batch)
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.5  # an untrained model's loss


def test_tiny_scale_end_to_end(tmp_path):
    stream = io.StringIO()
    arms = ["dslab", "torch", "hf", "liger"]
    report, path = run_suite(SUITE, scale="tiny", arms=arms, trials=2, steps=2, warmup_steps=1,
                             out=tmp_path / "reports", stream=stream)
    back = read_report(path)
    by_arm = {r.arm: r for r in back.results}
    assert {a: by_arm[a].status for a in arms} == {"dslab": "ok", "torch": "ok", "hf": "ok", "liger": "skipped"}
    assert "CUDA" in by_arm["liger"].error or "liger-kernel is not installed" in by_arm["liger"].error
    for arm in ("dslab", "torch", "hf"):
        m = by_arm[arm].metrics
        assert m["tokens_per_s"] > 0 and m["model_tflops"] > 0 and len(by_arm[arm].trials) == 2
    # same weights and batch: our model on the two kernel sets trains alike
    ours = [by_arm[a].metrics["final_loss"] for a in ("dslab", "torch")]
    assert abs(ours[0] - ours[1]) < 0.02 * ours[1]
    assert back.profilers["flops"]["1b"]["forward_flops"] > 0
    assert back.profilers["memory"]["1b"]["model_states"]["params"] > 0
    assert "llama / 1b" in stream.getvalue()


class _FakeLiger:
    """A stand-in for liger_kernel that patches transformers' modeling_llama the way Liger does:
    module globals for rope, RMSNorm and the MLP; the instance's modules and forward."""

    def __init__(self):
        from transformers.models.llama import modeling_llama

        self.modeling_llama = modeling_llama
        self.rope_calls = 0

    def rope(self, q, k, cos, sin, *args, **kwargs):
        self.rope_calls += 1
        return self.original_rope(q, k, cos, sin)

    def apply(self, rope, rms_norm, swiglu, fused_linear_cross_entropy, cross_entropy, model):
        m = self.modeling_llama
        m.apply_rotary_pos_emb = self.rope
        m.LlamaRMSNorm = object
        m.LlamaMLP = object
        model.patched_by_liger = True

    def install(self, monkeypatch):
        self.original_rope = self.modeling_llama.apply_rotary_pos_emb
        package = types.ModuleType("liger_kernel")
        transformers_part = types.ModuleType("liger_kernel.transformers")
        transformers_part.apply_liger_kernel_to_llama = self.apply
        rope_module = types.ModuleType("liger_kernel.transformers.rope")
        rope_module.liger_rotary_pos_emb = self.rope
        package.transformers = transformers_part
        for name, module in (("liger_kernel", package), ("liger_kernel.transformers", transformers_part),
                             ("liger_kernel.transformers.rope", rope_module)):
            monkeypatch.setitem(sys.modules, name, module)


def test_liger_patches_only_its_own_model_and_its_steps(monkeypatch):
    from dslab.bench.liger import build_liger_llama, liger_available, liger_rope

    fake = _FakeLiger()
    fake.install(monkeypatch)
    m = fake.modeling_llama
    before = (m.apply_rotary_pos_emb, m.LlamaRMSNorm, m.LlamaMLP)
    suite, _ = load_suite(SUITE)
    workload = workloads_for(suite, "tiny")[0]
    model = build_liger_llama(workload.build_hf_model())
    assert model.patched_by_liger
    assert (m.apply_rotary_pos_emb, m.LlamaRMSNorm, m.LlamaMLP) == before  # the hf arm's model is untouched
    batch = workload.make_batch(torch.device("cpu"))
    model(**batch)
    assert fake.rope_calls == 0
    with liger_rope():
        model(**batch)
    assert fake.rope_calls == 2  # one call per layer, inside the liger step only
    assert m.apply_rotary_pos_emb is before[0]
    with pytest.raises(ArmSkipped, match="CUDA"):
        liger_available(torch.device("cpu"))


def test_liger_arm_is_refused_for_other_families(tmp_path):
    data = json.loads((REPO / "suites" / "gpt2" / "suite.json").read_text())
    data["arms"] = ["dslab", "liger"]
    (tmp_path / "suite.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="arm 'liger' cannot run family 'gpt2'"):
        load_suite(tmp_path)


@pytest.mark.parametrize("room,skipped", [(1.5, {"hf"}), (2.5, set())])
def test_arms_that_would_not_fit_in_host_memory_parked_are_skipped_by_name(tmp_path, monkeypatch, room, skipped):
    """When idle arms wait in host memory, an arm is skipped with the sizes when the arms before it
    would not fit there parked, instead of the kernel killing the run part-way (3B's six arms need
    231 GB parked; the H200 host has 128 GiB). One arm stays on the GPU, so three arms need room
    for two parked states, not three."""
    from dslab.bench import training

    suite, _ = load_suite(SUITE)
    need = training.resident_state_bytes(workloads_for(suite, "tiny")[0])
    monkeypatch.setattr(training, "_needs_parking", lambda *args: True)
    monkeypatch.setattr(training, "host_available_bytes", lambda: int(room * need / training.HOST_PARKING_SHARE))
    report, path = run_suite(SUITE, scale="tiny", arms=["dslab", "torch", "hf"], trials=2, steps=1, warmup_steps=0,
                             out=tmp_path / "reports", stream=io.StringIO())
    by_arm = {r.arm: r for r in read_report(path).results}
    for arm in ("dslab", "torch", "hf"):
        if arm in skipped:
            assert by_arm[arm].status == "skipped"
            assert "GiB of host memory" in by_arm[arm].error and "--arms" in by_arm[arm].error
        else:  # parked and unparked around its trials, in both trials
            assert by_arm[arm].status == "ok" and len(by_arm[arm].trials) == 2, by_arm[arm].error
    assert "each waits in host memory" in " ".join(read_report(path).notes)


def test_parking_keeps_one_arm_on_the_device(monkeypatch):
    """Arms are parked only when another needs the device: building or timing an arm parks the
    one left resident, and a trial of the resident arm moves nothing."""
    from dslab.bench import training

    events = []

    class Arm:
        def __init__(self, name):
            self.name = name

        def park(self):
            events.append(("park", self.name))

        def unpark(self):
            events.append(("unpark", self.name))

        def step(self):
            return None

    case = training.TrainingCase.__new__(training.TrainingCase)
    case.parking, case.resident = True, None
    monkeypatch.setattr(training, "run_trial", lambda *args, **kwargs: None)
    monkeypatch.setattr(training, "gather_trial", lambda measured, error, world: (measured, "stop here"))
    case.context = type("Context", (), {"world": None})()
    case.graph_pools = {}
    a, b = Arm("a"), Arm("b")
    case.resident = ("a", a)
    case._make_room()  # building b
    case.resident = ("b", b)
    with pytest.raises(training.TrialFailed):
        case.run_trial("b", b, 0, 1, 0)  # b is resident: nothing moves (the trial then fails)
    assert case.resident is None  # a failed arm is closed by the runner, never parked later
    case.resident = ("b", b)
    with pytest.raises(training.TrialFailed):
        case.run_trial("a", a, 0, 1, 0)
    assert events == [("park", "a"), ("park", "b"), ("unpark", "a")]


def test_host_available_bytes_reads_meminfo():
    from dslab.bench import training

    available = training.host_available_bytes()
    assert available is None or 0 < available < 2**50
