"""The table of benchmarks/autotune_vs_deepspeed.sh: per tuner, the config it chose, how many
experiments it ran, its search's wall time, and the chosen config's tokens/s when trained and timed
the same way for both (the examples' ``--timed_from``); then dslab over DeepSpeed in tokens/s and
DeepSpeed over dslab in search time (issue 45's target: both >= 1).

    python3 benchmarks/autotune_compare.py OUT/autotune_vs_deepspeed/MODEL [--json f.json]

What it reads in that directory: ``wall_{dslab,deepspeed}.txt`` (each search's wall time),
``results_{dslab,deepspeed}/ds_config_optimal.json``, ``results_deepspeed/summary.txt``
(DeepSpeed's experiment count), the dslab report under ``reports_dslab`` (its experiments), and
``timed_{dslab,deepspeed}.log`` (the ``timed: <tokens/s> tokens/s`` line). A missing piece is a
dash in the table, with the reason below it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

TIMED = re.compile(r"^timed: ([0-9.]+) tokens/s", re.MULTILINE)
DS_COUNT = re.compile(r"Total number of experiments: (\d+)")


def chosen(config: dict) -> str:
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else zero
    gas = config.get("gradient_accumulation_steps", 1)
    return f"z{stage} mbs{config.get('train_micro_batch_size_per_gpu')} gas{gas}"


def read(work: Path) -> tuple[dict, list[str]]:
    rows, notes = {}, []
    for tuner in ("dslab", "deepspeed"):
        wall = work / f"wall_{tuner}.txt"
        row = {"chosen": None, "experiments": None, "wall_s": float(wall.read_text()) if wall.is_file() else None,
               "tokens_per_s": None}
        optimal = work / f"results_{tuner}" / "ds_config_optimal.json"
        if optimal.is_file():
            row["chosen"] = chosen(json.loads(optimal.read_text()))
        else:
            notes.append(f"{tuner}: no {optimal.relative_to(work)} (see {tuner}.log)")
        timed = work / f"timed_{tuner}.log"
        match = TIMED.search(timed.read_text()) if timed.is_file() else None
        if match:
            row["tokens_per_s"] = float(match.group(1))
        elif optimal.is_file():
            notes.append(f"{tuner}: the chosen config's timed run printed no tokens/s (see {timed.name})")
        rows[tuner] = row
    summary = work / "results_deepspeed" / "summary.txt"
    match = DS_COUNT.search(summary.read_text()) if summary.is_file() else None
    if match:
        rows["deepspeed"]["experiments"] = int(match.group(1))
    reports = sorted((work / "reports_dslab").glob("autotune/*/run.json"))
    if reports:
        section = json.loads(reports[-1].read_text())["profilers"]["autotuning"]
        rows["dslab"]["experiments"] = sum(1 for e in section["experiments"] if e["status"] != "pruned")
    return rows, notes


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows, notes = read(args.work)

    def cell(value, fmt):
        return "-" if value is None else format(value, fmt)

    print(f"\n{'tuner':<10} {'chosen':<18} {'experiments':>11} {'search s':>9} {'tokens/s':>10}")
    for tuner, row in rows.items():
        print(f"{tuner:<10} {row['chosen'] or '-':<18} {cell(row['experiments'], 'd'):>11} "
              f"{cell(row['wall_s'], '.1f'):>9} {cell(row['tokens_per_s'], ',.0f'):>10}")
    d, s = rows["dslab"], rows["deepspeed"]
    result = {"rows": rows, "notes": notes}
    if d["tokens_per_s"] and s["tokens_per_s"]:
        result["tokens_ratio"] = d["tokens_per_s"] / s["tokens_per_s"]
        print(f"dslab's choice / DeepSpeed's choice, tokens/s: {result['tokens_ratio']:.3f} (target >= 1)")
    if d["wall_s"] and s["wall_s"]:
        result["search_time_ratio"] = d["wall_s"] / s["wall_s"]
        print(f"dslab's search time / DeepSpeed's: {result['search_time_ratio']:.3f} (target <= 1)")
    for note in notes:
        print(f"note: {note}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
