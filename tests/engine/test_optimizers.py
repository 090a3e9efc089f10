"""Lamb against a per-tensor reference written here; the optimizer config's mapping and errors."""

import copy

import pytest
import torch

from dslab.config_base import parse_section
from dslab.engine.lamb import Lamb
from dslab.engine.optimizers import OptimizerConfig, build_optimizer

SHAPES = [(7, 5), (13,), (3, 4, 2), (1,), (6, 6)]


def lamb_reference_step(params, grads, state, *, lr, betas, eps, weight_decay, bias_correction,
                        max_coeff, min_coeff, max_grad_norm):
    """One LAMB step, one tensor at a time, in float64. Returns the trust ratios before clamping.

    ``state`` maps index -> (step, m, v); None grads are skipped.
    """
    b1, b2 = betas
    live = [i for i, g in enumerate(grads) if g is not None]
    if max_grad_norm > 0:
        total = sum(float((grads[i].double() ** 2).sum()) for i in live) ** 0.5
        if total > max_grad_norm:
            grads = [None if g is None else g * (max_grad_norm / total) for g in grads]
    raw_ratios = {}
    for i in live:
        p, g = params[i], grads[i].double()
        k, m, v = state.get(i, (0, torch.zeros_like(p), torch.zeros_like(p)))
        k += 1
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = (m / (1 - b1 ** k), v / (1 - b2 ** k)) if bias_correction else (m, v)
        u = m_hat / (v_hat.sqrt() + eps) + weight_decay * p
        w_norm, u_norm = float(p.norm()), float(u.norm())
        if w_norm > 0 and u_norm > 0:
            raw_ratios[i] = w_norm / u_norm
            ratio = min(max(w_norm / u_norm, min_coeff), max_coeff)
        else:
            ratio = 1.0
        params[i] = p - lr * ratio * u
        state[i] = (k, m, v)
    return raw_ratios


def random_params(gen, dtype):
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    params[3] = torch.zeros(1, dtype=torch.float64)  # ||p|| = 0: ratio 1
    params[4] = params[4] * 1e4  # huge ||p|| vs ||u||: clamps at max_coeff
    params[0] = params[0] * 1e-6  # tiny ||p||: clamps at min_coeff
    return params, [torch.nn.Parameter(p.to(dtype)) for p in params]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-11), (torch.float32, 2e-5)])
@pytest.mark.parametrize("bias_correction,weight_decay,max_grad_norm,eps",
                         [(True, 0.0, 0.0, 1e-6), (True, 0.05, 0.0, 1e-6),
                          (False, 0.01, 1.5, 0.1)])
def test_lamb_matches_reference(dtype, tol, bias_correction, weight_decay, max_grad_norm, eps):
    # with max_grad_norm, eps is large so that the update is not invariant to the gradients'
    # scale, and every third step's gradients are small enough not to be clipped
    gen = torch.Generator().manual_seed(1234)
    ref_params, params = random_params(gen, dtype)
    hyper = dict(lr=0.02, betas=(0.8, 0.95), eps=eps, weight_decay=weight_decay,
                 bias_correction=bias_correction, max_coeff=3.0, min_coeff=0.05,
                 max_grad_norm=max_grad_norm)
    opt = Lamb(params, **hyper)
    state = {}
    clamped_high = clamped_low = False
    for step in range(6):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
        if step % 3 == 0:
            grads = [g * 0.03 for g in grads]
        grads[1] = torch.zeros_like(grads[1])  # a zero gradient
        if step % 2 == 1:
            grads[2] = None  # no gradient this step: skipped
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.to(dtype)
        raw = lamb_reference_step(ref_params, grads, state, **hyper)
        clamped_high |= raw.get(4, 0.0) > hyper["max_coeff"]
        clamped_low |= raw.get(0, 1.0) < hyper["min_coeff"]
        opt.step()
        for i, (p, ref) in enumerate(zip(params, ref_params)):
            scale = max(1.0, float(ref.abs().max()))
            torch.testing.assert_close(p.detach().double(), ref, rtol=tol, atol=tol * scale,
                                       msg=f"param {i} after step {step}")
    assert clamped_high and clamped_low
    assert opt.state[params[2]]["step"] == 3
    for i, p in enumerate(params):
        assert opt.state[p]["step"] == (3 if i == 2 else 6)
    # grads were clipped for the update only
    assert params[0].grad.dtype == dtype and torch.equal(params[0].grad.double(),
                                                         grads[0].to(dtype).double())


def test_lamb_zero_grad_without_weight_decay_leaves_param():
    p = torch.nn.Parameter(torch.randn(4, 3))
    before = p.detach().clone()
    opt = Lamb([p], lr=0.1)
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(p.detach(), before)


