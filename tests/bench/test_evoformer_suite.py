"""suites/evoformer: its shapes and batch, the tiny scale end to end on the CPU (report, summary,
dashboard), an arm running out of GPU memory, the flop count's fallback, and the arms a family
refuses (``sdpa`` without an SDPA kernel set, ``hf`` without a transformers model)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from dslab import cli
from dslab.bench import arms as arms_module
from dslab.bench import common, runner, training
from dslab.bench.evoformer import EvoformerTrainModel
from dslab.bench.runner import run_suite
from dslab.bench.suite import load_suite, select_arms
from dslab.bench.workloads import workloads_for
from dslab.models.evoformer import evoformer_flops
from dslab.report import frames, list_runs, read_report

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "suites" / "evoformer"
ALL_ARMS = ["dslab", "torch", "torch-compile", "torch-compile-ro", "sdpa"]
EAGER_ARMS = ["dslab", "torch", "sdpa"]
OOM_MESSAGE = "CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of 79.11 GiB\nmore"


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "suite"
    path.mkdir(exist_ok=True)
    (path / "suite.json").write_text(json.dumps(data))
    return path


def test_suite_shapes_arms_and_flops():
    suite, _ = load_suite(SUITE)
    assert suite.family == "evoformer" and suite.precision == "bf16" and suite.arms == ALL_ARMS
    assert suite.engine["cuda_graphs"] == {"enabled": True}  # the dslab arm replays the blocks from graphs
    for section in ("flops_profiler", "memory_tracer", "comms_logger", "telemetry"):
        assert suite.engine[section]["enabled"] is True
    assert suite.engine["wall_clock_breakdown"] is True
    full = {w.case.name: w for w in workloads_for(suite, "full")}
    assert {n: (w.preset, w.case.micro_batch) for n, w in full.items()} == {
        "initial": ("evoformer_initial", 1), "finetune": ("evoformer_finetune", 1)}
    for name, (seqs, res) in {"initial": (128, 256), "finetune": (512, 384)}.items():
        cfg = full[name].model_config()
        assert (cfg.blocks, cfg.n_seq, cfg.n_res, cfg.c_m, cfg.c_z, cfg.checkpoint_blocks) == (4, seqs, res, 256, 128,
                                                                                               False)
        assert full[name].samples_and_tokens() == (1, seqs * res)  # one crop; its MSA positions
        assert full[name].formula_forward_flops() == evoformer_flops(cfg, batch=1)
    tiny = workloads_for(suite, "tiny")
    assert [w.case.name for w in tiny] == ["initial", "finetune"]
    assert [(w.model_config().n_seq, w.model_config().n_res) for w in tiny] == [(5, 7), (9, 6)]


def test_batch_pads_the_end_of_every_crop_and_the_masks_matter():
    suite, _ = load_suite(SUITE)
    (workload,) = workloads_for(suite, "tiny", ["finetune"])  # N_seq 9, N_res 6, micro-batch 1
    batch = workload.make_batch(torch.device("cpu"))
    assert {k: (tuple(v.shape), v.dtype) for k, v in batch.items()} == {
        "m": ((1, 9, 6, 32), torch.bfloat16), "z": ((1, 6, 6, 16), torch.bfloat16),
        "msa_mask": ((1, 9, 6), torch.bfloat16), "pair_mask": ((1, 6, 6), torch.bfloat16)}
    # ceil(6 / 8) = 1 residue and ceil(9 / 4) = 3 MSA rows are padding, at the end of the crop
    residues = torch.tensor([1.0] * 5 + [0.0])
    sequences = torch.tensor([1.0] * 6 + [0.0] * 3)
    assert torch.equal(batch["msa_mask"][0].float(), sequences[:, None] * residues[None, :])
    assert torch.equal(batch["pair_mask"][0].float(), residues[:, None] * residues[None, :])
    again = workload.make_batch(torch.device("cpu"))
    assert all(torch.equal(batch[k], again[k]) for k in batch)  # fixed by the suite's seed

    model = workload.build_model(kernels="torch")
    assert isinstance(model, EvoformerTrainModel)
    ones = {**batch, "msa_mask": torch.ones_like(batch["msa_mask"]), "pair_mask": torch.ones_like(batch["pair_mask"])}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        masked, unmasked = float(model(**batch)), float(model(**ones))
    assert masked == masked and abs(masked - unmasked) > 1e-4


def test_tiny_scale_end_to_end_writes_a_report_the_dashboard_shows(tmp_path):
    from dashboards import views
    from dashboards.app import render
    from dashboards.data import RunStore

    stream = io.StringIO()
    report, path = run_suite(SUITE, scale="tiny", arms=EAGER_ARMS, trials=2, steps=2, warmup_steps=1,
                             out=tmp_path / "reports", stream=stream)
    back = read_report(path)
    assert back.status == "complete" and not back.missing
    assert [(r.case, r.arm) for r in back.results] == [(c, a) for c in ("initial", "finetune") for a in EAGER_ARMS]
    assert all(r.status == "ok" for r in back.results), [(r.case, r.arm, r.error) for r in back.results]
    suite, _ = load_suite(SUITE)
    for entry, workload in zip(back.config["cases"], workloads_for(suite, "tiny")):
        assert entry["family"] == "evoformer" and entry["seq_len"] is None
        assert entry["formula_forward_flops"] == evoformer_flops(workload.model_config(), workload.case.micro_batch)
        counted = back.config["flops_per_step"][entry["name"]]
        # forward and backward (twice the forward), less the backward of the outer product mean's
        # sequence counts (a matmul of the masks, which need no gradient)
        assert 2.99 * entry["formula_forward_flops"] < counted < 3 * entry["formula_forward_flops"]
    for r in back.results:
        m = r.metrics
        assert len(r.trials) == 2 and m["step_time_ms"] > 0 and m["model_tflops"] > 0
        seqs, res = (5, 7) if r.case == "initial" else (9, 6)
        assert m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * seqs * res)
    for case in ("initial", "finetune"):  # same weights, same batch: the arms' losses agree
        losses = [back.result(case, arm).metrics["final_loss"] for arm in EAGER_ARMS]
        assert max(losses) - min(losses) < 0.02 * abs(losses[0])
        assert back.profilers["flops"][case]["forward_flops"] > 0
        assert back.profilers["memory"][case]["model_states"]["params"] > 0
    assert "evoformer / finetune" in stream.getvalue() and "sdpa" in stream.getvalue()

    page = str(render(RunStore(tmp_path / "reports"), f"/run/evoformer/{report.run_id}"))
    assert "sdpa" in page and "finetune" in page
    rows = views.arm_rows(frames.results(back), frames.trials(back))
    assert {(row["case"], row["arm"]) for row in rows if row["status"] == "ok"} == {
        (c, a) for c in ("initial", "finetune") for a in EAGER_ARMS}


@pytest.mark.slow
def test_cli_bench_runs_the_eager_arms_and_a_compiled_one(tmp_path, capsys):
    """``dslab bench`` on suites/evoformer's suite file: the tiny scale, the eager arms and
    ``torch-compile-ro``, one trial of one step, on the ``initial`` case only, cut to one block.
    Its time is Inductor compiling the model's forward and backward (with an empty Inductor cache
    and the tests' scalar C++ kernels, tests/conftest.py). One block holds every sublayer of the
    stack and compiles in about two thirds of the time of the tiny scale's two (75-90 s against
    113-120 s on a loaded 2-core machine); the second adds a copy of the same graph.
    ``torch-compile`` compiles the same graphs under other Inductor options (no CUDA-graph trees,
    which a CPU does not use anyway), time that shows nothing new: BERT's README test runs both
    compiled arms. A second case would compile again with dynamic shapes, so the ``finetune`` case
    runs its eager arms in test_tiny_scale_end_to_end_writes_a_report_the_dashboard_shows instead,
    which runs both cases at two blocks."""
    data = json.loads((SUITE / "suite.json").read_text())
    initial = data["scales"]["tiny"]["cases"][0]
    assert initial["name"] == "initial"
    initial["model_options"] = {**initial.get("model_options", {}), "blocks": 1}
    arms = [arm for arm in ALL_ARMS if arm != "torch-compile"]
    assert cli.main(["bench", str(_write(tmp_path, data)), "--cases", "initial", "--arms", ",".join(arms), "--trials",
                     "1", "--steps", "1", "--warmup", "1", "--out", str(tmp_path / "r")]) == 0
    (run,) = list_runs(tmp_path / "r")
    back = read_report(run)
    assert back.status == "complete" and back.config["scale"] == "tiny" and back.config["arms"] == arms
    assert back.config["cases"][0]["model_options"] == {"blocks": 1}
    assert [(r.case, r.arm) for r in back.results] == [("initial", a) for a in arms]
    assert all(r.status == "ok" and r.metrics["step_time_ms"] > 0 for r in back.results), \
        [(r.case, r.arm, r.error) for r in back.results]
    # same weights, same batch: the compiled arm trains the model the eager arms train
    losses = {r.arm: r.metrics["final_loss"] for r in back.results}
    assert max(losses.values()) - min(losses.values()) < 0.02 * abs(losses["torch"]), losses
    assert set(back.best_plain) == {"initial"}
    assert "evoformer / initial" in capsys.readouterr().out  # the summary table


def test_an_arm_out_of_gpu_memory_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    """torch arm: out of memory while it is built (every case); sdpa arm: in its second trial.
    Both are recorded as ``oom`` with the first line of PyTorch's message; dslab runs on."""
    real_build, real_step, real_free = training.build_arm, arms_module.PlainArm.step, common.free_memory
    sdpa_steps, frees = {"n": 0}, []

    def build(name, *args, **kwargs):
        if name == "torch":
            raise torch.OutOfMemoryError(OOM_MESSAGE)
        return real_build(name, *args, **kwargs)

    def step(self):
        if self.name == "sdpa":
            sdpa_steps["n"] += 1
            if sdpa_steps["n"] == 10:  # trial 1: 7 warm-up steps (through dslab's profiled steps 3-6) + 2; trial 2's first settling step
                raise torch.cuda.OutOfMemoryError(OOM_MESSAGE)
        return real_step(self)

    monkeypatch.setattr(training, "build_arm", build)
    monkeypatch.setattr(arms_module.PlainArm, "step", step)
    for module in (runner, training):  # the count's frees are the case's, the failures' the runner's
        monkeypatch.setattr(module, "free_memory", lambda device: (frees.append(device), real_free(device)))
    stream = io.StringIO()
    report, path = run_suite(SUITE, scale="tiny", arms=EAGER_ARMS, cases=["initial"], trials=2, steps=2,
                             warmup_steps=1, out=tmp_path / "r", stream=stream)
    back = read_report(path)
    assert back.status == "partial"  # two arms ran out of memory
    built_oom, trial_oom, dslab = (back.result("initial", a) for a in ("torch", "sdpa", "dslab"))
    assert built_oom.status == "oom" and not built_oom.trials
    assert built_oom.error == "out of memory (building the arm): CUDA out of memory. Tried to allocate 3.00 GiB. " \
                              "GPU 0 has a total capacity of 79.11 GiB"
    assert trial_oom.status == "oom" and len(trial_oom.trials) == 1  # the finished trial is kept
    assert trial_oom.error.startswith("out of memory (trial 2): CUDA out of memory. Tried to allocate 3.00 GiB")
    assert "\n" not in trial_oom.error
    assert dslab.status == "ok" and len(dslab.trials) == 2
    # the partial sdpa arm keeps its ratio; no arm that finished is left to be the best plain arm
    assert set(back.ratios["initial"]) == {"dslab/sdpa"} and "initial" not in back.best_plain
    assert len(frees) >= 3  # after the count, after the failed build, after the failed trial
    printed = stream.getvalue()
    assert "torch: oom while building" in printed and "trial 2/2 sdpa: oom: out of memory (trial 2)" in printed
    assert "    sdpa: oom: out of memory (trial 2): CUDA out of memory." in printed  # the summary's problems

    from dashboards import views

    rows = {(row["case"], row["arm"]): row for row in views.arm_rows(frames.results(back), frames.trials(back))}
    assert rows[("initial", "torch")]["status"] == "oom"
    assert rows[("initial", "sdpa")]["error"].startswith("out of memory (trial 2)")


