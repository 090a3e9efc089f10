"""Which ``dslab.bench`` module calls which while a suite runs: a map of a suite's path through bench.

    python benchmarks/bench_call_graph.py suites/gpt2_inference --arms dslab,hf

Runs the suite's ``tiny`` scale on the CPU (2 trials of 1 step, 1 warm-up step; reports go to a
temporary folder) under :func:`sys.setprofile` and prints every caller -> callee pair of
``dslab.bench`` modules with its number of calls, then the functions the runner hands work to, in
the order it first calls each. A kind of suite that calls back into the runner shows up as a
``<kind> -> runner`` pair.
"""

from __future__ import annotations

import argparse
import collections
import io
import sys
import tempfile

PACKAGE = "dslab.bench"


def _module(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name.removeprefix(PACKAGE + ".") if name.startswith(PACKAGE) else None


def trace_suite(suite: str, arms: list[str] | None) -> tuple[collections.Counter, list[str]]:
    from dslab.bench.runner import run_suite

    calls: collections.Counter = collections.Counter()
    handed: list[str] = []

    def profile(frame, event, arg):
        if event != "call" or frame.f_code.co_name == "<module>" or frame.f_back is None:
            return
        callee, caller = _module(frame), _module(frame.f_back)
        if callee is None or caller is None or caller == callee:
            return
        calls[(caller, callee)] += 1
        target = f"{callee}.{frame.f_code.co_qualname}"
        if caller == "runner" and target not in handed and "<locals>" not in target:  # not a dataclass's __init__
            handed.append(target)

    sys.setprofile(profile)
    try:
        run_suite(suite, scale="tiny", arms=arms, trials=2, steps=1, warmup_steps=1, out=tempfile.mkdtemp(),
                  stream=io.StringIO())
    finally:
        sys.setprofile(None)
    return calls, handed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite")
    parser.add_argument("--arms", help="comma-separated arms (default: the suite's)")
    args = parser.parse_args()
    calls, handed = trace_suite(args.suite, args.arms.split(",") if args.arms else None)
    print("calls between modules (caller -> callee: count):")
    for (caller, callee), count in sorted(calls.items()):
        print(f"  {caller} -> {callee}: {count}")
    print("the runner's calls out, the first of each, in order:")
    print("  " + ", ".join(handed))


if __name__ == "__main__":
    main()
