"""The activation-memory arithmetic (dslab.profilers.activation_model) and its public name."""

import math

import pytest

import dslab
from dslab.models.gpt2 import gpt2_774m, gpt2_1558m
from dslab.profilers.activation_model import activation_bytes

# (config, micro-batch, checkpoint_layers, measured GiB on one H200: benchmarks/activation_memory.py)
MEASURED = [
    (gpt2_1558m, 8, 0, 20.06), (gpt2_1558m, 8, 1, 3.32), (gpt2_1558m, 8, 2, 2.15),
    (gpt2_774m, 4, 0, 6.18), (gpt2_774m, 4, 1, 1.23), (gpt2_774m, 4, 2, 0.88),
]


@pytest.mark.parametrize("make, micro_batch, every, measured", MEASURED)
def test_estimate_is_within_ten_percent_of_the_h200_measurements(make, micro_batch, every, measured):
    estimate = dslab.estimate_activation_memory(make(), micro_batch, 1024, every)["total"] / 2**30
    assert abs(estimate / measured - 1) < 0.10, (estimate, measured)


def test_the_terms():
    s, b, h, v, layers = 1024, 2, 64, 1000, 6
    plain = activation_bytes(layers, h, s, b, v)
    head = 2 * s * b * v + 2 * v * h + 4 * s * b * h
    assert plain == {"layers": 34 * layers * s * b * h, "head": head, "total": 34 * layers * s * b * h + head}
    for every in (1, 4, 6, 7):
        segments = math.ceil(layers / every)
        assert activation_bytes(layers, h, s, b, v, every)["layers"] == segments * 4 * s * b * h
    with pytest.raises(ValueError, match="checkpoint_layers must be an int >= 0"):
        activation_bytes(layers, h, s, b, v, -1)
    with pytest.raises(ValueError, match="hidden must be an int >= 1"):
        activation_bytes(layers, 0, s, b, v)


def test_config_defaults_to_its_own_sequence_and_segments():
    config = gpt2_774m(checkpoint_layers=3)
    assert dslab.estimate_activation_memory(config, 2) == activation_bytes(
        36, 1280, 1024, 2, config.padded_vocab_size, 3)
