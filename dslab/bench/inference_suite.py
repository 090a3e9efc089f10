"""Inference suite configs: a ``suite.json`` with ``"kind": "inference"``.

::

    {
      "name": "gpt2_inference", "kind": "inference", "family": "gpt2", "precision": "bf16",
      "inference": {"enable_cuda_graph": true},      # init_inference's keys for the dslab arms
      "arms": ["dslab", "dslab-int8", "hf", "hf-static"],
      "compare_tokens": 32,
      "telemetry": {"enabled": true, "interval_ms": 500},   # NVML samples while each case runs
      "scales": {
        "full": {"preset": "gpt2_124m", "warmup_steps": 2, "steps": 3, "trials": 3,
                 "cases": [{"name": "124m-b1", "batch": 1, "prompt_len": 32, "max_new_tokens": 128}]},
        "tiny": {...}
      }
    }

A case is a model preset (:mod:`dslab.models.gpt2`'s ``gpt2_*``, or for ``"family": "llama"``
:mod:`dslab.models.llama`'s ``llama*``; the scale's unless the case names one), a batch of prompts of ``prompt_len`` tokens and ``max_new_tokens`` to generate. A step is
one ``generate`` call; ``warmup_steps`` calls precede each arm's first trial (compilation,
autotuning, graph capture), later trials settle with one.

The arms (:mod:`dslab.bench.inference`):

- ``dslab``: :func:`dslab.init_inference` of transformers' model (the one the hf arms run), in the
  suite's precision, with the suite's ``inference`` keys;
- ``dslab-int8``: the same with ``dtype=torch.int8`` (activations in the suite's precision);
- ``hf``: transformers' ``generate``, eager, dynamic KV cache;
- ``hf-static``: transformers' ``generate`` with ``cache_implementation="static"`` (on CUDA
  transformers compiles the model's forward for it; on a CPU it does not compile).

``dtype`` and ``max_out_tokens`` of the dslab arms are set by the runner (the precision, the arm,
and the case's prompt + new tokens); the suite's ``inference`` section may not set them.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, model_validator

from dslab.config_base import ConfigSection
from dslab.profilers.telemetry import TelemetryConfig

INFERENCE_KIND = "inference"
InferenceArmName = Literal["dslab", "dslab-int8", "hf", "hf-static"]
INFERENCE_ARMS: tuple[str, ...] = get_args(InferenceArmName)
RUNNER_KEYS = ("dtype", "max_out_tokens", "max_tokens")


class InferenceCase(ConfigSection):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    preset: str | None = None
    batch: int = Field(ge=1)
    prompt_len: int = Field(ge=1)
    max_new_tokens: int = Field(ge=1)
    model_options: dict = Field(default_factory=dict)


class InferenceScale(ConfigSection):
    preset: str
    cases: list[InferenceCase] = Field(min_length=1)
    arms: list[InferenceArmName] | None = None
    warmup_steps: int = Field(2, ge=0)
    steps: int = Field(3, ge=1)
    trials: int = Field(3, ge=1)

    @model_validator(mode="after")
    def _unique_cases(self):
        names = [c.name for c in self.cases]
        if len(names) != len(set(names)):
            raise ValueError(f"case names must be unique, got {names}")
        return self


class InferenceSuiteConfig(ConfigSection):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    kind: Literal["inference"]
    description: str = ""
    family: Literal["gpt2", "llama"] = "gpt2"
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    model_options: dict = Field(default_factory=dict)
    inference: dict = Field(default_factory=dict)
    arms: list[InferenceArmName] = Field(default_factory=lambda: list(INFERENCE_ARMS))
    compare_tokens: int = Field(32, ge=1)
    telemetry: TelemetryConfig = TelemetryConfig()
    scales: dict[Literal["full", "tiny"], InferenceScale]
    seed: int = 1234

    @model_validator(mode="after")
    def _checks(self):
        if "dslab" not in self.arms:
            raise ValueError("'arms' must include 'dslab' (the arm every ratio is taken against)")
        for key in RUNNER_KEYS:
            if key in self.inference:
                raise ValueError(f"'inference.{key}' is set by the suite runner from the precision, the arm and the "
                                 f"case's prompt_len + max_new_tokens; remove it")
        from dslab.inference.config import resolve_config

        resolve_config(self.inference, {})  # a bad key is an error now, naming it
        return self


def select_inference_arms(suite: InferenceSuiteConfig, requested: list[str] | None, scale: str) -> list[str]:
    """The requested arms (dslab first), or the scale's, or the suite's; ValueError for an
    unknown arm (naming this kind of suite's arms)."""
    if not requested:
        scale_arms = suite.scales[scale].arms if scale in suite.scales else None
        arms = list(scale_arms or suite.arms)
        return ["dslab", *[a for a in arms if a != "dslab"]]
    unknown = [a for a in requested if a not in INFERENCE_ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)} for inference suite {suite.name}; choose from "
                         f"{', '.join(INFERENCE_ARMS)}")
    return list(dict.fromkeys(["dslab", *requested]))


def select_inference_cases(scale: InferenceScale, requested: list[str] | None) -> list[InferenceCase]:
    if not requested:
        return list(scale.cases)
    names = [c.name for c in scale.cases]
    unknown = [c for c in requested if c not in names]
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; this scale has {', '.join(names)}")
    return [c for c in scale.cases if c.name in requested]
