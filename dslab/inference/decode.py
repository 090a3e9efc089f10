"""The per-token step on static buffers, one slot per batch bucket, replayed from a CUDA graph.

A generation of ``batch`` rows runs in the slot of its bucket (the next power of two, so a few
graphs serve every batch size). A slot holds, for ``bucket`` rows:

- the KV cache (:class:`dslab.inference.kv_cache.KVCache`, ``max_seq`` positions of the model's
  key/value heads: fewer than its query heads under grouped-query attention), allocated once;
- ``tokens`` int64 ``[bucket]``: the token each row feeds next;
- ``write_pos`` int64 ``[bucket]``: the cache position that token goes to (its position id is
  ``write_pos - valid_start``);
- ``valid_start`` int32 ``[bucket]``: each row's first real (non-pad) cache position.

The model is an :class:`~dslab.inference.modules.InferenceTransformer` (GPT-2) or an
:class:`~dslab.inference.llama_modules.InferenceLlama` (Llama layout, whose rotary positions come
from the same ``write_pos - valid_start``). The step (:meth:`DecodeRunner.step`) embeds ``tokens``,
runs every layer with decode attention, returns the logits ``[bucket, vocab]`` and advances
``write_pos`` by one, all on the device. Rows past ``batch`` are filler: they start at token 0,
position ``P`` and ``valid_start`` 0, their outputs are ignored, and each row's computation is
independent of the others'.

With graphs (CUDA, ``enable_cuda_graph``), the first step of a slot runs the body twice on a side
stream (Triton compiles and autotunes there; ``write_pos`` is put back after each run, and the
cache positions they wrote lie beyond every position read before they are written again), then
captures it into a graph with its own memory pool; every later step is ``graph.replay()``, whose
static output is the logits buffer. The caller writes the next tokens into ``tokens`` in place.
torch's cached cuBLAS workspaces are cleared before and after each capture, so a graph owns the
workspace it replays into (:mod:`dslab.models.graphs` says why). Under tensor parallelism the
graph holds the step's NCCL all_reduces: the collectives issued while it is captured are recorded
(:func:`dslab.comm.recording_calls`) and announced to the comm observers after each replay
(:func:`dslab.comm.announce_replay`), so the comms logger counts them once per token, as it counts
the eager step's. The step runs eagerly instead,
with the same buffers, off CUDA, without graphs, or while a dispatch mode (the flops profiler's
counter) is active.

The prompt (:meth:`DecodeRunner.prefill`) is graphed too, per slot and prompt shape, once that
shape comes a second time: an eager prefill issues ~10 kernels a layer from Python and is
host-bound (Llama-3.2-1B, 512 tokens, one H200: 11.5 ms of host work for 2.2 ms of device work),
where a replay costs the host one launch. Only prompts without padding (no attention mask, or one
of all ones: :func:`dslab.inference.generate.check_prompt` drops it) of at most
:data:`PREFILL_GRAPH_TOKENS` tokens in all are graphed; a shape seen once runs eagerly, so one-off
prompt lengths never pay for a capture (two warm-up runs and the capture, about three eager
prefills), and at most :data:`PREFILL_GRAPHS` graphs are kept per slot (the oldest dropped first).
The graph reads the prompt from a static buffer and writes the slot's cache and a static logits
buffer, which the caller reads before the next prefill of that shape. A capture that fails (a host
read inside the model, say) leaves that shape eager for good, its reason in ``stats``.
"""

from __future__ import annotations

from collections import Counter

import torch

from dslab import comm
from dslab.inference.kv_cache import KVCache
from dslab.inference.llama_modules import InferenceLlama
from dslab.inference.modules import InferenceTransformer

InjectedModel = InferenceTransformer | InferenceLlama

WARMUP_RUNS = 2
#: Largest prompt (batch x length tokens) whose prefill is graphed, and the graphs kept per slot.
PREFILL_GRAPH_TOKENS = 16384
PREFILL_GRAPHS = 8


def batch_bucket(batch: int) -> int:
    """The slot size that serves ``batch`` rows: the next power of two."""
    return 1 << (batch - 1).bit_length()


def _clear_cublas_workspaces() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


class DecodeSlot:
    """The static state of one batch bucket (see the module docstring)."""

    def __init__(self, model: InjectedModel, bucket: int, max_seq: int):
        device = model.device
        self.bucket = bucket
        self.cache = KVCache(len(model.layers), bucket, model.kv_heads // model.tp.size, max_seq, model.head_dim,
                             model.dtype, device)
        self.tokens = torch.zeros(bucket, dtype=torch.int64, device=device)
        self.write_pos = torch.zeros(bucket, dtype=torch.int64, device=device)
        self.valid_start = torch.zeros(bucket, dtype=torch.int32, device=device)
        self.graph = None
        self.logits = None
        self.collectives: list[comm.CollectiveCall] = []  # those the graph holds, announced at each replay
        # (batch, prompt length) -> (graph, static input ids, static logits, collectives), oldest first
        self.prefill_graphs: dict[tuple[int, int], tuple] = {}

    def start(self, first_tokens: torch.Tensor, prompt_len: int, valid_start: torch.Tensor) -> None:
        """Rows ``0 .. len(first_tokens) - 1`` feed ``first_tokens`` at position ``prompt_len``."""
        batch = first_tokens.shape[0]
        self.tokens.zero_()
        self.tokens[:batch].copy_(first_tokens)
        self.write_pos.fill_(prompt_len)
        self.valid_start.zero_()
        self.valid_start[:batch].copy_(valid_start)


