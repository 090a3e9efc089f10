"""``init_inference``'s config: DeepSpeed's inference keys, typed and checked.

The keys are DeepSpeed's (``deepspeed.init_inference(model, config=None, **kwargs)``); they come as
keyword arguments, as a ``config`` dict or JSON file, or both. A key given both ways with different
values is an error, as in DeepSpeed.

=====================================  ==========================================================
key                                    meaning
=====================================  ==========================================================
``dtype``                              ``torch.float16`` (DeepSpeed's default), ``torch.bfloat16``,
                                       ``torch.float32`` or ``torch.int8`` (also as strings: "fp16",
                                       "bf16", "fp32", "int8", ...). int8 quantises the
                                       transformer layers' linear weights (``quant``)
``replace_with_kernel_inject``         inject dslab's inference modules (default True; DeepSpeed's
(``kernel_inject``)                    default is False). False runs the model unchanged
``tensor_parallel``                    ``{"enabled": true, "tp_size": N}``: heads and MLP columns
                                       sliced over N ranks
``mp_size``                            the old spelling of ``tensor_parallel.tp_size``
``max_out_tokens`` (``max_tokens``)    prompt + new tokens the KV cache holds (default 1024, and at
                                       most the model's positions)
``min_out_tokens`` (``min_tokens``)    DeepSpeed's; accepted and checked (<= ``max_out_tokens``);
                                       dslab sizes its cache by ``max_out_tokens`` alone
``enable_cuda_graph``                  capture the per-token step as a CUDA graph per batch bucket
                                       (default True; on CUDA only; DeepSpeed's default is False)
``checkpoint``, ``base_dir``           weights to load before injection (:mod:`.checkpoint`)
``injection_policy``                   ``{LayerClass: (names...)}``; must name the layer class of a
(``injection_dict``)                   model dslab injects (see :mod:`.policies`)
``quant``                              dslab's int8 settings: ``{"weight": {"num_bits": 8,
                                       "group_size": null, "q_groups": 1}, "compute_dtype":
                                       "bf16"}``: one scale per output channel unless
                                       ``group_size`` (inputs per scale) or DeepSpeed's
                                       ``q_groups`` (groups per row) says otherwise;
                                       ``compute_dtype`` is what activations and the
                                       unquantised weights run in
=====================================  ==========================================================

DeepSpeed keys dslab does not implement (:data:`DEEPSPEED_KEYS_AT_DEFAULT`) are accepted at
DeepSpeed's default value and refused by name otherwise. An unknown key is an error naming the
closest known key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import ConfigDict, Field, field_validator, model_validator

from dslab.config_base import ConfigSection, closest_key, known_keys, parse_section

DTYPE_NAMES = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "int8": torch.int8,
}
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8)
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# DeepSpeed inference keys dslab does not implement, with the value at which they change nothing.
DEEPSPEED_KEYS_AT_DEFAULT: dict[str, Any] = {
    "moe": False,
    "ep_size": 1,
    "moe_experts": [1],
    "moe_type": "standard",
    "ep_group": None,
    "ep_mp_group": None,
    "mpu": None,
    "training_mp_size": 1,
    "replace_method": "auto",
    "return_tuple": True,
    "triangular_masking": True,
    "use_triton": False,
    "keep_module_on_host": False,
    "save_mp_checkpoint_path": None,
    "set_empty_params": False,
    "transposed_mode": False,
    "checkpoint_config": None,
}
ALIASES = {"kernel_inject": "replace_with_kernel_inject", "max_tokens": "max_out_tokens",
           "min_tokens": "min_out_tokens", "injection_dict": "injection_policy"}


def parse_dtype(value: Any, key: str = "dtype") -> torch.dtype:
    """A torch dtype of :data:`DTYPES` from a dtype or its name; ValueError naming ``key``."""
    if isinstance(value, str):
        name = value.lower().removeprefix("torch.")
        if name in DTYPE_NAMES:
            return DTYPE_NAMES[name]
    elif isinstance(value, torch.dtype) and value in DTYPES:
        return value
    raise ValueError(f"{key}={value!r} is not supported; choose one of torch.float16, torch.bfloat16, "
                     f"torch.float32, torch.int8 (or 'fp16', 'bf16', 'fp32', 'int8')")


class TensorParallelConfig(ConfigSection):
    """DeepSpeed's ``tensor_parallel`` section (``tp_group``/``mpu`` are not taken: dslab makes
    its groups of consecutive ranks itself)."""

    enabled: bool = True
    tp_size: int = Field(1, ge=1)


class WeightQuantConfig(ConfigSection):
    num_bits: Literal[8] = 8
    group_size: int | None = Field(None, ge=1)
    q_groups: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _one_grouping(self):
        if self.group_size is not None and self.q_groups != 1:
            raise ValueError("give either 'group_size' (inputs per scale) or 'q_groups' (groups per row), not both")
        return self

    def group_size_for(self, in_features: int) -> int | None:
        """The inputs per scale of a ``[out, in_features]`` weight (None: one scale per output
        channel); ValueError naming the key when it does not divide ``in_features``."""
        if self.group_size is not None:
            if in_features % self.group_size:
                raise ValueError(f"config key 'quant.weight.group_size': {self.group_size} does not divide the "
                                 f"{in_features} input features of a quantised linear layer")
            return self.group_size
        if self.q_groups == 1:
            return None
        if in_features % self.q_groups:
            raise ValueError(f"config key 'quant.weight.q_groups': {self.q_groups} does not divide the "
                             f"{in_features} input features of a quantised linear layer")
        return in_features // self.q_groups


class QuantConfig(ConfigSection):
    """dslab's int8 settings (used when ``dtype`` is int8)."""

    enabled: bool = True
    weight: WeightQuantConfig = WeightQuantConfig()
    compute_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"


