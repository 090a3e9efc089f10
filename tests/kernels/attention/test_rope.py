"""rope: frequencies and tables against transformers' Llama rotary code, and the Triton kernel (under
the interpreter on CPU) against the PyTorch reference.

Errors are measured against the reference in float64 and must stay within twice PyTorch's own
error in the same precision, plus a floor of one unit in the last place at the output's scale.
"""

import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from dslab.kernels import kernel_backend
from dslab.kernels.attention.rope import apply_rope, apply_rope_reference, rope_inv_freq, rope_tables
from dslab.kernels.dispatch import interpreting
from dslab.profilers.flops import FlopsProfiler

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _assert_within_torch_error(name, actual, torch_low, exact):
    exact = exact.double()
    err = (actual.double() - exact).abs().max().item()
    torch_err = (torch_low.double() - exact).abs().max().item()
    floor = torch.finfo(actual.dtype).eps * exact.abs().max().item()
    assert err <= 2 * torch_err + floor, f"{name}: error {err:.3g} vs PyTorch's {torch_err:.3g} (floor {floor:.2g})"


def _config(head_dim, rope_parameters):
    return LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                       max_position_embeddings=16384, rope_parameters=rope_parameters)


@pytest.mark.parametrize(
    "theta, scaling",
    [(10000.0, None), (500000.0, {"rope_type": "default"}), (10000.0, {"rope_type": "linear", "factor": 4.0}),
     (500000.0, LLAMA3)],
    ids=["default", "default-500k", "linear", "llama3"],
)
def test_inv_freq_equals_transformers(theta, scaling):
    head_dim = 128  # Llama 3's: its wavelengths span llama3 scaling's three bands
    parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    config = _config(head_dim, parameters)
    if parameters["rope_type"] == "default":
        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](config)
    got = rope_inv_freq(head_dim, theta, scaling)
    assert got.dtype == torch.float32 and got.shape == (head_dim // 2,)
    assert torch.equal(got, expected)
    assert torch.equal(rope_inv_freq(head_dim, theta, config.rope_parameters), expected)


def test_legacy_type_key_and_llama3_bands():
    legacy = rope_inv_freq(64, 10000.0, {"type": "linear", "factor": 2.0})
    assert torch.equal(legacy, rope_inv_freq(64, 10000.0) / 2)
    plain, scaled = rope_inv_freq(128, 500000.0), rope_inv_freq(128, 500000.0, LLAMA3)
    assert torch.equal(scaled[:8], plain[:8])  # short wavelengths kept
    assert torch.equal(scaled[-8:], plain[-8:] / 8)  # long ones divided by the factor
    middle = (scaled != plain) & (scaled != plain / 8)
    assert middle.any()


def test_tables_equal_transformers_rotary_embedding():
    head_dim, batch, seq = 32, 2, 9
    config = _config(head_dim, {"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.stack([torch.arange(seq), torch.arange(seq) + 3000])
    cos_hf, sin_hf = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = rope_tables(positions, rope_inv_freq(head_dim))
    assert cos.shape == (batch, seq, head_dim // 2) and cos.dtype == torch.float32
    assert torch.equal(torch.cat((cos, cos), -1), cos_hf)
    assert torch.equal(torch.cat((sin, sin), -1), sin_hf)
    shared_cos, _ = rope_tables(torch.arange(seq), rope_inv_freq(head_dim))
    assert torch.equal(shared_cos, cos[0])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rotation_equals_transformers_apply_rotary_pos_emb(backend):
    batch, seq, heads_q, heads_k, head_dim = 2, 7, 6, 2, 32
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seq, heads_q, head_dim, generator=gen)
    k = torch.randn(batch, seq, heads_k, head_dim, generator=gen)
    positions = torch.stack([torch.arange(seq), torch.arange(seq) + 11])
    cos, sin = rope_tables(positions, rope_inv_freq(head_dim, 500000.0, LLAMA3))
    q_hf, k_hf = apply_rotary_pos_emb(q, k, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), unsqueeze_dim=2)
    with kernel_backend(backend):
        q_rot, k_rot = apply_rope(q, k, cos, sin)
    torch.testing.assert_close(q_rot, q_hf)
    torch.testing.assert_close(k_rot, k_hf)
    assert q_rot.is_contiguous() and k_rot.is_contiguous()


def _packed_inputs(batch, seq, heads_q, heads_k, head_dim, dtype, per_batch, seed=0):
    """A packed projection ``[batch, seq, (heads_q + 2 heads_k) head_dim]`` (q, k, v blocks), its
    gradient for q_rot and k_rot, and the half tables (per sequence: left-padded positions)."""
    gen = torch.Generator().manual_seed(seed)
    packed = (torch.randn(batch, seq, (heads_q + 2 * heads_k) * head_dim, generator=gen) * 2).to(dtype)
    dq = torch.randn(batch, seq, heads_q, head_dim, generator=gen).to(dtype)
    dk = torch.randn(batch, seq, heads_k, head_dim, generator=gen).to(dtype)
    if per_batch:
        pad = torch.arange(batch)[:, None] * 2
        positions = (torch.arange(seq)[None, :] - pad).clamp(min=0) + 1000
    else:
        positions = torch.arange(seq) + 1000
    cos, sin = rope_tables(positions, rope_inv_freq(head_dim, 10000.0))
    return packed, dq, dk, cos, sin


def _run(fn, packed, dq, dk, cos, sin, heads_q, heads_k, dtype=None):
    """q_rot, k_rot and the packed projection's gradient, with q and k strided views into it."""
    dtype = dtype or packed.dtype
    packed = packed.detach().to(dtype).requires_grad_()
    batch, seq, _ = packed.shape
    head_dim = dq.shape[-1]
    q = packed[..., : heads_q * head_dim].view(batch, seq, heads_q, head_dim)
    k = packed[..., heads_q * head_dim: (heads_q + heads_k) * head_dim].view(batch, seq, heads_k, head_dim)
    table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    q_rot, k_rot = fn(q, k, cos.to(table_dtype), sin.to(table_dtype))
    (grad,) = torch.autograd.grad((q_rot, k_rot), packed, (dq.to(dtype), dk.to(dtype)))
    return [q_rot.detach(), k_rot.detach(), grad]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("per_batch", [False, True], ids=["shared-table", "per-batch-table"])
def test_triton_matches_float64_reference_on_packed_gqa_views(dtype, per_batch):
    heads_q, heads_k = 6, 2
    packed, dq, dk, cos, sin = _packed_inputs(3, 7, heads_q, heads_k, 32, dtype, per_batch)
    exact = _run(apply_rope_reference, packed, dq, dk, cos, sin, heads_q, heads_k, dtype=torch.float64)
    low = _run(apply_rope_reference, packed, dq, dk, cos, sin, heads_q, heads_k)
    with kernel_backend("triton"):
        got = _run(apply_rope, packed, dq, dk, cos, sin, heads_q, heads_k)
    for name, a, lo, ex in zip(["q_rot", "k_rot", "d_packed"], got, low, exact):
        assert a.dtype == dtype and a.shape == lo.shape
        _assert_within_torch_error(name, a, lo, ex)
    assert got[0].is_contiguous() and got[1].is_contiguous()
    assert not got[2][..., (heads_q + heads_k) * 32:].any()  # v's block takes no gradient


@pytest.mark.parametrize("heads_q, heads_k", [(5, 5), (4, 1), (3, 0)])
def test_uneven_shapes_and_without_k(heads_q, heads_k):
    """head_dim 20 (half 10: a masked power-of-two block), odd head counts, k None when heads_k is 0,
    and q with a non-unit last stride (copied first)."""
    gen = torch.Generator().manual_seed(4)
    batch, seq, head_dim = 2, 5, 20
    q = torch.randn(batch, seq, head_dim, heads_q, generator=gen).transpose(2, 3).requires_grad_()
    k = torch.randn(batch, seq, heads_k, head_dim, generator=gen).requires_grad_() if heads_k else None
    cos, sin = rope_tables(torch.arange(seq) + 7, rope_inv_freq(head_dim, 10000.0))
    dq = torch.randn(batch, seq, heads_q, head_dim, generator=gen)
    dk = torch.randn(batch, seq, heads_k, head_dim, generator=gen)
    leaves = [q] if k is None else [q, k]

    def run(fn):
        q_rot, k_rot = fn(q, k, cos, sin)
        outs = [q_rot] if k is None else [q_rot, k_rot]
        if k is None:
            assert k_rot is None
        return [o.detach() for o in outs] + list(torch.autograd.grad(outs, leaves, [dq, dk][: len(outs)]))

    expected = run(apply_rope_reference)
    with kernel_backend("triton"):
        got = run(apply_rope)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)


def test_torch_backend_and_cpu_auto_run_the_reference():
    packed, _, _, cos, sin = _packed_inputs(2, 5, 4, 2, 16, torch.float32, per_batch=True)
    q = packed[..., :64].view(2, 5, 4, 16)
    k = packed[..., 64:96].view(2, 5, 2, 16)
    expected = apply_rope_reference(q, k, cos, sin)
    for name in ("torch", "auto"):
        with kernel_backend(name):
            for a, e in zip(apply_rope(q, k, cos, sin), expected):
                assert torch.equal(a, e)


@pytest.mark.parametrize("with_k", [True, False])
def test_custom_op_passes_opcheck(with_k):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 3, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 3, 1, 8, generator=gen, requires_grad=True) if with_k else None
    cos, sin = rope_tables(torch.arange(3), rope_inv_freq(8))
    torch.library.opcheck(torch.ops.dslab.rope.default, (q, k, cos, sin))


