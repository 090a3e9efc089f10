"""Engine overhead: dslab's engine vs a hand-written loop on the same model.

Default (one GPU, bf16): both arms train the same plain-PyTorch GPT-2 124M (seq 1024, micro-batch
16) with ``torch.autocast(bf16)`` over fp32 parameters and ``torch.optim.AdamW(fused=True)``; the
engine arm gets that through its config (``bf16.enabled``, optimizer AdamW). Trials alternate
between the arms; each trial times ``--steps`` steps with CUDA events after a warm-up. Prints the
median step time of each arm and the ratio engine / hand-written (target: within 1.03).

    python benchmarks/engine_overhead.py [--trials 5] [--steps 20] [--batch 16] [--seq 1024]

``--host``: the host (Python) time of a training step, on CUDA when there is one and on the CPU
otherwise. The model is dslab's BERT with BERT-large's structure (24 layers, 302 parameter tensors
in 227 modules) at tiny sizes (hidden 64, 2 heads, intermediate 256, vocab 1000, ``kernels="torch"``),
so that the host's per-step work shows beside the compute. The engine arm runs the BERT-large
pretraining config (AdamW, ``gradient_clipping`` 1.0, bf16, ``cuda_graphs``, no profilers); the
hand-written arm runs ``autocast(bf16)`` forward, ``backward``, ``clip_grad_norm_``, fused AdamW
``step`` and ``zero_grad`` on an identical model (graphs switched on as well). Each trial times
``--steps`` steps with the host clock, split into forward + backward and the optimizer step
(``engine.step()``, or clipping + ``step`` + ``zero_grad``); the tables give the medians over the
trials and the engine's overhead as the difference to the hand-written arm. On CUDA the phases are
the time the host spends issuing them (no synchronisation inside a trial).
``--profile N`` adds a cProfile of N engine steps: calls, tottime and cumtime per step of every
function that takes at least 1% of the profiled time.

    python benchmarks/engine_overhead.py --host [--trials 7] [--steps 50] [--profile 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

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


def gpu_overhead(args) -> None:
    """GPT-2 124M step time, engine vs hand-written, on one GPU."""
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU (or --host)"
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


# -- host time per step (--host) ------------------------------------------------------------------


def host_bert(seed: int = 0):
    """dslab's BERT with BERT-large's structure at tiny sizes (see the module docstring)."""
    from dslab.models.bert import BertForPreTraining, bert_large

    torch.manual_seed(seed)
    config = bert_large(vocab_size=1000, hidden=64, heads=2, intermediate=256, max_position=128)
    return BertForPreTraining(config, kernels="torch")


def host_batch(batch: int, seq: int, device: torch.device, seed: int = 0) -> dict:
    """A pretraining batch: every fifth token masked for MLM, NSP labels, no padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (batch, seq), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, ::5] = ids[:, ::5]
    out = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids),
           "masked_lm_labels": labels, "next_sentence_label": torch.randint(0, 2, (batch,), generator=g)}
    return {k: v.to(device) for k, v in out.items()}


def host_engine_config(batch: int) -> dict:
    """The BERT-large pretraining config of the measurement (profilers off)."""
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "cuda_graphs": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "steps_per_print": 10**9,
    }


