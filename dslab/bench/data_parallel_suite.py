"""Data-parallel suite configs: a ``suite.json`` with ``"kind": "data_parallel"`` (``suites/zero``).

::

    {
      "name": "zero", "kind": "data_parallel", "family": "gpt2", "precision": "bf16",
      "engine": {"optimizer": {...}, "gradient_clipping": 1.0, "zero_optimization": {...}},
      "arms": ["dslab-zero0", ..., "dslab-zero3", "dslab-zero3-offload", "ddp", "fsdp2",
               "fsdp2-compile", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"],
      "scales": {
        "full": {"preset": "gpt2_355m", "nprocs": null, "warmup_steps": 5, "steps": 10, "trials": 3,
                 "cases": [{"name": "355m", "seq_len": 1024, "micro_batch": 8}]},
        "tiny": {"preset": "gpt2_tiny", "nprocs": [1, 2], ...}
      }
    }

Each case runs on every process count of ``nprocs`` (``dslab bench --nprocs`` overrides it; null:
1, 2, 4, ... up to the GPUs of the machine, and the GPU count itself), every process stepping the
case's ``micro_batch``, and is named after both: ``355m-n4``. ``dslab bench`` starts the
processes itself, one torchrun per process count (:mod:`dslab.bench.launcher`).

The arms (:mod:`dslab.bench.data_parallel`; the peers in :mod:`dslab.bench.peers`):

- ``dslab-zero0`` ... ``dslab-zero3``: dslab's engine on dslab's kernels at that ZeRO stage,
  with the suite engine's other ``zero_optimization`` keys; ``dslab-zero3-offload`` adds
  ``offload_optimizer: {device: cpu, pin_memory: true}``.
- ``ddp``, ``fsdp2``, ``fsdp2-compile``: PyTorch-native data parallelism over the same model on
  torch's kernels.
- ``deepspeed-zero1`` ... ``-zero3``: DeepSpeed's engine over dslab's model and kernels, when
  ``deepspeed`` imports (else recorded as skipped with the reason).
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, model_validator

from dslab.config_base import ConfigSection

DATA_PARALLEL_KIND = "data_parallel"
DataParallelArmName = Literal[
    "dslab-zero0", "dslab-zero1", "dslab-zero2", "dslab-zero3", "dslab-zero3-offload",
    "ddp", "fsdp2", "fsdp2-compile", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3",
]
DATA_PARALLEL_ARMS: tuple[str, ...] = get_args(DataParallelArmName)
DSLAB_ARMS: tuple[str, ...] = tuple(a for a in DATA_PARALLEL_ARMS if a.startswith("dslab-"))
# The families whose blocks FSDP2 and DeepSpeed's stage 3 can wrap here.
DataParallelFamily = Literal["gpt2", "bert"]
DATA_PARALLEL_FAMILIES: tuple[str, ...] = get_args(DataParallelFamily)


class DataParallelCase(ConfigSection):
    """A model case: its sequence length, the micro-batch every process steps, and optionally a
    preset and model options of its own."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.]+$")  # no '-': '-n<N>' is appended per process count
    seq_len: int = Field(ge=2)
    micro_batch: int = Field(ge=1)
    preset: str | None = None
    model_options: dict = Field(default_factory=dict)

    @property
    def family(self) -> None:
        """Every case runs the suite's family."""
        return None


class DataParallelScale(ConfigSection):
    preset: str
    cases: list[DataParallelCase] = Field(min_length=1)
    arms: list[DataParallelArmName] | None = None
    # process counts; None: 1, 2, 4, ... up to the machine's GPUs, and their count
    nprocs: list[int] | None = None
    warmup_steps: int = Field(5, ge=0)
    steps: int = Field(10, ge=1)
    trials: int = Field(3, ge=1)

    @model_validator(mode="after")
    def _checks(self):
        names = [c.name for c in self.cases]
        if len(names) != len(set(names)):
            raise ValueError(f"case names must be unique, got {names}")
        if self.nprocs is not None:
            check_nprocs(self.nprocs, "nprocs")
        return self


class DataParallelSuiteConfig(ConfigSection):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    kind: Literal["data_parallel"]
    description: str = ""
    family: DataParallelFamily
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    model_options: dict = Field(default_factory=dict)
    engine: dict = Field(default_factory=dict)
    arms: list[DataParallelArmName] = Field(default_factory=lambda: list(DATA_PARALLEL_ARMS))
    scales: dict[Literal["full", "tiny"], DataParallelScale]
    seed: int = 1234

    @model_validator(mode="after")
    def _checks(self):
        for scale_name, scale in self.scales.items():
            arms = scale.arms or self.arms
            if not any(a in DSLAB_ARMS for a in arms):
                raise ValueError(f"{'scales.' + scale_name + '.arms' if scale.arms else 'arms'} must include a "
                                 f"dslab arm ({', '.join(DSLAB_ARMS)})")
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                    "bf16", "fp16"):
            if key in self.engine:
                raise ValueError(f"'engine.{key}' is set by the suite runner from the case's micro_batch and the "
                                 f"suite's precision; remove it")
        stage = (self.engine.get("zero_optimization") or {}).get("stage")
        if stage is not None:
            raise ValueError("'engine.zero_optimization.stage' is set by each arm (dslab-zero0 ... dslab-zero3); "
                             "remove it")
        return self


def check_nprocs(nprocs: list[int], where: str) -> list[int]:
    """``nprocs`` sorted, each once; ValueError naming ``where`` for a count below 1 or none."""
    if not nprocs:
        raise ValueError(f"{where}: give at least one process count")
    bad = [n for n in nprocs if isinstance(n, bool) or not isinstance(n, int) or n < 1]
    if bad:
        raise ValueError(f"{where}: process counts must be whole numbers >= 1, got {bad}")
    return sorted(set(nprocs))


def parse_nprocs(text: str) -> list[int]:
    """``--nprocs 1,2,4`` as a list; ValueError naming the option for anything else."""
    counts = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if not (item.isascii() and item.isdigit()):
            raise ValueError(f"--nprocs {text!r}: {item!r} is not a process count; give e.g. 1,2,4")
        counts.append(int(item))
    return check_nprocs(counts, "--nprocs")


def default_nprocs(gpus: int) -> list[int]:
    """1, 2, 4, ... up to ``gpus``, and ``gpus`` itself (2 gloo processes, [1, 2], without a GPU)."""
    if gpus < 1:
        return [1, 2]
    counts, n = [], 1
    while n <= gpus:
        counts.append(n)
        n *= 2
    return sorted(set(counts + [gpus]))


def select_data_parallel_arms(suite: DataParallelSuiteConfig, requested: list[str] | None, scale: str) -> list[str]:
    """The requested arms, or the scale's, or the suite's; ValueError for an unknown arm, or for a
    selection without a dslab arm."""
    if requested:
        unknown = [a for a in requested if a not in DATA_PARALLEL_ARMS]
        if unknown:
            raise ValueError(f"unknown arm(s) {', '.join(unknown)} for data-parallel suite {suite.name}; choose from "
                             f"{', '.join(DATA_PARALLEL_ARMS)}")
        arms = list(dict.fromkeys(requested))
    else:
        arms = list(suite.scales[scale].arms or suite.arms)
    if not any(a in DSLAB_ARMS for a in arms):
        raise ValueError(f"--arms {','.join(arms)}: include a dslab arm ({', '.join(DSLAB_ARMS)}); the "
                         f"comparisons are taken against them")
    return arms
