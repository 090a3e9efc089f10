"""``dslab bench suites/gpt2_inference`` at its tiny scale on the CPU: every arm generates, the
report (schema 3) carries the inference section (times, memory, the greedy comparison), reads
back, prints, and the dashboard draws its Inference tab; older reports read with an empty section;
bad suite settings are refused by name."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from dslab.bench.inference_suite import INFERENCE_ARMS
from dslab.bench.suite import load_suite
from dslab.report import SCHEMA_VERSION, read_report, report_from_dict
from dslab.report.summary import results_table

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "suites" / "gpt2_inference"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from dslab.cli import main

    root = tmp_path_factory.mktemp("inference_reports")
    code = main(["bench", str(SUITE), "--cases", "b3", "--trials", "1", "--steps", "1", "--warmup", "0",
                 "--out", str(root)])
    assert code == 0
    (run,) = list((root / "gpt2_inference").iterdir())
    return root, run


def test_the_suite_loads_with_its_four_arms():
    suite, _ = load_suite(SUITE)
    assert suite.kind == "inference" and tuple(suite.arms) == INFERENCE_ARMS
    full = {c.name: (c.preset, c.batch, c.prompt_len, c.max_new_tokens) for c in suite.scales["full"].cases}
    assert full == {"124m-b1": ("gpt2_124m", 1, 32, 128), "124m-b32": ("gpt2_124m", 32, 32, 128),
                    "1.5b-b1": ("gpt2_1558m", 1, 32, 128), "1.5b-b32": ("gpt2_1558m", 32, 32, 128)}


def test_tiny_run_writes_the_inference_section(tiny_run):
    _, run = tiny_run
    report = read_report(run)
    assert report.status == "complete" and report.schema_version == SCHEMA_VERSION == 3
    assert report.config["kind"] == "inference" and report.config["scale"] == "tiny"
    assert {r.arm: r.status for r in report.results} == {arm: "ok" for arm in INFERENCE_ARMS}
    record = report.inference["b3"]
    assert (record["batch"], record["prompt_len"], record["max_new_tokens"]) == (3, 8, 8)
    for arm in INFERENCE_ARMS:
        m = record["arms"][arm]
        assert m["prefill_ms"] > 0 and m["per_token_ms_p90"] >= m["per_token_ms_p50"] > 0 and m["tokens_per_s"] > 0
        assert m["weights_bytes"] > 0
        result = report.result("b3", arm)
        assert result.metrics["tokens_per_s"] == pytest.approx(3 * 8 / (result.metrics["step_time_ms"] / 1e3))
    # the KV cache of batch 3 is the bucket of 4 at prompt + new = 16 positions, bf16
    hidden, layers = 128, 2
    assert record["arms"]["dslab"]["kv_cache_bytes"] == 2 * layers * 4 * 16 * hidden * 2
    assert record["arms"]["dslab-int8"]["weights_bytes"] < record["arms"]["dslab"]["weights_bytes"]
    greedy = record["greedy"]
    assert greedy["reference_arm"] == "hf" and greedy["compared_tokens"] == 8
    assert greedy["arms"]["dslab"] == {"equal": True, "first_divergence": None, "agreement": 1.0}
    assert greedy["arms"]["hf-static"]["equal"]
    memory = report.profilers["memory"]["b3"]  # the dslab arm's memory tracer: its weights, and the KV cache
    assert memory["model_states"]["params"] == record["arms"]["dslab"]["weights_bytes"]
    assert memory["inference"]["kv_cache_bytes"] == record["arms"]["dslab"]["kv_cache_bytes"]
    telemetry = report.profilers["telemetry"]["b3"]  # sampled while the case ran (says why not, on a CPU)
    assert telemetry["available"] or telemetry["reason"]
    assert report.best_plain["b3"] in ("hf", "hf-static")  # dslab-int8 is dslab's, never the best plain arm
    text = results_table(report)
    assert "greedy dslab vs hf over 8 new tokens: the same tokens" in text
    assert "dslab: prefill" in text and "per token p50" in text


def test_the_dashboard_draws_the_inference_tab(tiny_run):
    pytest.importorskip("dash")
    from dashboards import inference as inference_view
    from dashboards.app import render
    from dashboards.data import RunStore

    root, run = tiny_run
    store = RunStore(root)
    report = store.report("gpt2_inference", run.name)
    assert inference_view.has_inference(report)
    text = str(render(store, f"/run/gpt2_inference/{run.name}/inference"))
    for expected in ("inference-arms", "inference-per-token", "inference-greedy", "batch 3, prompt 8 + 8 new tokens",
                     "dslab-int8", "hf-static"):
        assert expected in text, expected
    assert "could not be drawn" not in text
    rows = {r["arm"]: r for r in inference_view.arm_rows(report.inference["b3"])}
    assert rows["dslab"]["kv_cache_gib"] > 0 and rows["hf"]["kv_cache_gib"] is None
    assert "/inference" in str(render(store, f"/run/gpt2_inference/{run.name}"))  # the tab is offered
    memory = str(render(store, f"/run/gpt2_inference/{run.name}/memory"))
    assert "memory-estimate" in memory and "could not be drawn" not in memory


def test_older_reports_read_with_an_empty_inference_section(tiny_run):
    _, run = tiny_run
    data = json.loads((run / "run.json").read_text())
    data["schema_version"] = 2
    older = report_from_dict(data)
    assert older.inference == {} and older.missing == [] and older.warnings == []
    del data["inference"]
    assert report_from_dict(data).inference == {}
    data["schema_version"] = 3
    assert "inference" in report_from_dict(data).missing


@pytest.mark.parametrize("change,message", [
    ({"arms": ["hf"]}, "'arms' must include 'dslab'"),
    ({"inference": {"dtype": "fp16"}}, "'inference.dtype' is set by the suite runner"),
    ({"inference": {"enable_cuda_grap": True}}, "did you mean 'enable_cuda_graph'"),
    ({"arms": ["dslab", "torch"]}, "arms"),
])
def test_bad_suite_settings(tmp_path, change, message):
    data = {**json.loads((SUITE / "suite.json").read_text()), **change}
    (tmp_path / "suite.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        load_suite(tmp_path)


def test_bad_run_options(tmp_path):
    from dslab.bench.runner import run_suite

    with pytest.raises(ValueError, match="unknown arm.*choose from dslab, dslab-int8, hf, hf-static"):
        run_suite(SUITE, scale="tiny", arms=["torch"], out=tmp_path, stream=io.StringIO())
    with pytest.raises(ValueError, match="--zero-stage applies to training suites"):
        run_suite(SUITE, scale="tiny", zero_stage=1, out=tmp_path, stream=io.StringIO())


def test_the_dslab_arm_makes_every_new_token_as_transformers_arms_do():
    """The model's generation config names an eos id the model produces at its second new token:
    transformers' arms ignore it (eos_token_id=None, min_new_tokens), and so does dslab's, so every
    arm times the same number of tokens."""
    import torch
    from tiny_models import hf_gpt2, prompts

    from dslab.bench.inference import GenerateArm
    from dslab.bench.inference_suite import InferenceCase

    model = hf_gpt2()
    ids, _ = prompts(2, 6)
    free = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generation_config.eos_token_id = int(free[0, 6 + 1])
    case = InferenceCase(name="b2", batch=2, prompt_len=6, max_new_tokens=5)
    arms = {name: GenerateArm(name, model, ids, case, "fp32", {}, torch.device("cpu")) for name in ("dslab", "hf")}
    for name, arm in arms.items():
        tokens, clock = arm.run()
        assert torch.equal(tokens, free), name
        assert clock["new_tokens"] == 5, name