class DecodeRunner:
    """Slots by bucket and the step over them (see the module docstring)."""

    def __init__(self, model: InjectedModel, max_seq: int, use_graphs: bool):
        self.model = model
        self.max_seq = max_seq
        self.use_graphs = use_graphs and model.device.type == "cuda"
        self.slots: dict[int, DecodeSlot] = {}
        self.stats: Counter = Counter()
        self.prefill_seen: Counter = Counter()
        self.prefill_failed: dict[tuple[int, int], str] = {}

    def slot(self, batch: int) -> DecodeSlot:
        bucket = batch_bucket(batch)
        if bucket not in self.slots:
            self.slots[bucket] = DecodeSlot(self.model, bucket, self.max_seq)
        return self.slots[bucket]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(s.cache.nbytes for s in self.slots.values())

    def _body(self, slot: DecodeSlot) -> torch.Tensor:
        logits = self.model.decode_step(slot.tokens, slot.write_pos, slot.valid_start, slot.cache)
        slot.write_pos.add_(1)
        return logits

    def _graphs_possible(self) -> str | None:
        """Why the step must run eagerly now, or None."""
        if not self.use_graphs:
            return "graphs off"
        if torch._C._len_torch_dispatch_stack() > 0:
            return "dispatch mode active"
        if torch.cuda.is_current_stream_capturing():
            return "inside another capture"
        return None

    def _capture(self, slot: DecodeSlot) -> None:
        saved = slot.write_pos.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                self._body(slot)
                slot.write_pos.copy_(saved)
        torch.cuda.current_stream().wait_stream(stream)
        _clear_cublas_workspaces()
        graph = torch.cuda.CUDAGraph()
        with comm.recording_calls(graph) as collectives, torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
            slot.logits = self._body(slot)
        _clear_cublas_workspaces()
        slot.write_pos.copy_(saved)  # the capture recorded the advance without running it
        slot.graph = graph
        slot.collectives = collectives
        self.stats["captures"] += 1

    def step(self, slot: DecodeSlot) -> torch.Tensor:
        """Logits ``[bucket, vocab]`` of the slot's ``tokens``; advances ``write_pos``. Under a
        graph the returned tensor is the graph's static output, overwritten by the next step."""
        eager_reason = self._graphs_possible()
        if eager_reason is not None:
            self.stats[f"eager ({eager_reason})"] += 1
            return self._body(slot)
        if slot.graph is None:
            self._capture(slot)
        slot.graph.replay()
        if slot.collectives:
            comm.announce_replay(slot.collectives)
        self.stats["replays"] += 1
        return slot.logits

    def prefill(self, slot: DecodeSlot, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The model's ``prefill`` of ``input_ids`` ``[batch, P]`` into ``slot``'s cache: logits
        ``[batch, vocab]`` of each row's last position, from a graph replay when the module
        docstring's conditions hold (then the graph's static output, overwritten by the next
        prefill of this shape)."""
        batch, length = input_ids.shape
        key = (batch, length)
        reason = self._graphs_possible()
        if reason is None and attention_mask is not None:
            reason = "padded prompt"
        if reason is None and batch * length > PREFILL_GRAPH_TOKENS:
            reason = f"more than {PREFILL_GRAPH_TOKENS} prompt tokens"
        if reason is None:
            reason = self.prefill_failed.get((slot.bucket, *key))
        if reason is None:
            self.prefill_seen[(slot.bucket, *key)] += 1
            if key not in slot.prefill_graphs and self.prefill_seen[(slot.bucket, *key)] < 2:
                reason = "first prompt of its shape"
        if reason is not None:
            self.stats["prefill eager"] += 1
            return self.model.prefill(input_ids, attention_mask, slot.cache)
        if key not in slot.prefill_graphs:
            try:
                self._capture_prefill(slot, input_ids)
            except Exception as err:  # not capturable: this shape stays eager, and says why
                torch.cuda.synchronize()
                self.prefill_failed[(slot.bucket, *key)] = f"capture failed: {type(err).__name__}: {err}"
                self.stats["prefill capture failed"] += 1
                return self.model.prefill(input_ids, attention_mask, slot.cache)
        graph, ids, logits, collectives = slot.prefill_graphs[key]
        ids.copy_(input_ids)
        graph.replay()
        if collectives:
            comm.announce_replay(collectives)
        self.stats["prefill replays"] += 1
        return logits

    def _capture_prefill(self, slot: DecodeSlot, input_ids: torch.Tensor) -> None:
        ids = input_ids.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):  # the cache rows they write are written again by every replay
                self.model.prefill(ids, None, slot.cache)
        torch.cuda.current_stream().wait_stream(stream)
        _clear_cublas_workspaces()
        graph = torch.cuda.CUDAGraph()
        try:
            with comm.recording_calls(graph) as collectives, \
                    torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
                logits = self.model.prefill(ids, None, slot.cache)
        finally:
            _clear_cublas_workspaces()
        if len(slot.prefill_graphs) >= PREFILL_GRAPHS:
            slot.prefill_graphs.pop(next(iter(slot.prefill_graphs)))
        slot.prefill_graphs[tuple(input_ids.shape)] = (graph, ids, logits, collectives)
        self.stats["prefill captures"] += 1

    def release(self) -> None:
        """Drop every slot (caches, graphs and their memory pools)."""
        self.slots.clear()
        self.prefill_seen.clear()
