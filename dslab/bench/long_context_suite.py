"""Long-context suite configs: a ``suite.json`` with ``"kind": "long_context"`` (``suites/long_context``).

::

    {
      "name": "long_context", "kind": "long_context", "family": "llama", "precision": "bf16",
      "model_options": {"vocab_pad_multiple": 64, "checkpoint_layers": 1},
      "engine": {"optimizer": {...}, "gradient_clipping": 1.0, "zero_optimization": {"stage": 3}, ...},
      "arms": ["dslab-ulysses", "torch-cp"],
      "scales": {
        "full": {"preset": "llama3_1b", "model_options": {"hidden": 2048, ...}, "nprocs": [4],
                 "warmup_steps": 1, "steps": 3, "trials": 2,
                 "cases": [{"name": "32k", "seq_len": 32768}, ..., {"name": "256k", "seq_len": 262144}]},
        "tiny": {"preset": "llama_tiny", "model_options": {"max_positions": 512}, "nprocs": [2], ...}
      }
    }

Every case trains one sequence (``micro_batch``, default 1) of ``seq_len`` tokens split over all
the processes of a launch: the sequence-parallel degree is the launch's process count (``nprocs``;
``dslab bench --nprocs`` overrides it), and a case is named after both, ``32k-n4``. The model is
the scale's ``preset`` with the suite's ``model_options``, then the scale's, then the case's set on
it (so that one scale can name a shape the other's preset does not have).

The arms (:mod:`dslab.bench.long_context`; the peer in :mod:`dslab.bench.long_context_peers`):

- ``dslab-ulysses``: dslab's Llama on dslab's kernels in dslab's engine with the top-level
  ``sequence_parallel_size`` = the launch's processes (DeepSpeed-Ulysses: all-to-alls around
  attention), the suite engine's ZeRO stage over the sequence-data-parallel group;
- ``torch-cp``: the same model on PyTorch's ops (:class:`dslab.bench.torch_llama.TorchLlama`)
  under ``torch.distributed.tensor.experimental.context_parallel`` (ring attention inside SDPA)
  over a one-dimensional ``DeviceMesh`` of the launch's processes, FSDP2 (``fully_shard``) over
  the same mesh. CUDA only: skipped on a CPU with the reason.

The engine config is DeepSpeed's keys. The runner sets the batch keys, the precision and
``sequence_parallel_size`` (refused here), and the Llama's layer stack runs without CUDA graphs
under sequence parallelism (``cuda_graphs.enabled`` is refused by name).
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, model_validator

from dslab.bench.common import ArmSkipped
from dslab.bench.data_parallel_suite import check_nprocs
from dslab.config_base import ConfigSection

LONG_CONTEXT_KIND = "long_context"
LongContextArmName = Literal["dslab-ulysses", "torch-cp"]
LONG_CONTEXT_ARMS: tuple[str, ...] = get_args(LongContextArmName)
DSLAB_LONG_CONTEXT_ARMS: tuple[str, ...] = tuple(a for a in LONG_CONTEXT_ARMS if a.startswith("dslab-"))
# Each dslab arm and the peers that split the sequence over the same processes (the report's
# config.peers, which the scaling summary compares).
LONG_CONTEXT_PEERS: dict[str, tuple[str, ...]] = {"dslab-ulysses": ("torch-cp",)}
# The keys the runner sets in every arm's engine config.
RUNNER_ENGINE_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                      "bf16", "fp16", "sequence_parallel_size")


class LongContextCase(ConfigSection):
    """A case: the sequence length, the sequences of a step (``micro_batch``), and optionally a
    preset and model options of its own."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.]+$")  # no '-': '-n<N>' is appended per process count
    seq_len: int = Field(ge=2)
    micro_batch: int = Field(1, ge=1)
    preset: str | None = None
    model_options: dict = Field(default_factory=dict)

    @property
    def family(self) -> None:
        """Every case runs the suite's family."""
        return None


