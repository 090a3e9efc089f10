"""benchmarks/parallel_layouts.py's layout names and flop count (the timing itself needs GPUs)."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import parallel_layouts  # noqa: E402
import size_ladder  # noqa: E402


@pytest.mark.parametrize("name, world, expected", [
    ("dp", 4, (1, 1, 4, False)), ("pp4", 4, (1, 4, 1, True)), ("tp2dp2", 4, (2, 1, 2, False)),
    ("pp2dp2", 4, (1, 2, 2, True)), ("tp2pp2", 4, (2, 2, 1, True)), ("pp1", 1, (1, 1, 1, True)),
    ("tp2", 4, (2, 1, 2, False)),
])
def test_layout_names(name, world, expected):
    assert parallel_layouts.parse_layout(name, world) == expected


def test_layout_names_refused():
    with pytest.raises(ValueError, match="needs 3 ranks; this run has 4"):
        parallel_layouts.parse_layout("tp3", 4)
    with pytest.raises(ValueError, match="products of tpK"):
        parallel_layouts.parse_layout("zero2", 4)


def test_flops_match_the_size_ladders_count():
    assert parallel_layouts.model_flops(48, 1600, 1024, 65536) == pytest.approx(
        size_ladder.model_flops_per_step(48, 1600, 1024, 65536))


@pytest.mark.world_size(4)
def test_the_script_runs_every_layout_on_gloo(tmp_path):
    """The whole script on 4 CPU processes (torch kernels, no MFU): a check of its code paths
    before GPU time is spent on it, not a measurement."""
    import json
    import os
    import subprocess

    out = tmp_path / "layouts.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
         str(REPO / "benchmarks" / "parallel_layouts.py"), "--size", "tiny", "--layouts", "dp,pp4,tp2dp2,tp2pp2,tp3",
         "--micro", "2", "--micro-batches", "4", "--seq", "32", "--warmup", "1", "--steps", "1", "--json", str(out)],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["layout"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["tp3"]["error"] == "layout 'tp3' needs 3 ranks; this run has 4"
    for name in ("dp", "pp4", "tp2dp2", "tp2pp2"):
        assert rows[name]["tokens_per_s"] > 0 and len(rows[name]["losses"]) == 1
    assert [s["stage"] for s in rows["pp4"]["pipeline"]["per_stage"]] == [0, 1, 2, 3]
    assert rows["tp2pp2"]["pipeline"]["bubble_fraction"] == pytest.approx(1 / 5)
    assert "tp2pp2" in proc.stdout and "no MFU without a GPU" in proc.stdout
