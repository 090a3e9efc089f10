"""Generation: transformers' ``generate`` arguments, decoded over the static KV cache.

``generate_tokens`` runs the prompt (left padding allowed) through :meth:`prefill`, chooses the
first new token from its last position, then one :class:`~dslab.inference.decode.DecodeRunner`
step per further token. It returns ``[batch, prompt + new]`` (the prompt as given, then the new
tokens), or, with ``return_dict_in_generate``, an object with ``.sequences`` and the ``.scores``
/ ``.logits`` tuples (transformers' ``GenerateDecoderOnlyOutput`` when transformers imports, else
:class:`GenerationOutput`), as transformers' ``generate`` does.

The arguments (:func:`resolve_generation_args`) are read as transformers reads them: the source
model's ``generation_config`` (when it has one) gives the defaults, a ``generation_config``
argument overrides it, the keyword arguments override both (an explicit None unsets), and what is
still unset takes transformers' global defaults (greedy, ``top_k`` 50, 20 new tokens). dslab's
loop does:

=====================================  ==========================================================
argument                               meaning
=====================================  ==========================================================
``max_new_tokens``, ``max_length``     new tokens; ``max_length`` counts the prompt too
                                       (``max_new_tokens`` wins; neither: 20 new tokens, within
                                       the model's positions)
``min_new_tokens``, ``min_length``     the eos logits are -inf until that many new tokens (or
                                       that total length) exist (with an eos id only)
``eos_token_id``, ``pad_token_id``     an int or a list; a finished row gets ``pad_token_id``
                                       (default: the first eos id)
``do_sample``, ``temperature``,        sampling from the processed scores (else their argmax)
``top_k``, ``top_p``, ``generator``
``repetition_penalty``                 a prompt or generated token's logit is divided by the
                                       penalty when positive, multiplied when negative (left
                                       pads excluded)
``stopping_criteria``                  callables ``(input_ids, scores) -> bool [batch]`` (or a
                                       bool), called on the tokens so far after every token
``return_dict_in_generate``,           the output object; ``scores``: the processed fp32 scores
``output_scores``, ``output_logits``   of each new token, ``logits``: the raw fp32 logits
``use_cache``, ``num_beams``           True / 1 (``use_cache=False`` gives the same tokens: it is
                                       ignored, with a warning)
=====================================  ==========================================================

Any other argument with a value that changes the result (``num_beams`` > 1,
``num_return_sequences`` > 1, ``logits_processor``, ``no_repeat_ngram_size``, ``bad_words_ids``,
a ``streamer``, ...) is not dslab's: :func:`resolve_generation_args` names it, and the engine hands
the whole call to the source model's own ``generate``.

The scores of a step follow transformers' processor order, in fp32: repetition penalty, then
min-length (eos at -inf), then, when sampling, temperature, top-k (keep the ``top_k`` highest, 0:
all) and top-p (the smallest set of highest-probability tokens whose probability sums to more than
``top_p``, at least one); then the argmax, or ``torch.multinomial`` of their softmax on
``generator`` (torch's default generator when None, as transformers draws).

A row finishes when it produces an eos id or a stopping criterion says so; with an eos id,
finished rows get ``pad_token_id`` from then on (transformers pads only when there is an eos id),
and generation stops once every row has finished. The step at which each row finished is kept on
the device; whether all rows have finished is read on the host only every
:data:`EOS_CHECK_INTERVAL` tokens, and the tokens (and scores) beyond the step where the last row
finished are cut off at the end, so the output is the same as checking after every token.

Memory: one int64 ``[batch, prompt + max_new_tokens]`` buffer holds the sequences (the penalty and
the stopping criteria read its filled part); ``output_scores`` / ``output_logits`` keep an fp32
``[batch, vocab]`` tensor per new token each. Stopping criteria are Python calls after every token
(whatever host synchronisation they do, they do each step).

Sources: transformers' ``generation/utils.py`` (``generate``, ``_prepare_generated_length``,
``_get_logits_processor``, ``_sample``) and ``generation/logits_process.py``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from dslab.inference.decode import DecodeRunner
from dslab.inference.modules import InferenceTransformer
from dslab.inference.timing import TokenClock
from dslab.kernels.decode.greedy_step import greedy_step

EOS_CHECK_INTERVAL = 8
DEFAULT_NEW_TOKENS = 20  # transformers' default max_length, counted beyond the prompt

# The arguments dslab's loop takes (attention_mask is the engine's own).
NATIVE_ARGUMENTS = frozenset({
    "max_new_tokens", "max_length", "min_new_tokens", "min_length", "eos_token_id", "pad_token_id", "do_sample",
    "temperature", "top_k", "top_p", "repetition_penalty", "stopping_criteria", "return_dict_in_generate",
    "output_scores", "output_logits", "generation_config", "use_cache", "generator", "num_beams",
})
# transformers' global defaults of the native arguments (GenerationConfig._get_default_generation_params).
NATIVE_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0,
                   "min_length": 0, "num_beams": 1, "use_cache": True, "output_scores": False,
                   "output_logits": False, "return_dict_in_generate": False}
# GenerationConfig fields that do not change the tokens of greedy or sampled decoding: token ids
# used before the first step, cache and compile choices, beam-only and assistant-only settings.
IGNORED_FIELDS = frozenset({
    "bos_token_id", "decoder_start_token_id", "transformers_version", "cache_implementation", "cache_config",
    "max_cache_len", "compile_config", "disable_compile", "length_penalty", "early_stopping", "is_assistant",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "assistant_lookbehind", "target_lookbehind", "assistant_early_exit", "prefill_chunk_size", "low_memory",
})
# Values at which an argument dslab does not implement changes nothing.
NEUTRAL_VALUES = {"num_return_sequences": 1, "typical_p": 1.0, "no_repeat_ngram_size": 0,
                  "encoder_no_repeat_ngram_size": 0, "encoder_repetition_penalty": 1.0, "epsilon_cutoff": 0.0,
                  "eta_cutoff": 0.0, "guidance_scale": 1.0, "num_beam_groups": 1, "diversity_penalty": 0.0}


@dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0

    def check(self) -> None:
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be True or False, got {self.do_sample!r}")
        if not self.do_sample:
            return
        if not (_number(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a number > 0 when sampling, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 keeps every token), got {self.top_k!r}")
        if not (_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


@dataclass(frozen=True)
class GenerationArgs:
    """One ``generate`` call's settings, checked (:func:`resolve_generation_args`)."""

    max_new_tokens: int | None = None
    max_length: int | None = None
    min_new_tokens: int | None = None
    min_length: int = 0
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    sampling: Sampling = Sampling()
    repetition_penalty: float = 1.0
    stopping_criteria: tuple = ()
    return_dict_in_generate: bool = False
    output_scores: bool = False
    output_logits: bool = False
    generator: torch.Generator | None = None

    def lengths(self, prompt_len: int, max_positions: int) -> tuple[int, int]:
        """``(max_new_tokens, min_new_tokens)`` for a prompt of ``prompt_len`` tokens, as
        transformers derives them; ValueError naming ``max_length`` when it leaves no new token."""
        if self.max_new_tokens is not None:
            new = self.max_new_tokens
        elif self.max_length is not None:
            if self.max_length <= prompt_len:
                raise ValueError(f"max_length={self.max_length} counts the prompt and the new tokens; the prompt "
                                 f"already has {prompt_len}: raise max_length or give max_new_tokens")
            new = self.max_length - prompt_len
        else:
            new = min(prompt_len + DEFAULT_NEW_TOKENS, max_positions) - prompt_len
            if new < 1:
                raise ValueError(f"the prompt ({prompt_len} tokens) fills the model's {max_positions} positions; "
                                 f"give max_new_tokens")
        low = self.min_new_tokens if self.min_new_tokens is not None else max(self.min_length - prompt_len, 0)
        return new, low

    @property
    def pad(self) -> int:
        if self.pad_token_id is not None:
            return self.pad_token_id
        return self.eos_token_id[0] if self.eos_token_id else 0