def test_failure_status_tells_out_of_memory_from_other_failures():
    oom = common.error_text(torch.OutOfMemoryError(OOM_MESSAGE), "trial 3")
    assert oom == "out of memory (trial 3): CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total " \
                  "capacity of 79.11 GiB"
    assert common.failure_status(oom) == "oom"
    assert common.failure_status(f"rank 1: {oom}") == "oom"  # gathered from another rank
    other = common.error_text(RuntimeError("out of memory, said the allocator of a plugin"))
    assert common.failure_status(other) == "failed"
    assert common.failure_status("rank 0: RuntimeError: boom") == "failed"


def test_flop_count_out_of_memory_counts_again_on_fake_tensors(monkeypatch):
    suite, _ = load_suite(SUITE)
    (workload,) = workloads_for(suite, "tiny", ["initial"])
    cpu = torch.device("cpu")
    real = training._count_flops_on
    expected = real(workload, suite, cpu)

    def count(workload, suite, device, fake=False):
        if not fake:
            raise torch.OutOfMemoryError(OOM_MESSAGE)
        return real(workload, suite, device, fake=True)

    monkeypatch.setattr(training, "_count_flops_on", count)
    flops, note = training._count_flops(workload, suite, cpu)
    assert flops == expected
    assert note == ("flops counted on fake tensors (shapes only): counting on cpu ran out of memory: "
                    "CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of 79.11 GiB")


