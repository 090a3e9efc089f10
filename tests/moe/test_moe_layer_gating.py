"""The MoE gate (dslab.moe.gating, on the moe_gating kernel) and DeepSpeed's one-hot formulation
(dslab.moe.sharded_moe.top1gating/top2gating) against brute-force loops over tokens."""

import sys
from pathlib import Path

import pytest
import torch

from dslab.moe.gating import GateConfig, TopKGate, gate_capacity
from dslab.moe.sharded_moe import top1gating, top2gating

sys.path.insert(0, str(Path(__file__).parent))
from moe_layer_naive import ds_capacity, naive_gating  # noqa: E402

H = 7


def _gate(experts, k, seed=0, **cfg):
    torch.manual_seed(seed)
    return TopKGate(H, GateConfig(num_experts=experts, k=k, **cfg))


def _tokens(n, seed=1):
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed))


def _decision_lists(d):
    keep = d.keep.tolist()
    pos = [[p if kept else -1 for p, kept in zip(row, krow)] for row, krow in zip(d.position.tolist(), keep)]
    return d.expert_index.tolist(), pos, keep


def _naive_pos(ref):
    return [[p if kept else -1 for p, kept in zip(row, krow)] for row, krow in zip(ref["position"], ref["keep"])]


@pytest.mark.parametrize("tokens,experts,factor,k,min_cap", [
    (10, 4, 1.2, 1, 1), (10, 4, 1.2, 2, 1), (37, 5, 1.0, 1, 4), (37, 5, 0.3, 2, 4), (8, 8, 1.0, 1, 4),
    (1000, 7, 1.25, 2, 0), (3, 4, 2.0, 1, 0), (96, 12, 0.1, 1, 1)])
def test_capacity_is_deepspeeds(tokens, experts, factor, k, min_cap):
    assert gate_capacity(tokens, experts, factor * k, min_cap) == ds_capacity(tokens, experts, factor, k, min_cap)


def test_capacity_is_deepspeeds_over_a_sweep():
    for factor in (0.1, 0.3, 0.7, 1.1, 1.2, 1.25, 2.0):
        for k in (1, 2):
            for experts in range(1, 17):
                tokens = torch.arange(1, 300)
                expected = torch.ceil((tokens / experts) * torch.tensor(factor * k)).long().clamp(min=1)
                got = [gate_capacity(t, experts, factor * k, 1) for t in range(1, 300)]
                assert got == expected.tolist(), (factor, k, experts)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("drop_tokens", [True, False])
@pytest.mark.parametrize("masked", [False, True], ids=["all-tokens", "used_token"])
def test_gate_matches_brute_force(k, drop_tokens, masked):
    tokens, experts = 29, 5
    gate = _gate(experts, k, capacity_factor=0.6, min_capacity=2, drop_tokens=drop_tokens, use_rts=False,
                 top2_2nd_expert_sampling=False)
    x = _tokens(tokens)
    used = (torch.rand(tokens, generator=torch.Generator().manual_seed(3)) > 0.25).float() if masked else None
    d = gate(x, used)
    capacity = ds_capacity(tokens, experts, 0.6, k, 2) if drop_tokens else None
    assert d.capacity == capacity
    ref = naive_gating(gate.compute_logits(x), k, capacity, used)
    choices, pos, keep = _decision_lists(d)
    assert choices == ref["choices"] and keep == ref["keep"] and pos == _naive_pos(ref)
    assert d.exp_counts.tolist() == ref["counts"] and d.exp_counts.dtype == torch.int64
    torch.testing.assert_close(d.gate_weight.double(), torch.tensor(ref["weight"], dtype=torch.float64),
                               rtol=1e-6, atol=1e-7)
    assert d.l_aux.item() == pytest.approx(ref["l_aux"], rel=1e-5)
    if drop_tokens:
        assert not all(all(row) for row in keep)  # the case drops something
    else:
        assert all(all(row) for row in keep) == (not masked)


