"""``dslab.init_inference`` and the engine it returns.

::

    engine = dslab.init_inference(model, dtype=torch.bfloat16, replace_with_kernel_inject=True,
                                  tensor_parallel={"tp_size": 1}, max_out_tokens=1024,
                                  enable_cuda_graph=True)
    logits = engine(input_ids, attention_mask=mask)
    tokens = engine.generate(input_ids, attention_mask=mask, max_new_tokens=32)

What happens (keys in :mod:`dslab.inference.config`):

1. ``checkpoint`` is loaded into ``model`` (:mod:`dslab.inference.checkpoint`).
2. With ``replace_with_kernel_inject``, the model's policy (:mod:`dslab.inference.policies`) reads
   its weights, and :class:`~dslab.inference.modules.InferenceTransformer` (the Llama layout:
   :class:`~dslab.inference.llama_modules.InferenceLlama`) takes them over: cast to
   the compute dtype (int8 linear weights under ``dtype=torch.int8``), sliced for this rank's
   tensor-parallel share, on this process's device (its CUDA device when there is one, as
   DeepSpeed does, else the CPU). ``engine.module`` is that model; the source model is left as it
   was. A model without a policy runs unchanged (cast to ``dtype``) with a warning saying so, as
   DeepSpeed does; with ``tp_size`` > 1 it is split in place by automatic tensor parallelism
   (:mod:`dslab.inference.auto_tp`, DeepSpeed's AutoTP) and runs its own ``generate`` on every
   rank in lockstep. int8 needs a policy and is refused without one.
3. ``engine(input_ids, attention_mask=None, token_type_ids=None)`` runs the forward without
   autograd and returns what the source model returns (logits for language models).
   ``engine.generate(...)`` decodes with the static KV cache (:mod:`dslab.inference.generate`),
   CUDA graphs per batch bucket when on CUDA with ``enable_cuda_graph`` and eagerly otherwise.
   With ``tp_size`` > 1 the graph holds the step's all_reduces, which needs the tensor-parallel
   group to be NCCL's (torch captures NCCL collectives, not gloo's); over another backend the step
   runs eagerly, with a note in ``engine.notes`` saying so.

The KV cache of a batch bucket holds ``min(max_out_tokens, the model's positions)`` positions;
``prompt + max_new_tokens`` beyond that is an error naming both. ``engine.memory_records()`` gives
the bytes of the weights (by dtype, distinct storages) and of every KV cache allocated.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from dslab.inference.auto_tp import apply_auto_tp
from dslab.inference.checkpoint import load_checkpoint
from dslab.inference.config import InferenceConfig, resolve_config
from dslab.inference.decode import DecodeRunner
from dslab.inference.generate import check_prompt, generate_tokens, resolve_generation_args
from dslab.inference.llama_modules import InferenceLlama
from dslab.inference.modules import InferenceTransformer
from dslab.inference.policies import Unsupported, check_shapes, find_policy
from dslab.inference.tensor_parallel import TensorParallel, check_divisible, tensor_parallel_group
from dslab.inference.timing import TokenClock
from dslab.kernels.attention.attention import HEAD_DIMS

logger = logging.getLogger(__name__)


def init_inference(model: nn.Module, config: dict | str | None = None, **kwargs) -> InferenceEngine:
    """DeepSpeed's ``init_inference``: the inference engine of ``model`` (see the module docstring;
    keys in :mod:`dslab.inference.config`). Bad arguments raise ValueError naming the key."""
    return InferenceEngine(model, resolve_config(config, kwargs))


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _storage_bytes(tensors) -> dict[str, int]:
    """Bytes of the distinct storages behind ``tensors``, by dtype."""
    seen, out = set(), {}
    for t in tensors:
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        name = str(t.dtype).removeprefix("torch.")
        out[name] = out.get(name, 0) + storage.nbytes()
    return out


class InferenceEngine:
    """The engine ``init_inference`` returns (module docstring). ``token_clock``, when set to a
    :class:`~dslab.inference.timing.TokenClock`, times every ``generate`` call token by token."""

    def __init__(self, model: nn.Module, config: InferenceConfig):
        if not isinstance(model, nn.Module):
            raise ValueError(f"init_inference needs a torch.nn.Module, got {type(model).__name__}")
        self._config = config
        self.source_model = model  # generate() hands it the calls dslab's decode loop does not implement
        self.device = _device()
        self.checkpoint = load_checkpoint(model, config.checkpoint, config.base_dir) if config.checkpoint else None
        self.tp: TensorParallel = tensor_parallel_group(config.tp_size)
        self.policy = None
        self.notes: list[str] = []
        self.token_clock: TokenClock | None = None
        self._runner: DecodeRunner | None = None
        spec = self._spec(model) if config.replace_with_kernel_inject else None
        if spec is None:
            self._run_unchanged(model)
            return
        check_divisible(spec.heads, spec.intermediate, self.tp.size, spec.kv_heads)
        quant = config.quant.weight if config.int8 else None
        model_class = InferenceLlama if spec.family == "llama" else InferenceTransformer
        self.module = model_class(spec, self.tp, config.compute_dtype, self.device, quant).eval()
        self.max_seq = min(config.max_out_tokens, spec.max_positions)
        if spec.causal:
            eager_reason = self._eager_reason() if config.enable_cuda_graph else None
            if eager_reason is not None:
                self.notes.append(f"enable_cuda_graph: the per-token step runs eagerly ({eager_reason})")
            graphs = config.enable_cuda_graph and eager_reason is None
            self._runner = DecodeRunner(self.module, self.max_seq, graphs)

    # --- construction ----------------------------------------------------------------------------

    def _spec(self, model: nn.Module):
        try:
            policy, spec = find_policy(model, self._config.injection_policy)
            if spec.head_dim not in HEAD_DIMS:
                raise Unsupported(f"{policy.name} has head dim {spec.head_dim}; dslab's attention kernels take "
                                  f"{', '.join(map(str, HEAD_DIMS))}")
        except Unsupported as why:
            message = f"init_inference: {why}; the model runs unchanged, without dslab's inference kernels"
            warnings.warn(message, stacklevel=3)
            self.notes.append(message)
            return None
        check_shapes(spec)
        self.policy = policy.name
        self.notes.extend(spec.notes)
        return spec

    def _eager_reason(self) -> str | None:
        """Why the per-token step cannot be captured in a CUDA graph, or None. A tensor-parallel
        step holds all_reduces, which a graph can capture only as NCCL collectives."""
        if self.device.type != "cuda":
            return f"no CUDA device ({self.device})"
        if self.tp.size > 1:
            backend = dist.get_backend(self.tp.group)
            if backend != "nccl":
                return (f"tensor_parallel.tp_size={self.tp.size} over a {backend} group: a CUDA graph captures "
                        f"only NCCL collectives")
        return None

    def _run_unchanged(self, model: nn.Module) -> None:
        config = self._config
        if config.int8:
            raise ValueError(f"dtype=torch.int8 quantises the layers dslab injects; {type(model).__name__} is not "
                             f"injected (replace_with_kernel_inject={config.replace_with_kernel_inject})")
        if config.injection_policy:
            raise ValueError("injection_policy is given, but it applies only to the models dslab injects "
                             "(replace_with_kernel_inject=True with a model dslab has a policy for); without "
                             "injection, tensor_parallel splits the model by automatic tensor parallelism")
        if self.tp.size > 1:  # split in place before the move, so each device receives its share only
            self.notes.append(apply_auto_tp(model, self.tp).note)
        self.module = model.to(device=self.device, dtype=config.dtype).eval()
        self.max_seq = None

    # --- properties ------------------------------------------------------------------------------

    @property
    def config(self) -> InferenceConfig:
        return self._config

    @property
    def injected(self) -> bool:
        return isinstance(self.module, (InferenceTransformer, InferenceLlama))

    @property
    def dtype(self) -> torch.dtype:
        return self._config.dtype

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def cuda_graph_stats(self) -> dict[str, int]:
        return dict(self._runner.stats) if self._runner is not None else {}

    # --- running ---------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """The model's forward without autograd (see the module docstring)."""
        with torch.no_grad():
            if not self.injected:
                return self.module(*args, **kwargs)
            return self._injected_forward(*args, **kwargs)

    def _injected_forward(self, input_ids, attention_mask=None, token_type_ids=None):
        model = self.module
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            raise ValueError("input_ids must be a [batch, seq] integer tensor")
        if input_ids.shape[1] > model.max_positions:
            raise ValueError(f"input_ids has seq {input_ids.shape[1]} > the model's {model.max_positions} positions")
        for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
            if t is not None and (not isinstance(t, torch.Tensor) or t.shape != input_ids.shape):
                raise ValueError(f"{name} must have input_ids' shape {tuple(input_ids.shape)}")
        if token_type_ids is not None and model.token_type_embeddings is None:
            raise ValueError(f"token_type_ids: {model.source} has no token types")
        move = (lambda t: None if t is None else t.to(self.device))
        return model(move(input_ids).long(), move(attention_mask), move(token_type_ids))

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        """``[batch, prompt + new]`` token ids, or transformers' output object under
        ``return_dict_in_generate``, as transformers' ``generate`` with the same arguments
        (:mod:`dslab.inference.generate` lists those dslab's decode loop implements). A call with
        any other argument (``num_beams=4``, ``logits_processor``, ...) is handed, with a warning
        naming it, to the source model's own ``generate``, run where and in the dtype that model
        is. A model that is not injected (or split by automatic tensor parallelism) runs its own
        ``generate`` with every argument."""
        if not self.injected:
            generate = getattr(self.module, "generate", None)
            if not callable(generate):
                raise ValueError(f"{type(self.module).__name__} has no generate()")
            with torch.no_grad():
                mask = attention_mask.to(self.device) if isinstance(attention_mask, torch.Tensor) else attention_mask
                return generate(input_ids=input_ids.to(self.device), attention_mask=mask, **kwargs)
        if self.token_clock is not None:  # the call's start, its checks included, as for any generate()
            self.token_clock.start()
        if self._runner is None:
            raise ValueError(f"generate() needs a causal language model; this engine holds {self.module.source}")
        args, foreign = resolve_generation_args(kwargs, getattr(self.source_model, "generation_config", None),
                                                self.module.vocab_size)
        if foreign:
            return self._hand_off(foreign, input_ids, attention_mask, kwargs)
        if args.generator is not None and args.generator.device.type != self.device.type:
            raise ValueError(f"generator is on {args.generator.device}, the model on {self.device}")
        input_ids, mask, valid_start = check_prompt(input_ids, attention_mask, self.module.vocab_size, self.device)
        prompt = input_ids.shape[1]
        max_new_tokens, min_new_tokens = args.lengths(prompt, self.module.max_positions)
        if prompt + max_new_tokens > self.max_seq:
            raise ValueError(
                f"prompt ({prompt} tokens) + max_new_tokens ({max_new_tokens}) = {prompt + max_new_tokens} exceeds the "
                f"KV cache's {self.max_seq} positions (max_out_tokens={self._config.max_out_tokens}, the model has "
                f"{self.module.max_positions}); raise max_out_tokens or ask for fewer tokens")
        with torch.no_grad():
            return generate_tokens(self.module, self._runner, input_ids, mask, valid_start, args, max_new_tokens,
                                   min_new_tokens, self.token_clock)

    def _hand_off(self, names: list[str], input_ids, attention_mask, kwargs: dict):
        """The source model's own ``generate`` with the whole call (but ``generator``, which
        transformers does not take), on that model's device."""
        source = self.source_model
        generate = getattr(source, "generate", None)
        listed = ", ".join(names)
        if not callable(generate):
            raise ValueError(f"generate(): dslab's decode loop does not implement {listed}, and "
                             f"{type(source).__name__} has no generate() to hand the call to")
        passed = {k: v for k, v in kwargs.items() if k != "generator"}  # transformers draws from torch's default
        dropped = "; generator (dslab's own argument) is not passed on" if "generator" in kwargs else ""
        warnings.warn(f"generate(): dslab's decode loop does not implement {listed}; the call goes to "
                      f"{type(source).__name__}.generate() (the source model, without dslab's kernels){dropped}",
                      stacklevel=3)
        device = next(iter(source.parameters()), torch.empty(0)).device
        move = (lambda t: t.to(device) if isinstance(t, torch.Tensor) else t)
        with torch.no_grad():
            out = generate(input_ids=move(input_ids), attention_mask=move(attention_mask), **passed)
        return out.to(self.device) if isinstance(out, torch.Tensor) else out

    # --- memory ----------------------------------------------------------------------------------

    def memory_records(self) -> dict:
        """``{"weights_bytes", "weights_by_dtype", "kv_cache_bytes", "kv_caches": [...],
        "max_seq"}``: the module's parameters and buffers (distinct storages) and every KV cache
        allocated (one per batch bucket used)."""
        by_dtype = _storage_bytes([*self.module.parameters(), *self.module.buffers()])
        caches = [slot.cache.describe() for slot in self._runner.slots.values()] if self._runner else []
        return {"weights_bytes": sum(by_dtype.values()), "weights_by_dtype": by_dtype,
                "kv_cache_bytes": sum(c["bytes"] for c in caches), "kv_caches": caches, "max_seq": self.max_seq,
                "tp_size": self.tp.size}

    def release_cuda_graphs(self) -> None:
        """Free the decode graphs and KV caches (they are made again on the next ``generate``).
        Under tensor parallelism over NCCL the graphs hold collectives on the group's
        communicator: release them before ``torch.distributed.destroy_process_group()``
        (``benchmarks/inference_tp.py`` does; a run that tore the group down with its graphs alive
        did not exit)."""
        if self._runner is not None:
            self._runner.release()
