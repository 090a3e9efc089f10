"""Suite configs: ``suites/<name>/suite.json``.

A suite names a model family, the cases it measures (a sequence length, a micro-batch, optionally
a model preset and a family of their own per case), the scales (``full`` for GPUs, ``tiny`` for a
CPU, seconds long), the precision, the engine config in DeepSpeed's keys, the warm-up/measured
steps and trials, and the arms. A scale may override any of the run settings and every case's fields::

    {
      "name": "bert_large",
      "family": "bert",
      "precision": "bf16",
      "engine": {"optimizer": {...}, "gradient_clipping": 1.0},
      "arms": ["dslab", "torch", "torch-compile", "torch-compile-ro", "hf"],
      "scales": {
        "full": {"preset": "bert_large", "warmup_steps": 10, "steps": 30, "trials": 5,
                 "cases": [{"name": "seq128", "seq_len": 128, "micro_batch": 64}]},
        "tiny": {...}
      }
    }

A suite may mix families: a case with ``"family"`` runs that family instead of the suite's, and
then names its ``"preset"`` (the scale's preset belongs to the suite's family). ``suites/moe`` times
the MoE layer alone (``moe_layer``) beside GPT-2-MoE (``gpt2_moe``) this way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, get_args

from pydantic import Field, model_validator

from dslab.config_base import ConfigSection, parse_section

ArmName = Literal["dslab", "torch", "torch-compile", "torch-compile-ro", "hf"]
ARMS: tuple[str, ...] = get_args(ArmName)  # dslab/bench/arms.py says what each arm runs
FamilyName = Literal["bert", "gpt2", "gpt2_moe", "moe_layer"]
FAMILIES: tuple[str, ...] = get_args(FamilyName)  # dslab/bench/workloads.py says what each trains
SCALES = ("full", "tiny")
SUITE_FILE = "suite.json"


class CaseConfig(ConfigSection):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    seq_len: int = Field(ge=2)
    micro_batch: int = Field(ge=1)
    preset: str | None = None
    family: FamilyName | None = None
    model_options: dict = Field(default_factory=dict)


class ScaleConfig(ConfigSection):
    preset: str
    cases: list[CaseConfig] = Field(min_length=1)
    arms: list[ArmName] | None = None
    warmup_steps: int = Field(10, ge=0)
    steps: int = Field(30, ge=1)
    trials: int = Field(5, ge=1)

    @model_validator(mode="after")
    def _unique_cases(self):
        names = [c.name for c in self.cases]
        if len(names) != len(set(names)):
            raise ValueError(f"case names must be unique, got {names}")
        return self


class SuiteConfig(ConfigSection):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    family: FamilyName
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    model_options: dict = Field(default_factory=dict)
    engine: dict = Field(default_factory=dict)
    arms: list[ArmName] = Field(default_factory=lambda: list(ARMS))
    scales: dict[Literal["full", "tiny"], ScaleConfig]
    seed: int = 1234

    @model_validator(mode="after")
    def _checks(self):
        if "dslab" not in self.arms:
            raise ValueError("'arms' must include 'dslab' (the arm every ratio is taken against)")
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                    "bf16", "fp16"):
            if key in self.engine:
                raise ValueError(
                    f"'engine.{key}' is set by the suite runner from the case's micro_batch and the "
                    f"suite's precision; remove it"
                )
        for scale_name, scale in self.scales.items():
            for case in scale.cases:
                if case.family not in (None, self.family) and case.preset is None:
                    raise ValueError(
                        f"scales.{scale_name}: case {case.name!r} has family {case.family!r}, not the suite's "
                        f"{self.family!r}, so it must name its own 'preset' (the scale's preset "
                        f"{scale.preset!r} is a {self.family} preset)"
                    )
        return self


def load_suite(path: str | Path) -> tuple[SuiteConfig, Path]:
    """Read a suite from its directory (holding suite.json) or the JSON file itself."""
    path = Path(path)
    file = path / SUITE_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no suite at {path} (expected {file})")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"suite file {file} is not valid JSON: {err}") from None
    try:
        suite = parse_section(SuiteConfig, data)
    except ValueError as err:
        raise ValueError(f"suite file {file}: {err}") from None
    return suite, file


def select_arms(suite: SuiteConfig, requested: list[str] | None, scale: str | None = None) -> list[str]:
    """The requested arms (dslab always first among them), or the scale's, or the suite's."""
    if not requested:
        scale_arms = suite.scales[scale].arms if scale in suite.scales else None
        arms = list(scale_arms or suite.arms)
        return ["dslab", *[a for a in arms if a != "dslab"]]
    unknown = [a for a in requested if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    return list(dict.fromkeys(["dslab", *requested]))


def select_cases(scale: ScaleConfig, requested: list[str] | None) -> list[CaseConfig]:
    if not requested:
        return list(scale.cases)
    names = [c.name for c in scale.cases]
    unknown = [c for c in requested if c not in names]
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; this scale has {', '.join(names)}")
    return [c for c in scale.cases if c.name in requested]
