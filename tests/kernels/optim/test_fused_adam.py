"""FusedAdam: the multi-tensor Triton step (under the interpreter on CPU) against torch.optim.

Shapes are odd and, under the interpreter, span several 512-element chunks with masked tails.
Parameters are O(1) and lr is 1e-2, so a wrong formula moves them by ~1e-4 while correct fp32
updates differ from torch's by a few ulps.
"""

import copy

import pytest
import torch

from dslab.kernels.optim.fused_adam import FusedAdam

from dslab.kernels import kernel_backend

SHAPES = [(7,), (1000,), (33, 17), (1537,), (3, 5, 7), (512,)]
TOL = dict(rtol=1e-6, atol=1e-6)


def _params(shapes=SHAPES, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(device) for shape in shapes]


def _grads(params, seed):
    gen = torch.Generator().manual_seed(1000 + seed)
    return [torch.randn(p.shape, generator=gen).to(p.device) for p in params]


def _run(make_optimizer, initial, n_steps, backend="triton", skip=None, copies=None):
    """Parameters after ``n_steps`` steps; ``skip[k]`` lists indices left without grad at step k."""
    params = [torch.nn.Parameter(p.clone()) for p in initial]
    optimizer = make_optimizer(params)
    if copies is not None:
        optimizer.set_param_copies(copies)
    for k in range(n_steps):
        for i, (p, g) in enumerate(zip(params, _grads(params, k))):
            p.grad = None if skip and i in skip.get(k, ()) else g
        with kernel_backend(backend):
            optimizer.step()
    return params, optimizer


def _assert_same_state(params_a, opt_a, params_b, opt_b):
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(a, b, **TOL)
        state_a, state_b = opt_a.state[a], opt_b.state[b]
        assert float(state_a["step"]) == float(state_b["step"])
        torch.testing.assert_close(state_a["exp_avg"], state_b["exp_avg"], **TOL)
        torch.testing.assert_close(state_a["exp_avg_sq"], state_b["exp_avg_sq"], **TOL)


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_matches_torch_adamw_and_adam(adam_w_mode, weight_decay, backend):
    initial = _params()
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    expected, torch_opt = _run(lambda ps: torch_cls(ps, lr=1e-2, betas=(0.8, 0.99), weight_decay=weight_decay),
                               initial, 4, backend="torch")
    got, opt = _run(lambda ps: FusedAdam(ps, lr=1e-2, betas=(0.8, 0.99), weight_decay=weight_decay,
                                         adam_w_mode=adam_w_mode), initial, 4, backend=backend)
    _assert_same_state(expected, torch_opt, got, opt)
    assert not torch.equal(got[0], initial[0])


def test_no_bias_correction_matches_the_reference_path():
    initial = _params()
    make = lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.05, bias_correction=False)  # noqa: E731
    expected, ref_opt = _run(make, initial, 3, backend="torch")
    got, opt = _run(make, initial, 3, backend="triton")
    _assert_same_state(expected, ref_opt, got, opt)


def test_params_without_grad_are_skipped_and_steps_counted_per_param():
    initial = _params()
    skip = {0: (1, 4), 2: (4,)}
    expected, torch_opt = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), initial, 3,
                               backend="torch", skip=skip)
    got, opt = _run(lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1), initial, 3, skip=skip)
    _assert_same_state(expected, torch_opt, got, opt)
    assert opt.state[got[4]]["step"] == 1.0 and opt.state[got[1]]["step"] == 2.0


def test_low_precision_copies_equal_the_params_cast():
    initial = _params()
    copies = [torch.empty(s, dtype=torch.bfloat16) for s in SHAPES[:3]] + [None]
    copies += [torch.empty(SHAPES[4], dtype=torch.float16), torch.empty(SHAPES[5], dtype=torch.bfloat16)]
    got, opt = _run(lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1), initial, 3, copies=copies,
                    skip={2: (5,)})
    for param, low in zip(got, copies):
        if low is not None:
            assert torch.equal(low, param.detach().to(low.dtype))


