"""The arms of a benchmark: the same workload trained several ways.

- ``dslab``: the model on dslab's kernels inside :func:`dslab.initialize`'s engine, configured by
  the suite's engine config (DeepSpeed keys) plus the case's micro-batch and the precision.
- ``torch``: the same model on PyTorch's own ops, a plain loop: autocast, backward,
  ``torch.optim.AdamW`` (fused on CUDA), clipping when the suite clips.
- ``torch-compile``: the ``torch`` arm with the model under ``torch.compile`` (default mode).
- ``torch-compile-ro``: the ``torch`` arm with the model under
  ``torch.compile(mode="reduce-overhead")``: Inductor's kernels replayed from CUDA graphs
  (cudagraph trees) for the forward and the backward; the optimizer stays eager. The strongest
  plain-PyTorch configuration a user would pick (``PlainArm`` says how parking and the loss work
  with the graphs).
- ``hf``: transformers' model of the same shape in the ``torch`` arm's loop (for the MoE
  families, transformers' Mixtral sparse-MoE block: :mod:`dslab.bench.hf_moe`). Not for the
  Evoformer, which transformers does not have.
- ``liger``: the ``hf`` arm's model with Liger-Kernel's Triton ops (RMSNorm, SwiGLU, rotary
  positions, the LM head fused with its loss; :mod:`dslab.bench.liger`), eager, as Liger's own
  recipe runs it: the strongest Llama setup a transformers user would pick. (Under
  ``torch.compile`` Liger 0.8.5's fused linear cross-entropy fails to trace on torch 2.11: a
  ``TypeError`` in ``addmm``'s decomposition on fake tensors.) Llama only, on CUDA, when
  ``liger-kernel`` imports; skipped with the reason otherwise.
- ``sdpa``: the ``torch`` arm's loop over the model built with its ``"sdpa"`` kernel set:
  attention through ``F.scaled_dot_product_attention``. Only the families whose models have that
  kernel set run it (the Evoformer); :data:`dslab.bench.suite.ARM_FAMILIES` says which.

``torch``, ``torch-compile``, ``torch-compile-ro``, ``hf``, ``liger`` and ``sdpa`` are the plain-PyTorch arms
(:data:`PLAIN_ARMS`); the summary compares ``dslab`` against the fastest of them in each case.

Every arm exposes ``step()`` (one optimizer step) and ``close()``; building an arm may raise, and
the runner records that arm as failed (or, out of GPU memory, as ``oom``) and goes on.

A deliberate slowdown, for checking a gate or the straggler analysis: ``DSLAB_INJECT_STEP_SLEEP_MS``
(milliseconds, >= 0) makes the ``dslab`` arm wait for the device and then sleep that long at the
end of every step. ``DSLAB_INJECT_STEP_SLEEP_RANKS`` (comma-separated global ranks, e.g. ``1`` or
``0,2``) limits the sleep to those ranks of a distributed run; unset or empty, every rank sleeps.
A rank that sleeps reaches the next step's collectives late, so the others wait for it there and
the comms logger names it a straggler. Ranks must lie in ``0 .. WORLD_SIZE-1``, and naming ranks
without a sleep is an error (:func:`injected_sleep_ms`). ``DSLAB_INJECT_STEP_SLEEP_MODE=device``
(default ``host``) spins the GPU instead: a ``torch.cuda._sleep`` kernel of that many milliseconds
(cycles calibrated once against CUDA events) queued at the end of every step, with no host
synchronisation, so the step grows by that much device time and the host keeps running ahead as
it does in a real slowdown; the host sleep's synchronisation alone costs a CUDA-graphed step its
overlap of launches and device work (a 2% sleep measured a 5% slowdown on GPT-2 124M). On a CPU
the two modes are the same.
"""

from __future__ import annotations

import os
import time

import torch

from dslab import comm
from dslab.bench.common import ArmSkipped
from dslab.bench.parking import park_training_state, unpark_training_state
from dslab.bench.suite import check_arms
from dslab.bench.workloads import Workload

