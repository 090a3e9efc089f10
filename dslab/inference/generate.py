"""Generation: greedy and sampled decoding over the static KV cache, as transformers' ``generate``.

``generate_tokens`` runs the prompt (left padding allowed) through :meth:`prefill`, chooses the
first new token from its last position, then one :class:`~dslab.inference.decode.DecodeRunner`
step per further token. It returns ``[batch, prompt + new]``: the prompt as given, then the new
tokens, as transformers does.

Choosing a token follows transformers' order and definitions: greedy is the argmax of the logits;
sampling divides by ``temperature``, keeps the ``top_k`` highest scores (0: all), then the smallest
set of highest-probability tokens whose probability sums to more than ``top_p`` (at least one),
and draws from the softmax with ``torch.multinomial`` on ``generator`` (torch's default generator
when None): the same generator seed gives the same tokens.

With ``eos_token_id`` (an int or a list), a row that has produced it gets ``pad_token_id`` (default:
the first eos id) from then on, and generation stops once every row has finished. Whether all rows
have finished is read on the host every :data:`EOS_CHECK_INTERVAL` tokens, not after every token;
the tokens beyond the step where the last row finished are cut off at the end, so the output is the
same as checking after every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dslab.inference.decode import DecodeRunner
from dslab.inference.modules import InferenceTransformer
from dslab.inference.timing import TokenClock

EOS_CHECK_INTERVAL = 8


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
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ValueError(f"temperature must be a number > 0 when sampling, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 keeps every token), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


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


def choose_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """int64 ``[batch]``: the argmax, or a draw from the filtered distribution."""
    if not sampling.do_sample:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, sampling).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _eos_ids(eos_token_id, vocab: int) -> list[int]:
    if eos_token_id is None:
        return []
    ids = [eos_token_id] if isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool) else eos_token_id
    if not isinstance(ids, (list, tuple)) or not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
        raise ValueError(f"eos_token_id must be a token id in [0, {vocab}) or a non-empty list of them, "
                         f"got {eos_token_id!r}")
    return list(ids)


def check_prompt(input_ids, attention_mask, vocab: int, device: torch.device):
    """``(input_ids, attention_mask or None, valid_start int32 [batch])`` on ``device``;
    ValueError naming the argument for anything ``generate`` cannot take."""
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
    return input_ids, mask, (mask == 0).sum(dim=1).to(torch.int32)


def generate_tokens(model: InferenceTransformer, runner: DecodeRunner, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor | None, valid_start: torch.Tensor, max_new_tokens: int,
                    sampling: Sampling, eos_token_id=None, pad_token_id: int | None = None,
                    generator: torch.Generator | None = None, clock: TokenClock | None = None) -> torch.Tensor:
    """``[batch, P + new]`` (see the module docstring). The prompt must fit the cache with the new
    tokens (the engine checks). ``clock``, started by the caller, is ticked after each new token."""
    batch, prompt_len = input_ids.shape
    eos = _eos_ids(eos_token_id, model.vocab_size)
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    device = input_ids.device
    eos_tensor = torch.tensor(eos, dtype=torch.int64, device=device) if eos else None
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    out = torch.empty(batch, max_new_tokens, dtype=torch.int64, device=device)
    slot = runner.slot(batch)
    produced = 0
    logits = model.prefill(input_ids, attention_mask, slot.cache)
    for step in range(max_new_tokens):
        if step > 0:
            logits = runner.step(slot)[:batch]
        tokens = choose_tokens(logits, sampling, generator)
        if eos_tensor is not None:
            tokens = torch.where(finished, torch.full_like(tokens, pad_token_id), tokens)
            finished |= torch.isin(tokens, eos_tensor)
        out[:, step] = tokens
        produced = step + 1
        if clock is not None:
            clock.tick()
        if step + 1 == max_new_tokens:
            break
        if step == 0:
            slot.start(tokens, prompt_len, valid_start)
        else:
            slot.tokens[:batch].copy_(tokens)
        if eos_tensor is not None and (step + 1) % EOS_CHECK_INTERVAL == 0 and bool(finished.all()):
            break
    if eos_tensor is not None:
        produced = _cut_after_last_finish(out[:, :produced], eos_tensor, produced)
    return torch.cat([input_ids, out[:, :produced]], dim=1)


def _cut_after_last_finish(new_tokens: torch.Tensor, eos: torch.Tensor, produced: int) -> int:
    """The columns transformers would have produced: up to the step where the last row emitted
    an eos, or all of them if some row never did."""
    hit = torch.isin(new_tokens, eos)
    if not bool(hit.any(dim=1).all()):
        return produced
    first = hit.int().argmax(dim=1)  # each row's first eos
    return int(first.max()) + 1