def test_copies_are_checked():
    params = [torch.nn.Parameter(p) for p in _params()[:2]]
    opt = FusedAdam(params)
    with pytest.raises(ValueError, match="2 parameters"):
        opt.set_param_copies([None])
    with pytest.raises(ValueError, match=r"copies\[1\]"):
        opt.set_param_copies([None, torch.empty(3, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match=r"copies\[0\]"):
        opt.set_param_copies([torch.empty(SHAPES[0]), None])


def _run_from_copies(initial, n_steps, backend, scale=None, copy_dtype=torch.bfloat16, adam_w_mode=True):
    """FusedAdam whose gradients are the copies' (``copy_dtype``), optionally divided by ``scale``
    (a 0-dim tensor, as the engine's clipping sets it); returns the params and the copies."""
    params = [torch.nn.Parameter(p.clone()) for p in initial]
    copies = [torch.empty(p.shape, dtype=copy_dtype).requires_grad_() for p in params]
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
    opt.set_param_copies(copies, grads_from_copies=True)
    for k in range(n_steps):
        for c, g in zip(copies, _grads(params, k)):
            c.grad = g.to(copy_dtype)
        if scale is not None:
            opt.grad_scale = scale
        with kernel_backend(backend):
            opt.step()
        if scale is not None:
            del opt.grad_scale
    return params, copies


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gradients_from_bf16_copies_with_a_grad_scale_match_torch(adam_w_mode, backend):
    # The engine's weight copies: the model computes with the bf16 copies, autograd leaves bf16
    # gradients on them, and clipping divides them by a device scalar inside the step.
    initial = _params()
    scale = torch.tensor(1.75)
    params = [torch.nn.Parameter(p.clone()) for p in initial]
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    torch_opt = torch_cls(params, lr=1e-2, weight_decay=0.1)
    for k in range(3):
        for p, g in zip(params, _grads(params, k)):
            p.grad = g.to(torch.bfloat16).float() / scale
        torch_opt.step()
    got, copies = _run_from_copies(initial, 3, backend, scale=scale, adam_w_mode=adam_w_mode)
    for expected, param, copy_ in zip(params, got, copies):
        torch.testing.assert_close(param, expected, **TOL)
        assert torch.equal(copy_.detach(), param.detach().to(torch.bfloat16))
        assert param.grad is None and copy_.grad.dtype == torch.bfloat16


def test_gradients_from_fp16_copies_and_fp32_params_mixed():
    # fp16 copies take the fp16 gradient path; a parameter without a copy keeps its own fp32 grad.
    initial = _params()
    got, _ = _run_from_copies(initial, 2, "triton", copy_dtype=torch.float16)
    expected, _ = _run_from_copies(initial, 2, "torch", copy_dtype=torch.float16)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **TOL)
    params = [torch.nn.Parameter(p.clone()) for p in initial[:2]]
    copy_ = torch.empty(params[0].shape, dtype=torch.bfloat16).requires_grad_()
    opt = FusedAdam(params, lr=1e-2)
    opt.set_param_copies([copy_, None], grads_from_copies=True)
    copy_.grad = torch.ones(params[0].shape, dtype=torch.bfloat16)
    params[1].grad = torch.ones(params[1].shape)
    with kernel_backend("triton"):
        opt.step()
    assert opt.state[params[0]]["step"] == 1.0 and opt.state[params[1]]["step"] == 1.0
    torch.testing.assert_close(params[1].detach(), initial[1] - 1e-2, rtol=0, atol=1e-6)


def test_a_gradient_both_on_the_param_and_on_its_copy_is_an_error():
    param = torch.nn.Parameter(torch.zeros(5))
    copy_ = torch.zeros(5, dtype=torch.bfloat16, requires_grad=True)
    opt = FusedAdam([param])
    opt.set_param_copies([copy_], grads_from_copies=True)
    param.grad, copy_.grad = torch.ones(5), torch.ones(5, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="read the parameter itself"):
        opt.step()


def test_unaligned_and_non_contiguous_params():
    flat = torch.randn(2 * 1000 + 1)
    views = [flat[1:1001], flat[1001:]]  # 4-byte offset: the kernel's unaligned variant
    strided = torch.randn(37, 23).t()  # non-contiguous: the per-tensor reference
    initial = [*views, strided]
    expected, torch_opt = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0), initial, 3,
                               backend="torch")

    params = [torch.nn.Parameter(flat.clone()[1:1001]), torch.nn.Parameter(flat.clone()[1001:]),
              torch.nn.Parameter(strided.clone())]
    assert params[0].data_ptr() % 16 != 0 and not params[2].is_contiguous()
    opt = FusedAdam(params, lr=1e-2)
    for k in range(3):
        for p, g in zip(params, _grads(params, k)):
            p.grad = g
        with kernel_backend("triton"):
            opt.step()
    _assert_same_state(expected, torch_opt, params, opt)


