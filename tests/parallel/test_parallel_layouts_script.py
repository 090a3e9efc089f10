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
