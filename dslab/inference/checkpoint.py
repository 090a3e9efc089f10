"""``init_inference(checkpoint=...)``: weights loaded into the model before injection.

``checkpoint`` is one of

- a state dict (``{name: tensor}``);
- a weights file: ``.pt``/``.pth``/``.bin`` (``torch.load(weights_only=True)``) or ``.safetensors``;
- DeepSpeed's checkpoint description, as a dict or a ``.json`` file:
  ``{"type": "ds_model" | "HuggingFace", "checkpoints": file or [files], "version": ...}``; the
  files (relative to ``base_dir``, else to the JSON file's folder) are read and merged in order
  (shards of one state dict). Megatron's tensor-parallel checkpoints (``"type": "Megatron"``) are
  refused by name: their shards split tensors, not keys.

The merged state dict must match the model's keys exactly (``load_state_dict(strict=True)``, the
tied copies transformers' models list included); a missing file, an unreadable one or a
mismatch is a ValueError naming the file and the keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

CHECKPOINT_TYPES = ("ds_model", "huggingface")


def _read_weights(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"checkpoint file {path} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, ImportError) as err:
        raise ValueError(f"checkpoint file {path} could not be read: {err}") from None
    if isinstance(data, dict) and isinstance(data.get("module"), dict):
        data = data["module"]  # DeepSpeed's model-states file keeps the weights under "module"
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise ValueError(f"checkpoint file {path} does not hold a state dict ({{name: tensor}})")
    return data


def _from_description(description: dict, folder: Path, where: str) -> tuple[dict, str]:
    kind = str(description.get("type", "")).lower()
    if kind == "megatron":
        raise ValueError(f"{where}: 'type': 'Megatron' checkpoints (tensor-parallel shards) are not supported; "
                         f"load the full weights into the model, or give a 'ds_model' / 'HuggingFace' checkpoint")
    if kind not in CHECKPOINT_TYPES:
        raise ValueError(f"{where}: 'type' must be one of 'ds_model', 'HuggingFace', got {description.get('type')!r}")
    files = description.get("checkpoints")
    if isinstance(files, str):
        files = [files]
    if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
        raise ValueError(f"{where}: 'checkpoints' must be a file or a non-empty list of files, got {files!r}")
    merged = {}
    for name in files:
        path = Path(name) if Path(name).is_absolute() else folder / name
        for key, value in _read_weights(path).items():
            if key in merged:
                raise ValueError(f"{where}: key {key!r} appears in more than one of its files ({path})")
            merged[key] = value
    return merged, f"{where} ({', '.join(files)})"


def _untied(model: nn.Module, missing: list[str], loaded: set[str]) -> list[str]:
    """The missing keys that are not tied to a loaded tensor (transformers drops tied copies such
    as ``lm_head.weight`` when it saves)."""
    tensors = dict(model.state_dict(keep_vars=True))
    loaded_storage = {tensors[k].data_ptr() for k in loaded if k in tensors}
    return [k for k in missing if k not in tensors or tensors[k].data_ptr() not in loaded_storage]


def load_checkpoint(model: nn.Module, checkpoint, base_dir: str = "") -> str:
    """Load ``checkpoint`` into ``model`` (see the module docstring); returns what was loaded."""
    if isinstance(checkpoint, dict) and "checkpoints" in checkpoint and "type" in checkpoint:
        state, where = _from_description(checkpoint, Path(base_dir or "."), "checkpoint description")
    elif isinstance(checkpoint, dict):
        state, where = checkpoint, "checkpoint state dict"
    elif isinstance(checkpoint, (str, Path)):
        path = Path(checkpoint)
        if path.suffix == ".json":
            if not path.is_file():
                raise ValueError(f"checkpoint description {path} does not exist")
            try:
                description = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"checkpoint description {path} is not valid JSON: {err}") from None
            if not isinstance(description, dict):
                raise ValueError(f"checkpoint description {path} must hold a JSON object")
            state, where = _from_description(description, Path(base_dir) if base_dir else path.parent, str(path))
        else:
            state, where = _read_weights(path), str(path)
    else:
        raise ValueError(f"checkpoint must be a state dict, a weights file or a checkpoint description, "
                         f"got {type(checkpoint).__name__}")
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a tensor of the wrong shape
        raise ValueError(f"checkpoint {where} does not fit {type(model).__name__}: {err}") from None
    missing = _untied(model, list(result.missing_keys), set(state))
    unexpected = list(result.unexpected_keys)
    if missing or unexpected:
        raise ValueError(f"checkpoint {where} does not fit {type(model).__name__}: missing keys {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}, unexpected keys {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
    return where
