"""The weight stream of a batch-1 Llama-3.2-1B decode step through ``decode_linear``, launch
configuration by launch configuration.

    python3 benchmarks/decode_chain_bench.py [--layers 16] [--reps 20] [--trials 5]

A batch-1 decode step reads every weight once: per layer QKV (3072 x 2048), the attention output
(2048 x 2048), gate/up (16384 x 2048) and down (2048 x 8192), then the LM head (128256 x 2048),
2.47 GB in bf16. This benchmark launches those 65 projections as the fused step does (QKV with
the residual add and RMSNorm in front and rope and the KV-cache writes behind, gate/up with the add,
the norm and SwiGLU, the LM head with the final norm), without the attention kernels between
them, over distinct weights (nothing of one replay is left in L2 for the next), each variant
captured in one CUDA graph and replayed ``--reps`` times, ``--trials`` times interleaved:

- ``tile kernel``: :mod:`dslab.kernels.decode.decode_linear_triton` at one row (one output tile
  a program, ``decode_linear.ROW_KERNEL = False``), with and without programmatic dependent launch;
- ``row kernel``: :mod:`dslab.kernels.decode.decode_row_triton`'s persistent programs at its
  default configuration, with and without dependent launch, then with dependent launch under each
  configuration tried for one group of projections (QKV; the attention output; gate/up and the
  LM head; down), the others at their defaults.

The row kernel's result is checked against the tile kernel's over the whole chain first (the same
sums in the same order: equal bit for bit). GB/s counts weight bytes; the percentage divides by
the device-to-device copy bandwidth (bytes read + written a second), whose time for the weights
is the floor printed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from inference_kernels_bench import copy_bandwidth_gbs  # noqa: E402

from dslab.kernels.attention.rope import rope_tables  # noqa: E402
from dslab.kernels.decode.decode_linear import decode_linear  # noqa: E402
from dslab.kernels.decode import decode_row_triton as row_triton  # noqa: E402
from dslab.kernels.decode.decode_row_triton import forced_row_config  # noqa: E402
from dslab.kernels.dispatch import dependent_launches  # noqa: E402

linear_module = importlib.import_module("dslab.kernels.decode.decode_linear")  # the package attribute is the function

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 8192, 32, 8, 64, 128256
#: (BLOCK_N, BLOCK_K (0: whole row), num_warps, programs per SM (0: as many as an SM holds, one wave))
#: tried at K <= 2048, and at K = 8192.
SMALL_K = [(4, 0, 8, 4), (2, 0, 4, 8), (8, 0, 8, 2), (8, 0, 8, 0), (4, 0, 8, 0), (2, 0, 8, 0), (1, 0, 8, 0),
           (4, 0, 4, 0), (2, 0, 4, 0), (1, 0, 4, 0), (8, 0, 16, 0), (4, 0, 16, 0)]
LARGE_K = [(2, 0, 8, 2), (2, 0, 8, 0), (2, 0, 16, 0), (1, 0, 8, 0), (1, 0, 4, 0), (1, 0, 16, 0), (2, 2048, 8, 0),
           (4, 2048, 8, 0), (2, 2048, 4, 0)]


class Chain:
    """The 65 projections' weights and the buffers they read and write."""

    def __init__(self, layers: int, device: str = "cuda"):
        bf16 = dict(device=device, dtype=torch.bfloat16)
        qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM

        def weight(n, k):
            return torch.randn(n, k, **bf16) / k ** 0.5

        self.layers = [dict(qkv=weight(qkv_rows, HIDDEN), o=weight(HIDDEN, HEADS * HEAD_DIM),
                            gate_up=weight(2 * INTER, HIDDEN), down=weight(HIDDEN, INTER),
                            norm_1=1 + 0.1 * torch.randn(HIDDEN, **bf16), norm_2=1 + 0.1 * torch.randn(HIDDEN, **bf16))
                       for _ in range(layers)]
        self.lm_head, self.final_norm = weight(VOCAB, HIDDEN), 1 + 0.1 * torch.randn(HIDDEN, **bf16)
        self.bytes = 2 * (sum(w.numel() for layer in self.layers for name, w in layer.items()
                              if not name.startswith("norm")) + self.lm_head.numel())
        self.x = torch.randn(1, HIDDEN, **bf16)
        self.residual = torch.randn(1, HIDDEN, **bf16)
        self.attn = torch.randn(1, HEADS * HEAD_DIM, **bf16)
        self.q = torch.empty(1, HEADS * HEAD_DIM, **bf16)
        self.caches = [tuple(torch.zeros(1, KV_HEADS, 256, HEAD_DIM, **bf16) for _ in range(2)) for _ in range(layers)]
        self.write_pos = torch.tensor([40], device=device)
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM))
        self.rope = rope_tables(self.write_pos, inv_freq)
        self.logits = None

    def run(self, config_for=None):
        """The 65 launches; ``config_for(name)``: the forced row-kernel configuration of the projection
        ``name`` (qkv, o, gate_up, down, lm_head; None: its default)."""
        def forced(name):
            return forced_row_config(config_for(name)) if config_for else contextlib.nullcontext()

        eps = 1e-5
        h = self.x
        for layer, (k_cache, v_cache) in zip(self.layers, self.caches):
            with forced("qkv"):
                _, a = decode_linear(h, layer["qkv"], residual=self.residual, rms_norm=(layer["norm_1"], eps),
                                     return_sum=True,
                                     kv=(self.q, k_cache, v_cache, self.write_pos, HEAD_DIM, self.rope))
            with forced("o"):
                o = decode_linear(self.attn, layer["o"])
            with forced("gate_up"):
                act, a = decode_linear(o, layer["gate_up"], residual=a, rms_norm=(layer["norm_2"], eps),
                                       activation="swiglu", return_sum=True)
            with forced("down"):
                h = decode_linear(act, layer["down"])
        with forced("lm_head"):
            self.logits = decode_linear(h, self.lm_head, residual=a, rms_norm=(self.final_norm, eps))
        return self.logits


