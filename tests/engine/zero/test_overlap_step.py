"""``offload_optimizer.overlap_step``: the offloaded parameters' CPU optimizer step on a worker
thread while the next forward runs, in one process on the CPU (stage 3, ``offload_param: cpu``)."""

import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import dslab
from dslab.engine.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import base_config, make_data  # noqa: E402


class Deep(nn.Module):
    """Five Linear layers (one released unit each at threshold 0) and a loss head."""

    def __init__(self, dim=16, hidden=48, classes=4):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, hidden)] + [nn.Linear(hidden, hidden) for _ in range(3)])
        self.head = nn.Linear(hidden, classes)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return nn.functional.cross_entropy(self.head(x), y)


def _config(overlap: bool, accum: int = 2, **offload):
    return base_config(
        gradient_accumulation_steps=accum, gradient_clipping=0.5,
        scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                  "warmup_num_steps": 5}},
        zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 1000,
                           "offload_param": {"device": "cpu", **offload},
                           "offload_optimizer": {"device": "cpu", "overlap_step": overlap}})


def _train(overlap: bool, steps: int = 4, accum: int = 2, **offload):
    torch.manual_seed(0)
    model = Deep()
    engine, _, _, _ = dslab.initialize(model=model, config=_config(overlap, accum, **offload))
    x, y = make_data(8 * steps * accum, seed=3)
    losses, lrs = [], []
    for i in range(steps * accum):
        loss = engine(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        lrs.append(engine.get_lr()[0])
    engine.zero.settle()
    with dslab.zero.GatheredParameters(list(model.parameters())):
        weights = [p.detach().clone() for p in model.parameters()]
    state = engine.optimizer.state_dict()["state"]
    return losses, lrs, weights, state, engine


@pytest.mark.parametrize("offload", [{}, {"fetch_dtype": "bf16"}], ids=["fp32", "bf16-fetch"])
def test_a_background_step_trains_as_the_serial_step_does(offload):
    """Losses, learning rates (WarmupLR changing them every step), weights and Adam's moments
    after 4 steps of 2 micro-steps with clipping: bit for bit the serial step's."""
    serial = _train(False, **offload)
    overlapped = _train(True, **offload)
    assert overlapped[0] == serial[0]
    assert overlapped[1] == serial[1] and len(set(serial[1])) > 2
    for a, b in zip(overlapped[2], serial[2]):
        assert torch.equal(a, b)
    for key, moments in serial[3].items():
        for name, value in moments.items():
            assert torch.equal(overlapped[3][key][name], value), (key, name)
    stats = overlapped[4].zero.offload.stats()
    assert stats["overlap_step_s"] > 0  # the worker stepped


def _slow_adam(engine, seconds: float):
    """Make every optimizer step of ``engine`` take ``seconds`` more (on whichever thread)."""
    step = type(engine.optimizer).step
    threads = []

    def slow(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        time.sleep(seconds)
        return step(self, *args, **kwargs)

    return slow, threads


def test_the_step_returns_before_the_offloaded_units_are_stepped_and_a_fetch_waits(monkeypatch):
    """With a slow optimizer, engine.step() returns while the worker still steps the units (the
    engine clears gradients meanwhile, and the worker's chunks keep theirs); the next forward's
    first fetch waits for the first unit (counted as ``update_wait_s``), the chunks ran on the
    worker thread, and the weights are the serial step's."""
    x, y = make_data(16, seed=3)
    torch.manual_seed(0)
    serial_model = Deep()
    serial, _, _, _ = dslab.initialize(model=serial_model, config=_config(False, accum=1))
    serial.backward(serial(x[:8], y[:8]))
    serial.step()
    serial_loss = float(serial(x[8:], y[8:]))

    torch.manual_seed(0)
    model = Deep()
    engine, _, _, _ = dslab.initialize(model=model, config=_config(True, accum=1))
    slow, threads = _slow_adam(engine, 0.05)
    inside = threading.Event()

    def slow_and_seen(self, *args, **kwargs):
        inside.set()
        return slow(self, *args, **kwargs)

    monkeypatch.setattr(type(engine.optimizer), "step", slow_and_seen)
    clear = engine.zero.zero_grad

    def clear_while_the_worker_steps():  # the engine's clearing after the step, with the worker
        inside.wait(5.0)  # inside its first chunk's step: that chunk's grads must survive it
        clear()

    monkeypatch.setattr(engine.zero, "zero_grad", clear_while_the_worker_steps)
    engine.backward(engine(x[:8], y[:8]))
    start = time.perf_counter()
    engine.step()
    returned = time.perf_counter() - start
    chunks = len(engine.zero.offload.chunks)
    assert chunks == 4  # sub_group_size 1000: the first two layers make one chunk
    assert engine.zero.stepping()
    assert returned < 0.05 * chunks  # the chunks' steps were not waited for
    engine.zero_grad()  # between a step and the next forward, as a training loop may
    assert float(engine(x[8:], y[8:])) == serial_loss
    home = engine.zero.param_home.stats()
    assert home["update_wait_s"] > 0
    engine.zero.settle()
    assert not engine.zero.stepping()
    assert set(threads) == {"dslab-offload-step"} and len(threads) == chunks


def test_an_error_on_the_worker_is_raised_by_the_next_fetch_and_by_settle(monkeypatch):
    torch.manual_seed(0)
    model = Deep()
    engine, _, _, _ = dslab.initialize(model=model, config=_config(True, accum=1))
    step = type(engine.optimizer).step
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise FloatingPointError("injected")
        return step(self, *args, **kwargs)

    monkeypatch.setattr(type(engine.optimizer), "step", failing)
    x, y = make_data(16, seed=3)
    engine.backward(engine(x[:8], y[:8]))
    engine.step()
    with pytest.raises(RuntimeError, match=r"step .*overlap_step.* failed; unit \d was to be fetched") as caught:
        engine(x[8:], y[8:])  # the second chunk failed: a fetch refuses the incomplete step
    assert isinstance(caught.value.__cause__, FloatingPointError)
    with pytest.raises(RuntimeError, match="background") as joined:
        engine.zero.settle()
    assert isinstance(joined.value.__cause__, FloatingPointError)
    engine.zero.settle()  # raised once


def test_a_checkpoint_right_after_a_step_holds_that_steps_states(tmp_path, monkeypatch):
    """save_checkpoint right after a background step waits for it: the checkpoint loads into a
    serial engine and continues to the serial run's losses."""
    torch.manual_seed(0)
    model = Deep()
    engine, _, _, _ = dslab.initialize(model=model, config=_config(True, accum=1))
    slow, _ = _slow_adam(engine, 0.02)
    monkeypatch.setattr(type(engine.optimizer), "step", slow)
    x, y = make_data(48, seed=3)
    for i in range(3):
        engine.backward(engine(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8]))
        engine.step()
    assert engine.zero.stepping()
    engine.save_checkpoint(str(tmp_path), tag="t")
    assert not engine.zero.stepping()
    monkeypatch.undo()

    def rest(e):
        out = []
        for i in range(3, 6):
            loss = e(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8])
            e.backward(loss)
            e.step()
            out.append(float(loss))
        return out

    torch.manual_seed(1)
    resumed, _, _, _ = dslab.initialize(model=Deep(), config=_config(False, accum=1))
    resumed.load_checkpoint(str(tmp_path), tag="t")
    torch.manual_seed(0)
    reference, _, _, _ = dslab.initialize(model=Deep(), config=_config(False, accum=1))
    for i in range(3):
        reference.backward(reference(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8]))
        reference.step()
    assert rest(resumed) == rest(reference)


