import copy

import pytest
import torch
import torch.nn as nn

import dslab
from dslab.engine.precision import FP16Config, LossScaler

from helpers import TinyNet, base_config, make_data


def batches(x, y, size):
    for i in range(0, len(x), size):
        yield x[i:i + size], y[i:i + size]


def test_client_loop_trains_and_counts():
    torch.manual_seed(0)
    model = TinyNet(dropout=0.0)
    engine, opt, loader, sched = dslab.initialize(model=model, config=base_config())
    assert loader is None and sched is None and opt is engine.optimizer
    x, y = make_data(512)
    losses = []
    for epoch in range(4):
        for xb, yb in batches(x, y, 8):
            loss = engine(xb, yb)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    first, last = sum(losses[:16]) / 16, sum(losses[-16:]) / 16
    assert last < 0.5 * first
    assert engine.global_steps == 256 and engine.global_samples == 256 * 8
    assert engine.was_step_applied()
    assert engine.get_lr() == [1e-2]


def test_initialize_returns_dataloader_and_uses_args():
    import argparse

    parser = dslab.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args([])
    assert args.deepspeed_config is None and args.deepspeed is False
    x, y = make_data(64)
    data = torch.utils.data.TensorDataset(x, y)
    engine, _, loader, _ = dslab.initialize(args=args, model=TinyNet(), training_data=data, config=base_config())
    xb, yb = next(iter(loader))
    assert xb.shape == (8, 16)
    with pytest.raises(ValueError, match="no config"):
        dslab.initialize(args=args, model=TinyNet())


def test_optimizer_given_and_in_config_is_an_error():
    model = TinyNet()
    with pytest.raises(ValueError, match="keep one"):
        dslab.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=base_config())


def test_client_optimizer_and_callable():
    model = TinyNet()
    cfg = base_config()
    del cfg["optimizer"]
    engine, opt, _, _ = dslab.initialize(model=model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5), config=cfg)
    assert isinstance(opt, torch.optim.SGD) and engine.get_lr() == [0.5]
    engine2, _, _, _ = dslab.initialize(model=TinyNet(), config=cfg)
    loss = engine2(*make_data(8))
    engine2.backward(loss)
    with pytest.raises(RuntimeError, match="needs an optimizer"):
        engine2.step()


@pytest.mark.parametrize("accum", [2, 4])
def test_accumulation_equals_one_large_batch(accum):
    torch.manual_seed(1)
    reference_model = TinyNet(dropout=0.0)
    model = copy.deepcopy(reference_model)
    x, y = make_data(8 * accum * 3)
    opt_cfg = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    big, _, _, _ = dslab.initialize(model=reference_model, config=base_config(
        train_micro_batch_size_per_gpu=8 * accum, optimizer=opt_cfg))
    small, _, _, _ = dslab.initialize(model=model, config=base_config(
        train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=accum, optimizer=opt_cfg))
    for xb, yb in batches(x, y, 8 * accum):
        loss = big(xb, yb)
        big.backward(loss)
        big.step()
    boundaries = []
    for xb, yb in batches(x, y, 8):
        boundaries.append(small.is_gradient_accumulation_boundary())
        loss = small(xb, yb)
        small.backward(loss)
        small.step()
    assert boundaries == ([False] * (accum - 1) + [True]) * 3
    assert small.global_steps == big.global_steps == 3
    assert small.global_samples == big.global_samples == 3 * 8 * accum
    for p, q in zip(big.module.parameters(), small.module.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_step_off_boundary_does_not_update():
    model = TinyNet(dropout=0.0)
    engine, _, _, _ = dslab.initialize(model=model, config=base_config(gradient_accumulation_steps=2))
    before = [p.detach().clone() for p in model.parameters()]
    loss = engine(*make_data(8))
    engine.backward(loss)
    engine.step()
    assert not engine.was_step_applied()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is not None for p in model.parameters())


def test_gradient_clipping_matches_manual():
    torch.manual_seed(2)
    model = TinyNet(dropout=0.0)
    manual = copy.deepcopy(model)
    opt_cfg = {"type": "SGD", "params": {"lr": 1.0}}
    engine, _, _, _ = dslab.initialize(model=model, config=base_config(gradient_clipping=0.05, optimizer=opt_cfg))
    x, y = make_data(8)
    loss = engine(x, y)
    engine.backward(loss)
    norm_before = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
    assert norm_before > 0.05
    engine.step()
    manual(x, y).backward()
    torch.nn.utils.clip_grad_norm_(manual.parameters(), 0.05)
    with torch.no_grad():
        for p in manual.parameters():
            p -= p.grad
    for p, q in zip(model.parameters(), manual.parameters()):
        torch.testing.assert_close(p, q)