class HostArms:
    """The two arms of ``--host``: each step is a pair of callables, (forward + backward,
    optimizer step)."""

    def __init__(self, batch: int, seq: int):
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.batch = host_batch(batch, seq, self.device)
        hand_model = host_bert().to(self.device)
        hand_model.enable_cuda_graphs(True)
        hand_opt = torch.optim.AdamW(hand_model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
        engine, _, _, _ = dslab.initialize(model=host_bert(), config=host_engine_config(batch))
        assert type(engine.optimizer) is torch.optim.AdamW and engine.optimizer.defaults.get("fused")
        self.engine = engine

        def hand_forward_backward():
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                loss = hand_model(**self.batch)
            loss.backward()

        def hand_step():
            torch.nn.utils.clip_grad_norm_(hand_model.parameters(), 1.0)
            hand_opt.step()
            hand_opt.zero_grad(set_to_none=True)

        def engine_forward_backward():
            engine.backward(engine(**self.batch))

        self.arms = {"hand-written": (hand_forward_backward, hand_step),
                     "dslab engine": (engine_forward_backward, engine.step)}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def run(self, name: str, steps: int) -> dict[str, float]:
        """Host milliseconds per step of ``steps`` steps of arm ``name``: total and by phase."""
        forward_backward, step = self.arms[name]
        clock = time.perf_counter
        phases = [0.0, 0.0]
        self.sync()
        begin = clock()
        for _ in range(steps):
            t0 = clock()
            forward_backward()
            t1 = clock()
            step()
            t2 = clock()
            phases[0] += t1 - t0
            phases[1] += t2 - t1
        self.sync()
        total = clock() - begin
        return {"step_ms": total / steps * 1e3, "fwd_bwd_ms": phases[0] / steps * 1e3,
                "opt_step_ms": phases[1] / steps * 1e3}


def profile_engine(arms: HostArms, steps: int, min_share: float = 0.01) -> list[dict]:
    """cProfile ``steps`` engine steps; per step, the calls, tottime and cumtime (ms) of every
    function whose cumtime is at least ``min_share`` of the profiled time."""
    import cProfile
    import pstats

    forward_backward, step = arms.arms["dslab engine"]
    profiler = cProfile.Profile()
    arms.sync()
    profiler.enable()
    for _ in range(steps):
        forward_backward()
        step()
    arms.sync()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    total = max(ct for _, _, _, ct, _ in stats.values())
    rows = []
    for (path, line, func), (_, calls, tottime, cumtime, _) in stats.items():
        if cumtime >= min_share * total:
            where = f"{path.split('site-packages/')[-1].split('/work/main/')[-1]}:{line}" if line else path
            rows.append({"function": f"{func} ({where})", "calls": calls / steps,
                         "tottime_ms": tottime / steps * 1e3, "cumtime_ms": cumtime / steps * 1e3})
    rows.sort(key=lambda r: -r["cumtime_ms"])
    return rows


def host_overhead(args) -> None:
    """Host time per step of the BERT-large-shaped loop, engine vs hand-written."""
    arms = HostArms(args.batch, args.seq)
    for name in arms.arms:
        for _ in range(args.warmup):
            arms.arms[name][0]()
            arms.arms[name][1]()
    times: dict[str, list[dict[str, float]]] = {name: [] for name in arms.arms}
    for trial in range(args.trials):
        order = list(arms.arms) if trial % 2 == 0 else list(reversed(arms.arms))
        for name in order:
            times[name].append(arms.run(name, args.steps))

    def median(name: str, key: str) -> float:
        return statistics.median(t[key] for t in times[name])

    where = torch.cuda.get_device_name() if arms.device.type == "cuda" else "CPU"
    print(f"\nBERT-large structure at tiny sizes, batch {args.batch}, seq {args.seq}, bf16 autocast, "
          f"fused AdamW, clipping 1.0, {where}, {torch.get_num_threads()} threads | torch {torch.__version__}")
    print(f"host ms per step, median of {args.trials} trials of {args.steps} steps")
    print(f"{'arm':<14} {'step':>8} {'min':>8} {'max':>8} {'fwd+bwd':>8} {'opt step':>9}")
    for name, ts in times.items():
        steps = [t["step_ms"] for t in ts]
        print(f"{name:<14} {median(name, 'step_ms'):>8.3f} {min(steps):>8.3f} {max(steps):>8.3f} "
              f"{median(name, 'fwd_bwd_ms'):>8.3f} {median(name, 'opt_step_ms'):>9.3f}")
    overhead = {key: median("dslab engine", key) - median("hand-written", key)
                for key in ("step_ms", "fwd_bwd_ms", "opt_step_ms")}
    print(f"engine overhead per step: {overhead['step_ms']:.3f} ms (forward + backward "
          f"{overhead['fwd_bwd_ms']:.3f}, optimizer step {overhead['opt_step_ms']:.3f})")
    rows = profile_engine(arms, args.profile) if args.profile else []
    if rows:
        print(f"\ncProfile of {args.profile} engine steps, per step:")
        print(f"{'calls':>8} {'tottime ms':>11} {'cumtime ms':>11}  function")
        for r in rows:
            print(f"{r['calls']:>8.1f} {r['tottime_ms']:>11.3f} {r['cumtime_ms']:>11.3f}  {r['function']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"times_ms": times, "overhead_ms": overhead, "profile": rows, "device": where,
                       "args": vars(args)}, f, indent=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", action="store_true",
                        help="host time per step of the BERT-large-shaped loop (runs on the CPU too)")
    parser.add_argument("--trials", type=int, default=None, help="default 5 (--host: 7)")
    parser.add_argument("--steps", type=int, default=None, help="default 20 (--host: 50)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=None, help="default 16 (--host: 2)")
    parser.add_argument("--seq", type=int, default=None, help="default 1024 (--host: 32)")
    parser.add_argument("--profile", type=int, default=0,
                        help="--host: cProfile this many engine steps after the trials")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    defaults = ({"trials": 7, "steps": 50, "batch": 2, "seq": 32} if args.host
                else {"trials": 5, "steps": 20, "batch": 16, "seq": 1024})
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.host:
        host_overhead(args)
    else:
        gpu_overhead(args)


if __name__ == "__main__":
    main()