@dataclass
class GenerationOutput:
    """transformers' ``GenerateDecoderOnlyOutput`` fields, when transformers is not installed."""

    sequences: torch.Tensor
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    attentions: tuple | None = field(default=None)
    hidden_states: tuple | None = field(default=None)


# --- arguments -----------------------------------------------------------------------------------


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_neutral(name: str, value) -> bool:
    if value is None or value is False:
        return True
    if name in NEUTRAL_VALUES and _number(value):
        return value == NEUTRAL_VALUES[name]
    return False


def _config_values(config) -> dict:
    """The set (non-None) fields of a transformers ``GenerationConfig``."""
    return {k: v for k, v in config.to_dict().items() if v is not None and not k.startswith("_")}


def resolve_generation_args(kwargs: dict, model_generation_config=None,
                            vocab: int | None = None) -> tuple[GenerationArgs | None, list[str]]:
    """``(args, [])`` when dslab's loop runs the call, ``(None, names)`` naming the arguments (or
    generation config fields) it does not implement; see the module docstring for the order in
    which ``model_generation_config``, ``kwargs["generation_config"]`` and ``kwargs`` are read.
    ValueError naming the argument for a value that cannot work."""
    given = dict(kwargs)
    config = given.pop("generation_config", None)
    if config is not None and not callable(getattr(config, "to_dict", None)):
        raise ValueError(f"generation_config must be a transformers GenerationConfig, got {type(config).__name__}")
    settings = dict(NATIVE_DEFAULTS)
    for source in (model_generation_config, config):
        if callable(getattr(source, "to_dict", None)):
            settings.update(_config_values(source))
    settings.update(given)

    num_beams = settings["num_beams"] if settings["num_beams"] is not None else 1
    if not _int(num_beams) or num_beams < 1:
        raise ValueError(f"num_beams must be an int >= 1, got {num_beams!r}")
    foreign = sorted(name for name, value in settings.items()
                     if name not in NATIVE_ARGUMENTS and name not in IGNORED_FIELDS and not _is_neutral(name, value))
    if num_beams > 1:
        foreign = ["num_beams", *foreign]
    if foreign:
        return None, foreign
    return _checked(settings, vocab), []


