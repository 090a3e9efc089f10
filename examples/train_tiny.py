"""A small DeepSpeed-style training script: the same loop runs on one CPU, one GPU, or several
processes under torchrun.

    bin/dslab env && .venv/bin/python examples/train_tiny.py
    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 examples/train_tiny.py
"""

import argparse
import time

import torch
import torch.nn as nn

import dslab


class TinyTransformer(nn.Module):
    """A 2-layer pre-LN transformer language model on random tokens."""

    def __init__(self, vocab=512, dim=128, heads=4, layers=2, seq=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        mask = torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)
        self.register_buffer("causal", mask, persistent=False)

    def forward(self, tokens):
        h = self.embed(tokens[:, :-1]) + self.pos[: tokens.shape[1] - 1]
        h = self.blocks(h, mask=self.causal[: h.shape[1], : h.shape[1]], is_causal=True)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    dslab.add_config_arguments(parser)
    args = parser.parse_args()
    config = args.deepspeed_config or {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": torch.cuda.is_available()},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 10}},
        "steps_per_print": 10,
    }
    torch.manual_seed(0)
    engine, _, _, _ = dslab.initialize(model=TinyTransformer(), config=config)
    # A learnable stream: each sequence counts up from a random start.
    g = torch.Generator().manual_seed(engine.rank)
    t0 = time.perf_counter()
    for step in range(args.steps * engine.gradient_accumulation_steps()):
        start = torch.randint(0, 512, (engine.train_micro_batch_size_per_gpu(), 1), generator=g)
        tokens = ((start + torch.arange(65)) % 512).to(engine.device)
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        if engine.was_step_applied() and engine.global_steps % 10 == 0 and engine.rank == 0:
            print(f"step {engine.global_steps:4d}  loss {loss.item():.4f}  lr {engine.get_lr()[0]:.2e}")
    if engine.rank == 0:
        print(f"{engine.global_steps} steps, {engine.global_samples} samples in {time.perf_counter() - t0:.1f}s "
              f"on {engine.device} x{engine.world_size}")


if __name__ == "__main__":
    main()
