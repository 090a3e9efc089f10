"""Peak memory of an arm that replays CUDA graphs: the graph's pool counts (GPU).

A replay allocates nothing, so the allocator's peak over a trial misses the activations a graph
writes into its private pool. ``run_trial`` adds the bytes of the arm's own pools beyond their
allocated blocks, and leaves out the pools of other arms."""

import pytest
import torch

from dslab.bench.measure import graph_pools, run_trial

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

MIB = 1 << 20


def _graphed_step(n_floats: int):
    """A step replaying a graph whose pool holds a temporary of ``n_floats`` fp32 values."""
    x = torch.randn(n_floats, device="cuda")
    out = torch.empty((), device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            temporary = x * 2.0  # freed inside the capture: its block stays in the pool
            out.copy_(temporary.sum())
            del temporary
    torch.cuda.current_stream().wait_stream(stream)

    def step():
        graph.replay()
        return out

    return step, graph, x


def test_the_arms_own_graph_pool_counts_in_its_peak_and_another_arms_does_not():
    device = torch.device("cuda")
    other_step, other_graph, other_x = _graphed_step(64 * MIB // 4)  # another arm's 64 MiB pool
    mine: set = set()
    before = set(graph_pools(device))
    step, graph, x = _graphed_step(32 * MIB // 4)  # this arm's 32 MiB temporary, captured "in" its trial
    plain = run_trial(step, device, warmup=1, steps=3)
    assert "graph_pool_bytes" not in plain
    mine |= set(graph_pools(device)) - before  # the capture above ran before the trial: attribute it
    counted = run_trial(step, device, warmup=1, steps=3, pools=mine)
    assert counted["graph_pool_bytes"] >= 32 * MIB
    assert counted["graph_pool_bytes"] < 64 * MIB  # the other arm's pool is not this arm's
    assert counted["peak_memory_bytes"] - plain["peak_memory_bytes"] >= 32 * MIB
    assert counted["peak_memory_bytes"] - plain["peak_memory_bytes"] < 64 * MIB


def test_pools_created_during_the_trial_are_attributed_to_the_arm():
    device = torch.device("cuda")
    state = {}

    def step():
        if "step" not in state:  # the arm captures its graph in its first warm-up step
            state["step"], state["graph"], state["x"] = _graphed_step(16 * MIB // 4)
        return state["step"]()

    pools: set = set()
    trial = run_trial(step, device, warmup=1, steps=2, pools=pools)
    assert len(pools) == 1
    assert trial["graph_pool_bytes"] >= 16 * MIB
    assert trial["peak_memory_bytes"] >= 16 * MIB
