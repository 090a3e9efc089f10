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

A case's shape is its ``seq_len`` and ``micro_batch``, except for the families whose preset fixes
the shape (:data:`SHAPED_BY_PRESET`: the Evoformer's ``n_seq`` x ``n_res`` crop); their cases give
no ``seq_len`` and change the shape through ``model_options``.

Some arms run only some families (:data:`ARM_FAMILIES`): ``sdpa`` needs a model with an SDPA
kernel set, ``hf`` a model transformers has. A suite, a scale or ``--arms`` naming an arm for a
case whose family cannot run it is an error that names both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, get_args

from pydantic import Field, model_validator

from dslab.config_base import ConfigSection, parse_section

ArmName = Literal["dslab", "torch", "torch-compile", "torch-compile-ro", "hf", "sdpa", "liger"]
ARMS: tuple[str, ...] = get_args(ArmName)  # dslab/bench/arms.py says what each arm runs
FamilyName = Literal["bert", "gpt2", "gpt2_moe", "moe_layer", "evoformer", "llama"]
FAMILIES: tuple[str, ...] = get_args(FamilyName)  # dslab/bench/workloads.py says what each trains
# The arms that only some families can run, and why the others cannot; every other arm runs every family.
ARM_FAMILIES: dict[str, tuple[tuple[str, ...], str]] = {
    "hf": (("bert", "gpt2", "gpt2_moe", "moe_layer", "llama"), "transformers has no model of it"),
    "sdpa": (("evoformer",), "its models have no 'sdpa' kernel set"),
    "liger": (("llama",), "Liger-Kernel patches transformers' Llama here, no other model"),
}
# Families whose preset fixes a case's shape: their cases give no seq_len.
SHAPED_BY_PRESET = ("evoformer",)
SCALES = ("full", "tiny")
SUITE_FILE = "suite.json"
# The repository's suites, listed when a suite path names none (a source checkout has them).
REPO_SUITES = Path(__file__).resolve().parents[2] / "suites"


class CaseConfig(ConfigSection):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    seq_len: int | None = Field(None, ge=2)
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
    # Default: every arm the suite's family can run (:func:`family_arms`).
    arms: list[ArmName] = Field(default_factory=lambda: ["dslab"])
    scales: dict[Literal["full", "tiny"], ScaleConfig]
    seed: int = 1234

    @model_validator(mode="before")
    @classmethod
    def _default_arms(cls, data):
        if isinstance(data, dict) and "arms" not in data and data.get("family") in FAMILIES:
            data = {**data, "arms": list(family_arms(data["family"]))}
        return data

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
                family = case.family or self.family
                if case.family not in (None, self.family) and case.preset is None:
                    raise ValueError(
                        f"scales.{scale_name}: case {case.name!r} has family {case.family!r}, not the suite's "
                        f"{self.family!r}, so it must name its own 'preset' (the scale's preset "
                        f"{scale.preset!r} is a {self.family} preset)"
                    )
                if family in SHAPED_BY_PRESET and case.seq_len is not None:
                    raise ValueError(
                        f"scales.{scale_name}: case {case.name!r} ({family}) takes its shape from its preset; "
                        f"remove 'seq_len' (change the shape with 'model_options')"
                    )
                if family not in SHAPED_BY_PRESET and case.seq_len is None:
                    raise ValueError(f"scales.{scale_name}: case {case.name!r} ({family}) needs a 'seq_len'")
            where = f"scales.{scale_name}.arms" if scale.arms is not None else "arms"
            check_arms(scale.arms or self.arms, [c.family or self.family for c in scale.cases], where)
        return self


def family_arms(family: str) -> tuple[str, ...]:
    """Every arm ``family`` can run, in :data:`ARMS` order."""
    return tuple(a for a in ARMS if a not in ARM_FAMILIES or family in ARM_FAMILIES[a][0])


def check_arms(arms: list[str], families: list[str], where: str | None = None) -> None:
    """ValueError naming the arm and the family when one of ``arms`` cannot run one of ``families``
    (``where``: the key or option that named the arms, to begin the message with)."""
    for arm in arms:
        if arm not in ARM_FAMILIES:
            continue
        runs, reason = ARM_FAMILIES[arm]
        for family in dict.fromkeys(families):
            if family not in runs:
                raise ValueError(f"{where + ': ' if where else ''}arm {arm!r} cannot run family {family!r}: "
                                 f"{reason} (arm {arm!r} runs {', '.join(runs)})")


def load_suite(path: str | Path) -> tuple[SuiteConfig, Path]:
    """Read a suite from its directory (holding suite.json) or the JSON file itself. A suite with
    ``"kind": "inference"`` is an :class:`dslab.bench.inference_suite.InferenceSuiteConfig`, one
    with ``"kind": "data_parallel"`` a
    :class:`dslab.bench.data_parallel_suite.DataParallelSuiteConfig`, one with ``"kind":
    "model_parallel"`` a :class:`dslab.bench.model_parallel_suite.ModelParallelSuiteConfig`, one with
    ``"kind": "long_context"`` a :class:`dslab.bench.long_context_suite.LongContextSuiteConfig`."""
    path = Path(path)
    file = path / SUITE_FILE if path.is_dir() else path
    if not file.is_file():
        folder, names = suites_near(path)
        found = (f"suites under {folder}: {', '.join(names)}" if names else
                 f"no suite (a folder holding {SUITE_FILE}) under {_search_folders(path)[0]} or {REPO_SUITES}")
        expected = file if file.suffix == ".json" else file / SUITE_FILE
        raise FileNotFoundError(f"no suite at {path} (expected {expected}); {found}")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"suite file {file} is not valid JSON: {err}") from None
    model = SuiteConfig
    if isinstance(data, dict) and data.get("kind") == "inference":
        from dslab.bench.inference_suite import InferenceSuiteConfig as model
    elif isinstance(data, dict) and data.get("kind") == "data_parallel":
        from dslab.bench.data_parallel_suite import DataParallelSuiteConfig as model
    elif isinstance(data, dict) and data.get("kind") == "model_parallel":
        from dslab.bench.model_parallel_suite import ModelParallelSuiteConfig as model
    elif isinstance(data, dict) and data.get("kind") == "long_context":
        from dslab.bench.long_context_suite import LongContextSuiteConfig as model
    try:
        suite = parse_section(model, data)
    except ValueError as err:
        raise ValueError(f"suite file {file}: {err}") from None
    return suite, file


