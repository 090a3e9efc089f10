"""Model-parallel suite configs: a ``suite.json`` with ``"kind": "model_parallel"``
(``suites/parallel``), and the arm names, which are parallel layouts.

::

    {
      "name": "parallel", "kind": "model_parallel", "family": "gpt2", "precision": "bf16",
      "model_options": {"vocab_pad_multiple": 64, "dropout": 0.0},
      "engine": {"optimizer": {...}, "gradient_clipping": 1.0},
      "arms": ["dslab-dp", "dslab-tp2dp2", "dslab-pp4", "dslab-pp2dp2", "dslab-tp2pp2",
               "torch-tp2dp2", "torch-pp4", "deepspeed-pp4"],
      "scales": {
        "full": {"preset": "gpt2_1558m", "nprocs": [4], "warmup_steps": 2, "steps": 4, "trials": 3,
                 "cases": [{"name": "1.5b", "seq_len": 1024, "micro_batch": 4, "global_batch": 64}]},
        "tiny": {"preset": "gpt2_tiny", "nprocs": [2, 4], ...}
      }
    }

An arm is ``<implementation>-<layout>``. A layout is ``dp`` (every rank data parallel) or a
product of ``tpK`` (tensor parallel over K ranks), ``ppK`` (K pipeline stages) and ``dpK`` (K
data-parallel replicas), in that order: ``tp2``, ``pp4``, ``tp2dp2``, ``pp2dp2``, ``tp2pp2``. A
factor left out is 1, so every layout but ``dp`` needs exactly the product of its factors in
processes; on a launch of another size its arms are skipped, with the reason in the report.
Naming a ``pp`` factor runs a pipeline engine (``pp1``: one stage, what the pipeline machinery
costs where it has nothing to overlap). A layout that cannot split a case's model (its heads, MLP
width or padded vocabulary over ``tp``, its blocks over ``pp``) is skipped on that case with the
reason, as is one whose replicas cannot share the case's global batch out: GPT-2 XL's 25 heads do
not split over 2 tensor-parallel ranks. The implementations:

- ``dslab``: every layout. ``dslab.initialize`` with ``mpu=`` a
  :class:`~dslab.parallel.topology.PipelineParallelGrid` over dslab's GPT-2 (tensor parallel with
  ``tp_size``), or the pipeline engine over :func:`dslab.models.gpt2_pipe.gpt2_pipeline_module`;
  ZeRO stage 1 over the data-parallel group where the layout has one (``dp`` > 1), else 0.
- ``torch``: ``tpK`` and ``tpKdpM`` (``parallelize_module`` on a ``DeviceMesh``, FSDP2 over the
  data-parallel dimension) and ``ppK`` (``torch.distributed.pipelining``, ``Schedule1F1B``).
- ``deepspeed``: ``ppK`` and ``ppKdpM`` (DeepSpeed's ``PipelineModule`` and pipeline engine on
  dslab's layers).

:mod:`dslab.bench.model_parallel` and :mod:`dslab.bench.model_parallel_peers` say what each runs.

A case names its ``global_batch``: the sequences of one optimizer step, the same for every arm.
An arm with ``D`` data-parallel replicas runs ``global_batch / (micro_batch * D)`` micro-batches
per step on each replica (the pipeline's micro-batches, or gradient accumulation); a layout where
that is not a whole number is skipped. ``activation_checkpoint_interval`` (default 0) checkpoints
the pipeline arms' layers in runs of that many (dslab's and DeepSpeed's
``activation_checkpoint_interval``, ``torch.utils.checkpoint`` around runs of blocks for
``torch-pp``); the other arms keep their activations.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dslab.bench.common import ArmSkipped
from dslab.bench.data_parallel_suite import check_nprocs
from dslab.config_base import ConfigSection

MODEL_PARALLEL_KIND = "model_parallel"
IMPLEMENTATIONS = ("dslab", "torch", "deepspeed")
_LAYOUT = re.compile(r"^(?:tp(?P<tp>[1-9][0-9]*))?(?:pp(?P<pp>[1-9][0-9]*))?(?:dp(?P<dp>[1-9][0-9]*))?$")


@dataclass(frozen=True)
class Layout:
    """A parallel layout: ``tp`` tensor-parallel ranks, ``pp`` pipeline stages, ``dp``
    data-parallel replicas (None: every rank the other two leave, the ``dp`` layout), and whether
    it runs a pipeline engine (a ``pp`` factor was named)."""

    name: str
    tp: int
    pp: int
    dp: int | None
    pipeline: bool

    @property
    def processes(self) -> int | None:
        """The processes the layout needs (None: any number, the ``dp`` layout)."""
        return None if self.dp is None else self.tp * self.pp * self.dp

    def sizes(self, world: int) -> tuple[int, int, int]:
        """``(tp, pp, dp)`` on ``world`` processes; :class:`ArmSkipped` when the layout needs another
        number of them."""
        if self.dp is None:
            return self.tp, self.pp, world
        if self.processes != world:
            raise ArmSkipped(f"layout {self.name} needs {self.processes} process(es); this launch has {world}")
        return self.tp, self.pp, self.dp


def parse_layout(text: str) -> Layout:
    """The :class:`Layout` named ``text``: ``dp``, or ``tpK``, ``ppK``, ``dpK`` in that order
    (ValueError otherwise)."""
    if text == "dp":
        return Layout(name=text, tp=1, pp=1, dp=None, pipeline=False)
    match = _LAYOUT.match(text)
    if not text or match is None:
        raise ValueError(f"layout {text!r}: 'dp', or a product of tpK, ppK and dpK in that order "
                         f"(tp2, pp4, tp2dp2, pp2dp2, tp2pp2)")
    tp, pp, dp = (int(match[k]) if match[k] else 1 for k in ("tp", "pp", "dp"))
    return Layout(name=text, tp=tp, pp=pp, dp=dp, pipeline=match["pp"] is not None)


def parse_arm(name: str) -> tuple[str, Layout]:
    """``(implementation, layout)`` of arm ``name``; ValueError for a name, or an implementation
    and layout pair, that no arm runs (see the module docstring)."""
    impl, _, layout_name = name.partition("-")
    if impl not in IMPLEMENTATIONS or not layout_name:
        raise ValueError(f"arm {name!r}: name it <implementation>-<layout> with an implementation of "
                         f"{', '.join(IMPLEMENTATIONS)} (dslab-dp, dslab-tp2dp2, torch-pp4, deepspeed-pp2dp2)")
    try:
        layout = parse_layout(layout_name)
    except ValueError as err:
        raise ValueError(f"arm {name!r}: {err}") from None
    if impl == "torch":
        tensor = not layout.pipeline and layout.tp > 1
        pipeline = layout.pipeline and layout.tp == 1 and layout.dp == 1
        if not (tensor or pipeline):
            raise ValueError(f"arm {name!r}: the torch arms are tensor parallel (tpK, tpKdpM: parallelize_module) or "
                             f"one pipeline over all their ranks (ppK: torch.distributed.pipelining); data "
                             f"parallelism alone is suites/zero's ddp and fsdp2")
    if impl == "deepspeed" and not (layout.pipeline and layout.tp == 1):
        raise ValueError(f"arm {name!r}: the deepspeed arms are pipelines (ppK, ppKdpM: DeepSpeed's PipelineModule); "
                         f"its data parallelism alone is suites/zero's deepspeed-zeroK")
    return impl, layout


def micro_batches_per_step(global_batch: int, micro_batch: int, dp: int, layout: str) -> int:
    """Micro-batches per optimizer step on each data-parallel replica; :class:`ArmSkipped` when
    ``global_batch`` is not a whole number of them."""
    if global_batch % (micro_batch * dp):
        raise ArmSkipped(f"layout {layout}: the global batch of {global_batch} sequences is not a whole number of "
                         f"micro-batches of {micro_batch} over {dp} data-parallel replica(s)")
    return global_batch // (micro_batch * dp)


def layout_peers(arms: list[str]) -> dict[str, list[str]]:
    """Each dslab arm of ``arms`` and the peer arms of ``arms`` with its layout (the report's
    ``config.peers``, which the scaling summary compares)."""
    out: dict[str, list[str]] = {}
    for arm in arms:
        impl, layout = parse_arm(arm)
        if impl == "dslab":
            out[arm] = [a for a in arms if a != arm and parse_arm(a)[1].name == layout.name]
    return out


class ModelParallelCase(ConfigSection):
    """A model case: its sequence length, the micro-batch a replica steps, the sequences of one
    optimizer step, the pipeline arms' checkpointing, and optionally a preset and model options of
    its own."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.]+$")  # no '-': '-n<N>' is appended per process count
    seq_len: int = Field(ge=2)
    micro_batch: int = Field(ge=1)
    global_batch: int = Field(ge=1)
    activation_checkpoint_interval: int = Field(0, ge=0)
    preset: str | None = None
    model_options: dict = Field(default_factory=dict)

    @property
    def family(self) -> None:
        """Every case runs the suite's family."""
        return None


