"""GPT-2 written for PyTorch's own model parallelism: the model the ``torch-tp*`` and ``torch-pp*``
arms of a model-parallel suite train (:mod:`dslab.bench.model_parallel_peers`).

It is :class:`dslab.models.gpt2.GPT2LMHeadModel`'s function (learned positions, pre-LN blocks,
causal attention, tanh-GELU MLP, final LayerNorm, LM head tied to the token embeddings, the same
initialisation) on plain ``nn`` modules, laid out the way ``parallelize_module`` and
``torch.distributed.pipelining`` expect a model (torchtitan's ``Transformer``):

- every projection is its own ``nn.Linear`` (``attention.q``, ``.k``, ``.v``, ``.out``;
  ``mlp.fc``, ``mlp.proj``), so ``ColwiseParallel`` and ``RowwiseParallel`` can split them by
  name. dslab's model packs q, k and v into one projection and fuses its bias, dropout and
  residual adds into its kernels; transformers' GPT-2 packs them into a ``Conv1D``. Neither splits
  by heads under ``ColwiseParallel``, which shards a weight's rows contiguously;
- attention reshapes with ``view(b, s, -1, head_dim)``, so a rank holding ``heads/tp`` heads'
  projections computes its own heads without knowing the split;
- the blocks live in an ``nn.ModuleDict`` keyed by their index, and the embeddings, the final norm
  and the head may be absent (``None``): a pipeline stage is this model holding some blocks
  (:func:`build_torch_gpt2`), whose forward skips what it does not hold.

Attention is ``F.scaled_dot_product_attention(is_causal=True)`` (flash attention on a GPU), the
loss ``F.cross_entropy`` over the padded vocabulary (``config.padded_vocab_size`` columns;
dslab's loss masks the padding columns out of the softmax, this one leaves them in: the same
matmuls, and a softmax over 47 more columns at GPT-2's vocabulary).

Shapes: ``tokens`` ``[batch, seq]`` int64 -> logits ``[batch, seq, padded_vocab]`` (a stage
without the head returns the hidden states ``[batch, seq, hidden]``; a stage without the
embeddings takes them).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from dslab.models.gpt2 import GPT2Config

IGNORE_INDEX = -100


class TorchAttention(nn.Module):
    """Causal self-attention with separate q, k, v and output projections."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        hidden = config.hidden
        self.head_dim = hidden // config.heads
        self.dropout = config.dropout
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class TorchMLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.fc = nn.Linear(config.hidden, config.intermediate)
        self.proj = nn.Linear(config.intermediate, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class TorchBlock(nn.Module):
    """``x + drop(attn(ln1(x)))``, then ``x + drop(mlp(ln2(x)))``."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.dropout = config.dropout
        self.attention_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_epsilon)
        self.attention = TorchAttention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_epsilon)
        self.mlp = TorchMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attention(self.attention_norm(x)), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.mlp_norm(x)), self.dropout, self.training)


class TorchGPT2(nn.Module):
    """GPT-2, or the part of it one pipeline stage holds (module docstring).

    ``blocks``: the indices of the blocks held (default: all); ``embed``: the token and position
    embeddings; ``head``: the final norm and the LM head. With both ``embed`` and ``head`` the
    head's weight is the token embedding matrix (tied); a last stage without the embeddings has
    a head matrix of its own, initialised as the embedding matrix is (:meth:`init_weights`), whose
    gradient the caller sums with the first stage's.

    ``checkpoint_interval`` > 0 runs the blocks in activation checkpoints of that many blocks
    (``torch.utils.checkpoint``, non-reentrant) while training.
    """

    def __init__(self, config: GPT2Config, blocks: range | None = None, embed: bool = True, head: bool = True,
                 checkpoint_interval: int = 0):
        super().__init__()
        config.validate()
        self.config = config
        self.checkpoint_interval = checkpoint_interval
        blocks = range(config.layers) if blocks is None else blocks
        self.wte = nn.Embedding(config.padded_vocab_size, config.hidden) if embed else None
        self.wpe = nn.Embedding(config.n_positions, config.hidden) if embed else None
        self.layers = nn.ModuleDict({str(i): TorchBlock(config) for i in blocks})
        self.final_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_epsilon) if head else None
        self.lm_head = nn.Linear(config.hidden, config.padded_vocab_size, bias=False) if head else None

    def init_weights(self, seed: int) -> None:
        """GPT-2's initialisation, drawn per module from ``seed`` so that any stage draws what the
        whole model would: Linear and Embedding weights ~ N(0, initializer_range), biases 0,
        LayerNorms 1 and 0, the residual projections (``attention.out``, ``mlp.proj``) with
        ``std / sqrt(2 * layers)``; the token matrix (and an untied head) from ``seed`` itself,
        block ``i`` from ``seed + 1 + i``, the positions from ``seed + 1 + layers``."""
        config = self.config
        std = config.initializer_range
        scaled = std / math.sqrt(2 * config.layers)

        def draw(module: nn.Module, module_seed: int) -> None:
            torch.manual_seed(module_seed)
            for name, m in module.named_modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    residual = name.endswith("attention.out") or name.endswith("mlp.proj")
                    nn.init.normal_(m.weight, mean=0.0, std=scaled if residual else std)
                    if isinstance(m, nn.Linear) and m.bias is not None:
                        nn.init.zeros_(m.bias)
                elif isinstance(m, nn.LayerNorm):
                    nn.init.ones_(m.weight)
                    nn.init.zeros_(m.bias)

        with torch.no_grad():
            if self.wte is not None:
                draw(self.wte, seed)
                draw(self.wpe, seed + 1 + config.layers)
            for index, block in self.layers.items():
                draw(block, seed + 1 + int(index))
            if self.lm_head is not None:
                draw(self.final_norm, seed)
                if self.wte is not None:
                    self.lm_head.weight = self.wte.weight
                else:
                    draw(self.lm_head, seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = F.dropout(self.wte(tokens) + self.wpe(positions), self.config.dropout, self.training)
        else:
            x = tokens
        blocks = list(self.layers.values())
        interval = self.checkpoint_interval if self.training and torch.is_grad_enabled() else 0
        if interval:
            for start in range(0, len(blocks), interval):
                x = torch.utils.checkpoint.checkpoint(_run_blocks, blocks[start:start + interval], x,
                                                      use_reentrant=False)
        else:
            x = _run_blocks(blocks, x)
        if self.lm_head is not None:
            x = self.lm_head(self.final_norm(x))
        return x


def _run_blocks(blocks: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of position ``t`` against ``labels[:, t + 1]`` (the last position and
    any -100 label scored against nothing), in fp32: dslab's GPT-2 loss. ``logits`` may be a
    DTensor split over the vocabulary (inside ``loss_parallel()``)."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


def stage_blocks(layers: int, stage: int, stages: int) -> range:
    """The blocks of pipeline stage ``stage`` of ``stages``: contiguous runs whose lengths differ
    by at most one, the longer runs first (dslab's ``type:GPT2Block`` partition of the blocks)."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not one of {stages} stages")
    if layers < stages:
        raise ValueError(f"{layers} blocks cannot fill {stages} pipeline stages: every stage holds at least one")
    base, extra = divmod(layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def build_torch_gpt2(config: GPT2Config, device: torch.device, seed: int, stage: int = 0, stages: int = 1,
                     checkpoint_interval: int = 0) -> TorchGPT2:
    """The whole model (``stages`` 1) or pipeline stage ``stage``'s part of it, built and
    initialised on ``device`` (:meth:`TorchGPT2.init_weights`), in training mode."""
    with torch.device(device):
        model = TorchGPT2(config, stage_blocks(config.layers, stage, stages), embed=stage == 0,
                          head=stage == stages - 1, checkpoint_interval=checkpoint_interval)
        model.init_weights(seed)
    return model.train()
