"""benchmarks/decode_profile.py's layer breakdown: one layer's launches found in a profiled run
of whole steps, with each launch's mean over the layers and replays."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
decode_profile = pytest.importorskip("decode_profile")


def _run(head, layer, tail, layers, replays, first=None, seed=0):
    """A profiled run: per step the head launches, ``layers`` layers (the first one ``first`` when
    given), the tail; each launch's time its base plus noise, recorded with the expected means."""
    rng = random.Random(seed)
    sequence = []
    for _ in range(replays):
        step = list(head)
        for index in range(layers):
            step += first if (first is not None and index == 0) else layer
        step += tail
        sequence += [(name, us + rng.uniform(-0.5, 0.5)) for name, us in step]
    return sequence


def test_layer_block_and_the_launches_around_it():
    head = [("embed", 2.0), ("rope_cos", 1.0)]
    layer = [("linear", 10.0), ("split", 4.0), ("combine", 1.5), ("linear", 8.0), ("linear", 20.0), ("linear", 12.0)]
    tail = [("linear", 120.0)]
    layer_out, outside, blocks = decode_profile.layer_breakdown(_run(head, layer, tail, 16, 20), 20, 16)
    assert blocks == 16 and [n for n, _ in layer_out] == [n for n, _ in layer]
    for (_, got), (_, want) in zip(layer_out, layer):
        assert got == pytest.approx(want, abs=0.1)
    assert [n for n, _ in outside] == ["embed", "rope_cos", "linear"]
    assert outside[-1][1] == pytest.approx(120.0, abs=0.5)


def test_a_first_layer_that_launches_differently_is_left_outside():
    layer = [("prologue", 3.0), ("linear", 10.0), ("split", 4.0), ("linear", 9.0)]
    first = layer[1:]  # the first layer's norm runs inside its linear: one launch fewer
    layer_out, outside, blocks = decode_profile.layer_breakdown(
        _run([("embed", 2.0)], layer, [("head", 50.0)], 8, 5, first=first), 5, 8)
    assert blocks == 7
    assert sorted(n for n, _ in layer_out) == sorted(n for n, _ in layer)
    assert len(outside) == 1 + len(first) + 1


def test_steps_that_differ_or_do_not_divide_give_none():
    sequence = _run([], [("a", 1.0), ("b", 2.0)], [], 4, 3)
    assert decode_profile.layer_breakdown(sequence[:-1], 3, 4) is None
    sequence[0] = ("c", 1.0)
    assert decode_profile.layer_breakdown(sequence, 3, 4) is None
