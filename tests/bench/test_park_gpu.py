"""On a GPU: parking an arm moves its training state into one flat, ordinary (pageable) host
allocation (not torch's pinned-host cache, which rounds blocks up to powers of two and never
shrinks) and back, and the arm trains on as before."""

from __future__ import annotations

import pytest
import torch

from dslab.bench.parking import park_training_state, unpark_training_state

pytestmark = pytest.mark.gpu


def test_parked_state_is_pageable_and_comes_back():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(300, 700), torch.nn.GELU(), torch.nn.Linear(700, 5)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(64, 300, device=device)

    def step():
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    first = step()
    before = [p.detach().clone() for p in model.parameters()]
    parked = park_training_state(model, optimizer)
    held = list(model.parameters()) + [v for s in optimizer.state.values() for v in s.values()]
    where = [(t.device.type, t.is_pinned(), parked.holds(t)) for t in held]
    assert all(w == ("cpu", False, True) for w in where), where
    assert all(torch.equal(p.detach(), b.cpu()) for p, b in zip(model.parameters(), before))
    unpark_training_state(model, optimizer, parked, device)
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert all(v.device.type == "cuda" for s in optimizer.state.values() for v in s.values())
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    losses = [first] + [step() for _ in range(5)]
    assert losses[-1] < losses[0], losses
