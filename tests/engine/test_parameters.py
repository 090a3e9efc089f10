"""dslab.engine.parameters: the kept parameter list follows every change of the module tree, and
clipping is torch's clip_grad_norm_ bit for bit."""

import pytest
import torch
import torch.nn as nn

from dslab.engine import parameters
from dslab.engine.parameters import ModuleParameters, clip_grad_norm_


class Tied(nn.Module):
    """Embedding and decoder sharing one weight, a ModuleList, a bias-free layer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.ones(4))


def same_objects(a, b):
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def test_list_is_module_parameters_and_kept_while_unchanged():
    model = Tied()
    cache = ModuleParameters(model)
    first = cache()
    assert same_objects(first, list(model.parameters()))
    assert len(first) == 1 + 3 * 2 + 1  # the tied weight once
    for _ in range(3):
        assert cache() is first
    assert cache.rebuilds == 1


def _set_new_parameter(m):
    m.blocks[1].weight = nn.Parameter(torch.zeros(4, 4))


def _register_parameter(m):
    m.blocks[0].register_parameter("extra", nn.Parameter(torch.zeros(2)))


def _delete_parameter(m):
    del m.blocks[2].bias


def _parameter_to_none(m):
    m.blocks[2].bias = None


def _add_module(m):
    m.add_module("extra", nn.Linear(2, 2))


def _replace_submodule(m):
    m.blocks[1] = nn.Linear(4, 4)


def _module_list_insert(m):
    m.blocks.insert(0, nn.Linear(4, 4))  # writes ModuleList._modules directly, no hooks


def _module_list_delete(m):
    del m.blocks[0]


def _module_list_append(m):
    m.blocks.append(nn.Linear(4, 4))


def _load_state_dict_assign(m):
    state = {k: v.clone() for k, v in m.state_dict().items()}
    m.load_state_dict(state, assign=True)


def _direct_dict_write(m):
    m.blocks[0]._parameters["weight"] = nn.Parameter(torch.zeros(4, 4))


def _untie(m):
    m.head.weight = nn.Parameter(m.embed.weight.detach().clone())


def _to_meta(m):
    m.to("meta")  # nn.Module._apply makes new Parameters here, writing _parameters directly


@pytest.mark.parametrize("change", [
    _set_new_parameter, _register_parameter, _delete_parameter, _parameter_to_none, _add_module,
    _replace_submodule, _module_list_insert, _module_list_delete, _module_list_append,
    _load_state_dict_assign, _direct_dict_write, _untie, _to_meta,
])
def test_list_follows_a_change_of_the_tree(change):
    model = Tied()
    cache = ModuleParameters(model)
    before = cache()
    change(model)
    after = cache()
    assert same_objects(after, list(model.parameters()))
    assert not same_objects(after, before)
    assert cache.rebuilds == 2
    assert cache() is after and cache.rebuilds == 2


def test_changes_that_keep_the_parameter_objects_keep_the_list():
    model = Tied()
    cache = ModuleParameters(model)
    first = cache()
    model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
    model.blocks[0].weight.data = torch.zeros(4, 4)
    model.scale.requires_grad_(False)
    model.to(torch.float64)  # same-device conversion: param.data is swapped in place
    assert cache() is first and cache.rebuilds == 1
    assert same_objects(first, list(model.parameters()))


def test_invalidate_rebuilds():
    model = Tied()
    cache = ModuleParameters(model)
    cache()
    cache.invalidate()
    assert same_objects(cache(), list(model.parameters()))
    assert cache.rebuilds == 2


class OwnWalk(nn.Module):
    """Hides its frozen layer from parameters(): a walk the cache cannot follow."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.frozen = nn.Linear(2, 2)

    def named_parameters(self, *args, **kwargs):
        for name, p in super().named_parameters(*args, **kwargs):
            if not name.startswith("frozen."):
                yield name, p


class Child(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)

    def named_modules(self, *args, **kwargs):
        yield from super().named_modules(*args, **kwargs)


@pytest.mark.parametrize("model", [OwnWalk(), nn.Sequential(nn.Linear(2, 2), Child())],
                         ids=["root_named_parameters", "child_named_modules"])
def test_a_tree_with_its_own_walk_is_walked_every_call(model):
    cache = ModuleParameters(model)
    for calls in range(1, 4):
        assert same_objects(cache(), list(model.parameters()))
        assert cache.rebuilds == calls


# -- clipping -------------------------------------------------------------------------------------


def _random_grads(shapes_dtypes, seed, scale, missing=()):
    g = torch.Generator().manual_seed(seed)
    params = []
    for i, (shape, dtype) in enumerate(shapes_dtypes):
        p = nn.Parameter(torch.zeros(shape, dtype=dtype))
        if i not in missing:
            p.grad = (torch.randn(shape, generator=g) * scale).to(dtype)
        params.append(p)
    return params


SHAPES = [((64, 32), torch.float32), ((32,), torch.float32), ((7, 5, 3), torch.float32),
          ((1,), torch.float32), ((1000,), torch.float32)]
MIXED = [((64, 32), torch.float32), ((32,), torch.bfloat16), ((7, 5, 3), torch.float64),
         ((16,), torch.float32), ((9, 9), torch.bfloat16)]


@pytest.mark.parametrize("shapes", [SHAPES, MIXED], ids=["fp32", "mixed_dtypes"])
@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["clipped", "below_max"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_is_torch_clip_grad_norm_bit_for_bit(shapes, max_norm, seed):
    ours = _random_grads(shapes, seed, scale=3.0, missing={1})
    theirs = _random_grads(shapes, seed, scale=3.0, missing={1})
    norm = clip_grad_norm_(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert torch.equal(norm, expected) and norm.dtype == expected.dtype
    for p, q in zip(ours, theirs):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert p.grad.dtype == q.grad.dtype and torch.equal(p.grad, q.grad)
    if max_norm < 1.0:
        assert float(norm) > max_norm  # the case clipped something


def test_clip_without_gradients_is_a_no_op():
    params = _random_grads(SHAPES, 0, scale=1.0, missing=set(range(len(SHAPES))))
    norm = clip_grad_norm_(params, 1.0)
    assert torch.equal(norm, torch.tensor(0.0))
    assert all(p.grad is None for p in params)


def test_clip_falls_back_to_torch_off_the_foreach_path(monkeypatch):
    calls = []
    torch_clip = torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm, *args, **kwargs):
        calls.append(max_norm)
        return torch_clip(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(parameters, "_device_has_foreach_support", lambda device: False)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    ours = _random_grads(SHAPES, 4, scale=3.0)
    theirs = _random_grads(SHAPES, 4, scale=3.0)
    assert torch.equal(clip_grad_norm_(ours, 0.5), torch_clip(theirs, 0.5))
    assert calls == [0.5]
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ours, theirs))


def test_clear_grads_sets_every_gradient_to_none():
    params = _random_grads(SHAPES, 0, scale=1.0, missing={2})
    parameters.clear_grads(params)
    assert all(p.grad is None for p in params)
