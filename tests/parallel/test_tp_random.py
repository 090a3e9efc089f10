"""The tensor-parallel random stream (dslab.parallel.random): a fork draws from its own stream and
leaves the default generators as they were; a tensor-parallel layer's attention dropout draws
there; an activation checkpoint replays it, so the recompute drops the same elements."""

import pytest
import torch

from dslab.models.checkpoint import checkpoint
from dslab.models.ops import op_set
from dslab.models.tensor_parallel_layers import tensor_parallel_layer
from dslab.parallel.random import MODEL_PARALLEL_RNG, RngStatesTracker, get_rng_tracker, model_parallel_seed


@pytest.fixture(autouse=True)
def clean_tracker():
    get_rng_tracker().reset()
    yield
    get_rng_tracker().reset()


def test_fork_draws_its_own_stream_and_leaves_the_default_alone():
    tracker = RngStatesTracker()
    tracker.add("a", 7)
    torch.manual_seed(1)
    expected_default = torch.rand(3)
    torch.manual_seed(1)
    with tracker.fork("a"):
        first = torch.rand(3)
    with tracker.fork("a"):
        second = torch.rand(3)
    assert torch.equal(torch.rand(3), expected_default)  # the default stream did not move
    torch.manual_seed(7)
    assert torch.equal(torch.cat([first, second]), torch.rand(6))  # the stream continues across forks
    other = RngStatesTracker()
    other.add("a", 8)  # another rank's stream
    with other.fork("a"):
        assert not torch.equal(torch.rand(3), first)
    with pytest.raises(ValueError, match="exists already"):
        tracker.add("a", 1)
    torch.manual_seed(9)
    with RngStatesTracker().fork("missing"):  # no such stream: the default generators
        drawn = torch.rand(3)
    torch.manual_seed(9)
    assert torch.equal(drawn, torch.rand(3))


def test_model_parallel_seed_seeds_the_default_and_the_rank_stream():
    model_parallel_seed(5)
    assert torch.initial_seed() == 5
    with get_rng_tracker().fork():
        drawn = torch.rand(2)
    torch.manual_seed(5 + 2718)  # rank 0 of no group
    assert torch.equal(drawn, torch.rand(2))


def layer():
    torch.manual_seed(0)
    return tensor_parallel_layer(64, 2, 256, 0.0, 0.5, 1e-5, True, True, "tanh", op_set("torch"))


def test_tensor_parallel_attention_drops_on_the_rank_stream():
    module = layer().train()
    x = torch.randn(2, 8, 64)
    get_rng_tracker().add(MODEL_PARALLEL_RNG, 11)
    before_stream = get_rng_tracker().get_states()[MODEL_PARALLEL_RNG]["cpu"]
    torch.manual_seed(3)
    module(x)
    after_default = torch.get_rng_state()
    torch.manual_seed(3)
    assert torch.equal(after_default, torch.get_rng_state())  # the attention did not draw from it
    assert not torch.equal(before_stream, get_rng_tracker().get_states()[MODEL_PARALLEL_RNG]["cpu"])


def test_checkpoint_replays_the_rank_stream():
    module = layer().train()
    x = torch.randn(2, 8, 64, requires_grad=True)

    def grads(use_checkpoint: bool):
        get_rng_tracker().reset()
        get_rng_tracker().add(MODEL_PARALLEL_RNG, 11)
        torch.manual_seed(3)
        module.zero_grad()
        x.grad = None
        out = checkpoint(module, x) if use_checkpoint else module(x)
        out.square().sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]

    plain, recomputed = grads(False), grads(True)
    assert any(not torch.equal(a, b) for a, b in zip(plain, grads_without_dropout(module, x)))
    for a, b in zip(plain, recomputed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def grads_without_dropout(module, x):
    module.eval()
    try:
        module.zero_grad()
        x.grad = None
        module(x).square().sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]
    finally:
        module.train()
