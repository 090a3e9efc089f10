"""The engine's optimizer step on the host: no walk of the module tree per step, no value read
back from the device on the default path, and the same numbers as a hand-written loop, also
after the module or the optimizer's param groups change."""

import copy

import pytest
import torch
import torch.nn as nn

import dslab

from helpers import TinyNet, base_config, make_data

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}


def _step(engine, x, y):
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return loss


def _hand_step(model, opt, x, y, clip, dtype=torch.bfloat16):
    """Forward (under autocast to ``dtype`` unless None), backward, clipping, step; returns the
    gradient norm before clipping."""
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        loss = model(x, y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def test_bf16_clipped_adamw_steps_equal_a_hand_written_loop():
    """The engine's fused AdamW divides the gradients by the clipping scale inside its kernel
    (``optimizer.grad_scale``); the hand-written loop multiplies them by the clipping coefficient
    first. The two differ by the rounding of a division against a multiplication, nothing more."""
    torch.manual_seed(0)
    model = TinyNet(dropout=0.0)
    hand = copy.deepcopy(model)
    engine, _, _, _ = dslab.initialize(model=model, config=base_config(
        gradient_clipping=0.05, bf16={"enabled": True}, optimizer=ADAMW))
    assert engine.optimizer.defaults.get("fused")
    hand_opt = torch.optim.AdamW(hand.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    x, y = make_data(64)
    for i in range(0, 64, 8):
        _step(engine, x[i:i + 8], y[i:i + 8])
        norm = _hand_step(hand, hand_opt, x[i:i + 8], y[i:i + 8], 0.05)
        assert norm > 0.05  # the clipping acts in every step
        for p, q in zip(model.parameters(), hand.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
            assert p.grad is None and q.grad is None
    assert getattr(engine.optimizer, "grad_scale", None) is None


def test_clipping_rides_in_the_fused_optimizer_step(monkeypatch):
    """With torch's fused AdamW the engine multiplies no gradient itself: the step sees
    ``grad_scale = max(1, (norm + 1e-6) / max_norm)`` and the attribute is gone afterwards. A
    foreach (not fused) AdamW is clipped first, as before."""
    from dslab.engine import parameters

    seen = []
    original_step = torch.optim.AdamW.step

    def spy_step(self, *args, **kwargs):
        seen.append(getattr(self, "grad_scale", None))
        return original_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy_step)
    torch.manual_seed(0)
    engine, _, _, _ = dslab.initialize(model=TinyNet(dropout=0.0), config=base_config(
        gradient_clipping=0.05, optimizer=ADAMW))
    x, y = make_data(8)
    multiplies = []
    monkeypatch.setattr(torch, "_foreach_mul_", lambda *a, **k: multiplies.append(a))
    loss = engine(x, y)
    engine.backward(loss)
    grads = [p.grad.detach().clone() for p in engine.module.parameters()]
    engine.step()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert multiplies == [] and len(seen) == 1
    torch.testing.assert_close(seen[0], torch.clamp((norm + 1e-6) / 0.05, min=1.0))
    assert getattr(engine.optimizer, "grad_scale", None) is None

    fused = torch.optim.AdamW([nn.Parameter(torch.ones(3))], fused=True)
    assert parameters.steps_with_grad_scale(fused)
    fused.grad_scale = torch.ones(())
    assert not parameters.steps_with_grad_scale(fused)  # someone else's scale is left alone
    assert not parameters.steps_with_grad_scale(torch.optim.AdamW([nn.Parameter(torch.ones(3))], foreach=True))


class _WalkCounter:
    """Counts nn.Module's tree walks (parameters, named_parameters, buffers, modules, ...)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        for name in ("_named_members", "named_modules"):
            original = getattr(nn.Module, name)

            def counted(module, *args, _original=original, **kwargs):
                self.calls += 1
                return _original(module, *args, **kwargs)

            monkeypatch.setattr(nn.Module, name, counted)


@pytest.mark.parametrize("extra", [{}, {"wall_clock_breakdown": True}, {"fp16": {"enabled": True}},
                                   {"gradient_clipping": 0.0}],
                         ids=["bf16", "bf16_wall_clock", "fp16", "no_clipping"])
def test_steady_state_step_walks_no_module_tree(monkeypatch, extra):
    config = base_config(gradient_clipping=1.0, bf16={"enabled": True}, optimizer=ADAMW)
    config.update(extra)
    if "fp16" in extra:
        config.pop("bf16")
    engine, _, _, _ = dslab.initialize(model=TinyNet(), config=config)
    x, y = make_data(8)
    _step(engine, x, y)
    walks = _WalkCounter(monkeypatch)
    for _ in range(5):
        _step(engine, x, y)
    assert walks.calls == 0
    assert engine.global_steps == 6


class _ReadCounter:
    """Counts the Tensor methods that read a value back to the host (a device synchronisation on
    CUDA) called from Python."""

    METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self, monkeypatch):
        self.calls = []
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, _name=name, **kwargs):
                self.calls.append(_name)
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("extra, reads_per_step", [
    ({}, 0),
    ({"wall_clock_breakdown": True}, 0),
    ({"gradient_clipping": 0.0}, 0),
    ({"fp16": {"enabled": True}}, 1),  # the overflow verdict decides on the host whether to step
    ({"csv_monitor": {"enabled": True}}, 1),  # the mean loss written to the monitor
], ids=["bf16", "bf16_wall_clock", "no_clipping", "fp16", "monitor"])
def test_host_reads_per_step(monkeypatch, tmp_path, extra, reads_per_step):
    config = base_config(gradient_clipping=1.0, bf16={"enabled": True}, optimizer=ADAMW)
    config.update(extra)
    if "fp16" in extra:
        config.pop("bf16")
    if "csv_monitor" in extra:
        config["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path)}
    engine, _, _, _ = dslab.initialize(model=TinyNet(dropout=0.0), config=config)
    x, y = make_data(8)
    _step(engine, x, y)
    reads = _ReadCounter(monkeypatch)
    for _ in range(4):
        _step(engine, x, y)
    assert len(reads.calls) == 4 * reads_per_step, reads.calls
    engine.destroy()


def test_re_registered_parameter_and_added_param_group_are_stepped_as_by_hand():
    """A parameter replaced after initialize() and given to the optimizer in a new param group:
    clipping counts its gradient, the optimizer steps it, the step clears its gradient."""
    torch.manual_seed(1)
    model = TinyNet(dropout=0.0)
    hand = copy.deepcopy(model)
    sgd = {"type": "SGD", "params": {"lr": 0.5}}
    engine, _, _, _ = dslab.initialize(model=model, config=base_config(gradient_clipping=0.05, optimizer=sgd))
    hand_opt = torch.optim.SGD(hand.parameters(), lr=0.5, fused=True)
    x, y = make_data(16)
    _step(engine, x[:8], y[:8])
    _hand_step(hand, hand_opt, x[:8], y[:8], 0.05, dtype=None)

    replacement = torch.randn_like(model.fc2.weight)
    old_weight = model.fc2.weight
    model.fc2.weight = nn.Parameter(replacement.clone())
    hand.fc2.weight = nn.Parameter(replacement.clone())
    engine.optimizer.add_param_group({"params": [model.fc2.weight], "lr": 0.25})
    hand_opt.add_param_group({"params": [hand.fc2.weight], "lr": 0.25})

    _step(engine, x[8:], y[8:])
    assert _hand_step(hand, hand_opt, x[8:], y[8:], 0.05, dtype=None) > 0.05

    assert not torch.equal(model.fc2.weight, replacement)
    for p, q in zip(model.parameters(), hand.parameters()):
        assert torch.equal(p, q)
        assert p.grad is None
    assert old_weight.grad is None


def test_load_state_dict_keeps_the_list_and_assign_renews_it():
    torch.manual_seed(2)
    model = TinyNet(dropout=0.0)
    engine, _, _, _ = dslab.initialize(model=model, config=base_config(gradient_clipping=1.0, optimizer=ADAMW))
    x, y = make_data(8)
    _step(engine, x, y)
    kept = engine._parameters_of_module()
    rebuilds = engine._param_cache.rebuilds
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    _step(engine, x, y)
    assert engine._parameters_of_module() is kept and engine._param_cache.rebuilds == rebuilds

    model.load_state_dict(state, assign=True)
    new = list(model.parameters())
    assert not any(p is q for p, q in zip(new, kept))
    engine(x, y).backward()  # gradients on the new Parameters
    engine.step()
    assert engine._parameters_of_module() == new
    assert all(p.grad is None for p in new)


def test_engine_zero_grad_clears_every_module_gradient():
    model = TinyNet(dropout=0.0)
    engine, _, _, _ = dslab.initialize(model=model, config=base_config(gradient_accumulation_steps=2))
    x, y = make_data(8)
    engine.backward(engine(x, y))
    engine.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    engine.backward(engine(x, y))
    model.fc1.weight = nn.Parameter(model.fc1.weight.detach().clone())
    model.fc1.weight.grad = torch.ones_like(model.fc1.weight)
    assert all(p.grad is not None for p in model.parameters())
    engine.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    engine.backward(engine(x, y))
    engine.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


class OwnZeroGrad(TinyNet):
    def __init__(self):
        super().__init__(dropout=0.0)
        self.zero_grad_calls = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero_grad_calls += 1
        super().zero_grad(set_to_none=set_to_none)


def test_a_module_zero_grad_of_its_own_is_called_each_step():
    model = OwnZeroGrad()
    engine, _, _, _ = dslab.initialize(model=model, config=base_config())
    x, y = make_data(8)
    for _ in range(3):
        _step(engine, x, y)
    assert model.zero_grad_calls == 3


def test_replacing_engine_module_renews_the_list():
    engine, _, _, _ = dslab.initialize(model=TinyNet(), config=base_config())
    first = engine._parameters_of_module()
    other = TinyNet()
    engine.module = other
    assert engine._parameters_of_module() == list(other.parameters())
    assert engine._parameters_of_module() is not first


@pytest.mark.parametrize("accumulation", [1, 3])
def test_backward_gradients_are_the_loss_gradients_over_the_accumulation(accumulation):
    torch.manual_seed(3)
    model = TinyNet(dropout=0.0)
    hand = copy.deepcopy(model)
    engine, _, _, _ = dslab.initialize(
        model=model, config=base_config(gradient_accumulation_steps=accumulation))
    x, y = make_data(8)
    engine.backward(engine(x, y))
    (hand(x, y) / accumulation).backward()
    for p, q in zip(model.parameters(), hand.parameters()):
        assert torch.equal(p.grad, q.grad)
