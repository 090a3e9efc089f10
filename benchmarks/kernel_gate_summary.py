"""Issue 45's kernel-gate table from ``benchmarks/gate_gpu.sh kernels`` output: every A/A and
every slowed pytest-benchmark file of a folder gated against its baseline, per benchmark, at the
given threshold and run-to-run noise levels (each level one column pair).

    python3 benchmarks/kernel_gate_summary.py OUT_DIR [--threshold 3%] [--run-noise 0 0.3%]

OUT_DIR holds ``kernels_base.json``, ``kernels_aa_<i>.json`` and ``kernels_slow_<i>.json``. For each
benchmark: A/A runs flagged (false alarms), slowed runs caught (only the dslab arm is slowed, so
a torch row's "caught" is also a false alarm), the measured injected slowdown (the slowed files'
``extra_info.injected_fraction``), and the change the gate read (median over runs). A count says
how many of its passes were unresolved (their interval reached past the threshold on the worse
side: rounds too few or too spread to catch a change of the threshold's size); above the
table, the run-to-run noise of the unchanged processes (:func:`run_noise`). Exit 1 when the
folder holds no usable files.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dslab.gate.command import parse_run_noise, parse_threshold  # noqa: E402
from dslab.gate.pytest_benchmark import gate_pytest_benchmark  # noqa: E402
from dslab.gate.verdict import REGRESSION, GateSettings  # noqa: E402


def _short(case: str) -> str:
    return case.split("test_kernel[", 1)[-1].rstrip("]")


def summarize(folder: Path, threshold: float, noises: list[float]) -> tuple[list[str], list[list[str]]]:
    base = folder / "kernels_base.json"
    runs = {kind: sorted(folder.glob(f"kernels_{kind}_*.json"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
            for kind in ("aa", "slow")}
    if not base.is_file() or not (runs["aa"] or runs["slow"]):
        raise FileNotFoundError(f"{folder}: needs kernels_base.json and kernels_aa_<i>.json / kernels_slow_<i>.json")
    injected: dict[str, list[float]] = {}
    for path in runs["slow"]:
        for bench in json.loads(path.read_text())["benchmarks"]:
            value = (bench.get("extra_info") or {}).get("injected_fraction")
            if value is not None:
                injected.setdefault(bench.get("fullname") or bench["name"], []).append(value)
    table: dict[str, dict] = {}
    for noise in noises:
        settings = GateSettings(threshold=threshold, run_noise=noise)
        for kind, paths in runs.items():
            for path in paths:
                for row in gate_pytest_benchmark(base, path, settings).rows:
                    entry = table.setdefault(row.case, {})
                    entry.setdefault((kind, noise), []).append((row.verdict == REGRESSION, row.unresolved))
                    if noise == noises[0] and row.ratio is not None:
                        entry.setdefault(("change", kind), []).append(row.ratio - 1.0)
    header = ["benchmark", "injected (measured)", "A/A change", "slowed change"]
    for noise in noises:
        label = f"noise {noise:.2%}"
        header += [f"A/A flagged ({label})", f"slowed caught ({label})"]
    rows = []
    for case, entry in table.items():
        inj = injected.get(case)
        cells = [_short(case), f"{statistics.median(inj):+.2%}" if inj else "-"]
        for kind in ("aa", "slow"):
            changes = entry.get(("change", kind))
            cells.append(f"{statistics.median(changes):+.2%} ({min(changes):+.2%}..{max(changes):+.2%})"
                         if changes else "-")
        for noise in noises:
            for kind in ("aa", "slow"):
                hits = entry.get((kind, noise), [])
                unresolved = sum(u for _, u in hits)
                cells.append(f"{sum(f for f, _ in hits)} of {len(hits)}"
                             + (f" ({unresolved} unresolved)" if unresolved else "") if hits else "-")
        rows.append(cells)
    return header, rows


def run_noise(folder: Path) -> tuple[float, int, str, float] | None:
    """The spread of a benchmark's median between processes of unchanged code: the pooled standard
    deviation of the log medians of ``kernels_base.json`` and every ``kernels_aa_<i>.json``, per
    benchmark, pooled over benchmarks; how many processes; and the benchmark with the largest
    spread, with its own (one unsteady benchmark can carry the pooled figure). What ``dslab gate
    --run-noise`` wants; None with fewer than two processes."""
    paths = [folder / "kernels_base.json", *sorted(folder.glob("kernels_aa_*.json"))]
    medians: dict[str, list[float]] = {}
    for path in paths:
        if not path.is_file():
            continue
        for bench in json.loads(path.read_text())["benchmarks"]:
            median = (bench.get("stats") or {}).get("median")
            if median:
                medians.setdefault(bench.get("fullname") or bench["name"], []).append(math.log(median))
    squares, degrees, widest = 0.0, 0, ("", 0.0)
    for name, values in medians.items():
        if len(values) > 1:
            mean = statistics.fmean(values)
            squares += sum((v - mean) ** 2 for v in values)
            degrees += len(values) - 1
            widest = max(widest, (name, statistics.stdev(values)), key=lambda pair: pair[1])
    if not degrees:
        return None
    return math.sqrt(squares / degrees), max(len(v) for v in medians.values()), _short(widest[0]), widest[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--threshold", type=parse_threshold, default=0.03)
    parser.add_argument("--run-noise", type=parse_run_noise, nargs="+", default=[0.0, 0.003])
    args = parser.parse_args(argv)
    try:
        header, rows = summarize(args.folder, args.threshold, args.run_noise)
    except (OSError, ValueError) as err:
        print(f"kernel_gate_summary: {err}", file=sys.stderr)
        return 1
    noise = run_noise(args.folder)
    if noise is not None:
        print(f"run-to-run noise: {noise[0]:.2%} (pooled SD of the log medians of {noise[1]} unchanged processes: "
              f"the baseline and the A/A runs; dslab gate --run-noise wants about this); widest: {noise[2]} "
              f"{noise[3]:.2%}")
    print(f"threshold {args.threshold:.1%}; rows: " + str(len(rows)))
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join("---" for _ in header) + " |")
    for cells in rows:
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
