"""dslab.moe.MoE (single process): outputs against a token-by-token computation, the kernel path
(Triton under the interpreter) against DeepSpeed's einsum formulation with gradients, the
argument checks, the expert parameters' marks and the optimizer groups."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import dslab.moe
from dslab.kernels import kernel_backend
from dslab.moe import MLPExpert, MoE, is_moe_param, split_params_into_different_moe_groups_for_optimizer
from dslab.moe.sharded_moe import reference_forward
from dslab.moe.utils import has_moe_layers

sys.path.insert(0, str(Path(__file__).parent))
from moe_layer_naive import dense_capacity, naive_moe_forward  # noqa: E402

H, FFN = 9, 14


def _mlp(activation=nn.GELU, bias=True):
    return nn.Sequential(nn.Linear(H, FFN, bias=bias), activation(), nn.Linear(FFN, H, bias=bias))


def _moe(expert=None, seed=0, **kwargs):
    """A layer whose experts differ (DeepSpeed's copies start identical; tests want them apart)."""
    torch.manual_seed(seed)
    moe = MoE(H, expert if expert is not None else _mlp(), **kwargs)
    with torch.no_grad():
        for p in moe.deepspeed_moe.experts.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return moe


def _x(shape, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


QUIET = dict(use_rts=False, top2_2nd_expert_sampling=False)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("drop_tokens", [True, False], ids=["capacity", "dropless"])
@pytest.mark.parametrize("residual", [False, True], ids=["moe", "residual"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_output_equals_token_by_token(k, drop_tokens, residual, training):
    moe = _moe(num_experts=5, k=k, capacity_factor=0.7, eval_capacity_factor=0.9, min_capacity=2,
               drop_tokens=drop_tokens, use_residual=residual, **QUIET)
    moe.train(training)
    x = _x((3, 11, H))
    out, l_aux, counts = moe(x)
    assert out.shape == x.shape and l_aux.shape == () and counts.shape == (5,)
    expected, ref = naive_moe_forward(moe, x.reshape(-1, H), dense_capacity(moe, 33))
    torch.testing.assert_close(out.reshape(-1, H).double(), expected, rtol=1e-5, atol=1e-5)
    assert counts.tolist() == ref["counts"] and counts.dtype == torch.int64
    assert l_aux.item() == pytest.approx(ref["l_aux"], rel=1e-5)
    if drop_tokens:
        assert not all(all(row) for row in ref["keep"])


def test_used_token_masks_tokens():
    moe = _moe(num_experts=4, k=1, capacity_factor=0.8, min_capacity=1, **QUIET)
    x = _x((21, H))
    used = (torch.arange(21) % 3 != 0).float()
    out, _, counts = moe(x, used)
    expected, ref = naive_moe_forward(moe, x, dense_capacity(moe, 21), used.tolist())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert counts.tolist() == ref["counts"] and int(counts.sum()) == 14
    assert (out[::3] == 0).all()


class _TupleExpert(nn.Module):
    """Not an MLP the layer can stack: runs in the per-expert loop; returns (output, bias)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, H)
        self.scale = nn.Parameter(torch.ones(H))

    def forward(self, x):
        return torch.tanh(self.proj(x)) * self.scale, None


@pytest.mark.parametrize("expert", [
    _TupleExpert, lambda: _mlp(nn.ReLU), lambda: _mlp(nn.SiLU, bias=False), lambda: _mlp(lambda: nn.GELU("tanh")),
    lambda: MLPExpert(H, FFN, "silu")], ids=["loop", "relu", "silu-nobias", "gelu-tanh", "MLPExpert"])
@pytest.mark.parametrize("drop_tokens", [True, False], ids=["capacity", "dropless"])
def test_expert_kinds(expert, drop_tokens):
    moe = _moe(expert(), num_experts=3, k=2, capacity_factor=0.8, min_capacity=1, drop_tokens=drop_tokens, **QUIET)
    assert moe.deepspeed_moe.experts.stacked == (expert is not _TupleExpert)
    x = _x((17, H))
    out, _, _ = moe(x)
    expected, _ = naive_moe_forward(moe, x, dense_capacity(moe, 17))
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def _grads(module, x, out, l_aux, dy):
    loss = (out * dy).sum() + 0.3 * l_aux
    params = [p for p in module.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [x, *params])
    return [out.detach(), l_aux.detach(), *grads]


CASES = [
    dict(k=1, drop_tokens=True, noisy_gate_policy="Jitter", use_rts=True),
    dict(k=1, drop_tokens=True, noisy_gate_policy="RSample", use_rts=False),
    dict(k=1, drop_tokens=False),
    dict(k=2, drop_tokens=True, noisy_gate_policy="Jitter"),
    dict(k=2, drop_tokens=False, use_residual=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_triton_kernel_path_equals_deepspeed_formulation(case):
    """Outputs, l_aux, exp_counts and the gradients of input, gate and experts, in training
    (noise drawn identically by both paths)."""
    moe = _moe(num_experts=5, capacity_factor=0.6, min_capacity=1, **case)
    x = _x((2, 19, H)).requires_grad_()
    dy = _x((2, 19, H), seed=2)
    torch.manual_seed(11)
    with kernel_backend("triton"):
        out, l_aux, counts = moe(x)
        got = _grads(moe, x, out, l_aux, dy)
    torch.manual_seed(11)
    with kernel_backend("torch"):
        ref_out, ref_l_aux, ref_counts = reference_forward(moe.deepspeed_moe, x)
        if moe.use_residual:
            coef = torch.softmax(moe.coefficient(x), dim=-1)
            ref_out = ref_out * coef[..., :1] + moe.mlp(x) * coef[..., 1:]
        expected = _grads(moe, x, ref_out, ref_l_aux, dy)
    assert torch.equal(counts, ref_counts)
    names = ["output", "l_aux", "d_input"] + [n for n, p in moe.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_bf16_autocast():
    moe = _moe(num_experts=4, k=2, **QUIET)
    x = _x((13, H))
    ref, _, _ = moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, l_aux, _ = moe(x)
    assert out.dtype == torch.bfloat16 and l_aux.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


def test_expert_parameters_are_marked_and_grouped():
    moe = _moe(num_experts=4, k=1, use_residual=True)
    experts = moe.deepspeed_moe.experts
    assert experts.w1.shape == (4, FFN, H) and experts.b1.shape == (4, FFN)
    assert experts.w2.shape == (4, H, FFN) and experts.b2.shape == (4, H)
    expert_ids = {id(p) for p in experts.parameters()}
    for name, p in moe.named_parameters():
        if id(p) in expert_ids:
            assert is_moe_param(p) and p.group_name == "ep_size_1", name
        else:
            assert not is_moe_param(p), name
    assert {n for n, p in moe.named_parameters() if not is_moe_param(p)} == {
        "deepspeed_moe.gate.wg.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias",
        "coefficient.weight", "coefficient.bias"}
    model = nn.Sequential(nn.Linear(H, H), moe)
    assert has_moe_layers(model) == (True, 4)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "lr": 0.1, "name": "all"}, max_group_size=4 * FFN * H + 4 * FFN)
    assert groups[0]["name"] == "all" and not any(is_moe_param(p) for p in groups[0]["params"])
    assert all(g["moe"] and g["name"] == "ep_size_1" and g["lr"] == 0.1 for g in groups[1:])
    assert [len(g["params"]) for g in groups[1:]] == [2, 2]  # (w1, b1) and (w2, b2): split by size
    assert {id(p) for g in groups[1:] for p in g["params"]} == expert_ids
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_experts_start_as_copies_of_the_expert():
    torch.manual_seed(0)
    expert = _mlp()
    moe = MoE(H, expert, num_experts=3)
    for j in range(3):
        assert torch.equal(moe.deepspeed_moe.experts.w1[j], expert[0].weight)
        assert torch.equal(moe.deepspeed_moe.experts.b2[j], expert[2].bias)


def test_deepspeed_script_runs_with_the_package_name_swapped():
    from dslab.moe.layer import MoE as LayerMoE

    assert LayerMoE is dslab.moe.MoE
    fc3 = nn.Linear(84, 84)
    layer = LayerMoE(hidden_size=84, expert=fc3, num_experts=2, ep_size=1, use_residual=False, k=1,
                     min_capacity=0, noisy_gate_policy=None)
    out, l_aux, exp_counts = layer(torch.randn(4, 84))
    (out.sum() + 0.01 * l_aux).backward()
    assert out.shape == (4, 84) and exp_counts.tolist() in ([4, 0], [0, 4], [2, 2], [1, 3], [3, 1])
    assert layer.deepspeed_moe.experts.deepspeed_experts[0].weight.grad is not None


@pytest.mark.parametrize("kwargs,name", [
    (dict(k=3), "k"), (dict(num_experts=6, ep_size=4), "ep_size"), (dict(num_experts=4, ep_size=2), "ep_size"),
    (dict(noisy_gate_policy="Gaussian"), "noisy_gate_policy"), (dict(use_tutel=True), "use_tutel"),
    (dict(enable_expert_tensor_parallelism=True), "enable_expert_tensor_parallelism"),
    (dict(capacity_factor=0.0), "capacity_factor"), (dict(eval_capacity_factor=-1), "eval_capacity_factor"),
    (dict(min_capacity=-1), "min_capacity"), (dict(num_experts=0), "num_experts"), (dict(hidden_size=0), "hidden_size"),
    (dict(k=2, num_experts=1), "k=2"), (dict(drop_tokens="no"), "drop_tokens"), (dict(use_rts=None), "use_rts"),
    (dict(expert="mlp"), "expert"), (dict(use_residual=1), "use_residual")])
def test_bad_arguments_name_themselves(kwargs, name):
    args = dict(hidden_size=H, expert=_mlp(), num_experts=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        MoE(**args)


def test_bad_inputs_name_themselves():
    moe = _moe(num_experts=2)
    with pytest.raises(ValueError, match="hidden_size"):
        moe(torch.randn(3, H + 1))
    with pytest.raises(ValueError, match="used_token"):
        moe(torch.randn(3, H), torch.ones(4))