@pytest.mark.parametrize("k", [1, 2])
def test_deepspeed_formulation_matches_brute_force(k):
    tokens, experts, capacity = 23, 4, ds_capacity(23, 4, 0.7, k, 1)
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(5))
    if k == 1:
        l_aux, combine, dispatch, counts = top1gating(logits, 0.7, 1, use_rts=False)
    else:
        l_aux, combine, dispatch, counts = top2gating(logits, 0.7, 1, top2_2nd_expert_sampling=False)
    ref = naive_gating(logits, k, capacity)
    assert combine.shape == (tokens, experts, capacity) and torch.equal(dispatch, combine > 0)
    expected = torch.zeros(tokens, experts, capacity, dtype=torch.float64)
    for t in range(tokens):
        for c in range(k):
            if ref["keep"][t][c]:
                expected[t, ref["choices"][t][c], ref["position"][t][c]] = ref["weight"][t][c]
    torch.testing.assert_close(combine.double(), expected, rtol=1e-6, atol=1e-7)
    assert counts.tolist() == ref["counts"] and l_aux.item() == pytest.approx(ref["l_aux"], rel=1e-5)


def test_top2_normalises_over_the_two_chosen_and_renormalises_when_one_is_dropped():
    gate = _gate(4, 2, capacity_factor=0.6, min_capacity=1, top2_2nd_expert_sampling=False)
    x = _tokens(24)
    d = gate(x)
    probs = torch.softmax(gate.compute_logits(x), dim=1)
    chosen = probs.gather(1, d.expert_index)
    both = d.keep.all(1)
    one = d.keep.sum(1) == 1
    assert both.any() and one.any()
    torch.testing.assert_close(d.gate_weight[both], chosen[both] / chosen[both].sum(1, keepdim=True))
    torch.testing.assert_close(d.gate_weight[one].sum(1), torch.ones(int(one.sum())))
    assert (d.gate_weight[~d.keep] == 0).all()


def test_random_token_selection_keeps_a_random_subset_within_capacity():
    tokens, experts = 40, 4
    gate = _gate(experts, 1, capacity_factor=0.5, min_capacity=1, use_rts=True)
    x = _tokens(tokens)
    capacity = gate.capacity(tokens)
    plain = naive_gating(gate.compute_logits(x), 1, None)
    counts = plain["counts"]
    assert max(counts) > capacity  # some expert overflows
    kept_sets = set()
    kept_often = torch.zeros(tokens)
    for seed in range(60):
        torch.manual_seed(seed)
        d = gate(x)
        torch.manual_seed(seed)
        priority = torch.rand(tokens)  # the gate's only random draw here
        choice = d.expert_index[:, 0]
        assert choice.tolist() == [row[0] for row in plain["choices"]]
        assert d.exp_counts.tolist() == counts
        for e in range(experts):
            mine = (choice == e).nonzero().flatten()
            kept = mine[d.keep[mine, 0]]
            assert len(kept) == min(counts[e], capacity)
            top = mine[torch.argsort(priority[mine], descending=True)[:capacity]]
            assert sorted(kept.tolist()) == sorted(top.tolist())  # the highest priorities win
            assert d.position[kept, 0].tolist() == list(range(len(kept)))  # slots in token order
        kept_sets.add(tuple(d.keep[:, 0].tolist()))
        kept_often += d.keep[:, 0]
    assert len(kept_sets) > 50  # random, not token order
    full = [e for e in range(experts) if counts[e] > capacity]
    overflowing = torch.isin(torch.tensor([row[0] for row in plain["choices"]]), torch.tensor(full))
    first_tokens = [(torch.tensor([row[0] for row in plain["choices"]]) == e).nonzero()[0].item() for e in full]
    assert all(kept_often[t] < 60 for t in first_tokens)  # token order would always keep these
    assert kept_often[overflowing].min() > 0