class ModelParallelScale(ConfigSection):
    preset: str
    cases: list[ModelParallelCase] = Field(min_length=1)
    arms: list[str] | None = None
    # process counts; None: 1, 2, 4, ... up to the machine's GPUs, and their count
    nprocs: list[int] | None = None
    warmup_steps: int = Field(2, ge=0)
    steps: int = Field(4, ge=1)
    trials: int = Field(3, ge=1)

    @model_validator(mode="after")
    def _checks(self):
        names = [c.name for c in self.cases]
        if len(names) != len(set(names)):
            raise ValueError(f"case names must be unique, got {names}")
        if self.nprocs is not None:
            check_nprocs(self.nprocs, "nprocs")
        return self


class ModelParallelSuiteConfig(ConfigSection):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    kind: Literal["model_parallel"]
    description: str = ""
    family: Literal["gpt2"]
    # no fp16: the torch pipeline arms have no loss scale shared by their stages
    precision: Literal["bf16", "fp32"] = "bf16"
    model_options: dict = Field(default_factory=dict)
    engine: dict = Field(default_factory=dict)
    arms: list[str] = Field(min_length=1)
    scales: dict[Literal["full", "tiny"], ModelParallelScale]
    seed: int = 1234

    @field_validator("arms")
    @classmethod
    def _known_arms(cls, arms: list[str]) -> list[str]:
        for arm in arms:
            parse_arm(arm)
        return arms

    @model_validator(mode="after")
    def _checks(self):
        for scale_name, scale in self.scales.items():
            where = f"scales.{scale_name}.arms" if scale.arms else "arms"
            arms = scale.arms or self.arms
            try:
                check_arm_selection(arms)
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                    "bf16", "fp16"):
            if key in self.engine:
                raise ValueError(f"'engine.{key}' is set by the suite runner from the case's micro_batch and "
                                 f"global_batch and the suite's precision; remove it")
        if (self.engine.get("zero_optimization") or {}).get("stage") is not None:
            raise ValueError("'engine.zero_optimization.stage' is set by each arm (1 where its layout has data "
                             "parallelism, else 0); remove it")
        if (self.engine.get("cuda_graphs") or {}).get("enabled"):
            raise ValueError("'engine.cuda_graphs.enabled': dslab's tensor-parallel GPT-2 and its pipeline layers run "
                             "without CUDA graphs; remove it so that every layout runs the same way")
        return self


def check_arm_selection(arms: list[str]) -> None:
    """ValueError for an unknown arm, or a selection without a dslab arm."""
    impls = [parse_arm(a)[0] for a in arms]
    if "dslab" not in impls:
        raise ValueError(f"{', '.join(arms)}: include a dslab arm (dslab-<layout>); the comparisons are taken "
                         f"against them")


def select_model_parallel_arms(suite: ModelParallelSuiteConfig, requested: list[str] | None, scale: str) -> list[str]:
    """The requested arms (``--arms``), or the scale's, or the suite's; ValueError for an unknown
    arm or a selection without a dslab arm."""
    if not requested:
        return list(suite.scales[scale].arms or suite.arms)
    arms = list(dict.fromkeys(requested))
    try:
        check_arm_selection(arms)
    except ValueError as err:
        raise ValueError(f"--arms: {err}") from None
    return arms