class LongContextScale(ConfigSection):
    preset: str
    # set on the preset after the suite's model_options and before each case's
    model_options: dict = Field(default_factory=dict)
    cases: list[LongContextCase] = Field(min_length=1)
    arms: list[LongContextArmName] | None = None
    # process counts, each the sequence-parallel degree of its launch; None: 1, 2, 4, ... up to
    # the machine's GPUs, and their count
    nprocs: list[int] | None = None
    warmup_steps: int = Field(1, ge=0)
    steps: int = Field(3, ge=1)
    trials: int = Field(2, ge=1)

    @model_validator(mode="after")
    def _checks(self):
        names = [c.name for c in self.cases]
        if len(names) != len(set(names)):
            raise ValueError(f"case names must be unique, got {names}")
        if self.nprocs is not None:
            check_nprocs(self.nprocs, "nprocs")
        return self


class LongContextSuiteConfig(ConfigSection):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    kind: Literal["long_context"]
    description: str = ""
    family: Literal["llama"]
    # no fp16: long-context training runs in bf16, and the torch-cp arm has no loss scaling
    precision: Literal["bf16", "fp32"] = "bf16"
    model_options: dict = Field(default_factory=dict)
    engine: dict = Field(default_factory=dict)
    arms: list[LongContextArmName] = Field(default_factory=lambda: list(LONG_CONTEXT_ARMS))
    scales: dict[Literal["full", "tiny"], LongContextScale]
    seed: int = 1234

    @model_validator(mode="after")
    def _checks(self):
        for scale_name, scale in self.scales.items():
            arms = scale.arms or self.arms
            if not any(a in DSLAB_LONG_CONTEXT_ARMS for a in arms):
                raise ValueError(f"{'scales.' + scale_name + '.arms' if scale.arms else 'arms'} must include a "
                                 f"dslab arm ({', '.join(DSLAB_LONG_CONTEXT_ARMS)})")
        for key in RUNNER_ENGINE_KEYS:
            if key in self.engine:
                raise ValueError(f"'engine.{key}' is set by the suite runner (the case's micro_batch, the suite's "
                                 f"precision, sequence_parallel_size = the launch's processes); remove it")
        if (self.engine.get("cuda_graphs") or {}).get("enabled"):
            raise ValueError("'engine.cuda_graphs.enabled': dslab's Llama runs its layer stack without CUDA graphs "
                             "under sequence parallelism (the all-to-alls inside it); remove it")
        return self


def select_long_context_arms(suite: LongContextSuiteConfig, requested: list[str] | None, scale: str) -> list[str]:
    """The requested arms (``--arms``), or the scale's, or the suite's; ValueError for an unknown
    arm or a selection without a dslab arm."""
    if requested:
        unknown = [a for a in requested if a not in LONG_CONTEXT_ARMS]
        if unknown:
            raise ValueError(f"unknown arm(s) {', '.join(unknown)} for long-context suite {suite.name}; choose from "
                             f"{', '.join(LONG_CONTEXT_ARMS)}")
        arms = list(dict.fromkeys(requested))
    else:
        arms = list(suite.scales[scale].arms or suite.arms)
    if not any(a in DSLAB_LONG_CONTEXT_ARMS for a in arms):
        raise ValueError(f"--arms {','.join(arms)}: include a dslab arm ({', '.join(DSLAB_LONG_CONTEXT_ARMS)}); "
                         f"the comparisons are taken against it")
    return arms


def long_context_peers(arms: list[str]) -> dict[str, list[str]]:
    """Each dslab arm of ``arms`` and its peers among ``arms`` (the report's ``config.peers``)."""
    return {arm: [p for p in LONG_CONTEXT_PEERS.get(arm, ()) if p in arms]
            for arm in arms if arm in DSLAB_LONG_CONTEXT_ARMS}


def check_sequence_split(seq_len: int, world: int, arm: str) -> None:
    """:class:`ArmSkipped` when a sequence of ``seq_len`` tokens does not split into ``world``
    equal chunks (every rank of a sequence-parallel group holds as many tokens)."""
    if seq_len % world:
        raise ArmSkipped(f"{arm}: seq_len {seq_len} does not split into {world} equal chunks")
