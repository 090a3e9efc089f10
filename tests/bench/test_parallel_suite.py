"""``dslab bench suites/parallel``: the model-parallel suite starts its processes itself (one
torchrun per process count; gloo processes at the tiny scale on a CPU) and writes one report with
every layout that fits the launch (steps, tokens/s, per-GPU TFLOP/s from Megatron's count, every
rank's memory), the pipeline arms' per-stage busy and idle time, and the layouts that do not fit
skipped with the reason; the layout names, the suite's config checks, the flop count, and the
torch peers' GPT-2 against dslab's."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dslab.bench.common import ArmSkipped
from dslab.bench.data_parallel import data_parallel_workloads
from dslab.bench.model_parallel import megatron_flops, plan_layout
from dslab.bench.model_parallel_peers import clip_grad_norm
from dslab.bench.model_parallel_suite import layout_peers, micro_batches_per_step, parse_arm, parse_layout
from dslab.bench.suite import load_suite
from dslab.bench.torch_gpt2 import build_torch_gpt2, next_token_loss, stage_blocks
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny
from dslab.report import list_runs, read_report

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "suites" / "parallel"
# every implementation's layouts; on 2 processes the tp2 arms run, on 4 the others
ARMS = ["dslab-dp", "dslab-tp2", "dslab-tp2dp2", "dslab-pp4", "dslab-pp2dp2", "dslab-tp2pp2", "torch-tp2",
        "torch-tp2dp2", "torch-pp4", "deepspeed-pp4"]
FITS = {2: {"dslab-dp", "dslab-tp2", "torch-tp2"},
        4: {"dslab-dp", "dslab-tp2dp2", "dslab-pp4", "dslab-pp2dp2", "dslab-tp2pp2", "torch-tp2dp2", "torch-pp4",
            "deepspeed-pp4"}}


def _deepspeed_importable() -> bool:
    return subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True).returncode == 0


@pytest.mark.world_size(4)
def test_tiny_scale_on_cpu_runs_the_layouts_that_fit_2_and_4_processes(tmp_path):
    out = tmp_path / "reports"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "dslab.cli", "bench", str(SUITE), "--scale", "tiny", "--nprocs", "2,4",
           "--arms", ",".join(ARMS), "--trials", "1", "--steps", "2", "--warmup", "1", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "launching 2 process(es)" in proc.stderr and "launching 4 process(es)" in proc.stderr
    assert "strong scaling" in proc.stdout  # the summary, on standard output

    (run,) = list_runs(out)
    report = read_report(run)
    assert report.status == "complete" and report.config["kind"] == "model_parallel"
    assert report.cases() == ["tiny-n2", "tiny-n4"] and report.arms() == ARMS
    deepspeed = _deepspeed_importable()
    losses: dict[tuple[str, str], float] = {}
    for n, case in ((2, "tiny-n2"), (4, "tiny-n4")):
        for arm in ARMS:
            result = report.result(case, arm)
            if arm not in FITS[n]:
                needs = 2 if arm.endswith("-tp2") else 4
                assert result.status == "skipped", (case, arm, result.error)
                assert result.error == f"layout {arm.split('-')[1]} needs {needs} process(es); this launch has {n}"
                continue
            if arm.startswith("deepspeed") and not deepspeed:
                assert result.status == "skipped" and "deepspeed is not installed" in result.error
                continue
            assert result.status == "ok", (case, arm, result.error)
            (trial,) = result.trials
            assert len(trial.step_times_ms) == 2
            metrics = result.metrics
            assert metrics["tokens_per_s"] > 0 and metrics["model_tflops"] > 0
            assert all(metrics[f"peak_rss_bytes_rank{r}"] > 0 for r in range(n))
            # every arm steps the global batch: tokens/s are its tokens over the step time
            assert metrics["tokens_per_s"] == pytest.approx(8 * 64 / (metrics["step_time_ms"] / 1e3))
            losses[(case, arm)] = metrics["final_loss"]
    # the layouts of one implementation train one model from one start: the same losses
    for impl, pipeline in (("dslab", False), ("dslab", True), ("torch", False)):
        same = [v for (_, arm), v in losses.items() if arm.startswith(impl + "-") and ("pp" in arm) == pipeline]
        assert len(same) >= 2 and max(same) - min(same) < 0.01 * min(same), (impl, pipeline, losses)

    entry = next(c for c in report.config["cases"] if c["name"] == "tiny-n4")
    assert entry["layouts"]["dslab-pp2dp2"] == {"tp": 1, "pp": 2, "dp": 2, "micro_batches": 2,
                                                "activation_checkpoint_interval": 1, "zero_stage": 1}
    assert entry["layouts"]["dslab-tp2"] == {"skipped": "layout tp2 needs 2 process(es); this launch has 4"}
    assert entry["model_flops_per_step"] == pytest.approx(megatron_flops(4, 128, 1000, 64, 8))
    assert report.config["flops_per_step"]["tiny-n4"] == int(entry["model_flops_per_step"] / 4)
    # the pipeline arms' stages: busy and idle time of every batch against the 1F1B bubble
    for arm, stages, micro in (("dslab-pp4", 4, 4), ("dslab-pp2dp2", 2, 2), ("dslab-tp2pp2", 2, 4)):
        record = report.profilers["pipeline"][f"tiny-n4 {arm}"]
        assert record["stages"] == stages and record["micro_batches"] == micro
        assert record["bubble_fraction"] == pytest.approx((stages - 1) / (micro + stages - 1))
        assert [s["stage"] for s in record["per_stage"]] == list(range(stages))
        for stage in record["per_stage"]:
            # 3 warm-up steps (through the memory tracer's profile step 2) and 2 timed
            assert len(stage["batches"]) == 5 and all(b["busy_ms"] > 0 for b in stage["batches"])
            assert 0 <= stage["idle_fraction"] < 1
    assert "tiny-n4 dslab-dp" not in report.profilers["pipeline"]
    assert len(report.profilers["comms"]["tiny-n4 dslab-tp2dp2"]["per_rank"]) == 4
    # dslab's layouts against the peers that split the model the same way
    assert report.config["peers"]["dslab-pp4"] == ["torch-pp4", "deepspeed-pp4"]
    ratio = (report.result("tiny-n4", "dslab-pp4").metrics["tokens_per_s"]
             / report.result("tiny-n4", "torch-pp4").metrics["tokens_per_s"])
    assert report.ratios["tiny-n4"]["dslab-pp4/torch-pp4"] == pytest.approx(ratio)
    assert "dslab-tp2/torch-tp2" in report.ratios["tiny-n2"]


@pytest.mark.parametrize("name, expected", [
    ("dp", (1, 1, None, False)), ("tp2", (2, 1, 1, False)), ("pp4", (1, 4, 1, True)), ("tp2dp2", (2, 1, 2, False)),
    ("pp2dp2", (1, 2, 2, True)), ("tp2pp2", (2, 2, 1, True)), ("pp1", (1, 1, 1, True)),
])
def test_layout_names(name, expected):
    layout = parse_layout(name)
    assert (layout.tp, layout.pp, layout.dp, layout.pipeline) == expected


def test_layouts_that_do_not_fit_are_skipped_with_the_reason():
    assert parse_layout("dp").sizes(3) == (1, 1, 3)
    assert parse_layout("tp2pp2").sizes(4) == (2, 2, 1)
    with pytest.raises(ArmSkipped, match=r"layout pp2dp2 needs 4 process\(es\); this launch has 8"):
        parse_layout("pp2dp2").sizes(8)
    assert micro_batches_per_step(64, 4, 2, "tp2dp2") == 8
    with pytest.raises(ArmSkipped, match="global batch of 8 sequences is not a whole number of micro-batches of 2 "
                                         r"over 3 data-parallel replica\(s\)"):
        micro_batches_per_step(8, 2, 3, "dp")


@pytest.mark.parametrize("name, words", [
    ("dslab-pp2tp2", "in that order"), ("dslab-x4", "tpK, ppK and dpK"), ("megatron-tp2", "<implementation>-<layout>"),
    ("torch-pp2dp2", "one pipeline over all their ranks"), ("torch-dp", "suites/zero's ddp"),
    ("torch-tp2pp2", "tensor parallel"), ("deepspeed-tp2", "the deepspeed arms are pipelines"),
    ("deepspeed-dp", "the deepspeed arms are pipelines"),
])
def test_arms_no_implementation_runs_are_refused(name, words):
    with pytest.raises(ValueError, match=words):
        parse_arm(name)


def test_peers_pair_the_arms_of_one_layout():
    arms = ["dslab-dp", "dslab-pp4", "torch-tp2dp2", "dslab-tp2dp2", "torch-pp4", "deepspeed-pp4"]
    assert layout_peers(arms) == {"dslab-dp": [], "dslab-pp4": ["torch-pp4", "deepspeed-pp4"],
                                  "dslab-tp2dp2": ["torch-tp2dp2"]}


def _edit_suite(tmp_path, change):
    data = json.loads((SUITE / "suite.json").read_text())
    change(data)
    (tmp_path / "suite.json").write_text(json.dumps(data))
    return tmp_path


@pytest.mark.parametrize("change, words", [
    (lambda s: s.update(arms=["torch-pp4", "deepspeed-pp4"]), "include a dslab arm"),
    (lambda s: s.update(arms=["dslab-pp4", "torch-pp2dp2"]), "one pipeline over all their ranks"),
    (lambda s: s["engine"].setdefault("zero_optimization", {}).update(stage=1), "set by each arm"),
    (lambda s: s["engine"].update(cuda_graphs={"enabled": True}), "cuda_graphs.enabled"),
    (lambda s: s["engine"].update(gradient_accumulation_steps=2), "global_batch"),
    (lambda s: s.update(precision="fp16"), "precision"),
    (lambda s: s["scales"]["tiny"].update(nprocs=[0]), "process counts must be whole numbers >= 1"),
])
def test_bad_suite_configs_name_the_problem(tmp_path, change, words):
    with pytest.raises(ValueError, match=words):
        load_suite(_edit_suite(tmp_path, change))


def _plans(suite, scale: str, nprocs: int) -> dict[tuple[str, str], object]:
    """Each (case, arm) of ``scale`` on ``nprocs`` processes: its LayoutRun, or why it is skipped."""
    plans = {}
    for workload in data_parallel_workloads(suite, scale, None, [nprocs]):
        for arm in suite.scales[scale].arms or suite.arms:
            try:
                plans[(workload.case.name, arm)] = plan_layout(arm, workload, nprocs)
            except ArmSkipped as err:
                plans[(workload.case.name, arm)] = str(err)
    return plans


def test_the_full_scale_splits_every_case_on_4_processes_but_gpt2_xls_heads():
    suite, _ = load_suite(SUITE)
    assert suite.scales["full"].nprocs == [4] and suite.scales["tiny"].nprocs == [2, 4]
    assert {parse_arm(a)[0] for a in suite.arms} == {"dslab", "torch", "deepspeed"}
    plans = _plans(suite, "full", 4)
    skipped = {key: why for key, why in plans.items() if isinstance(why, str)}
    # GPT-2 XL's 25 heads do not split over 2 tensor-parallel ranks; its 50-head twin's do
    assert set(skipped) == {("1.5b-n4", arm) for arm in ("dslab-tp2dp2", "dslab-tp2pp2", "torch-tp2dp2")}
    assert skipped[("1.5b-n4", "torch-tp2dp2")] == ("layout tp2dp2 cannot split the model: heads=25 does not divide "
                                                  "by tp_size=2: each rank holds whole attention heads")
    run = plans[("6.7b-n4", "dslab-tp2pp2")]
    assert (run.tp, run.pp, run.dp, run.micro_batches, run.checkpoint_interval) == (2, 2, 1, 16, 1)
    run = plans[("1.5b_heads50-n4", "torch-tp2dp2")]
    assert (run.tp, run.pp, run.dp, run.micro_batches, run.checkpoint_interval) == (2, 1, 2, 8, 0)
    assert plans[("6.7b-n4", "dslab-dp")].zero_stage == 1 and plans[("6.7b-n4", "dslab-pp4")].zero_stage == 0


def test_layouts_that_cannot_split_the_model_or_share_the_batch_are_skipped(tmp_path):
    def change(s):
        s["scales"]["tiny"]["cases"][0]["model_options"].update(layers=3)
        s["scales"]["tiny"]["cases"][0]["global_batch"] = 6
    suite, _ = load_suite(_edit_suite(tmp_path, change))
    plans = _plans(suite, "tiny", 4)
    assert plans[("tiny-n4", "dslab-pp4")] == ("layout pp4 cannot split the model: its 3 blocks cannot fill 4 "
                                               "pipeline stages")
    assert plans[("tiny-n4", "dslab-dp")] == ("layout dp: the global batch of 6 sequences is not a whole number of "
                                              "micro-batches of 2 over 4 data-parallel replica(s)")
    assert plans[("tiny-n4", "dslab-tp2pp2")].micro_batches == 3


def test_flops_are_the_layout_benchmarks_count():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import parallel_layouts
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert megatron_flops(48, 1600, 50257, 1024, 64) == pytest.approx(parallel_layouts.model_flops(48, 1600, 1024,
                                                                                                    65536))


def _dslab_state_as_torch(state: dict) -> dict:
    """dslab's GPT-2 state dict in :class:`TorchGPT2`'s names (q, k, v unpacked)."""
    out = {"wte.weight": state["wte.weight"], "wpe.weight": state["wpe.weight"],
           "final_norm.weight": state["final_norm.weight"], "final_norm.bias": state["final_norm.bias"],
           "lm_head.weight": state["wte.weight"]}
    layers = {k.split(".")[1] for k in state if k.startswith("layers.")}
    for i in layers:
        p = f"layers.{i}."
        packed = zip("qkv", state[p + "attention.qkv.weight"].chunk(3), state[p + "attention.qkv.bias"].chunk(3))
        for name, w, b in packed:
            out[p + f"attention.{name}.weight"], out[p + f"attention.{name}.bias"] = w, b
        out[p + "attention.out.weight"] = state[p + "attention.out_proj.weight"]
        out[p + "attention.out.bias"] = state[p + "attention.out_bias"]
        out[p + "mlp.fc.weight"], out[p + "mlp.fc.bias"] = state[p + "mlp.fc_in.weight"], state[p + "mlp.fc_in_bias"]
        out[p + "mlp.proj.weight"] = state[p + "mlp.fc_out.weight"]
        out[p + "mlp.proj.bias"] = state[p + "mlp.fc_out_bias"]
        for norm in ("attention_norm", "mlp_norm"):
            out[p + f"{norm}.weight"], out[p + f"{norm}.bias"] = state[p + f"{norm}.weight"], state[p + f"{norm}.bias"]
    return out


def test_the_torch_peers_gpt2_is_dslabs_function():
    config = gpt2_tiny(dropout=0.0, layers=3)
    torch.manual_seed(0)
    dslab_model = GPT2LMHeadModel(config, "torch")
    peer = build_torch_gpt2(config, torch.device("cpu"), seed=5)
    peer.load_state_dict(_dslab_state_as_torch(dslab_model.state_dict()))
    assert peer.lm_head.weight is peer.wte.weight
    ids = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    expected = dslab_model(input_ids=ids, labels=ids)
    assert next_token_loss(peer(ids), ids).item() == pytest.approx(expected.item(), rel=1e-5)
    # the stages of a cut model compute the whole model's loss
    stages = [build_torch_gpt2(config, torch.device("cpu"), seed=5, stage=s, stages=2) for s in range(2)]
    whole = peer.state_dict()
    for stage in stages:
        stage.load_state_dict({k: v for k, v in whole.items() if k in stage.state_dict()})
    assert next_token_loss(stages[1](stages[0](ids)), ids).item() == pytest.approx(expected.item(), rel=1e-5)


def test_a_stage_draws_the_weights_the_whole_model_draws():
    config = gpt2_tiny(layers=4)
    whole = build_torch_gpt2(config, torch.device("cpu"), seed=9).state_dict()
    last = build_torch_gpt2(config, torch.device("cpu"), seed=9, stage=1, stages=2).state_dict()
    held = {k for k in whole if k.startswith(("layers.2.", "layers.3.", "final_norm."))}
    assert set(last) == held | {"lm_head.weight"}
    for key, value in last.items():
        torch.testing.assert_close(value, whole["wte.weight" if key == "lm_head.weight" else key])
    assert [list(stage_blocks(7, s, 3)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match="3 blocks cannot fill 4 pipeline stages"):
        stage_blocks(3, 0, 4)


def test_clipping_scales_every_gradient_by_the_whole_norm():
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
    for p, g in zip(params, ([3.0, 0.0, 0.0], [0.0, 4.0, 0.0], [0.0, 0.0, 12.0])):
        p.grad = torch.tensor(g)
    norm = clip_grad_norm(params, 1.0, not_counted=(params[2],))  # the third: a tied copy another stage counts
    assert norm.item() == pytest.approx(5.0)
    assert params[0].grad.tolist() == pytest.approx([3 / 5, 0, 0], rel=1e-5)
    assert params[2].grad.tolist() == pytest.approx([0, 0, 12 / 5], rel=1e-5)
    assert math.isclose(clip_grad_norm(params, 100.0).item(), math.sqrt(0.36 + 0.64 + 12 ** 2 / 25), rel_tol=1e-5)
    assert params[1].grad.tolist() == pytest.approx([0, 4 / 5, 0], rel=1e-5)  # under the limit: unchanged