class InferenceConfig(ConfigSection):
    """The resolved ``init_inference`` settings (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True,
                              arbitrary_types_allowed=True)

    dtype: Any = torch.float16
    replace_with_kernel_inject: bool = True
    tensor_parallel: TensorParallelConfig = TensorParallelConfig()
    mp_size: int | None = Field(None, ge=1)
    max_out_tokens: int = Field(1024, ge=1)
    min_out_tokens: int = Field(1, ge=1)
    enable_cuda_graph: bool = True
    checkpoint: Any = None
    base_dir: str = ""
    injection_policy: dict | None = None
    quant: QuantConfig = QuantConfig()

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value):
        return parse_dtype(value)

    @model_validator(mode="after")
    def _checks(self):
        if self.mp_size is not None:
            tp = self.tensor_parallel.tp_size
            if "tp_size" in self.tensor_parallel.model_fields_set and tp != self.mp_size:
                raise ValueError(f"mp_size={self.mp_size} (the old spelling of tensor_parallel.tp_size) "
                                 f"contradicts tensor_parallel.tp_size={tp}")
        if self.min_out_tokens > self.max_out_tokens:
            raise ValueError(f"min_out_tokens={self.min_out_tokens} must be <= max_out_tokens={self.max_out_tokens}")
        return self

    @property
    def tp_size(self) -> int:
        """Ranks the layers are sliced over (1 when tensor parallelism is off)."""
        if not self.tensor_parallel.enabled:
            return 1
        return self.mp_size if self.mp_size is not None else self.tensor_parallel.tp_size

    @property
    def int8(self) -> bool:
        return self.dtype == torch.int8

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype activations (and every unquantised weight) run in."""
        return COMPUTE_DTYPES[self.quant.compute_dtype] if self.int8 else self.dtype


def _read_config_file(path: str | Path) -> dict:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"inference config file {file} does not exist")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"inference config file {file} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"inference config file {file} must hold a JSON object")
    return data


def _canonical(data: dict, where: str) -> dict:
    """``data`` with DeepSpeed's aliases renamed and its unimplemented keys checked and dropped."""
    out = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ValueError(f"{where}: config keys must be strings, got {key!r}")
        name = ALIASES.get(key, key)
        if name in out:
            raise ValueError(f"{where}: '{key}' and its other spelling both given")
        if name in DEEPSPEED_KEYS_AT_DEFAULT:
            if value != DEEPSPEED_KEYS_AT_DEFAULT[name]:
                raise ValueError(f"init_inference: '{key}'={value!r} is a DeepSpeed setting dslab does not implement "
                                 f"(accepted only at {DEEPSPEED_KEYS_AT_DEFAULT[name]!r})")
            continue
        if name == "dtype":
            try:
                value = parse_dtype(value)
            except ValueError:
                pass  # refused with the key's name when the config is validated
        out[name] = value
    return out


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors in a checkpoint dict
        return a is b


def resolve_config(config: dict | str | Path | None, kwargs: dict) -> InferenceConfig:
    """The config of ``init_inference(model, config, **kwargs)``: ``config`` (a dict or a JSON
    file) and the keyword arguments merged; ValueError naming any bad or conflicting key."""
    if config is None:
        base = {}
    elif isinstance(config, (str, Path)):
        base = _read_config_file(config)
    elif isinstance(config, dict):
        base = dict(config)
    else:
        raise ValueError(f"config must be a dict, a path to a JSON file or None, got {type(config).__name__}")
    base = _canonical(base, "config")
    extra = _canonical(kwargs, "init_inference")
    for key, value in extra.items():
        if key in base and not _same(base[key], value):
            raise ValueError(f"'{key}' is given both in config ({base[key]!r}) and as an argument ({value!r}) "
                             f"with different values")
        base[key] = value
    if isinstance(base.get("tensor_parallel"), int):
        raise ValueError("tensor_parallel must be a dict such as {'tp_size': 2}, "
                         f"got {base['tensor_parallel']!r}")
    unknown = [k for k in base if k not in known_keys(InferenceConfig)]
    if unknown:
        hint = closest_key(unknown[0], known_keys(InferenceConfig) + list(ALIASES))
        raise ValueError(f"unknown init_inference key '{unknown[0]}'" + (f"; did you mean '{hint}'?" if hint else ""))
    return parse_section(InferenceConfig, base)