INJECT_SLEEP_ENV = "DSLAB_INJECT_STEP_SLEEP_MS"
INJECT_SLEEP_RANKS_ENV = "DSLAB_INJECT_STEP_SLEEP_RANKS"
INJECT_SLEEP_MODE_ENV = "DSLAB_INJECT_STEP_SLEEP_MODE"
INJECT_SLEEP_MODES = ("host", "device")

PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}

# The plain loops' arms, the kernel set of our model each builds (the hf arm builds transformers'
# model instead) and, for the compiled ones, torch.compile's mode (None: the default).
PLAIN_ARMS = ("torch", "torch-compile", "torch-compile-ro", "hf", "sdpa", "liger")
PLAIN_ARM_KERNELS = {"torch": "torch", "torch-compile": "torch", "torch-compile-ro": "torch", "sdpa": "sdpa"}
COMPILE_MODES = {"torch-compile": None, "torch-compile-ro": "reduce-overhead"}
# The arms that train transformers' model rather than ours.
HF_MODEL_ARMS = ("hf", "liger")


def _optimizer_settings(engine_cfg: dict) -> dict:
    """lr/betas/eps/weight_decay from the suite's engine optimizer section (AdamW defaults)."""
    opt = engine_cfg.get("optimizer") or {}
    kind = str(opt.get("type", "AdamW")).lower()
    if kind not in ("adam", "adamw"):
        raise ValueError(
            f"the torch/hf arms train with AdamW; suite engine optimizer type {opt.get('type')!r} "
            f"has no plain-PyTorch twin"
        )
    params = dict(opt.get("params") or {})
    keep = {k: params[k] for k in ("lr", "betas", "eps", "weight_decay") if k in params}
    keep.setdefault("lr", 1e-4)
    return keep


def inject_sleep_ms() -> float:
    """``DSLAB_INJECT_STEP_SLEEP_MS``: the sleep per step the slowed ranks take (0 when unset)."""
    raw = os.environ.get(INJECT_SLEEP_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{INJECT_SLEEP_ENV}={raw!r} is not a number of milliseconds") from None
    if value < 0:
        raise ValueError(f"{INJECT_SLEEP_ENV} must be >= 0, got {value}")
    return value


def inject_sleep_mode() -> str:
    """``DSLAB_INJECT_STEP_SLEEP_MODE``: ``host`` (the default) or ``device`` (module docstring)."""
    raw = os.environ.get(INJECT_SLEEP_MODE_ENV, "").strip() or "host"
    if raw not in INJECT_SLEEP_MODES:
        raise ValueError(f"{INJECT_SLEEP_MODE_ENV}={raw!r}: choose {' or '.join(INJECT_SLEEP_MODES)}")
    return raw


def device_spin_cycles(ms: float, probe_cycles: int = 20_000_000) -> int:
    """The ``torch.cuda._sleep`` cycles that spin the current device for ``ms`` milliseconds: the
    median of three timed probes of ``probe_cycles`` (CUDA events), scaled."""
    rates = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe_cycles)
        end.record()
        end.synchronize()
        rates.append(probe_cycles / start.elapsed_time(end))
    return max(1, int(round(sorted(rates)[1] * ms)))


def inject_sleep_ranks(world_size: int) -> tuple[int, ...] | None:
    """The ranks ``DSLAB_INJECT_STEP_SLEEP_RANKS`` names (sorted, each once), or None when it is
    unset or empty: then every rank sleeps. Raises ValueError for an item that is not a rank of
    ``world_size`` processes."""
    raw = os.environ.get(INJECT_SLEEP_RANKS_ENV, "").strip()
    if not raw:
        return None
    ranks = set()
    for item in raw.split(","):
        item = item.strip()
        if not (item.isascii() and item.isdigit()):
            raise ValueError(f"{INJECT_SLEEP_RANKS_ENV}={raw!r}: {item!r} is not a rank; give comma-separated "
                             f"ranks such as '1' or '0,2'")
        rank = int(item)
        if rank >= world_size:
            raise ValueError(f"{INJECT_SLEEP_RANKS_ENV}={raw!r} names rank {rank}, but the run has {world_size} "
                             f"process(es) (ranks 0..{world_size - 1})")
        ranks.add(rank)
    return tuple(sorted(ranks))


