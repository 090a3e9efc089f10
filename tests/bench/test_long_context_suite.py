"""``dslab bench suites/long_context``: the long-context suite starts its processes itself (2 gloo
processes at the tiny scale on a CPU) and writes one report: ``dslab-ulysses`` trains one sequence
split over the processes (tokens/s, counted TFLOP/s, every rank's memory, the all-to-alls in its
comms record) and its first-step loss is one process's on the unsplit model and the same batch;
``torch-cp`` is skipped on a CPU with its reason. In one process: the flop count (causal SDPA at
half, equal to the closed form), the torch Llama against dslab's, and the suite's config checks.
On 2 GPUs (``gpu``): ``torch-cp`` runs and its first-step loss is one GPU's unsplit model's."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dslab.bench.long_context import (
    DslabUlyssesArm, count_step_flops, cpu_flash_formulas, llama_step_flops, long_context_workloads,
)
from dslab.bench.long_context_peers import CPU_REASON
from dslab.bench.long_context_suite import LONG_CONTEXT_ARMS, select_long_context_arms
from dslab.bench.suite import load_suite
from dslab.bench.torch_llama import build_torch_llama, rotary_tables, shifted_targets
from dslab.models.llama import LlamaForCausalLM, llama_tiny
from dslab.profilers.flops_causal import causal_aware_formulas
from dslab.report import list_runs, read_report

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "suites" / "long_context"
CASES = {"s256-n2": 256, "s512-n2": 512}


def _bench(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "dslab.cli", "bench", str(SUITE), "--scale", "tiny", "--nprocs", "2",
           "--trials", "1", "--steps", "2", "--warmup", "1", "--out", str(out), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("long_context") / "reports"
    proc = _bench(out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "launching 2 process(es)" in proc.stderr
    assert "long_context / s512-n2" in proc.stdout  # the summary, on standard output
    (run,) = list_runs(out)
    return read_report(run)


def _reference_losses(workload) -> tuple[float, float]:
    """The first-step loss of one process on the unsplit model and the same batch: through the
    dslab arm itself at sequence-parallel size 1 (bf16, the engine), and the fp32 model's."""
    suite, _ = load_suite(SUITE)
    engine = {k: suite.engine[k] for k in ("optimizer", "gradient_clipping", "zero_optimization")}
    arm = DslabUlyssesArm(workload, torch.device("cpu"), "bf16", engine, world=1)
    bf16 = float(arm.step().detach())
    arm.close()
    torch.manual_seed(workload.seed)
    model = LlamaForCausalLM(workload.model_config(), "dslab")
    with torch.no_grad():
        fp32 = float(model(**workload.make_batch(torch.device("cpu"))))
    return bf16, fp32


@pytest.mark.world_size(2)
def test_tiny_scale_trains_one_split_sequence_per_step(tiny_report):
    report = tiny_report
    assert report.status == "complete" and report.config["kind"] == "long_context"
    assert report.cases() == list(CASES) and report.arms() == list(LONG_CONTEXT_ARMS)
    assert report.config["peers"] == {"dslab-ulysses": ["torch-cp"]}
    suite, _ = load_suite(SUITE)
    for workload in long_context_workloads(suite, "tiny", None, [2]):
        case, seq = workload.case.name, workload.case.seq_len
        result = report.result(case, "dslab-ulysses")
        assert result.status == "ok", result.error
        metrics = result.metrics
        assert metrics["tokens_per_s"] > 0
        # one sequence per step, counted once however many ranks hold it
        assert metrics["tokens_per_s"] == pytest.approx(seq / (metrics["step_time_ms"] / 1e3))
        assert all(metrics[f"peak_rss_bytes_rank{r}"] > 0 for r in range(2))
        # per-GPU flops: the whole step's count over the 2 processes, which is the closed form's
        config = workload.model_config()
        assert report.config["flops_per_step"][case] == llama_step_flops(config, seq, 1) // 2
        assert metrics["model_tflops"] == pytest.approx(
            report.config["flops_per_step"][case] / (metrics["step_time_ms"] / 1e3) / 1e12)
        entry = next(c for c in report.config["cases"] if c["name"] == case)
        assert entry["sequence_parallel_size"] == 2 and entry["tokens_per_rank"] == seq // 2
        assert entry["formula_flops_per_step"] == llama_step_flops(config, seq, 1)
        # Ulysses' all-to-alls: q, k, v packed in one and the output, forward, backward and the
        # checkpointed recompute, in each of the 2 layers, over 3 steps
        comms = report.profilers["comms"][f"{case} dslab-ulysses"]
        all_to_all = sum(op["count"] for op in comms["ops"] if op["op"] == "all_to_all")
        assert all_to_all == 6 * config.layers * 3
        assert len(comms["per_rank"]) == 2
        record = report.profilers["long_context"][f"{case} dslab-ulysses"]
        assert record["sequence_parallel_size"] == 2 and record["tokens_per_rank"] == seq // 2
        peer = report.result(case, "torch-cp")
        if torch.cuda.is_available():
            assert peer.status == "ok", peer.error
        else:
            assert peer.status == "skipped" and peer.error == CPU_REASON


@pytest.mark.world_size(2)
def test_first_step_loss_is_one_process_on_the_unsplit_model(tiny_report):
    """The split run's first loss (the whole sequence's mean on 2 ranks) against one process's
    in the same precision, within twice that precision's own error against fp32 (a rank that
    attended only its own chunk is off by ~3e-3 here, ~20 times the tolerance)."""
    suite, _ = load_suite(SUITE)
    for workload in long_context_workloads(suite, "tiny", None, [2]):
        split = tiny_report.profilers["long_context"][f"{workload.case.name} dslab-ulysses"]["first_step_loss"]
        bf16, fp32 = _reference_losses(workload)
        assert abs(split - bf16) <= 2 * abs(bf16 - fp32) + 1e-6, (workload.case.name, split, bf16, fp32)