def _checked(s: dict, vocab: int | None) -> GenerationArgs:
    def whole(name: str, low: int, what: str):
        value = s.get(name)
        if value is not None and (not _int(value) or value < low):
            raise ValueError(f"{name} must be an int >= {low}{what}, got {value!r}")
        return value

    def flag(name: str) -> bool:
        value = s.get(name)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
        return bool(value)

    max_new = whole("max_new_tokens", 1, "")
    max_length = whole("max_length", 1, " (the prompt and the new tokens)")
    min_new = whole("min_new_tokens", 0, "")
    min_length = whole("min_length", 0, " (the prompt and the new tokens)") or 0
    pad = whole("pad_token_id", 0, "")
    eos = tuple(_eos_ids(s.get("eos_token_id"), vocab))
    sampling = Sampling(flag("do_sample"), _or(s.get("temperature"), 1.0), _or(s.get("top_k"), 0),
                        _or(s.get("top_p"), 1.0))
    sampling.check()
    penalty = _or(s.get("repetition_penalty"), 1.0)
    if not (_number(penalty) and penalty > 0):
        raise ValueError(f"repetition_penalty must be a number > 0 (1.0: none), got {penalty!r}")
    criteria = _criteria(s.get("stopping_criteria"))
    if not flag("use_cache") and s.get("use_cache") is not None:
        warnings.warn("generate(use_cache=False): dslab's decode always reads its KV cache; the tokens are those "
                      "use_cache=False gives, so the argument is ignored", stacklevel=4)
    generator = s.get("generator")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    return GenerationArgs(max_new, max_length, min_new, min_length, eos, pad, sampling, float(penalty), criteria,
                          flag("return_dict_in_generate"), flag("output_scores"), flag("output_logits"), generator)


