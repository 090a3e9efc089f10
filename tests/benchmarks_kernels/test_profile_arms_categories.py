"""benchmarks/profile_arms.py's kernel categories: the kernel names dslab's, cuBLAS's, cuDNN's and
Inductor's kernels carry on a GPU land in the lever they belong to, and the table gives each
variant's time and its difference to the first."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from profile_arms import category_table, device_idle, kernel_category, kernel_time_by_category  # noqa: E402


@pytest.mark.parametrize("name,category", [
    ("_attention_fwd_kernel", "attention fwd"),
    ("_attention_bwd_kernel", "attention bwd"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention fwd"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7", "attention bwd"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "attention bwd"),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, ...)", "attention bwd"),
    ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, ...)", "attention bwd"),
    ("_forward_kernel", "cross-entropy"),
    ("_backward_kernel", "cross-entropy"),
    ("_loss_and_grad_kernel", "cross-entropy"),
    ("triton_red_fused__log_softmax_backward_data_nll_loss_backward_0", "cross-entropy"),
    ("_layer_norm_bwd_kernel", "layer norm"),
    ("triton_per_fused_native_layer_norm_3", "layer norm"),
    ("_rms_norm_bwd_kernel", "layer norm"),
    ("_rope_kernel", "rope"),
    ("_swiglu_fwd_kernel", "swiglu"),
    ("triton_poi_fused_mul_silu_2", "swiglu"),
    ("_adam_kernel", "optimizer"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>", "optimizer"),
    ("nvjet_sm90_tst_256x128_64x4_2x1_v_bz_coopA_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda...>", "casts and copies"),
    ("_bias_gelu_fwd_kernel", "other"),
    ("triton_poi_fused_add_gelu_5", "other"),
])
def test_kernel_names_land_in_their_category(name, category):
    assert kernel_category(name) == category


def test_category_table_gives_each_variant_and_its_difference_to_the_first():
    table = category_table({"dslab-eager": {"gemm": 20.0, "attention fwd": 5.0},
                            "torch-compile": {"gemm": 19.0, "attention fwd": 2.5, "other": 1.0}})
    lines = {line.split()[0] + (" " + line.split()[1] if line.split()[1].isalpha() else ""): line
             for line in table.splitlines()[1:]}
    assert lines["attention fwd"].split()[-3:] == ["5.00", "2.50", "-2.50"]
    assert lines["gemm"].split()[-3:] == ["20.00", "19.00", "-1.00"]
    assert lines["total"].split()[-3:] == ["25.00", "22.50", "-2.50"]
    assert "torch-compile - dslab-eager" in table.splitlines()[0]


def test_device_annotations_are_not_counted_beside_their_kernels():
    """``Optimizer.step#AdamW.step`` appears on the device timeline spanning the optimizer's
    kernels; counting it too would charge the optimizer twice."""
    from types import SimpleNamespace

    import torch

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [
        SimpleNamespace(name="Optimizer.step#AdamW.step", device_type=cuda, device_time_total=3000.0,
                        is_user_annotation=True),
        SimpleNamespace(name="void at::native::multi_tensor_apply_kernel<...>", device_type=cuda,
                        device_time_total=2400.0, is_user_annotation=False),
        SimpleNamespace(name="nvjet_sm90_tst_256x128", device_type=cuda, device_time_total=600.0,
                        is_user_annotation=False),
        SimpleNamespace(name="aten::mm", device_type=cpu, device_time_total=600.0, is_user_annotation=False),
    ]
    assert kernel_time_by_category(events, steps=3) == {"optimizer": 0.8, "gemm": 0.2}


def test_device_idle_splits_launch_gaps_from_long_waits():
    """Kernels (and one overlapping pair) at known times over 2 steps: the union is busy, gaps of at
    most 8 us are launch gaps, the longer ones are listed with their neighbours, longest first; a
    device annotation spanning a gap and a host event are not kernels."""
    from types import SimpleNamespace

    import torch

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, start, end, device=cuda, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start, end=end))

    events = [
        event("gemm", 0.0, 100.0),
        event("gelu", 103.0, 150.0),           # 3 us launch gap
        event("side", 120.0, 160.0),           # overlaps gelu, ends later
        event("adam", 260.0, 300.0),           # 100 us wait after "side"
        event("ln", 305.0, 400.0),             # 5 us launch gap
        event("embed", 420.0, 440.0),          # 20 us wait after "ln"
        event("Optimizer.step#Adam.step", 150.0, 300.0, annotation=True),
        event("aten::mm", 0.0, 1000.0, device=cpu),
    ]
    idle = device_idle(events, steps=2)
    assert idle["span"] == pytest.approx(440.0 / 2e3)
    assert idle["busy"] == pytest.approx((100.0 + 57.0 + 40.0 + 95.0 + 20.0) / 2e3)
    assert idle["launch_gaps"] == pytest.approx(8.0 / 2e3)
    assert idle["long_gaps"] == pytest.approx(120.0 / 2e3)
    assert idle["busy"] + idle["launch_gaps"] + idle["long_gaps"] == pytest.approx(idle["span"])
    assert idle["largest"] == [(100.0, "side", "adam"), (20.0, "ln", "embed")]
    assert device_idle([event("aten::mm", 0.0, 5.0, device=cpu)], steps=1)["largest"] == []