def _injection(world_size: int) -> tuple[float, tuple[int, ...] | None]:
    """``(sleep ms, ranks or None for all)`` from both variables, checked together."""
    ms, ranks = inject_sleep_ms(), inject_sleep_ranks(world_size)
    if ranks is not None and not ms:
        raise ValueError(f"{INJECT_SLEEP_RANKS_ENV} is set but {INJECT_SLEEP_ENV} is unset or 0: set the "
                         f"sleep (milliseconds per step) as well")
    return ms, ranks


def injected_sleep_ms(rank: int, world_size: int) -> float:
    """The sleep per step of ``rank``: ``DSLAB_INJECT_STEP_SLEEP_MS`` where
    ``DSLAB_INJECT_STEP_SLEEP_RANKS`` selects the rank (or is unset: every rank), else 0.
    Naming ranks without a sleep raises ValueError."""
    ms, ranks = _injection(world_size)
    return ms if ranks is None or rank in ranks else 0.0


def describe_injected_sleep(world_size: int) -> str | None:
    """One line saying which ranks of the dslab arm sleep how long in every step (for the
    progress output and the report's notes), or None when nothing is injected. Checks both
    variables as :func:`injected_sleep_ms` does."""
    ms, ranks = _injection(world_size)
    mode = inject_sleep_mode()
    if not ms:
        return None
    how = " (as a device-side spin, DSLAB_INJECT_STEP_SLEEP_MODE=device)" if mode == "device" else ""
    if ranks is None:
        return (f"{INJECT_SLEEP_ENV}={ms:g}: the dslab arm sleeps that long in every step{how} "
                f"(a deliberate slowdown for checking a gate)")
    named = ", ".join(str(r) for r in ranks)
    return (f"{INJECT_SLEEP_ENV}={ms:g} on rank{'s' if len(ranks) > 1 else ''} {named} only "
            f"({INJECT_SLEEP_RANKS_ENV}): the dslab arm sleeps that long in every step there{how}, a deliberate "
            f"straggler that the other ranks wait for at their next collective")


class EngineArm:
    """The ``dslab`` arm: dslab kernels inside the dslab engine."""

    name = "dslab"

    def __init__(self, workload: Workload, device: torch.device, precision: str, engine_cfg: dict,
                 profile_dir=None, measured_peak_tflops: float | None = None, echo_profile_text: bool = False):
        import dslab

        config = dict(engine_cfg)
        config["train_micro_batch_size_per_gpu"] = workload.case.micro_batch
        config["gradient_accumulation_steps"] = 1
        if precision != "fp32":
            config[precision] = {"enabled": True}
        config.setdefault("steps_per_print", 10**9)
        model = workload.build_model(kernels="dslab", device=device)
        self.engine, _, _, _ = dslab.initialize(model=model, config=config, dist_init_required=False)
        if profile_dir is not None:
            self.engine.set_profile_output_dir(profile_dir, echo_text=echo_profile_text)
        if measured_peak_tflops:
            self.engine.set_measured_peak(measured_peak_tflops)
        self.batch = workload.make_batch(self.engine.device)
        self.loss_fn = workload.loss_fn()
        self.sleep_s = injected_sleep_ms(comm.get_rank(), comm.get_world_size()) / 1e3
        self.spin_cycles = 0
        if self.sleep_s and inject_sleep_mode() == "device" and self.engine.device.type == "cuda":
            self.spin_cycles, self.sleep_s = device_spin_cycles(self.sleep_s * 1e3), 0.0
        self.model_for_counting = model

    def step(self) -> torch.Tensor:
        loss = self.engine(**self.batch)
        self.engine.backward(loss)
        self.engine.step()
        if self.spin_cycles:
            torch.cuda._sleep(self.spin_cycles)  # queued device time, no host synchronisation
        if self.sleep_s:
            # A deliberate slowdown for checking a gate or the straggler analysis (module
            # docstring): wait for the device, then sleep, so the measured step grows by at least
            # this much.
            if self.engine.device.type == "cuda":
                torch.cuda.synchronize()
            time.sleep(self.sleep_s)
        return loss

    def park(self) -> None:
        release = getattr(self.engine.module, "release_cuda_graphs", None)
        if release is not None:
            release()  # the graphs' memory pools hold a whole forward's activations
        self._parked = park_training_state(self.engine.module, self.engine.optimizer)

    def unpark(self) -> None:
        unpark_training_state(self.engine.module, self.engine.optimizer, self._parked, self.engine.device)
        self._parked = None

    def records(self) -> dict[str, dict]:
        """The engine's profiler records (flops, memory, comms, telemetry, wall clock)."""
        return self.engine.profiler_records()

    def cuda_graph_stats(self) -> dict[str, int]:
        """The layer stack's graph captures, replays and eager calls (empty when graphs are off)."""
        return dict(getattr(self.engine.module, "cuda_graph_stats", {}) or {})

    def moe_stats(self) -> list[dict] | None:
        """The MoE layers' routing of the last step (device tensors), None for a dense model."""
        stats = getattr(self.engine.module, "moe_stats", None)
        return stats() if callable(stats) else None

    def close(self) -> None:
        self.engine.destroy()
        del self.engine