def test_sdpa_arm_is_refused_for_a_family_without_an_sdpa_kernel_set(tmp_path):
    gpt2 = json.loads((REPO / "suites" / "gpt2" / "suite.json").read_text())
    gpt2["arms"] = ["dslab", "torch", "sdpa"]
    with pytest.raises(ValueError, match="arm 'sdpa' cannot run family 'gpt2': its models have no 'sdpa' kernel set"):
        load_suite(_write(tmp_path, gpt2))
    gpt2["arms"] = ["dslab", "torch"]
    gpt2["scales"]["tiny"]["arms"] = ["dslab", "sdpa"]
    with pytest.raises(ValueError, match=r"scales\.tiny\.arms: arm 'sdpa' cannot run family 'gpt2'"):
        load_suite(_write(tmp_path, gpt2))
    del gpt2["scales"]["tiny"]["arms"]
    suite, _ = load_suite(_write(tmp_path, gpt2))
    with pytest.raises(ValueError, match="--arms: arm 'sdpa' cannot run family 'gpt2'"):
        select_arms(suite, ["sdpa"], "tiny")
    (workload,) = workloads_for(suite, "tiny")[:1]
    with pytest.raises(ValueError, match="arm 'sdpa' cannot run family 'gpt2'"):
        arms_module.build_arm("sdpa", workload, torch.device("cpu"), "bf16", suite.engine)
    del gpt2["arms"]  # a suite without arms runs every arm its family can
    assert load_suite(_write(tmp_path, gpt2))[0].arms == ["dslab", "torch", "torch-compile", "torch-compile-ro", "hf"]