def _search_folders(path: Path) -> list[Path]:
    """Where the suites beside ``path`` would be: the folder holding it (the one above, for a
    path to a suite.json), then the repository's ``suites/``."""
    beside = path.parent.parent if path.name == SUITE_FILE else path.parent
    return [beside, REPO_SUITES]


def suites_near(path: str | Path) -> tuple[Path, list[str]]:
    """The suites beside ``path`` (folders holding a suite.json in the folder that holds it), or
    if there are none there, the repository's ``suites/``: the folder searched and the suites'
    names, sorted (no names when neither has one)."""
    folders = _search_folders(Path(path))
    for folder in folders:
        if folder.is_dir():
            names = sorted(d.name for d in folder.iterdir() if (d / SUITE_FILE).is_file())
            if names:
                return folder, names
    return folders[-1], []


def select_arms(suite: SuiteConfig, requested: list[str] | None, scale: str | None = None) -> list[str]:
    """The requested arms (dslab always first among them), or the scale's, or the suite's."""
    if not requested:
        scale_arms = suite.scales[scale].arms if scale in suite.scales else None
        arms = list(scale_arms or suite.arms)
        return ["dslab", *[a for a in arms if a != "dslab"]]
    unknown = [a for a in requested if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    scales = [suite.scales[scale]] if scale in suite.scales else list(suite.scales.values())
    check_arms(requested, [c.family or suite.family for sc in scales for c in sc.cases], "--arms")
    return list(dict.fromkeys(["dslab", *requested]))


def select_cases(scale: ScaleConfig, requested: list[str] | None) -> list[CaseConfig]:
    if not requested:
        return list(scale.cases)
    names = [c.name for c in scale.cases]
    unknown = [c for c in requested if c not in names]
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; this scale has {', '.join(names)}")
    return [c for c in scale.cases if c.name in requested]