def plain_step(forward, loss_fn, batch: dict, model: torch.nn.Module, optimizer, dtype: torch.dtype | None,
               device: torch.device, scaler, clip: float, keep_loss: bool = False) -> torch.Tensor:
    """One step of a plain loop: the loss under autocast to ``dtype`` (None: none), backward
    (through ``scaler`` for fp16), clipping of ``model``'s gradients at ``clip`` (> 0), the
    optimizer's step and its gradients set to None. Returns the loss (a copy with ``keep_loss``:
    CUDA-graph trees overwrite the one they return at the next replay)."""
    if dtype is not None:
        with torch.autocast(device.type, dtype=dtype):
            loss = loss_fn(forward, batch)
    else:
        loss = loss_fn(forward, batch)
    reported = loss.detach().clone() if keep_loss else loss
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    else:
        loss.backward()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return reported


class PlainArm:
    """A hand-written loop: autocast forward, backward, AdamW (fused on CUDA), optional clipping.

    ``torch-compile-ro`` runs the model under ``torch.compile(mode="reduce-overhead")``, whose
    cudagraph trees replay the compiled forward and backward from CUDA graphs that write their
    outputs (the loss, the activations saved for backward, the gradients) into one private memory
    pool. Inductor partitions the graph around ops it cannot capture (BERT's ``nonzero``) and
    captures the rest.

    - Each step begins with ``torch.compiler.cudagraph_mark_step_begin()``: the previous step's
      outputs are dead, and the next replay may overwrite them.
    - ``step()`` returns a clone of the loss: the loss the graph returned lives in the pool and is
      overwritten by the next step's replay (reading it after that raises). The gradients live
      there too; clipping and AdamW consume them and they are set to None within the step.
    - Parking (``park``/``unpark``) moves the parameters to the host and back into new storage.
      The parameters are static inputs of the recorded graphs, so on the first call after
      ``unpark`` the trees see their addresses changed and record the forward and backward again
      (the old recordings stay in the tree; a replay never reads a stale address). That happens in
      the settling steps before a trial is timed. torch 2.11 counted each such re-record towards
      ``cudagraph_unexpected_rerecord_limit`` (128 per function, far above a suite's trials;
      past it the function would run without graphs); torch 2.13 no longer counts re-records
      for changed parameter addresses.
    - The pool stays on the GPU between the arm's trials, parked or not: the trees free it only
      with ``torch._dynamo.reset()``, which would also discard the ``torch-compile`` arm's code.
      On an H100 it held 7.4 GiB for GPT-2 124M (micro-batch 16) and 16.4 GiB for 774M
      (micro-batch 8). This arm's ``peak_memory_bytes`` under-counts: replays allocate nothing
      (at 774M it read 27.7 GiB while the four arms' resident states alone took about 37 GiB).

    On a CPU ``reduce-overhead`` compiles as usual and runs without graphs (Inductor captures
    CUDA graphs on CUDA devices only); marking the step is then a no-op.
    """

    def __init__(self, name: str, workload: Workload, device: torch.device, precision: str, engine_cfg: dict):
        if name not in PLAIN_ARMS:
            raise ValueError(f"arm {name!r} is not a plain-PyTorch arm; choose from {', '.join(PLAIN_ARMS)}")
        check_arms([name], [workload.family])
        self.name = name
        self.device = device
        self.dtype = PRECISION_DTYPES[precision]
        hf = name in HF_MODEL_ARMS
        model = (workload.build_hf_model(device) if hf
                 else workload.build_model(kernels=PLAIN_ARM_KERNELS[name], device=device))
        self.liger = name == "liger"
        if self.liger:
            from dslab.bench.liger import build_liger_llama

            model = build_liger_llama(model)
        self.model = model.to(device).train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), **_optimizer_settings(engine_cfg),
            **({"fused": True} if device.type == "cuda" else {"foreach": True}),
        )
        self.clip = float(engine_cfg.get("gradient_clipping", 0.0))
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self.cudagraph_trees = COMPILE_MODES.get(name) == "reduce-overhead"
        if name in COMPILE_MODES:
            # Let the graph hold data-dependent shapes (BERT's sparse MLM gathers the masked rows
            # with nonzero); without it Dynamo breaks the graph there and recompiles every step.
            torch._dynamo.config.capture_dynamic_output_shape_ops = True
            mode = COMPILE_MODES[name]
            self.forward = torch.compile(self.model, **({"mode": mode} if mode else {}))
        else:
            self.forward = self.model
        self.loss_fn = workload.loss_fn(hf=hf)
        self.batch = workload.make_batch(device)

    def step(self) -> torch.Tensor:
        if self.cudagraph_trees:
            torch.compiler.cudagraph_mark_step_begin()
        if self.liger:
            from dslab.bench.liger import liger_rope

            with liger_rope():
                return self._step()
        return self._step()

    def _step(self) -> torch.Tensor:
        return plain_step(self.forward, self.loss_fn, self.batch, self.model, self.optimizer, self.dtype,
                          self.device, self.scaler, self.clip, keep_loss=self.cudagraph_trees)

    def park(self) -> None:
        self._parked = park_training_state(self.model, self.optimizer)

    def unpark(self) -> None:
        unpark_training_state(self.model, self.optimizer, self._parked, self.device)
        self._parked = None

    def close(self) -> None:
        del self.model, self.optimizer, self.forward


def build_arm(name: str, workload: Workload, device: torch.device, precision: str, engine_cfg: dict,
              profile_dir=None, measured_peak_tflops: float | None = None, world_size: int = 1,
              echo_profile_text: bool = False):
    """The arm ``name``. With ``world_size`` > 1 (a distributed run) only the ``dslab`` arm runs:
    the others are single-process loops and raise :class:`ArmSkipped`."""
    if name != "dslab" and world_size > 1:
        raise ArmSkipped(f"single-process arm; not run with WORLD_SIZE={world_size}")
    if name != "dslab" and workload.is_moe and workload.model_config().ep_size > 1:
        raise ArmSkipped(f"ep_size={workload.model_config().ep_size}: expert parallelism is the dslab arm's; "
                         f"the plain arms keep every expert on one rank")
    if name == "dslab":
        return EngineArm(workload, device, precision, engine_cfg, profile_dir, measured_peak_tflops, echo_profile_text)
    if name in HF_MODEL_ARMS:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise ArmSkipped("transformers is not installed") from None
    if name == "liger":
        from dslab.bench.liger import liger_available

        liger_available(device)
    return PlainArm(name, workload, device, precision, engine_cfg)
