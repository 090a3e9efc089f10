"""The engine leaves the caller's tensors as they were, and a row's tokens do not depend on the
rows beside it.

``input_ids`` and ``attention_mask`` given as int64 on the engine's device reach the engine as the
caller's own storage (``.to(device, torch.int64)`` returns the same tensor), so an in-place write
anywhere on the way, or a store past an output that lands in them, changes what the caller holds.
Here they are views into larger int64 tensors (rows sliced off both ends, columns sliced off the
front, so the views are neither at the start of their storage nor contiguous), and every element
of those storages is checked bit for bit after ``engine(...)``, greedy ``generate`` and sampled
``generate``, on the PyTorch reference backend and on the Triton kernels under the interpreter,
at batch 16 (a full bucket) and 5 (bucket 8: three filler rows), in bf16 (fp32 too on the
reference backend). A row generated alone equals that row of the batch, in fp32, where every row's
computation is independent of the others'.

What this cannot see: stores that land in memory the caller does not hold, and the CUDA-only
launch paths (cached Triton launches, graph replay): ``test_decode_gpu.py`` covers those.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_gpt2, prompts

import dslab
from dslab.kernels import kernel_backend
from dslab.kernels.dispatch import interpreting

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="the Triton interpreter runs on CPU (TRITON_INTERPRET=1)")
BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]

PROMPT = 8
NEW_TOKENS = 2  # the first token from the prefill, one decode step
# A full bucket of 16 (prefill layer norms over two interpreted row blocks) and a part-filled one of
# 8; a full bucket of 32 would only double the interpreted programs of every launch.
BATCHES = (16, 5)
# GPT-2 of two layers, two heads of 32 (the smallest head dim prefill attention takes), hidden 64,
# an MLP of 80 and a vocabulary of 100 (the head's 128 padded rows cut back to 100): every kernel
# of the larger tiny model, at fewer interpreted programs per launch.
HIDDEN, HEADS, INNER, VOCAB = 64, 2, 80, 100


@pytest.fixture(scope="module")
def model():
    return hf_gpt2(n_embd=HIDDEN, n_head=HEADS, n_inner=INNER, vocab_size=VOCAB)


def _caller_storage(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ids and mask of ``batch + 2`` rows and ``PROMPT + 2`` columns whose :func:`_views`
    rows 1, 3, 5, ... are left-padded by 1 .. 3 positions (the two columns the views leave out are
    padding on every row)."""
    view_pads = [0 if row % 2 == 0 else 1 + row % 3 for row in range(batch)]
    pads = [2] + [pad + 2 for pad in view_pads] + [2]
    ids, mask = prompts(batch + 2, PROMPT + 2, vocab=VOCAB, seed=seed, pads=pads)
    assert ids.dtype == mask.dtype == torch.int64
    return ids, mask


def _views(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows 1 .. batch and the last PROMPT columns: an offset, non-contiguous view of each."""
    return ids[1:-1, 2:], mask[1:-1, 2:]


# bf16 on the Triton backend runs every Triton kernel the engine has (flash attention only takes
# fp16/bf16); fp32 there would add nothing but time.
@pytest.mark.parametrize("backend,dtype", [("torch", torch.float32), ("torch", torch.bfloat16),
                                           pytest.param("triton", torch.bfloat16, marks=needs_interpreter)],
                         ids=["torch-fp32", "torch-bf16", "triton-bf16"])
def test_inputs_are_left_bit_for_bit_unchanged(model, backend, dtype):
    with kernel_backend(backend):
        engine = dslab.init_inference(model, dtype=dtype, max_out_tokens=PROMPT + NEW_TOKENS)
        for batch in BATCHES:
            ids_storage, mask_storage = _caller_storage(batch, seed=batch)
            expected_ids, expected_mask = ids_storage.clone(), mask_storage.clone()
            ids, mask = _views(ids_storage, mask_storage)
            assert not ids.is_contiguous() and ids.storage_offset() > 0
            assert ids.to(engine.device, torch.int64) is ids  # the engine gets the caller's own storage

            logits = engine(ids, attention_mask=mask)
            greedy = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
            sampled = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=True,
                                      top_k=0, generator=torch.Generator().manual_seed(batch))
            assert logits.shape == (batch, PROMPT, model.config.vocab_size)
            assert greedy.shape == sampled.shape == (batch, PROMPT + NEW_TOKENS)
            assert torch.equal(greedy[:, :PROMPT], ids) and torch.equal(sampled[:, :PROMPT], ids)
            assert torch.equal(ids_storage, expected_ids), f"batch {batch}: input_ids changed"
            assert torch.equal(mask_storage, expected_mask), f"batch {batch}: attention_mask changed"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_generated_alone_equals_that_row_of_the_batch(model, backend):
    """fp32 greedy: rows 0 (no padding) and 3 (left-padded) of each batch, generated as one-row
    slices of the caller's tensors after the whole batch, give the batch's tokens; a two-row slice
    (bucket 2) too."""
    with kernel_backend(backend):
        engine = dslab.init_inference(model, dtype=torch.float32, max_out_tokens=PROMPT + NEW_TOKENS)
        for batch in BATCHES:
            ids_storage, mask_storage = _caller_storage(batch, seed=100 + batch)
            ids, mask = _views(ids_storage, mask_storage)
            tokens = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
            assert bool((mask[3] == 0).any()) and bool((mask[0] == 1).all())
            for rows in (slice(0, 1), slice(3, 4), slice(batch - 2, batch)):
                alone = engine.generate(ids[rows], attention_mask=mask[rows], max_new_tokens=NEW_TOKENS)
                assert torch.equal(alone, tokens[rows]), f"batch {batch}, rows {rows}"
