"""Datasheet peaks of the NVIDIA GPUs dslab is run on, for MFU and bandwidth utilisation.

Every figure is the vendor datasheet's, dense (no 2:4 structured sparsity): where a datasheet
quotes the tensor-core rate "with sparsity" only (Hopper, Blackwell), the dense rate is half of
it, and the table writes it as ``sparse / 2`` so the datasheet figure stays visible.

- ``bf16_tflops`` / ``fp16_tflops``: tensor-core TFLOP/s (V100 has no bf16: ``None``).
- ``fp32_tflops``: plain FP32 (CUDA cores, not TF32 tensor cores).
- ``memory_bandwidth_tbs``: device memory bandwidth in TB/s (10**12 bytes/s).
- ``memory_gb``: device memory in GB (10**9 bytes) as the datasheet states it.

These are upper bounds at boost clock; the measured peak on the device (a matmul, a copy) is
what a benchmark should also state next to them (DESIGN.md, "Measuring honestly").
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """Datasheet peaks of one GPU variant (see the module docstring for units)."""

    name: str
    bf16_tflops: float | None
    fp16_tflops: float
    fp32_tflops: float
    memory_bandwidth_tbs: float
    memory_gb: float
    source: str


@dataclasses.dataclass(frozen=True)
class _Variant:
    model: str  # the model token as device names print it: "H100", "V100", "L40S"
    form_tokens: frozenset[str]  # name tokens that select this variant ("PCIE", "SXM4", "HBM3")
    default_form: bool  # chosen when the name carries no form token at all
    spec: GpuSpec


def _variant(model: str, forms: str, default_form: bool, spec: GpuSpec) -> _Variant:
    return _Variant(model, frozenset(forms.split()), default_form, spec)


_V100 = "NVIDIA Tesla V100 GPU Accelerator datasheet"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (dense = with-sparsity figure / 2)"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (dense = with-sparsity figure / 2)"
_L40S = "NVIDIA L40S datasheet"
_B200 = "NVIDIA HGX B200 datasheet, per GPU (dense = with-sparsity figure / 2)"

_VARIANTS: tuple[_Variant, ...] = (
    _variant("V100", "SXM2", True, GpuSpec("V100 SXM2 16GB", None, 125, 15.7, 0.9, 16, _V100)),
    _variant("V100", "SXM2", True, GpuSpec("V100 SXM2 32GB", None, 125, 15.7, 0.9, 32, _V100)),
    _variant("V100", "PCIE", False, GpuSpec("V100 PCIe 16GB", None, 112, 14, 0.9, 16, _V100)),
    _variant("V100", "PCIE", False, GpuSpec("V100 PCIe 32GB", None, 112, 14, 0.9, 32, _V100)),
    _variant("V100S", "PCIE", True, GpuSpec("V100S PCIe 32GB", None, 130, 16.4, 1.134, 32, _V100)),
    _variant("A100", "SXM SXM4", True, GpuSpec("A100 SXM4 40GB", 312, 312, 19.5, 1.555, 40, _A100)),
    _variant("A100", "SXM SXM4", True, GpuSpec("A100 SXM4 80GB", 312, 312, 19.5, 2.039, 80, _A100)),
    _variant("A100", "PCIE", False, GpuSpec("A100 PCIe 40GB", 312, 312, 19.5, 1.555, 40, _A100)),
    _variant("A100", "PCIE", False, GpuSpec("A100 PCIe 80GB", 312, 312, 19.5, 1.935, 80, _A100)),
    _variant(
        "H100", "SXM SXM5 HBM3", True, GpuSpec("H100 SXM5 80GB", 1979 / 2, 1979 / 2, 67, 3.35, 80, _H100)
    ),
    _variant("H100", "PCIE", False, GpuSpec("H100 PCIe 80GB", 1513 / 2, 1513 / 2, 51, 2.0, 80, _H100)),
    _variant("H100", "NVL", False, GpuSpec("H100 NVL 94GB", 1671 / 2, 1671 / 2, 60, 3.9, 94, _H100)),
    _variant(
        "H200", "SXM SXM5 HBM3E", True, GpuSpec("H200 SXM 141GB", 1979 / 2, 1979 / 2, 67, 4.8, 141, _H200)
    ),
    _variant("H200", "NVL", False, GpuSpec("H200 NVL 141GB", 1671 / 2, 1671 / 2, 60, 4.8, 141, _H200)),
    _variant("L40S", "", True, GpuSpec("L40S 48GB", 362.05, 362.05, 91.6, 0.864, 48, _L40S)),
    _variant("B200", "SXM SXM6 HBM3E", True, GpuSpec("B200 180GB", 4500 / 2, 4500 / 2, 75, 7.7, 180, _B200)),
)

GPU_SPECS: tuple[GpuSpec, ...] = tuple(variant.spec for variant in _VARIANTS)

_VENDOR_TOKENS = frozenset({"NVIDIA", "TESLA"})
_MODELS = frozenset(variant.model for variant in _VARIANTS)
_FORM_TOKENS = frozenset().union(*(variant.form_tokens for variant in _VARIANTS))
_MEMORY_TOKEN = re.compile(r"(\d+)GB")


def lookup_gpu(name: str) -> GpuSpec | None:
    """The datasheet spec for a device name as torch or nvidia-smi print it, else None.

    Names are split into tokens ("NVIDIA A100-SXM4-80GB" -> NVIDIA, A100, SXM4, 80GB): exactly one
    model token, form-factor tokens (SXM*, PCIE, NVL, HBM3*) and a memory size must together pick
    one variant. A name with any other token (a MIG slice, an unlisted form factor) or that leaves
    the choice ambiguous is unknown: a wrong peak is worse than none.
    """
    tokens = [token for token in re.split(r"[^A-Z0-9]+", name.upper()) if token]
    models = [token for token in tokens if token in _MODELS]
    if len(models) != 1:
        return None
    memory = [int(match.group(1)) for token in tokens if (match := _MEMORY_TOKEN.fullmatch(token))]
    forms = {token for token in tokens if token in _FORM_TOKENS}
    leftover = [
        token
        for token in tokens
        if token not in _VENDOR_TOKENS and token != models[0] and token not in forms
        and not _MEMORY_TOKEN.fullmatch(token)
    ]
    if leftover or len(memory) > 1:
        return None
    candidates = [
        variant
        for variant in _VARIANTS
        if variant.model == models[0] and (forms <= variant.form_tokens if forms else variant.default_form)
    ]
    if memory:
        candidates = [variant for variant in candidates if variant.spec.memory_gb == memory[0]]
    if len(candidates) != 1:
        return None
    return candidates[0].spec
