"""The pieces of benchmarks/autotune_vs_deepspeed.sh that run without a GPU or DeepSpeed: the
examples' timed window (``--timed_from``), the DeepSpeed example's config reading (a path or the
base64 text DeepSpeed's autotuner passes), and the comparison table over both tuners' files."""

from __future__ import annotations

import base64
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_gpt2_times_whole_windows(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 1000}
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    run = subprocess.run([sys.executable, "examples/train_gpt2.py", "--model", "gpt2_tiny", "--seq", "32", "--steps",
                          "6", "--timed_from", "2", "--deepspeed_config", str(tmp_path / "cfg.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    match = re.search(r"^timed: ([0-9.]+) tokens/s over steps 3\.\.6$", run.stdout, re.MULTILINE)
    assert match and float(match.group(1)) > 0, run.stdout
    bad = subprocess.run([sys.executable, "examples/train_gpt2.py", "--model", "gpt2_tiny", "--steps", "6",
                          "--timed_from", "6", "--deepspeed_config", str(tmp_path / "cfg.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--timed_from must be in [0, --steps)" in bad.stderr


def test_train_gpt2_memory_sites_need_cuda(tmp_path):
    (tmp_path / "cfg.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    base = [sys.executable, "examples/train_gpt2.py", "--model", "gpt2_tiny", "--seq", "32", "--steps", "2",
            "--deepspeed_config", str(tmp_path / "cfg.json")]
    bad = subprocess.run(base + ["--memory-sites", "-1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--memory-sites must be >= 0, got -1" in bad.stderr
    if not torch.cuda.is_available():
        off = subprocess.run(base + ["--memory-sites", "5"], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert off.returncode == 2 and "--memory-sites needs a CUDA device" in off.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_train_gpt2_prints_the_sites_at_the_peak_and_at_an_out_of_memory(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    cmd = [sys.executable, "examples/train_gpt2.py", "--model", "gpt2_tiny", "--seq", "64", "--steps", "3",
           "--memory-sites", "4", "--deepspeed_config", str(tmp_path / "cfg.json")]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("memory sites: ")]
    assert lines[0].startswith("memory sites: live at the traced peak: ") and 2 <= len(lines) <= 5
    assert any("dslab/" in line for line in lines[1:])
    # a micro-batch past the device (GPT-2 124M: its fp32 embedding output alone does not fit):
    # the sites go to stderr before the error
    free, _ = torch.cuda.mem_get_info()
    config["train_micro_batch_size_per_gpu"] = int(free // (1024 * 768 * 4)) + 1
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    cmd[cmd.index("gpt2_tiny")], cmd[cmd.index("64")] = "gpt2_124m", "1024"
    oom = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert oom.returncode != 0 and "out of memory" in oom.stderr.lower()
    before_error = oom.stderr[:oom.stderr.lower().rindex("out of memory")]
    assert "memory sites: live at the traced peak: " in before_error


def test_the_deepspeed_example_reads_a_path_or_base64(tmp_path):
    example = _load(REPO / "examples" / "train_gpt2_deepspeed.py", "train_gpt2_deepspeed_example")
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    assert example.read_config(str(path)) == config
    encoded = base64.urlsafe_b64encode(json.dumps(config).encode()).decode()
    assert len(encoded) > 64 and example.read_config(encoded) == config
    long = base64.urlsafe_b64encode(json.dumps({"pad": "x" * 400}).encode()).decode()  # longer than a file name
    assert example.read_config(long) == {"pad": "x" * 400}
    with pytest.raises(SystemExit, match="neither a file nor base64 JSON"):
        example.read_config("no-such-config.json")


def _work(tmp_path: Path, dslab_tokens: float | None = 52000.0) -> Path:
    work = tmp_path / "gpt2_355m"
    for tuner, config, wall in (("dslab", {"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 0}},
                                 "95.0"),
                                ("deepspeed", {"train_micro_batch_size_per_gpu": 24, "gradient_accumulation_steps": 1,
                                               "zero_optimization": {"stage": 1}}, "380.0")):
        (work / f"results_{tuner}").mkdir(parents=True)
        (work / f"results_{tuner}" / "ds_config_optimal.json").write_text(json.dumps(config))
        (work / f"wall_{tuner}.txt").write_text(wall + "\n")
    (work / "timed_deepspeed.log").write_text("step 10 loss 7.1\ntimed: 40000.0 tokens/s over steps 6..25\n")
    if dslab_tokens is not None:
        (work / "timed_dslab.log").write_text(f"timed: {dslab_tokens} tokens/s over steps 6..25\n")
    (work / "results_deepspeed" / "summary.txt").write_text("| z1 | ... |\n\nTuning completed in 0:06:20. "
                                                             "Total number of experiments: 11.")
    report = work / "reports_dslab" / "autotune" / "20261130T000000Z-aaaaaa"
    report.mkdir(parents=True)
    experiments = [{"status": s} for s in ("ok", "ok", "pruned", "early_stopped", "pruned")]
    report.joinpath("run.json").write_text(json.dumps({"profilers": {"autotuning": {"experiments": experiments}}}))
    return work


def test_the_comparison_table(tmp_path, capsys):
    compare = _load(REPO / "benchmarks" / "autotune_compare.py", "autotune_compare")
    out = tmp_path / "result.json"
    result = compare.main([str(_work(tmp_path)), "--json", str(out)])
    rows = result["rows"]
    assert rows["dslab"] == {"chosen": "z0 mbs16 gas1", "experiments": 3, "wall_s": 95.0, "tokens_per_s": 52000.0}
    assert rows["deepspeed"] == {"chosen": "z1 mbs24 gas1", "experiments": 11, "wall_s": 380.0, "tokens_per_s": 40000.0}
    assert result["tokens_ratio"] == pytest.approx(1.3) and result["search_time_ratio"] == pytest.approx(0.25)
    text = capsys.readouterr().out
    assert "dslab's choice / DeepSpeed's choice, tokens/s: 1.300" in text and "52,000" in text
    assert json.loads(out.read_text())["rows"]["deepspeed"]["experiments"] == 11


def test_a_missing_timed_run_is_a_dash_and_a_note(tmp_path, capsys):
    compare = _load(REPO / "benchmarks" / "autotune_compare.py", "autotune_compare")
    result = compare.main([str(_work(tmp_path / "a", dslab_tokens=None))])
    assert result["rows"]["dslab"]["tokens_per_s"] is None and "tokens_ratio" not in result
    assert any("dslab: the chosen config's timed run printed no tokens/s" in n for n in result["notes"])
    assert "note: dslab" in capsys.readouterr().out