def test_torch_compile_traces_the_custom_op():
    heads_q, heads_k = 6, 2
    packed, dq, dk, cos, sin = _packed_inputs(2, 5, heads_q, heads_k, 16, torch.float32, per_batch=True)

    def rotate_twice(q, k, cos, sin):
        q_rot, k_rot = apply_rope(q, k, cos, sin)
        return q_rot * 2, k_rot + 1

    compiled = torch.compile(rotate_twice, backend="aot_eager", fullgraph=True)
    with kernel_backend("triton"):
        eager = _run(rotate_twice, packed, dq, dk, cos, sin, heads_q, heads_k)
        got = _run(compiled, packed, dq, dk, cos, sin, heads_q, heads_k)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b)


class _Rotate(nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rope(q, k, cos, sin)


@pytest.mark.skipif(not (interpreting() or torch.cuda.is_available()), reason="needs a GPU or TRITON_INTERPRET=1")
def test_flops_profiler_counts_the_custom_ops():
    """dslab::rope and dslab::rope_backward: 3 per element of q and k, elementwise; the forward's
    figure is the reference's aten ops' (four products, a sum and a difference per pair)."""
    q = torch.randn(2, 5, 6, 16, requires_grad=True)
    k = torch.randn(2, 5, 2, 16, requires_grad=True)
    cos, sin = rope_tables(torch.arange(5), rope_inv_freq(16))
    elements = q.numel() + k.numel()
    forward_figures = {}
    for backend in ("triton", "torch"):
        model = _Rotate()
        profiler = FlopsProfiler(model)
        with kernel_backend(backend):
            profiler.start_profile()
            q_rot, k_rot = model(q, k, cos, sin)
            profiler.stop_profile()
            forward_figures[backend] = profiler.get_elementwise_flops()
            if backend == "triton":
                profiler.start_profile()
                (q_rot.sum() + k_rot.sum()).backward()
                profiler.stop_profile()
                records = profiler.records()
                assert records["total_flops"] == 0
                assert records["flops_by_op"]["dslab::rope_backward"] == {"figure": "elementwise", "flops": 3 * elements}
    assert forward_figures["triton"] == forward_figures["torch"] == 3 * elements


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: rope_inv_freq(31), "head_dim"),
        (lambda: rope_inv_freq(32, theta=0.0), "theta"),
        (lambda: rope_inv_freq(32, scaling={"rope_type": "yarn", "factor": 4.0}), "'yarn'.*default, linear, llama3"),
        (lambda: rope_inv_freq(32, scaling={"type": "dynamic"}), "'dynamic'"),
        (lambda: rope_inv_freq(32, scaling={"rope_type": "linear"}), "'factor'"),
        (lambda: rope_inv_freq(32, scaling={**LLAMA3, "low_freq_factor": -1.0}), "low_freq_factor"),
        (lambda: rope_inv_freq(32, scaling={**LLAMA3, "high_freq_factor": 0.5}), "high_freq_factor"),
        (lambda: rope_inv_freq(32, 10000.0, {"rope_type": "default", "rope_theta": 500000.0}), "rope_theta"),
        (lambda: rope_tables(torch.arange(4.0), rope_inv_freq(8)), "positions"),
        (lambda: rope_tables(torch.arange(4), torch.ones(2, 4)), "inv_freq"),
    ],
)
def test_bad_frequency_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _rope_args(q_shape=(2, 3, 4, 8), k_shape=(2, 3, 2, 8), dtype=torch.float32, table=(3, 4), **changes):
    args = dict(q=torch.ones(q_shape, dtype=dtype), k=torch.ones(k_shape, dtype=dtype),
                cos=torch.ones(table), sin=torch.ones(table))
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "args, match",
    [
        (_rope_args(q_shape=(3, 4, 8)), "q must be 4-d"),
        (_rope_args(dtype=torch.int32), "q must be float"),
        (_rope_args(q_shape=(2, 3, 4, 7), k_shape=(2, 3, 2, 7), table=(3, 3)), "head_dim must be even"),
        (_rope_args(k_shape=(2, 3, 8)), "k must be 4-d"),
        (_rope_args(k_shape=(1, 3, 2, 8)), "k must match q's batch"),
        (_rope_args(k_shape=(2, 3, 2, 16)), "k must match q's batch"),
        (_rope_args(k=torch.ones(2, 3, 2, 8, dtype=torch.float16)), "k must have q's dtype"),
        (_rope_args(cos=torch.ones(3, 4, dtype=torch.float16)), "cos must be float32"),
        (_rope_args(table=(3, 8)), "cos must have shape"),
        (_rope_args(table=(3, 3, 4)), "cos must have shape"),
        (_rope_args(sin=torch.ones(2, 3, 4)), "sin must have cos's shape"),
    ],
)
def test_bad_rotation_arguments_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        apply_rope(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("per_batch", [False, True], ids=["shared-table", "per-batch-table"])
def test_gpu_real_sizes(dtype, per_batch):
    heads_q, heads_k = 32, 8  # Llama 3 8B
    inputs = _packed_inputs(4, 2048, heads_q, heads_k, 128, dtype, per_batch)
    packed, dq, dk, cos, sin = (t.cuda() for t in inputs)
    exact = _run(apply_rope_reference, packed, dq, dk, cos, sin, heads_q, heads_k, dtype=torch.float64)
    low = _run(apply_rope_reference, packed, dq, dk, cos, sin, heads_q, heads_k)
    got = _run(apply_rope, packed, dq, dk, cos, sin, heads_q, heads_k)
    for name, a, lo, ex in zip(["q_rot", "k_rot", "d_packed"], got, low, exact):
        _assert_within_torch_error(name, a, lo, ex)