def test_rts_kernel_path_equals_reference_with_the_same_priorities():
    gate = _gate(5, 1, capacity_factor=0.5, min_capacity=1, use_rts=True)
    x = _tokens(33)
    torch.manual_seed(7)
    d = gate(x)
    torch.manual_seed(7)
    priority = torch.rand(33)
    _, combine, _, counts = top1gating(gate.compute_logits(x), 0.5, 1, use_rts=True, priority=priority)
    expected = torch.zeros_like(combine)
    rows = torch.arange(33)[d.keep[:, 0]]
    expected[rows, d.expert_index[rows, 0], d.position[rows, 0]] = d.gate_weight[rows, 0]
    torch.testing.assert_close(combine, expected)
    assert torch.equal(counts, d.exp_counts)


def test_eval_uses_eval_capacity_factor():
    gate = _gate(4, 2, capacity_factor=0.5, eval_capacity_factor=2.0, min_capacity=1)
    assert gate.capacity(40) == ds_capacity(40, 4, 0.5, 2, 1) == 10
    gate.eval()
    assert gate.capacity(40) == ds_capacity(40, 4, 2.0, 2, 1) == 40


def test_dropless_keeps_every_token():
    for k in (1, 2):
        gate = _gate(6, k, capacity_factor=0.01, min_capacity=0, drop_tokens=False)
        d = gate(_tokens(50))
        assert d.capacity is None and d.keep.all()
        assert int(d.exp_counts.sum()) == 50 * k
        if k == 2:
            torch.testing.assert_close(d.gate_weight.sum(1), torch.ones(50))


def test_jitter_only_in_training():
    gate = _gate(4, 1, noisy_gate_policy="Jitter")
    clean = _gate(4, 1)
    x = _tokens(20)
    base = clean.compute_logits(x)
    gate.eval()
    assert torch.equal(gate.compute_logits(x), base)
    gate.train()
    torch.manual_seed(0)
    jittered = gate.compute_logits(x)
    assert not torch.equal(jittered, base)
    torch.manual_seed(0)
    factor = torch.empty(20, H).uniform_(1 - 1e-2, 1 + 1e-2)
    torch.testing.assert_close(jittered, (x * factor) @ gate.wg.weight.t())


@pytest.mark.parametrize("k,policy", [(1, "RSample"), (2, None)], ids=["rsample-top1", "sampled-second-top2"])
def test_gumbel_choice_only_in_training(k, policy):
    gate = _gate(8, k, noisy_gate_policy=policy, drop_tokens=False, top2_2nd_expert_sampling=(k == 2))
    x = _tokens(200) * 0.01  # near-uniform logits: noise changes many choices
    plain = naive_gating(gate.compute_logits(x), k, None)
    gate.eval()
    assert gate(x).expert_index.tolist() == plain["choices"]
    gate.train()
    torch.manual_seed(3)
    d = gate(x)
    torch.manual_seed(3)
    noise = -torch.log(-torch.log(torch.rand(200, 8).clamp(min=torch.finfo(torch.float32).tiny, max=1 - 2 ** -24)))
    noisy = naive_gating(gate.compute_logits(x), k, None, first_noise=noise if k == 1 else None,
                         second_noise=noise if k == 2 else None)
    assert d.expert_index.tolist() == noisy["choices"] != plain["choices"]
    if k == 1:  # the noise chooses; the clean probabilities weigh
        probs = torch.softmax(gate.compute_logits(x), dim=1)
        torch.testing.assert_close(d.gate_weight, probs.gather(1, d.expert_index))
    else:
        assert [row[0] for row in d.expert_index.tolist()] == [row[0] for row in plain["choices"]]


def test_gate_is_fp32_under_autocast():
    gate = _gate(4, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = gate.compute_logits(_tokens(9).bfloat16())
    assert logits.dtype == torch.float32 and gate.wg.weight.dtype == torch.float32


def test_more_experts_than_the_kernel_holds_run_the_reference():
    gate = _gate(130, 2, capacity_factor=1.0, min_capacity=1, top2_2nd_expert_sampling=False)
    x = _tokens(40)
    d = gate(x)
    ref = naive_gating(gate.compute_logits(x), 2, d.capacity)
    assert d.expert_index.tolist() == ref["choices"] and d.keep.tolist() == ref["keep"]
    assert d.exp_counts.tolist() == ref["counts"]
