import io
import json
from pathlib import Path

import pytest
import torch

from dslab import cli
from dslab.bench import arms as arms_module
from dslab.bench.runner import run_suite
from dslab.bench.suite import load_suite
from dslab.report import list_runs, read_report

REPO = Path(__file__).resolve().parents[2]


def tiny_suite(tmp_path, **overrides) -> Path:
    suite = {
        "name": "gpt2_test",
        "family": "gpt2",
        "precision": "bf16",
        "engine": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0,
                   "wall_clock_breakdown": True, "memory_tracer": {"enabled": True, "profile_step": 1},
                   "telemetry": {"enabled": True, "interval_ms": 50},
                   "flops_profiler": {"enabled": True, "profile_step": 1}},
        "arms": ["dslab", "torch"],
        "scales": {"tiny": {"preset": "gpt2_tiny", "warmup_steps": 1, "steps": 3, "trials": 2,
                            "cases": [{"name": "a", "seq_len": 32, "micro_batch": 2},
                                      {"name": "b", "seq_len": 16, "micro_batch": 4}]}},
    }
    suite.update(overrides)
    path = tmp_path / "suite"
    path.mkdir(exist_ok=True)
    (path / "suite.json").write_text(json.dumps(suite))
    return path


def test_runner_end_to_end_writes_a_complete_report(tmp_path):
    report, path = run_suite(tiny_suite(tmp_path), out=tmp_path / "reports")
    assert path.name == "run.json" and path.parent.parent.name == "gpt2_test"
    back = read_report(path)
    assert back.status == "complete" and back.finished and not back.missing
    assert back.config["scale"] == "tiny" and back.config["trials"] == 2
    assert back.data["kind"] == "synthetic"
    assert back.environment["torch"]["version"]
    assert [(r.case, r.arm) for r in back.results] == [("a", "dslab"), ("a", "torch"), ("b", "dslab"), ("b", "torch")]
    for r in back.results:
        assert r.status == "ok" and len(r.trials) == 2
        assert all(len(t.step_times_ms) == 3 for t in r.trials)
        m = r.metrics
        assert m["samples_per_s"] > 0 and m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * (32 if r.case == "a" else 16))
        assert m["model_tflops"] > 0 and m["final_loss"] == m["final_loss"]  # flops counted, loss not NaN
    assert set(back.ratios) == {"a", "b"} and "dslab/torch" in back.ratios["a"]
    assert back.config["flops_per_step"]["a"] > 0
    phases = back.profilers["wall_clock"]["a"]["phases"]
    assert set(phases) == {"forward", "backward", "step"} and phases["forward"]["count"] >= 6
    memory = back.profilers["memory"]["a"]
    assert memory["cuda"] is False and "not traced" in memory["note"]
    assert memory["activation_bytes"] > 0 and memory["model_states"]["params"] > 0
    flops = back.profilers["flops"]["a"]
    assert flops["forward_flops"] > 0 and flops["backward_flops"] > flops["forward_flops"]
    assert flops["modules"] and flops["params"] > 0
    telemetry = back.profilers["telemetry"]["b"]
    assert telemetry["available"] is False and telemetry["reason"]


def test_failing_arm_does_not_stop_the_others(tmp_path, monkeypatch):
    original = arms_module.PlainArm.step

    def broken(self):
        if self.name == "torch":
            raise RuntimeError("synthetic failure in the torch arm")
        return original(self)

    monkeypatch.setattr(arms_module.PlainArm, "step", broken)
    report, path = run_suite(tiny_suite(tmp_path, arms=["dslab", "torch", "hf"]), out=tmp_path / "r")
    back = read_report(path)
    torch_res = back.result("a", "torch")
    assert torch_res.status == "failed" and "synthetic failure" in torch_res.error
    assert back.result("a", "dslab").status == "ok" and len(back.result("a", "dslab").trials) == 2
    assert back.result("a", "hf").status == "ok"
    assert back.status == "partial" and [(r.case, r.arm) for r in back.failed_results()] == [("a", "torch"), ("b", "torch")]