def defaults() -> dict[str, tuple]:
    """Each projection's default configuration (:func:`row_triton.row_config`)."""
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return dict(qkv=row_triton.row_config(qkv_rows, HIDDEN, False, True),
                o=row_triton.row_config(HIDDEN, HIDDEN, False),
                gate_up=row_triton.row_config(2 * INTER, HIDDEN, False, True),
                down=row_triton.row_config(HIDDEN, INTER, False),
                lm_head=row_triton.row_config(VOCAB, HIDDEN, False))


def capture(fn) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


@contextlib.contextmanager
def row_kernel(enabled: bool):
    previous, linear_module.ROW_KERNEL = linear_module.ROW_KERNEL, enabled
    try:
        yield
    finally:
        linear_module.ROW_KERNEL = previous


def label(config) -> str:
    block_n, block_k, warps, per_sm = config
    return f"BN{block_n} BK{block_k or 'row'} w{warps} x{per_sm or 'resident'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    copy = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s", flush=True)
    chain = Chain(args.layers)

    with row_kernel(False):
        want = chain.run().clone()
    got = chain.run().clone()
    print(f"row kernel against tile kernel over the chain: logits equal bit for bit: {torch.equal(got, want)}; "
          f"max |difference| {(got.float() - want.float()).abs().max().item():.3e}", flush=True)

    resident = {name: config[:3] + (0,) for name, config in defaults().items()}
    one_wave = chain.run(resident.get).clone()
    print(f"every default configuration resident (one wave) against the defaults: max |difference| "
          f"{(one_wave.float() - got.float()).abs().max().item():.3e} "
          f"(max |logit| {got.float().abs().max().item():.2f})",
          flush=True)

    variants = {}
    for pdl in (False, True):
        with row_kernel(False), dependent_launches(pdl):
            variants["tile kernel" + (" + PDL" if pdl else "")] = capture(chain.run)
        with dependent_launches(pdl):
            variants["row kernel" + (" + PDL" if pdl else "")] = capture(chain.run)
    for group in (("qkv",), ("o",), ("gate_up", "lm_head"), ("down",)):
        for config in LARGE_K if group == ("down",) else SMALL_K:
            with dependent_launches(True):
                variants[f"row + PDL, {'+'.join(group)} {label(config)}"] = capture(
                    lambda c=config, g=group: chain.run(lambda name: c if name in g else None))
    with dependent_launches(True):
        variants["row + PDL, every default resident"] = capture(lambda: chain.run(resident.get))
    print(f"captured {len(variants)} variants; programs an SM holds, per resident configuration compiled:", flush=True)
    for key, per_sm in row_triton._resident_cache.items():
        constexprs = dict(key[3])
        print(f"  BN{constexprs['BLOCK_N']} BK{constexprs['BLOCK_K']} {dict(key[4]).get('num_warps')} warps, "
              f"paired {dict(key[5])['PAIRED']}, norm {dict(key[5])['HAS_NORM']}: {per_sm} an SM")

    times = {name: [] for name in variants}
    for _ in range(args.trials):
        for name, graph in variants.items():
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.reps):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / args.reps)
    floor = chain.bytes / (copy * 1e9) * 1e6
    base = statistics.median(times["tile kernel"])
    print(f"\n{args.layers * 4 + 1} projections, {chain.bytes / 1e9:.3f} GB of weights; "
          f"copy-bandwidth floor {floor:.1f} us")
    print(f"{'variant':<44} {'us (median)':>12} {'GB/s':>7} {'% copy':>7} {'vs tile':>8}")
    for name, ts in times.items():
        us = statistics.median(ts)
        gbs = chain.bytes / us / 1e3
        print(f"{name:<44} {us:>12.1f} {gbs:>7.0f} {100 * gbs / copy:>6.1f}% {base / us:>7.3f}x")
    print("\nfastest configuration of each group (the others at their defaults):")
    for group in ("qkv", "o", "gate_up+lm_head", "down"):
        tried = {name: statistics.median(ts) for name, ts in times.items() if name.startswith(f"row + PDL, {group} ")}
        best = min(tried, key=tried.get)
        print(f"  {group:<16} {best.split(group + ' ', 1)[1]:<28} {tried[best]:.1f} us")


if __name__ == "__main__":
    main()