def test_step_flops_count_causal_attention_at_half():
    config = llama_tiny(max_positions=512, vocab_pad_multiple=64)
    for seq, batch in ((256, 1), (192, 2)):
        assert count_step_flops(config, seq, batch) == llama_step_flops(config, seq, batch)
    # the CPU flash kernel's price: torch's formulas (kv heads widened), halved when causal
    q = torch.randn(2, 4, 96, 32, requires_grad=True)
    k, v = (torch.randn(2, 2, 96, 32, requires_grad=True) for _ in range(2))
    mapping = {**causal_aware_formulas(), **cpu_flash_formulas()}
    counts = {}
    for causal in (True, False):
        counter = torch.utils.flop_counter.FlopCounterMode(display=False, custom_mapping=mapping)
        with counter:
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True).sum().backward()
        counts[causal] = counter.get_total_flops()
    full = 2 * 2 * 2 * 4 * 96 * 96 * 32 * 3.5  # q k^T and p v forward, five products backward (2.5x)
    assert counts[False] == full and counts[True] == full / 2


def test_torch_llama_is_dslab_llama_with_rotary_tables_as_inputs():
    """The torch-cp arm's model, given the dslab model's weights and the whole sequence's tables,
    computes its loss and gradients; a shifted window of tables (a rank's positions) is what
    context parallelism shards."""
    config = llama_tiny(max_positions=512, tie_word_embeddings=False, checkpoint_layers=1)
    torch.manual_seed(3)
    dslab_model = LlamaForCausalLM(dataclasses.replace(config), "torch")
    ids = torch.randint(0, config.vocab_size, (2, 160))
    want = dslab_model(ids, labels=ids)
    model = build_torch_llama(config, {k: v.clone() for k, v in dslab_model.state_dict().items()})
    targets = shifted_targets(ids)
    cos, sin = rotary_tables(config, 160, torch.device("cpu"))
    got = model(ids, targets, cos, sin) / (targets != -100).sum()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    got.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), dslab_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert torch.equal(cos, rotary_tables(config, 512, torch.device("cpu"))[0][:160])


def test_frozen_arms_and_config_checks(tmp_path):
    assert LONG_CONTEXT_ARMS == ("dslab-ulysses", "torch-cp")
    suite, _ = load_suite(SUITE)
    full = [w.model_config() for w in long_context_workloads(suite, "full", None, [4])]
    assert all(c.heads % 4 == 0 and c.kv_heads % 4 == 0 and c.max_positions >= 262144 for c in full)
    with pytest.raises(ValueError, match="include a dslab arm"):
        select_long_context_arms(suite, ["torch-cp"], "tiny")
    with pytest.raises(ValueError, match="unknown arm"):
        select_long_context_arms(suite, ["dslab-ring"], "tiny")
    data = json.loads((SUITE / "suite.json").read_text())
    short = json.loads(json.dumps(data))
    short["scales"]["tiny"]["model_options"]["max_positions"] = 256
    (tmp_path / "suite.json").write_text(json.dumps(short))
    with pytest.raises(ValueError, match="case 's512': seq_len 512 > the model's max_positions 256"):
        long_context_workloads(load_suite(tmp_path)[0], "tiny", None, [2])
    for change, key in (({"sequence_parallel_size": 2}, "'engine.sequence_parallel_size' is set by the suite runner"),
                        ({"cuda_graphs": {"enabled": True}}, "'engine.cuda_graphs.enabled'")):
        (tmp_path / "suite.json").write_text(json.dumps({**data, "engine": {**data["engine"], **change}}))
        with pytest.raises(ValueError, match=key):
            load_suite(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_torch_cp_first_step_loss_is_one_gpu_on_the_unsplit_model(tmp_path):
    """Both arms on 2 GPUs at the tiny scale; torch-cp's first loss (ring attention, FSDP2)
    against the torch Llama's on one GPU, unsplit, in the same bf16 compute, within twice that
    precision's error against fp32."""
    proc = _bench(tmp_path / "reports", "--steps", "1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = list_runs(tmp_path / "reports")
    report = read_report(run)
    suite, _ = load_suite(SUITE)
    device = torch.device("cuda", 0)
    for workload in long_context_workloads(suite, "tiny", None, [2]):
        case = workload.case.name
        for arm in LONG_CONTEXT_ARMS:
            assert report.result(case, arm).status == "ok", (case, arm, report.result(case, arm).error)
        split = report.profilers["long_context"][f"{case} torch-cp"]["first_step_loss"]
        config = workload.model_config()
        batch = workload.make_batch(device)
        targets = shifted_targets(batch["labels"])
        cos, sin = rotary_tables(config, workload.case.seq_len, device)
        losses = {}
        for dtype in (torch.bfloat16, torch.float32):
            seeded = workload.build_model(kernels="torch", device=device)
            model = build_torch_llama(config, seeded.state_dict()).to(dtype)
            with torch.no_grad():
                losses[dtype] = float(model(batch["input_ids"], targets, cos, sin) / (targets != -100).sum())
        bf16, fp32 = losses[torch.bfloat16], losses[torch.float32]
        assert abs(split - bf16) <= 2 * abs(bf16 - fp32) + 1e-4, (case, split, bf16, fp32)