def test_lamb_state_dict_round_trip():
    gen = torch.Generator().manual_seed(7)
    params_a = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES[:3]]
    params_b = [torch.nn.Parameter(p.detach().clone()) for p in params_a]
    opt_a, opt_b = Lamb(params_a, lr=0.01), Lamb(params_b, lr=0.01)
    grads = [[torch.randn(p.shape, generator=gen) for p in params_a] for _ in range(4)]
    for g in grads[:2]:
        for p, gi in zip(params_a, g):
            p.grad = gi
        opt_a.step()
    with torch.no_grad():
        for pa, pb in zip(params_a, params_b):
            pb.copy_(pa)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for g in grads[2:]:
        for pa, pb, gi in zip(params_a, params_b, g):
            pa.grad, pb.grad = gi, gi.clone()
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(params_a, params_b):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("kwargs,key", [
    ({"lr": -1.0}, "lr"), ({"betas": (0.9, 1.0)}, "betas"), ({"eps": -1.0}, "eps"),
    ({"weight_decay": -0.1}, "weight_decay"), ({"max_grad_norm": -1.0}, "max_grad_norm"),
    ({"min_coeff": 2.0, "max_coeff": 1.0}, "min_coeff"),
])
def test_lamb_rejects_bad_arguments(kwargs, key):
    with pytest.raises(ValueError, match=key):
        Lamb([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def run_steps(optimizer, params, grads):
    for g in grads:
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        optimizer.step()
    return [p.detach().clone() for p in params]


def fresh(seed=3):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(5)]
    return params, grads


@pytest.mark.parametrize("fused_ok", [False, True])
@pytest.mark.parametrize("config,reference", [
    ({"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1, "betas": [0.85, 0.99]}},
     lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, betas=(0.85, 0.99))),
    ({"type": "adam", "params": {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False,
                                 "torch_adam": True}},
     lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1)),
    ({"type": "ADAMW", "params": {"lr": 0.02, "eps": 1e-6, "amsgrad": True}},
     lambda ps: torch.optim.AdamW(ps, lr=0.02, eps=1e-6, weight_decay=0.0, amsgrad=True)),
    ({"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                                "weight_decay": 0.01}},
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.5, "dampening": 0.3}},
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, dampening=0.3)),
])
def test_build_optimizer_matches_torch(config, reference, fused_ok):
    params, grads = fresh()
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = build_optimizer(config, params, fused_ok=fused_ok)
    ref = reference(ref_params)
    assert type(opt) is type(ref)
    group = opt.param_groups[0]
    assert group["fused"] is True if fused_ok else group["foreach"] is True
    got = run_steps(opt, params, grads)
    want = run_steps(ref, ref_params, grads)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_build_lamb_and_param_groups():
    params, grads = fresh()
    groups = [{"params": params[:2], "lr": 0.5}, {"params": params[2:]}]
    config = parse_section(OptimizerConfig, {"type": "LAMB", "params": {
        "lr": 0.01, "max_coeff": 5.0, "min_coeff": 0.1, "bias_correction": False}}, "optimizer")
    assert config.type == "Lamb"
    opt = build_optimizer(config, groups, fused_ok=True)
    assert isinstance(opt, Lamb)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.01]
    assert opt.param_groups[1]["max_coeff"] == 5.0 and opt.param_groups[1]["min_coeff"] == 0.1
    assert opt.param_groups[1]["bias_correction"] is False


def test_adam_defaults_follow_deepspeed():
    opt = build_optimizer({"type": "Adam"}, [torch.nn.Parameter(torch.zeros(2))], fused_ok=False)
    group = opt.param_groups[0]
    assert isinstance(opt, torch.optim.AdamW)
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        1e-3, (0.9, 0.999), 1e-8, 0.0)


def test_unknown_param_names_closest():
    with pytest.raises(ValueError, match=r"optimizer\.params\.weight_decy.*"
                                         r"did you mean 'optimizer\.params\.weight_decay'"):
        build_optimizer({"type": "AdamW", "params": {"weight_decy": 0.1}},
                        [torch.nn.Parameter(torch.zeros(2))], fused_ok=False)
    with pytest.raises(ValueError, match=r"optimizer\.params\.momentun.*"
                                         r"optimizer\.params\.momentum'"):
        parse_section(OptimizerConfig, {"type": "SGD", "params": {"momentun": 0.9}}, "optimizer")
    # a parameter of another type is unknown here
    with pytest.raises(ValueError, match=r"optimizer\.params\.max_coeff"):
        parse_section(OptimizerConfig, {"type": "Adam", "params": {"max_coeff": 1.0}},
                      "optimizer")


def test_unknown_type_names_closest():
    with pytest.raises(ValueError, match=r"optimizer\.type.*did you mean 'AdamW'"):
        parse_section(OptimizerConfig, {"type": "adamww"}, "optimizer")
    with pytest.raises(ValueError, match=r"optimizer\.type.*'OneBitAdam' is not supported"):
        parse_section(OptimizerConfig, {"type": "OneBitAdam"}, "optimizer")
    with pytest.raises(ValueError, match="optimizer.type"):
        parse_section(OptimizerConfig, {"type": "Frobnicate"}, "optimizer")


@pytest.mark.parametrize("config,key", [
    ({"type": "Adam", "params": {"betas": [0.9, 1.5]}}, "betas"),
    ({"type": "Adam", "params": {"lr": -0.1}}, "lr"),
    ({"type": "AdamW", "params": {"adam_w_mode": False}}, "adam_w_mode"),
    ({"type": "Lamb", "params": {"min_coeff": 3.0, "max_coeff": 1.0}}, "min_coeff"),
    ({"type": "SGD", "params": {"nesterov": True}}, "nesterov"),
])
def test_bad_values_name_the_key(config, key):
    with pytest.raises(ValueError, match=rf"optimizer\.params.*{key}"):
        build_optimizer(config, [torch.nn.Parameter(torch.zeros(2))], fused_ok=False)


def test_params_mutated_after_parse_are_checked_at_build():
    config = OptimizerConfig(type="SGD", params={"lr": 0.1})
    config.params["lrate"] = 0.2
    with pytest.raises(ValueError, match=r"optimizer\.params\.lrate.*optimizer\.params\.lr'"):
        build_optimizer(config, [torch.nn.Parameter(torch.zeros(2))], fused_ok=False)