def test_evoformer_refuses_the_hf_arm_and_a_seq_len(tmp_path):
    data = json.loads((SUITE / "suite.json").read_text())
    suite, _ = load_suite(SUITE)
    with pytest.raises(ValueError, match="--arms: arm 'hf' cannot run family 'evoformer': transformers has no model"):
        select_arms(suite, ["hf"], "full")
    del data["arms"]
    assert load_suite(_write(tmp_path, data))[0].arms == ALL_ARMS
    data["arms"] = ALL_ARMS + ["hf"]
    with pytest.raises(ValueError, match="arm 'hf' cannot run family 'evoformer'"):
        load_suite(_write(tmp_path, data))
    data["arms"] = ALL_ARMS
    data["scales"]["tiny"]["cases"][0]["seq_len"] = 7
    with pytest.raises(ValueError, match=r"case 'initial' \(evoformer\) takes its shape from its preset; remove "
                                         "'seq_len'"):
        load_suite(_write(tmp_path, data))
    gpt2 = json.loads((REPO / "suites" / "gpt2" / "suite.json").read_text())
    del gpt2["scales"]["tiny"]["cases"][0]["seq_len"]
    with pytest.raises(ValueError, match=r"case '\w+' \(gpt2\) needs a 'seq_len'"):
        load_suite(_write(tmp_path, gpt2))
