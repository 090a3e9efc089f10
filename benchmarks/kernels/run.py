"""Kernel benchmark: every ``bench_<op>.py`` case, dslab vs PyTorch, in one run and one table.

    python benchmarks/kernels/run.py [--ops layer_norm,attention] [--rounds 5] [--json out.json]

The device's ceilings are measured first (bf16 matmul 8192^3 and a 1 GiB device copy). Each case
times its dslab and PyTorch callables alternately for ``--rounds`` rounds (CUDA events, 30 calls
a round after warm-up); the figure per side is the median over all calls. Each side is also
captured once in a CUDA graph and its replays timed: the device time of its kernels without the
host's launch overhead (``graph d/t``; ``-`` where a side cannot be captured). GB/s counts the fewest
bytes the op must move; TFLOP/s the flops it must do; ratio = PyTorch time / dslab time.

The cases and the CUDA-event timer are ``common.py``'s, shared with ``test_kernels_bench.py``
(the same cases as pytest-benchmark tests, for ``dslab gate --pytest-benchmark``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench_ops, graph_time_ms, median, op_cases, peak_extra_memory_bytes, time_ms  # noqa: E402

from dslab.bench.measure import measure_peaks  # noqa: E402


def load_cases(ops: list[str] | None, device):
    cases, errors = [], []
    for op in bench_ops():
        if ops and op not in ops:
            continue
        try:
            cases.extend(op_cases(op, device))
        except Exception as err:
            errors.append((op, err))
            traceback.print_exc()
    return cases, errors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", default=None, help="comma-separated bench_<op> names")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-graphs", dest="graphs", action="store_false",
                        help="skip the CUDA-graph replay timing (device time without launch overhead)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the kernel benchmark needs a CUDA GPU")
    device = torch.device("cuda")
    peaks = measure_peaks(device)
    ops = args.ops.split(",") if args.ops else None
    cases, errors = load_cases(ops, device)
    rows = []
    for case in cases:
        row = {"op": case.op, "shape": case.shape, "target": case.target, "notes": case.notes}
        try:
            d_times, t_times = [], []
            for r in range(args.rounds):
                first, second = (case.dslab, case.torch) if r % 2 == 0 else (case.torch, case.dslab)
                a = time_ms(first, warmup=5 if r else 10, iters=args.iters)
                b = time_ms(second, warmup=5 if r else 10, iters=args.iters)
                if r % 2 == 0:
                    d_times += a
                    t_times += b
                else:
                    t_times += a
                    d_times += b
            row["dslab_ms"], row["torch_ms"] = median(d_times), median(t_times)
            row["dslab_round_spread"] = (max(d_times) - min(d_times)) / row["dslab_ms"]
            row["ratio"] = row["torch_ms"] / row["dslab_ms"]
            if case.bytes_moved:
                row["dslab_gbps"] = case.bytes_moved / (row["dslab_ms"] * 1e-3) / 1e9
                row["torch_gbps"] = case.bytes_moved / (row["torch_ms"] * 1e-3) / 1e9
                row["pct_copy_bw"] = row["dslab_gbps"] / peaks["copy_gbps"]
            if case.flops:
                row["dslab_tflops"] = case.flops / (row["dslab_ms"] * 1e-3) / 1e12
                row["torch_tflops"] = case.flops / (row["torch_ms"] * 1e-3) / 1e12
                row["pct_matmul_peak"] = row["dslab_tflops"] / peaks["bf16_matmul_tflops"]
            if args.graphs:
                d_fail, t_fail = [], []
                d_graph, t_graph = graph_time_ms(case.dslab, failures=d_fail), graph_time_ms(case.torch, failures=t_fail)
                for side, failed in (("dslab", d_fail), ("torch", t_fail)):
                    if failed:
                        row[f"{side}_capture_error"] = failed[0]
                if d_graph and t_graph:
                    row["dslab_graph_ms"], row["torch_graph_ms"] = median(d_graph), median(t_graph)
                    row["graph_ratio"] = row["torch_graph_ms"] / row["dslab_graph_ms"]
            if case.check_memory:
                row["dslab_peak_extra_bytes"] = peak_extra_memory_bytes(case.dslab)
                row["torch_peak_extra_bytes"] = peak_extra_memory_bytes(case.torch)
            row["met"] = None if case.target is None else row["ratio"] >= case.target
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            traceback.print_exc()
        rows.append(row)
        torch.cuda.empty_cache()

    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
          f"{importlib.util.find_spec('triton') and __import__('triton').__version__}")
    print(f"measured peaks: bf16 matmul {peaks['bf16_matmul_tflops']:.0f} TFLOP/s, copy {peaks['copy_gbps']:.0f} GB/s")
    head = (f"{'op':<22} {'shape':<34} {'dslab ms':>9} {'torch ms':>9} {'ratio':>6} {'target':>6} {'rate':>16} "
            f"{'graph d/t ms':>14} {'g.ratio':>7} {'mem d/t GiB':>12}")
    print(head)
    for row in rows:
        if "error" in row:
            print(f"{row['op']:<22} {row['shape']:<34} ERROR {row['error'][:80]}")
            continue
        if "dslab_gbps" in row:
            rate = f"{row['dslab_gbps']:.0f} GB/s {row['pct_copy_bw']:.0%}"
        elif "dslab_tflops" in row:
            rate = f"{row['dslab_tflops']:.0f} TF/s {row['pct_matmul_peak']:.0%}"
        else:
            rate = "-"
        mem = "-"
        if "dslab_peak_extra_bytes" in row:
            mem = f"{row['dslab_peak_extra_bytes'] / 2**30:.2f}/{row['torch_peak_extra_bytes'] / 2**30:.2f}"
        target = f"{row['target']:.2f}" if row["target"] else "-"
        flag = "" if row["met"] is None else (" ok" if row["met"] else " MISS")
        graph, gratio = "-", "-"
        if "graph_ratio" in row:
            graph = f"{row['dslab_graph_ms']:.3f}/{row['torch_graph_ms']:.3f}"
            gratio = f"{row['graph_ratio']:.2f}"
        print(f"{row['op']:<22} {row['shape']:<34} {row['dslab_ms']:>9.3f} {row['torch_ms']:>9.3f} "
              f"{row['ratio']:>6.2f} {target:>6} {rate:>16} {graph:>14} {gratio:>7} {mem:>12}{flag}")
    for row in rows:
        for side in ("dslab", "torch"):
            if f"{side}_capture_error" in row:
                print(f"{row['op']} {row['shape']}: the {side} side could not be captured in a CUDA graph: "
                      f"{row[f'{side}_capture_error'][:160]}")
    for op, err in errors:
        print(f"{op}: could not load cases: {err}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peaks": peaks, "rows": rows, "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