def test_fp16_overflow_skips_step_and_lowers_scale():
    torch.manual_seed(3)
    model = TinyNet(dropout=0.0)
    cfg = base_config(fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    engine, _, _, _ = dslab.initialize(model=model, config=cfg)
    assert engine.cur_scale == 256.0
    x, y = make_data(8)
    handle = model.fc1.weight.register_hook(lambda g: g * float("inf"))
    before = [p.detach().clone() for p in model.parameters()]
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    handle.remove()
    assert not engine.was_step_applied()
    assert engine.skipped_steps == 1 and engine.global_steps == 1
    assert engine.cur_scale == 128.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    assert engine.was_step_applied() and engine.skipped_steps == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_fp16_step_equals_unscaled_fp32_gradients():
    """The loss scale cancels: unscaled grads equal the plain backward's (up to fp16 autocast)."""
    torch.manual_seed(4)
    model = TinyNet(dropout=0.0)
    ref = copy.deepcopy(model)
    cfg = base_config(fp16={"enabled": True, "initial_scale_power": 10}, optimizer={"type": "SGD", "params": {"lr": 1.0}})
    engine, _, _, _ = dslab.initialize(model=model, config=cfg)
    x, y = make_data(8)
    engine.backward(engine(x, y))
    engine.step()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = ref(x, y)
    loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= p.grad
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)


def test_loss_scaler_dynamics():
    s = LossScaler(FP16Config(enabled=True, initial_scale_power=4, loss_scale_window=3, hysteresis=2,
                              min_loss_scale=2.0))
    assert s.loss_scale == 16
    s.update_scale(True)   # hysteresis absorbs the first overflow
    assert s.loss_scale == 16
    s.update_scale(True)
    assert s.loss_scale == 8
    for _ in range(3):
        s.update_scale(False)
    assert s.loss_scale == 16  # grown after a full window without overflow
    for _ in range(10):
        s.update_scale(True)
    assert s.loss_scale == 2.0  # floor
    static = LossScaler(FP16Config(enabled=True, loss_scale=128.0))
    static.update_scale(True)
    assert static.loss_scale == 128.0
    consecutive = LossScaler(FP16Config(enabled=True, initial_scale_power=4, loss_scale_window=100,
                                        hysteresis=2, consecutive_hysteresis=True))
    consecutive.update_scale(True)   # uses one unit of hysteresis
    consecutive.update_scale(False)  # refilled at once
    consecutive.update_scale(True)
    assert consecutive.loss_scale == 16


def test_bf16_autocast_forward():
    model = TinyNet(dropout=0.0)

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    engine, _, _, _ = dslab.initialize(model=Probe(), config=base_config(bf16={"enabled": True}))
    out = engine(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())
    del model


def test_scheduler_from_config_is_stepped_per_optimizer_step():
    cfg = base_config(gradient_accumulation_steps=2, scheduler={
        "type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                       "warmup_num_steps": 10, "warmup_type": "linear"}})
    engine, _, _, sched = dslab.initialize(model=TinyNet(), config=cfg)
    x, y = make_data(8)
    for _ in range(6):
        engine.backward(engine(x, y))
        engine.step()
    assert engine.global_steps == 3
    assert engine.get_lr()[0] == pytest.approx(0.01 * 2 / 10)


def test_csv_monitor_and_wall_clock_breakdown(tmp_path):
    cfg = base_config(gradient_accumulation_steps=2, wall_clock_breakdown=True,
                      csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "job"})
    engine, _, _, _ = dslab.initialize(model=TinyNet(dropout=0.0), config=cfg)
    x, y = make_data(8)
    losses = []
    for _ in range(6):
        loss = engine(x, y)
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    engine.destroy()
    job = tmp_path / "job"
    names = sorted(p.name for p in job.iterdir())
    assert "Train_Samples_train_loss.csv" in names and "Train_Samples_lr.csv" in names
    assert {"Train_Samples_elapsed_time_ms_forward.csv", "Train_Samples_elapsed_time_ms_backward.csv",
            "Train_Samples_elapsed_time_ms_step.csv"} <= set(names)
    rows = (job / "Train_Samples_train_loss.csv").read_text().strip().splitlines()
    assert rows[0].startswith("step,")
    steps = [int(r.split(",")[0]) for r in rows[1:]]
    values = [float(r.split(",")[1]) for r in rows[1:]]
    assert steps == [16, 32, 48]  # global_samples after each optimizer step (batch 8 x 2 micro-steps)
    expected = [(losses[0] + losses[1]) / 2, (losses[2] + losses[3]) / 2, (losses[4] + losses[5]) / 2]
    assert values == pytest.approx(expected, rel=1e-6)
    fwd = [float(r.split(",")[1]) for r in (job / "Train_Samples_elapsed_time_ms_forward.csv").read_text().splitlines()[1:]]
    assert len(fwd) == 3 and all(t > 0 for t in fwd)


def test_compile_section_runs_the_model_compiled():
    torch.manual_seed(5)
    model = TinyNet(dropout=0.0)
    reference = copy.deepcopy(model)
    cfg = base_config(compile={"enabled": True, "backend": "aot_eager", "kwargs": {"fullgraph": True}},
                      optimizer={"type": "SGD", "params": {"lr": 0.1}})
    engine, _, _, _ = dslab.initialize(model=model, config=cfg)
    x, y = make_data(8)
    loss = engine(x, y)
    torch.testing.assert_close(loss, reference(x, y))
    engine.backward(loss)
    engine.step()
    assert engine.was_step_applied()
    with pytest.raises(ValueError, match="compile.kwargs"):
        dslab.initialize(model=TinyNet(), config=base_config(compile={"enabled": True, "kwargs": {"modee": 1}}))
