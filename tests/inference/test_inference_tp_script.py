"""benchmarks/inference_tp.py on two gloo ranks (fp32; it checks the pipeline, not speed): for a
GPT-2 and a Llama (grouped-query) preset it injects the model alone and sliced over the ranks,
generates at each batch, and prints a table row per batch with both per-token times and the first
new token where the greedy sequences differ."""

from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "inference_tp.py"


@pytest.mark.parametrize("preset", ["gpt2_tiny", "llama_tiny"])
def test_the_script_runs_tp2_beside_tp1(torchrun, preset):
    proc = torchrun(SCRIPT, "--preset", preset, "--batches", "1,3", "--prompt", "4", "--new", "5", "--trials", "1")
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["batch", "tp1", "ms/token"])
    assert f"{preset} on 2 x CPU" in lines[header - 2]
    rows = [line.split() for line in lines[header + 1: header + 3]]
    assert [row[0] for row in rows] == ["1", "3"]
    for row in rows:
        tp1, tp2, ratio = map(float, row[1:4])
        assert tp1 > 0 and tp2 > 0 and ratio == pytest.approx(tp1 / tp2, abs=0.01)
        assert row[-1] == "none"  # fp32: the sliced sums keep every greedy token of this prompt
