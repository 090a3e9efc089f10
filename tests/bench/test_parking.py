"""Parking an arm: its training state goes into one flat host allocation and comes back whole;
the arm then trains exactly as a twin that was never parked."""

from __future__ import annotations

import copy

import torch

from dslab.bench.parking import park_training_state, unpark_training_state


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(37, 19)
        self.mid = torch.nn.Linear(19, 23)
        self.norm = torch.nn.BatchNorm1d(23)  # has buffers
        self.back = torch.nn.Linear(23, 19)
        self.head = torch.nn.Linear(19, 37, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2's head

    def forward(self, ids):
        return self.head(self.back(self.norm(torch.relu(self.mid(self.embed(ids))))))


def _step(model, opt, ids):
    loss = torch.nn.functional.cross_entropy(model(ids), ids)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # keep gradients so that they are parked too
    return float(loss)


def _state_tensors(model, opt):
    out = list(model.parameters()) + [p.grad for p in model.parameters()] + list(model.buffers())
    out += [v for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"]
    return out


def test_park_packs_one_allocation_and_trains_on_like_an_unparked_twin():
    torch.manual_seed(0)
    model = Tied()
    twin = copy.deepcopy(model)
    twin.head.weight = twin.embed.weight
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_twin = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    ids = torch.randint(0, 37, (29,), generator=torch.Generator().manual_seed(1))
    assert _step(model, opt, ids) == _step(twin, opt_twin, ids)

    before = [t.detach().clone() for t in _state_tensors(model, opt)]
    parked = park_training_state(model, opt)
    tensors = _state_tensors(model, opt)
    flat_ptr = parked.flat.untyped_storage().data_ptr()
    assert {t.untyped_storage().data_ptr() for t in tensors} == {flat_ptr}
    assert all(t.data_ptr() % 64 == 0 for t in tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    # the tied weight is one parameter, parked once, and stays tied
    assert model.head.weight is model.embed.weight
    expected = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in
                   {id(t): t for t in tensors}.values())
    assert parked.nbytes == expected
    # torch's non-fused Adam keeps its step counters on the host, outside the parking
    steps = [s["step"] for s in opt.state.values()]
    assert steps and not any(parked.holds(s) for s in steps)

    unpark_training_state(model, opt, parked, torch.device("cpu"))
    assert parked.flat is None
    tensors = _state_tensors(model, opt)
    assert not any(t.untyped_storage().data_ptr() == flat_ptr for t in tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    for _ in range(4):
        assert _step(model, opt, ids) == _step(twin, opt_twin, ids)


def test_parking_twice_in_a_row_and_an_empty_model():
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        parked = park_training_state(model, opt)
        assert parked.nbytes == 64 * 2  # 60 bytes of weight and 12 of bias, each padded to 64
        unpark_training_state(model, opt, parked, torch.device("cpu"))
    empty = park_training_state(torch.nn.ReLU(), None)
    assert empty.nbytes == 0
    unpark_training_state(torch.nn.ReLU(), None, empty, torch.device("cpu"))