def test_overlap_step_is_refused_without_parameter_offload_to_the_cpu():
    with pytest.raises(ValueError, match="offload_optimizer.overlap_step' = true needs"):
        load_config(base_config(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu",
                                                                                       "overlap_step": True}}))
    with pytest.raises(ValueError, match="offload_param.device 'cpu' \\(got 'nvme' and 'nvme'\\)"):
        load_config(base_config(zero_optimization={
            "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp/p"},
            "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/o", "overlap_step": True}}))


class HeadFirst(nn.Module):
    """The head registered before the layers it follows: unit order is not forward order."""

    def __init__(self, dim=16, hidden=48, classes=4):
        super().__init__()
        self.head = nn.Linear(hidden, classes)
        self.layers = nn.ModuleList([nn.Linear(dim, hidden), nn.Linear(hidden, hidden)])

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return nn.functional.cross_entropy(self.head(x), y)


def test_the_worker_steps_the_units_in_the_order_the_forward_fetches_them(monkeypatch):
    torch.manual_seed(0)
    engine, _, _, _ = dslab.initialize(model=HeadFirst(), config=_config(True, accum=1))
    home = engine.zero.param_home
    updated = []
    finish = home.finish_update

    def record(unit):
        updated.append(unit.index)
        finish(unit)

    monkeypatch.setattr(home, "finish_update", record)
    x, y = make_data(16, seed=3)
    engine.backward(engine(x[:8], y[:8]))
    engine.step()
    engine.zero.settle()
    forward = [u.index for u in engine.zero.gatherer.order]
    assert forward[-1] == 0  # the head, unit 0, is gathered last
    assert updated == forward


class CountingAdamW(torch.optim.AdamW):
    """An optimizer outside torch.optim that keeps a counter on the instance."""

    def step(self, closure=None):
        self.calls = getattr(self, "calls", 0) + 1
        return super().step(closure)


def test_an_optimizer_outside_torch_optim_is_refused_by_name():
    torch.manual_seed(0)
    model = Deep()
    config = _config(True, accum=1)
    config.pop("optimizer")
    config.pop("scheduler")
    engine, _, _, _ = dslab.initialize(model=model, optimizer=lambda params: CountingAdamW(params, lr=1e-3),
                                       config=config)
    x, y = make_data(8, seed=3)
    engine.backward(engine(x, y))
    masters = [m.detach().clone() for m in engine.zero.masters]
    with pytest.raises(ValueError, match="overlap_step steps torch.optim optimizers only.*CountingAdamW"):
        engine.step()
    assert all(torch.equal(a, b) for a, b in zip(masters, engine.zero.masters))  # refused before any update
    assert not engine.zero.stepping()
