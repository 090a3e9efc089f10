"""The offloaded step's unscale-and-clip factor folded into torch's fused optimizers
(``offload.folded_factor``): the optimizer divides each gradient by ``grad_scale`` as it reads
it instead of a separate scaling pass over the host's gradients, with the same results."""

import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import dslab
from dslab.engine.zero import offload

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import base_config, make_data  # noqa: E402

STEP_SLEEP_S = 0.005  # added to every optimizer.step() call of the engine tests below

FUSED = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.99), fused=True),
}


def _params(seed):
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(n, generator=gen)) for n in (1031, 77)]


@pytest.mark.parametrize("name", sorted(FUSED))
def test_a_fused_optimizer_takes_the_factor_and_gives_the_scaled_steps_result(name):
    scaled, folded = _params(5), _params(5)
    opt_scaled, opt_folded = FUSED[name](scaled), FUSED[name](folded)
    gen = torch.Generator().manual_seed(11)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=gen) * 300.0 for p in scaled]
        factor = 1.0 / (1024.0 * (step + 1.7))  # a loss scale's inverse times a clip coefficient
        reference = [g.clone() for g in grads]
        torch._foreach_mul_(reference, factor)
        for p, g in zip(scaled, reference):
            p.grad = g
        opt_scaled.step()
        for p, g in zip(folded, grads):
            p.grad = g
        with offload.folded_factor(opt_folded, factor) as left:
            assert left is None and float(opt_folded.grad_scale) == pytest.approx(1.0 / factor)
            opt_folded.step()
        assert not hasattr(opt_folded, "grad_scale")
    for a, b, start in zip(scaled, folded, _params(5)):
        torch.testing.assert_close(b, a, rtol=2e-6, atol=1e-7)
        assert (a - start).abs().max() > 1e-3  # the steps moved the parameters


def test_other_optimizers_get_the_factor_back_and_none_stays_none():
    params = _params(1)
    for opt in (torch.optim.AdamW(params, lr=1e-2), torch.optim.AdamW(params, lr=1e-2, foreach=True),
                torch.optim.SGD(params, lr=1e-2, fused=True), torch.optim.RMSprop(params, lr=1e-2)):
        with offload.folded_factor(opt, 0.25) as left:
            assert left == 0.25 and not hasattr(opt, "grad_scale")
    fused = FUSED["adamw"](params)
    with offload.folded_factor(fused, None) as left:
        assert left is None and not hasattr(fused, "grad_scale")
    for unfoldable in (0.0, 1e-320):  # clipping an infinite norm: the scale pass multiplies by it
        with offload.folded_factor(fused, unfoldable) as left:
            assert left == unfoldable and not hasattr(fused, "grad_scale")
    with pytest.raises(RuntimeError, match="inside"):  # the attribute goes even when the step raises
        with offload.folded_factor(fused, 0.5):
            raise RuntimeError("inside")
    assert not hasattr(fused, "grad_scale")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 40), nn.Linear(40, 40), nn.Linear(40, 4)])

    def forward(self, x, y):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return nn.functional.cross_entropy(self.layers[-1](x), y)


def _train(monkeypatch, overlap: bool, fold: bool, steps: int = 4):
    if not fold:
        monkeypatch.setattr(offload, "steps_with_grad_scale", lambda optimizer: False)
    torch.manual_seed(0)
    config = base_config(gradient_accumulation_steps=2, gradient_clipping=0.05, zero_optimization={
        "stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 500,
        "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu", "overlap_step": overlap}})
    engine, _, _, _ = dslab.initialize(model=Net(), config=config)
    seen = []
    step = type(engine.optimizer).step

    def spy(self, *args, **kwargs):
        seen.append(getattr(self, "grad_scale", None) is not None)
        time.sleep(STEP_SLEEP_S)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(type(engine.optimizer), "step", spy)
    x, y = make_data(8 * steps * 2, seed=4)
    losses = []
    for i in range(steps * 2):
        loss = engine(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.zero.settle()
    monkeypatch.undo()
    return losses, seen, engine.zero.offload.stats()


@pytest.mark.parametrize("overlap", [False, True])
def test_the_offloaded_step_folds_the_clip_factor_with_the_unfolded_losses(monkeypatch, overlap):
    folded, seen, stats = _train(monkeypatch, overlap, fold=True)
    plain, seen_plain, _ = _train(monkeypatch, overlap, fold=False)
    assert seen and all(seen), seen  # with clipping on, every chunk's step reads a grad_scale
    assert seen_plain and not any(seen_plain)
    assert folded == pytest.approx(plain, rel=1e-5) and folded[-1] < folded[0]
    # the step's host time is reported: on the engine's thread, plus the worker's with overlap_step
    stepped = stats["cpu_step_s"] + stats["overlap_step_s"]
    assert stepped >= STEP_SLEEP_S * len(seen) and (stats["overlap_step_s"] > 0) == overlap


def test_the_benchmark_script_times_both_arms_to_the_same_losses(tmp_path):
    import json
    import os
    import subprocess

    out = tmp_path / "fold.json"
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "offload_step.py"
    proc = subprocess.run([sys.executable, str(script), "--layers", "2", "--dim", "48", "--trials", "1", "--steps", "3",
                           "--json", str(out)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["params"] == 2 * (48 * 48 + 48)
    assert all(len(summary["trials"][arm]) == 1 for arm in ("folded", "scale-pass"))
    assert summary["last_losses"]["folded"] == pytest.approx(summary["last_losses"]["scale-pass"], rel=1e-5)
    assert summary["speedup"] > 0 and "| 0M |" in proc.stdout and summary["torch_threads"] == 1
    staged = subprocess.run([sys.executable, str(script), "--layers", "2", "--dim", "48", "--trials", "1", "--steps",
                             "3", "--param-offload", "--json", str(out)], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert staged.returncode == 0, staged.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["stage"] == 3 and "with parameter offload" in staged.stdout
    assert summary["params"] == 2 * (48 * 48 + 48)
    assert summary["last_losses"]["folded"] == pytest.approx(summary["last_losses"]["scale-pass"], rel=1e-5)
    bad = subprocess.run([sys.executable, str(script), "--steps", "2"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--steps must be at least 3" in bad.stderr