def test_arm_that_fails_to_build_is_recorded(tmp_path, monkeypatch):
    real = arms_module.build_arm

    def build(name, *args, **kwargs):
        if name == "torch":
            raise MemoryError("cannot allocate the torch arm")
        return real(name, *args, **kwargs)

    monkeypatch.setattr("dslab.bench.training.build_arm", build)
    report, _ = run_suite(tiny_suite(tmp_path), out=tmp_path / "r", cases=["b"])
    assert [r.case for r in report.results] == ["b", "b"]
    assert report.result("b", "torch").status == "failed"
    assert "cannot allocate" in report.result("b", "torch").error
    assert report.result("b", "dslab").status == "ok"


def test_ctrl_c_leaves_an_incomplete_report(tmp_path, monkeypatch):
    calls = {"n": 0}
    original = arms_module.EngineArm.step

    def interrupted(self):
        calls["n"] += 1
        if calls["n"] == 9:  # in trial 2 of case a: trial 1 was 4 warm-up steps and 3 timed
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(arms_module.EngineArm, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_suite(tiny_suite(tmp_path), out=tmp_path / "r")
    (run,) = list_runs(tmp_path / "r")
    back = read_report(run)
    assert back.status == "incomplete"
    assert any("interrupted" in n for n in back.notes)
    assert back.result("a", "dslab").trials  # the first trial was kept


@pytest.mark.serial  # compares the arms' step times
def test_injected_sleep_slows_only_the_dslab_arm(tmp_path, monkeypatch):
    monkeypatch.setenv("DSLAB_INJECT_STEP_SLEEP_MS", "40")
    report, _ = run_suite(tiny_suite(tmp_path), out=tmp_path / "r", cases=["b"], trials=1)
    assert report.result("b", "dslab").metrics["step_time_min_ms"] >= 40
    monkeypatch.setenv("DSLAB_INJECT_STEP_SLEEP_MODE", "device")  # on a CPU: the host sleep as well
    report, _ = run_suite(tiny_suite(tmp_path), out=tmp_path / "r", cases=["b"], trials=1)
    assert report.result("b", "dslab").metrics["step_time_min_ms"] >= 40
    monkeypatch.setenv("DSLAB_INJECT_STEP_SLEEP_MODE", "gpu")
    with pytest.raises(ValueError, match="DSLAB_INJECT_STEP_SLEEP_MODE='gpu': choose host or device"):
        run_suite(tiny_suite(tmp_path), out=tmp_path / "r", cases=["b"], trials=1)
    monkeypatch.delenv("DSLAB_INJECT_STEP_SLEEP_MODE")
    monkeypatch.setenv("DSLAB_INJECT_STEP_SLEEP_MS", "soon")
    with pytest.raises(ValueError, match="DSLAB_INJECT_STEP_SLEEP_MS"):
        run_suite(tiny_suite(tmp_path), out=tmp_path / "r", cases=["b"], trials=1)


def test_no_timed_step_of_the_dslab_arm_is_a_profiled_one(tmp_path, monkeypatch):
    """The flops profiler counts, times and measures busy time on steps 1, 2 and 3 and the memory
    tracer breaks down step 1 (the suite's profile_step 1): the dslab arm's first trial warms up
    through step 3 although the suite asks for 1 warm-up step."""
    from dslab.bench import training

    first_timed = {}
    original = training.run_trial

    def spy(step, device, warmup, steps, pools=None):
        arm = step.__self__
        if isinstance(arm, arms_module.EngineArm):
            first_timed.setdefault(arm.engine.global_steps + warmup, warmup)
        return original(step, device, warmup, steps, pools=pools)

    monkeypatch.setattr(training, "run_trial", spy)
    stream = io.StringIO()
    report, _ = run_suite(tiny_suite(tmp_path), out=tmp_path / "r", cases=["b"], stream=stream)
    assert first_timed == {4: 4, 8: 1}  # trial 1 times steps 4-6 after 4 warm-up steps; trial 2 8-10 after 1
    for arm in ("dslab", "torch"):  # every arm warms up as long: all train the same steps
        assert f"[gpt2_test b] {arm}: 4 warm-up step(s), through the dslab engine's one-off profiled steps" \
            in stream.getvalue()
    assert report.profilers["flops"]["b"]["profiled"] and report.result("b", "dslab").status == "ok"


@pytest.mark.gpu
def test_device_spin_lasts_what_it_was_calibrated_for():
    from dslab.bench.arms import device_spin_cycles

    cycles = device_spin_cycles(5.0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) == pytest.approx(5.0, rel=0.1)


def test_suite_validation_names_the_problem(tmp_path):
    with pytest.raises(ValueError, match="unknown config key 'scales.tiny.step'"):
        load_suite(tiny_suite(tmp_path, scales={"tiny": {"preset": "gpt2_tiny", "step": 3,
                                                         "cases": [{"name": "a", "seq_len": 8, "micro_batch": 1}]}}))
    with pytest.raises(ValueError, match="engine.train_batch_size"):
        load_suite(tiny_suite(tmp_path, engine={"train_batch_size": 8}))
    with pytest.raises(ValueError, match="must include 'dslab'"):
        load_suite(tiny_suite(tmp_path, arms=["torch"]))
    with pytest.raises(FileNotFoundError, match="no suite"):
        load_suite(tmp_path / "missing")
    with pytest.raises(ValueError, match="unknown case"):
        run_suite(tiny_suite(tmp_path), out=tmp_path / "r", cases=["zzz"])
    with pytest.raises(ValueError, match="unknown arm.*torch-compile-ro"):
        run_suite(tiny_suite(tmp_path), out=tmp_path / "r", arms=["jax"])
    with pytest.raises(ValueError, match="arms"):
        load_suite(tiny_suite(tmp_path, arms=["dslab", "torch-compile-max"]))


def test_cli_bench_and_report_commands(tmp_path, capsys):
    out = tmp_path / "reports"
    assert cli.main(["bench", str(tiny_suite(tmp_path)), "--cases", "b", "--trials", "1", "--steps", "2",
                     "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "no CUDA GPU: running suite gpt2_test at the 'tiny' scale" in printed.err
    assert "gpt2_test / b" in printed.out and "dslab/arm" in printed.out  # the summary table, on stdout
    (run,) = list_runs(out)
    assert cli.main(["report", "list", "--reports", str(out)]) == 0
    listing = capsys.readouterr().out
    assert run.name in listing and "complete" in listing
    assert cli.main(["report", "show", run.name[:12], "--reports", str(out)]) == 0
    shown = capsys.readouterr().out
    assert f"run {run.name}" in shown and "gpt2_test / b" in shown
    assert cli.main(["report", "show", "nope", "--reports", str(out)]) == 1


def test_bench_writes_profiler_text_to_the_run_directory_and_prints_it_only_when_verbose(tmp_path, capsys):
    """The flops profile (here written when the engine closes: 1 warm-up + 2 steps end before the
    steps after the counted one) goes to profiles/<case>/flops_profile.txt, the report names it,
    and the terminal says where it is; --verbose prints the text too."""
    header = "dslab Flops Profiler"
    args = ["bench", str(tiny_suite(tmp_path)), "--arms", "dslab", "--cases", "b", "--trials", "1", "--steps", "2"]
    assert cli.main([*args, "--out", str(tmp_path / "quiet")]) == 0
    captured = capsys.readouterr()
    assert header not in captured.out and header not in captured.err
    (run,) = list_runs(tmp_path / "quiet")
    text = run / "profiles" / "b" / "flops_profile.txt"
    assert text.read_text().count(header) == 1 and "Profile Summary at step 1" in text.read_text()
    assert read_report(run).profilers["flops"]["b"]["text_file"] == "profiles/b/flops_profile.txt"
    assert f"[gpt2_test b] flops profile text: {text}" in captured.err.splitlines()
    assert "trial 1/1 dslab" in captured.err and "gpt2_test / b" in captured.out

    assert cli.main([*args, "--out", str(tmp_path / "loud"), "--verbose"]) == 0
    assert capsys.readouterr().out.count(header) == 1
    (run,) = list_runs(tmp_path / "loud")
    assert header in (run / "profiles" / "b" / "flops_profile.txt").read_text()


@pytest.mark.slow
def test_readme_suite_bert_large_tiny_runs_all_arms(tmp_path):
    """The README's main job: suites/bert_large at the tiny scale, every arm, on the CPU."""
    report, _ = run_suite(REPO / "suites" / "bert_large", out=tmp_path / "r")
    assert report.status == "complete"
    assert {r.arm for r in report.results} == {"dslab", "torch", "torch-compile", "torch-compile-ro", "hf"}
    assert set(report.best_plain) == {"seq128", "seq512"}
    assert all(r.status == "ok" for r in report.results), [(r.arm, r.error) for r in report.results]
    # The suite turns CUDA graphs on for the dslab arm; on a CPU the stack runs eagerly, and the
    # report says how each case's stack ran.
    graph_notes = [n for n in report.notes if "CUDA graphs" in n]
    assert len(graph_notes) == 2 and all("eager_not_cuda" in n for n in graph_notes), report.notes


def test_parked_arm_trains_on_after_a_round_trip_through_host_memory(tmp_path):
    """park()/unpark() keep the arm's state: the step after a round trip continues training."""
    import torch

    from dslab.bench.suite import load_suite
    from dslab.bench.workloads import workloads_for

    suite, _ = load_suite(tiny_suite(tmp_path))
    workload = workloads_for(suite, "tiny", ["b"])[0]
    arm = arms_module.build_arm("torch", workload, torch.device("cpu"), "bf16", suite.engine)
    arm.step()
    params = [p.detach().clone() for p in arm.model.parameters()]
    states = [v.clone() for st in arm.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    arm.park()
    arm.unpark()
    assert all(torch.equal(a, b) for a, b in zip(params, arm.model.parameters()))
    after = [v for st in arm.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    assert all(torch.equal(a, b) for a, b in zip(states, after))
    loss = arm.step()
    assert torch.isfinite(loss)


def test_reduce_overhead_arm_is_interleaved_and_parks(tmp_path, monkeypatch):
    """torch-compile-ro at the smallest config: the runner builds it and interleaves it with dslab
    trial by trial; every step marks a new cudagraph-trees step and returns a detached loss; it is
    the best plain arm when it is the only one; and it trains on after parking (on a CPU the
    compiled model runs without CUDA graphs)."""
    import torch

    from dslab.bench.workloads import workloads_for

    order, marks = [], []
    real_build = arms_module.build_arm

    def build(name, *args, **kwargs):
        arm = real_build(name, *args, **kwargs)
        step = arm.step

        def recorded():
            order.append(name)
            loss = step()
            assert name == "dslab" or not loss.requires_grad  # the ro arm returns a detached copy
            return loss

        arm.step = recorded
        return arm

    real_mark = torch.compiler.cudagraph_mark_step_begin

    def mark():
        marks.append(len(order))
        real_mark()

    monkeypatch.setattr("dslab.bench.training.build_arm", build)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", mark)
    path = tiny_suite(tmp_path, arms=["dslab", "torch-compile-ro"])
    report, _ = run_suite(path, out=tmp_path / "r", cases=["b"], trials=2, steps=2)
    ro = report.result("b", "torch-compile-ro")
    assert ro.status == "ok" and len(ro.trials) == 2 and ro.metrics["final_loss"] == ro.metrics["final_loss"]
    # trial 0: dslab then ro, 4 warm-up steps each (through dslab's profiled steps 1-3) + 2; trial 1
    # rotated: ro settles 1 step, then dslab
    assert order == ["dslab"] * 6 + ["torch-compile-ro"] * 9 + ["dslab"] * 3
    assert marks == list(range(7, 16))  # once in each of the ro arm's steps, before its forward
    assert report.best_plain == {"b": "torch-compile-ro"}
    assert report.ratios["b"]["dslab/best_plain"] == report.ratios["b"]["dslab/torch-compile-ro"]

    suite, _ = load_suite(path)
    arm = real_build("torch-compile-ro", workloads_for(suite, "tiny", ["b"])[0], torch.device("cpu"), "bf16",
                     suite.engine)
    before = arm.step()
    params = [p.detach().clone() for p in arm.model.parameters()]
    arm.park()
    arm.unpark()
    assert all(torch.equal(a, b) for a, b in zip(params, arm.model.parameters()))
    after = arm.step()
    assert torch.isfinite(after) and not torch.equal(before, after)
    assert any(not torch.equal(a, b) for a, b in zip(params, arm.model.parameters()))
    arm.close()


def test_run_trial_with_pools_on_cpu_has_no_graph_pool_bytes():
    from dslab.bench.measure import graph_pools, run_trial

    pools: set = set()
    trial = run_trial(lambda: torch.ones(()), torch.device("cpu"), warmup=1, steps=2, pools=pools)
    assert trial["peak_memory_bytes"] is None and "graph_pool_bytes" not in trial and not pools
    assert graph_pools(torch.device("cpu")) == {}
