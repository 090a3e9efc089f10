"""On a GPU: parking an arm moves its training state to ordinary host memory (not torch's
pinned-host cache, which rounds blocks up to powers of two and never shrinks) and back, and the
arm trains on as before."""

from __future__ import annotations

import pytest
import torch

from dslab.bench.arms import move_training_state

pytestmark = pytest.mark.gpu


def test_parked_state_is_pageable_and_comes_back():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(300, 700), torch.nn.GELU(), torch.nn.Linear(700, 5)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randn(64, 300, device=device)

    def step():
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    step()
    before = [p.detach().clone() for p in model.parameters()]
    move_training_state(model, optimizer, torch.device("cpu"))
    parked = list(model.parameters()) + [v for s in optimizer.state.values() for v in s.values()
                                         if torch.is_tensor(v)]
    assert all(t.device.type == "cpu" and not t.is_pinned() for t in parked)
    assert all(torch.equal(p.detach(), b.cpu()) for p, b in zip(model.parameters(), before))
    move_training_state(model, optimizer, device)
    assert all(p.device == device for p in model.parameters())
    losses = [step() for _ in range(3)]
    assert losses[-1] < losses[0]