def test_state_dict_round_trips_and_loads_from_torch():
    initial = _params()
    make = lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    params, opt = _run(make, initial, 2)
    saved = opt.state_dict()
    assert all(torch.is_tensor(s["step"]) for s in saved["state"].values())

    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = make(resumed)
    opt2.load_state_dict(copy.deepcopy(saved))  # a live state_dict shares the optimizer's tensors
    torch_resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_opt = torch.optim.AdamW(torch_resumed, lr=1e-2, weight_decay=0.1)
    torch_opt.load_state_dict(copy.deepcopy(saved))
    for k in range(2, 4):
        for a, b, c, g in zip(params, resumed, torch_resumed, _grads(params, k)):
            a.grad, b.grad, c.grad = g, g.clone(), g.clone()
        with kernel_backend("triton"):
            opt.step()
            opt2.step()
        torch_opt.step()
    _assert_same_state(params, opt, resumed, opt2)
    _assert_same_state(torch_resumed, torch_opt, resumed, opt2)

    from_torch = [torch.nn.Parameter(p.detach().clone()) for p in torch_resumed]
    opt3 = make(from_torch)
    opt3.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert isinstance(opt3.state[from_torch[0]]["step"], float)
    assert opt3.param_groups[0]["adam_w_mode"] is True


def test_rejects_what_it_does_not_support():
    with pytest.raises(ValueError, match="amsgrad"):
        FusedAdam([torch.nn.Parameter(torch.zeros(3))], amsgrad=True)
    with pytest.raises(ValueError, match="fp32"):
        FusedAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="betas"):
        FusedAdam([torch.nn.Parameter(torch.zeros(3))], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        FusedAdam([torch.nn.Parameter(torch.zeros(3))], lr=-1.0)
    param = torch.nn.Parameter(torch.zeros(4, 3))
    param.grad = torch.eye(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        FusedAdam([param]).step()


def _bert_large_like_shapes(layers):
    hidden, ffn = 1024, 4096
    shapes = [(30522, hidden), (512, hidden), (2, hidden), (hidden,), (hidden,)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (hidden,)] * 4 + [(hidden,), (hidden,)]
        shapes += [(ffn, hidden), (ffn,), (hidden, ffn), (hidden,), (hidden,), (hidden,)]
    return shapes


@pytest.mark.gpu
def test_gpu_matches_torch_fused_adamw_with_bf16_copies():
    shapes = _bert_large_like_shapes(layers=4)
    initial = _params(shapes, device="cuda")
    expected, torch_opt = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
                               initial, 3, backend="torch")
    copies = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
    got, opt = _run(lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01), initial, 3, backend="auto",
                    copies=copies)
    _assert_same_state(expected, torch_opt, got, opt)
    for param, low in zip(got, copies):
        assert torch.equal(low, param.detach().to(torch.bfloat16))


def test_moved_gradients_rebuild_the_tensor_table_and_keep_the_chunk_table():
    """Gradients are new tensors every step, so the tensor table (addresses) is rebuilt; the chunk
    table depends only on the sizes and is kept until the set of updated tensors changes."""
    initial = _params()
    params = [torch.nn.Parameter(p.clone()) for p in initial]
    optimizer = FusedAdam(params, lr=1e-2)
    seen = []
    for k in range(4):
        grads = _grads(params, k)
        for i, (p, g) in enumerate(zip(params, grads)):
            p.grad = None if k == 3 and i == 2 else g
        with kernel_backend("triton"):
            optimizer.step()
        ((_, _, tensor_table, chunk_table),) = optimizer._tables.values()
        seen.append((tensor_table, chunk_table))
        # The table the kernel read points at this step's gradients.
        expected = [g.data_ptr() for i, g in enumerate(grads) if not (k == 3 and i == 2)]
        assert tensor_table.view(-1, 6)[:, 1].tolist() == expected
    assert seen[1][0] is not seen[0][0] and seen[2][0] is not seen[1][0]
    assert seen[1][1] is seen[0][1] and seen[2][1] is seen[0][1]
    assert seen[3][1] is not seen[0][1]  # a parameter without a gradient: other sizes
    assert seen[3][1].view(-1, 2)[:, 0].max().item() == len(SHAPES) - 2
    expected, torch_opt = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0), initial, 4, backend="torch",
                               skip={3: (2,)})
    _assert_same_state(expected, torch_opt, params, optimizer)
