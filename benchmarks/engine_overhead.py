"""Engine overhead: dslab's engine vs a hand-written loop on the same model (one GPU, bf16).

Both arms train the same plain-PyTorch GPT-2 124M (seq 1024, micro-batch 16) with
``torch.autocast(bf16)`` over fp32 parameters and ``torch.optim.AdamW(fused=True)``; the engine
arm gets that through its config (``bf16.enabled``, optimizer AdamW). Trials alternate between the
arms; each trial times ``--steps`` steps with CUDA events after a warm-up. Prints the median step
time of each arm and the ratio engine / hand-written (target: within 1.03).

    python benchmarks/engine_overhead.py [--trials 5] [--steps 20] [--batch 16] [--seq 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F

import dslab


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2 124M shape: 12 layers, 768 hidden, 12 heads, vocab 50304, tied embeddings."""

    def __init__(self, vocab=50304, dim=768, layers=12, heads=12, seq=1024):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, tokens, targets):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def time_steps(step_fn, steps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step_fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    dev = torch.device("cuda")
    torch.manual_seed(0)
    tokens = torch.randint(0, 50304, (args.batch, args.seq + 1), device=dev)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    hand_model = GPT2(seq=args.seq).to(dev)
    engine_model = GPT2(seq=args.seq).to(dev)
    engine_model.load_state_dict(hand_model.state_dict())
    hand_opt = torch.optim.AdamW(hand_model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

    def hand_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = hand_model(inputs, targets)
        loss.backward()
        hand_opt.step()
        hand_opt.zero_grad(set_to_none=True)

    engine, _, _, _ = dslab.initialize(model=engine_model, config={
        "train_micro_batch_size_per_gpu": args.batch,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "steps_per_print": 10**9,
    })
    assert type(engine.optimizer) is torch.optim.AdamW and engine.optimizer.defaults.get("fused")

    def engine_step():
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()

    arms = {"hand-written": hand_step, "dslab engine": engine_step}
    for fn in arms.values():
        for _ in range(args.warmup):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in arms}
    for trial in range(args.trials):
        order = list(arms) if trial % 2 == 0 else list(reversed(arms))
        for name in order:
            times[name].append(time_steps(arms[name], args.steps))

    tokens_per_step = args.batch * args.seq
    print(f"\nGPT-2 124M, seq {args.seq}, batch {args.batch}, bf16 autocast, fused AdamW, "
          f"{torch.cuda.get_device_name()} | torch {torch.__version__}")
    print(f"{'arm':<14} {'median ms':>10} {'min':>8} {'max':>8} {'k tok/s':>9}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<14} {med:>10.2f} {min(ts):>8.2f} {max(ts):>8.2f} {tokens_per_step / med:>9.1f}")
    ratio = statistics.median(times["dslab engine"]) / statistics.median(times["hand-written"])
    print(f"engine / hand-written step time: {ratio:.4f} (target <= 1.03)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"times_ms": times, "ratio": ratio, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