def _or(value, default):
    return default if value is None else value


def _criteria(value) -> tuple:
    if value is None:
        return ()
    items = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    for item in items:
        if not callable(item):
            raise ValueError(f"stopping_criteria must be a StoppingCriteriaList or a list of callables "
                             f"(input_ids, scores) -> bool tensor [batch], got an item of type {type(item).__name__}")
    return items


def _eos_ids(eos_token_id, vocab: int | None) -> list[int]:
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.flatten().tolist()
    ids = [eos_token_id] if _int(eos_token_id) else eos_token_id
    limit = vocab if vocab is not None else float("inf")
    if not isinstance(ids, (list, tuple)) or not ids or not all(_int(i) and 0 <= i < limit for i in ids):
        raise ValueError(f"eos_token_id must be a token id in [0, {vocab}) or a non-empty list of them, "
                         f"got {eos_token_id!r}")
    return list(ids)


def check_prompt(input_ids, attention_mask, vocab: int, device: torch.device):
    """``(input_ids, attention_mask or None, valid_start int32 [batch])`` on ``device`` (the mask
    None also when it pads no row); ValueError naming the argument for anything ``generate`` cannot
    take."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point() \
            or input_ids.dtype == torch.bool or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty [batch, seq] integer tensor, got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}")
    input_ids = input_ids.to(device=device, dtype=torch.int64)
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids holds token ids outside [0, {vocab}): min {low}, max {high}")
    if attention_mask is None:
        return input_ids, None, torch.zeros(input_ids.shape[0], dtype=torch.int32, device=device)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got {got}")
    mask = attention_mask.to(device=device, dtype=torch.int64)
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    if not bool((mask[:, 1:] >= mask[:, :-1]).all()) or not bool((mask[:, -1] == 1).all()):
        raise ValueError("attention_mask must be left-padded (each row: zeros, then at least one 1 up to the "
                         "end); right padding would put pad tokens between the prompt and the new tokens")
    if bool((mask[:, 0] == 1).all()):  # no row is padded: the mask says nothing the model needs
        return input_ids, None, torch.zeros(input_ids.shape[0], dtype=torch.int32, device=device)
    return input_ids, mask, (mask == 0).sum(dim=1).to(torch.int32)


# --- scores --------------------------------------------------------------------------------------


def filter_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """fp32 scores ``[batch, vocab]`` after temperature, top-k and top-p (removed tokens at -inf)."""
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1)  # ascending, as transformers' TopPLogitsWarper
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= 1 - sampling.top_p
        remove[:, -1] = False  # the most likely token always stays
        scores = scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return scores


#: Logits per block of :func:`greedy_tokens`'s first pass; vocabularies of fewer than
#: :data:`BLOCKED_ARGMAX_MIN` take one argmax.
ARGMAX_BLOCK = 256
BLOCKED_ARGMAX_MIN = 16384


def blocked_argmax(logits: torch.Tensor, block: int = ARGMAX_BLOCK) -> torch.Tensor:
    """``logits.argmax(-1)`` of ``[rows, vocab]`` in two passes: each block of ``block`` logits its
    maximum and where (the vocabulary padded with -inf to whole blocks), then the first block
    holding the largest maximum. The same index as one argmax: the first largest logit, a NaN
    counting as largest (``max`` and ``argmax`` both take the first NaN), -inf pads never chosen
    before a real logit."""
    rows, vocab = logits.shape
    pad = -vocab % block
    blocks = torch.nn.functional.pad(logits, (0, pad), value=float("-inf")) if pad else logits
    values, within = blocks.reshape(rows, -1, block).max(dim=-1)
    first = values.argmax(dim=-1, keepdim=True)
    return (first * block + within.gather(1, first)).squeeze(1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """int64 ``[batch]``: ``logits.argmax(-1)``. A large vocabulary on a GPU takes
    :func:`blocked_argmax`: PyTorch reduces one row of 128,256 logits in one slow pass (28 us on an
    H200, ``benchmarks/generate_gaps.py``: 3% of a Llama-3.2-1B token), the blocks in parallel."""
    if logits.device.type == "cuda" and logits.dim() == 2 and logits.shape[-1] >= BLOCKED_ARGMAX_MIN:
        return blocked_argmax(logits)
    return logits.argmax(dim=-1)


def choose_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """int64 ``[batch]``: the argmax, or a draw from the filtered distribution."""
    if not sampling.do_sample:
        return greedy_tokens(logits)
    probs = filter_logits(logits, sampling).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def apply_repetition_penalty(scores: torch.Tensor, history: torch.Tensor, penalty: float,
                             skip: torch.Tensor | None = None) -> torch.Tensor:
    """``scores`` ``[batch, vocab]`` with every token of ``history`` ``[batch, len]`` penalised:
    divided by ``penalty`` where positive, multiplied where negative (transformers'
    RepetitionPenaltyLogitsProcessor). Row ``b``'s first ``skip[b]`` positions (its left pads)
    are not counted; ids beyond the vocabulary go to a dropped extra column."""
    vocab = scores.shape[-1]
    ids = history.clamp(max=vocab)
    if skip is not None:
        positions = torch.arange(history.shape[1], device=history.device)
        ids = ids.masked_fill(positions[None, :] < skip[:, None], vocab)
    padded = torch.nn.functional.pad(scores, (0, 1))
    picked = padded.gather(1, ids)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    return padded.scatter(1, ids, picked)[:, :vocab]


# --- the loop ------------------------------------------------------------------------------------


class _Stopping:
    """Which rows have finished, and at which step (on the device)."""

    def __init__(self, args: GenerationArgs, batch: int, max_new: int, device: torch.device):
        self.eos = torch.tensor(args.eos_token_id, dtype=torch.int64, device=device) if args.eos_token_id else None
        self.criteria = args.stopping_criteria
        self.active = self.eos is not None or bool(self.criteria)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.finish_step = torch.full((batch,), max_new, dtype=torch.int64, device=device)

    def update(self, step: int, tokens: torch.Tensor, history: torch.Tensor, scores) -> None:
        done = torch.isin(tokens, self.eos) if self.eos is not None else torch.zeros_like(self.finished)
        for criterion in self.criteria:
            done |= self._flags(criterion, criterion(history, scores))
        self.finish_step = torch.where(done & ~self.finished, step, self.finish_step)
        self.finished |= done

    def _flags(self, criterion, result) -> torch.Tensor:
        batch = self.finished.shape[0]
        if isinstance(result, bool):
            return torch.full_like(self.finished, result)
        if isinstance(result, torch.Tensor) and result.numel() in (1, batch):
            return result.to(device=self.finished.device, dtype=torch.bool).reshape(-1).expand(batch)
        name = getattr(criterion, "__name__", type(criterion).__name__)
        got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
        raise ValueError(f"stopping_criteria: {name} returned {got}; a criterion returns a bool tensor [{batch}] "
                         f"or a bool")

    def produced(self, produced: int) -> int:
        """The new tokens transformers keeps: up to the step where the last row finished, or all."""
        if not self.active or not bool(self.finished.all()):
            return produced
        return int(self.finish_step.max()) + 1


def _output(sequences: torch.Tensor, scores, logits):
    try:
        from transformers.generation.utils import GenerateDecoderOnlyOutput
    except ImportError:
        return GenerationOutput(sequences, scores, logits)
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits)


def generate_tokens(model: InferenceTransformer, runner: DecodeRunner, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor | None, valid_start: torch.Tensor, args: GenerationArgs,
                    max_new_tokens: int, min_new_tokens: int = 0, clock: TokenClock | None = None):
    """``[batch, P + new]``, or the output object under ``args.return_dict_in_generate`` (see the
    module docstring). The prompt must fit the cache with the new tokens (the engine checks).
    ``clock``, started by the caller, is ticked after each new token."""
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    sampling, generator = args.sampling, args.generator
    stopping = _Stopping(args, batch, max_new_tokens, device)
    eos_mask = None
    if stopping.eos is not None and min_new_tokens > 0:
        eos_mask = torch.zeros(model.vocab_size, dtype=torch.bool, device=device)
        eos_mask[stopping.eos] = True
    keep_scores = args.return_dict_in_generate and args.output_scores
    keep_logits = args.return_dict_in_generate and args.output_logits
    scores_kept, logits_kept = [], []
    processed = keep_scores or keep_logits or sampling.do_sample or args.repetition_penalty != 1.0 \
        or eos_mask is not None
    skip = valid_start.long() if attention_mask is not None else None
    sequence = torch.cat([input_ids, input_ids.new_zeros(batch, max_new_tokens)], dim=1)
    slot = runner.slot(batch)
    produced = 0
    logits = runner.prefill(slot, input_ids, attention_mask)
    for step in range(max_new_tokens):
        if step > 0:
            logits = runner.step(slot)[:batch]
        length = prompt_len + step
        if processed:
            raw = logits.to(torch.float32, copy=True)  # the step's output buffer is reused by the next step
            scores = raw
            if args.repetition_penalty != 1.0:
                scores = apply_repetition_penalty(scores, sequence[:, :length], args.repetition_penalty, skip)
            if eos_mask is not None and step < min_new_tokens:
                scores = scores.masked_fill(eos_mask, float("-inf"))
            if sampling.do_sample:
                scores = filter_logits(scores, sampling)
                tokens = torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(1)
            else:
                tokens = greedy_tokens(scores)
            if keep_scores:
                scores_kept.append(scores)
            if keep_logits:
                logits_kept.append(raw)
        elif not stopping.criteria:  # greedy: the token, the pads, the writes and the eos marks in one launch
            tokens = greedy_step(logits, sequence, length, slot.tokens[:batch] if step > 0 else None,
                                 stopping.finished if stopping.eos is not None else None, stopping.finish_step,
                                 stopping.eos, args.pad, step)
            produced = step + 1
            if clock is not None:
                clock.tick()
            if step + 1 == max_new_tokens:
                break
            if step == 0:
                slot.start(tokens, prompt_len, valid_start)
            if stopping.active and (step + 1) % EOS_CHECK_INTERVAL == 0 and bool(stopping.finished.all()):
                break
            continue
        else:
            tokens = greedy_tokens(logits)
        if stopping.eos is not None:
            tokens = torch.where(stopping.finished, torch.full_like(tokens, args.pad), tokens)
        sequence[:, length] = tokens
        produced = step + 1
        if clock is not None:
            clock.tick()
        if stopping.active:
            stopping.update(step, tokens, sequence[:, :length + 1], tuple(scores_kept) if keep_scores else None)
        if step + 1 == max_new_tokens:
            break
        if step == 0:
            slot.start(tokens, prompt_len, valid_start)
        else:
            slot.tokens[:batch].copy_(tokens)
        if stopping.active and (step + 1) % EOS_CHECK_INTERVAL == 0 and bool(stopping.finished.all()):
            break
    produced = stopping.produced(produced)
    sequences = sequence[:, :prompt_len + produced]
    if not args.return_dict_in_generate:
        return sequences
    return _output(sequences, tuple(scores_kept[:produced]) if keep_scores else None,
                   tuple(logits_kept[:produced]) if keep_logits else None)
