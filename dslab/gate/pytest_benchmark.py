"""Gating kernel microbenchmarks saved by pytest-benchmark, by the same rule as suite runs.

pytest-benchmark's JSON (``pytest --benchmark-json=FILE`` or ``--benchmark-save``) holds
``{"machine_info": {...}, "benchmarks": [{"name", "fullname", "group", "stats": {...}}], ...}``.
The raw timings, one per round in seconds per iteration, are in ``stats.data`` only when the
run was saved with ``--benchmark-save-data``; a benchmark without them cannot be judged (its
summary statistics alone do not give the rank test or the bootstrap anything to work on).

Each benchmark is one row: case = its ``fullname`` (``name`` when absent), arm = its ``group``
(empty when none), metric ``time``, lower is better. The two files must agree on the machine:
``machine``, ``processor``, ``system``, ``python_implementation``, the major.minor of
``python_version``, and ``cpu.brand_raw`` and ``cpu.count`` where py-cpuinfo recorded them (the
host name and kernel release are left out); and on what dslab's kernel benchmarks
(``benchmarks/kernels/conftest.py``) add to ``machine_info``: ``gpu.name``, the major.minor of
``torch.version`` and ``torch.cuda``, and ``dslab_kernels`` (the ``DSLAB_KERNELS`` variable). Those
four are compared as recorded, a missing one as null, so that a GPU file is never judged against
one without a GPU. Files that record different ``gpu.uuid`` values (two units of one model) are
judged, with a note (:func:`other_gpu_unit`). A benchmark is judged only against one timed the same way: the kernel
benchmarks record ``extra_info["timing"]`` (``"graph"``: replays of a CUDA graph, the device's work
alone; ``"eager..."``: the calls as issued; absent in files from before the option, which timed
eagerly). Rounds of one pytest process are not independent trials the way separate
benchmark trials are, so the p-value is optimistic; the threshold and the interval test are what
keep a microbenchmark gate quiet on noise.
"""

from __future__ import annotations

import json
from pathlib import Path

from dslab.gate.fingerprint import diff_values, major_minor
from dslab.gate.verdict import CANNOT_JUDGE, GateReport, GateSettings, Row, compare_samples

METRIC = "time"
DIRECTION = "lower"


def read_pytest_benchmark(path: str | Path) -> dict:
    """Parse a pytest-benchmark JSON file; FileNotFoundError or ValueError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no pytest-benchmark file at {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise ValueError(f"{path} is not pytest-benchmark output: it has no 'benchmarks' list")
    return data


def machine_fingerprint(machine_info: dict) -> dict:
    """The fields of pytest-benchmark's ``machine_info`` that must match (see the module docstring)."""
    info = machine_info if isinstance(machine_info, dict) else {}
    cpu = info.get("cpu") if isinstance(info.get("cpu"), dict) else {}
    out = {key: info.get(key) for key in ("machine", "processor", "system", "python_implementation")}
    out["python"] = major_minor(info.get("python_version"))
    for key in ("brand_raw", "count"):
        if key in cpu:
            out[f"cpu.{key}"] = cpu[key]
    gpu = info.get("gpu") if isinstance(info.get("gpu"), dict) else {}
    stack = info.get("torch") if isinstance(info.get("torch"), dict) else {}
    out["gpu.name"] = gpu.get("name")
    out["torch.version"] = major_minor(stack.get("version"))
    out["torch.cuda"] = major_minor(stack.get("cuda"))
    out["dslab_kernels"] = info.get("dslab_kernels")
    return out


def other_gpu_unit(base_info: dict, cand_info: dict) -> str | None:
    """A note when both files record their GPU's UUID (``machine_info.gpu.uuid``) and the two
    differ: the same model of GPU, another unit. Not a mismatch, but at a 3% threshold it matters:
    near the power limit units differ in the clock they sustain, so a matmul-bound kernel runs at
    another speed on each (on two H200s dslab's fused linear cross-entropy differed by about 2.5%
    while PyTorch's memory-bound version agreed within 0.1%)."""
    def uuid(info):
        gpu = info.get("gpu") if isinstance(info, dict) and isinstance(info.get("gpu"), dict) else {}
        return gpu.get("uuid")

    base, cand = uuid(base_info), uuid(cand_info)
    if not base or not cand or base == cand:
        return None
    return (f"the baseline ran on another GPU unit ({base}) than the candidate ({cand}): units of one model "
            f"sustain different clocks near the power limit, so matmul-bound benchmarks may differ by a few "
            f"percent with no change of code; for a threshold of a few percent take the baseline on the "
            f"candidate's GPU")


def timing_methods(data: dict) -> dict[tuple[str, str], str]:
    """``{(fullname, group): "graph" | "eager"}``: how each benchmark was timed (``extra_info
    ["timing"]``'s first word; ``"eager"`` when absent)."""
    out = {}
    for bench in data["benchmarks"]:
        if not isinstance(bench, dict):
            continue
        name = str(bench.get("fullname") or bench.get("name") or "?")
        timing = (bench.get("extra_info") or {}).get("timing")
        out[(name, str(bench.get("group") or ""))] = str(timing).split(":")[0] if timing else "eager"
    return out


def benchmark_timings(data: dict) -> dict[tuple[str, str], list[float] | None]:
    """``{(fullname, group): per-round seconds}``; None for a benchmark saved without its data."""
    out = {}
    for bench in data["benchmarks"]:
        if not isinstance(bench, dict):
            continue
        name = str(bench.get("fullname") or bench.get("name") or "?")
        group = str(bench.get("group") or "")
        raw = (bench.get("stats") or {}).get("data")
        out[(name, group)] = [float(x) for x in raw] if isinstance(raw, list) and raw else None
    return out


def gate_pytest_benchmark(
    baseline_path: str | Path, candidate_path: str | Path, settings: GateSettings | None = None
) -> GateReport:
    """Judge every benchmark of the candidate file (and any only in the baseline) by the gate's rule."""
    settings = settings or GateSettings()
    base_data, cand_data = read_pytest_benchmark(baseline_path), read_pytest_benchmark(candidate_path)
    report = GateReport(suite="pytest-benchmark", baseline=str(baseline_path), candidate=str(candidate_path),
                        settings=settings)
    base_machine = machine_fingerprint(base_data.get("machine_info"))
    cand_machine = machine_fingerprint(cand_data.get("machine_info"))
    shared = set(base_machine) & set(cand_machine)
    differences = diff_values({k: base_machine[k] for k in shared}, {k: cand_machine[k] for k in shared},
                              "machine_info")
    if differences:
        report.problems.append("machines differ: " + "; ".join(
            f"{path}: {json.dumps(a)} (baseline) vs {json.dumps(b)} (candidate)" for path, a, b in differences))
        return report
    other_unit = other_gpu_unit(base_data.get("machine_info"), cand_data.get("machine_info"))
    if other_unit:
        report.notes.append(other_unit)
    base, cand = benchmark_timings(base_data), benchmark_timings(cand_data)
    base_method, cand_method = timing_methods(base_data), timing_methods(cand_data)
    for name, group in dict.fromkeys([*cand, *base]):
        key = (name, group)
        reason = None
        if key not in cand:
            reason = "the candidate file has no such benchmark"
        elif key not in base:
            reason = "the baseline file has no such benchmark"
        else:
            missing = [side for side, timings in (("baseline", base), ("candidate", cand)) if timings[key] is None]
            if missing:
                reason = (f"the {' and '.join(missing)} file{'s were' if len(missing) > 1 else ' was'} saved without "
                          f"per-round timings (stats.data); rerun pytest with --benchmark-save-data")
            elif base_method[key] != cand_method[key]:
                reason = (f"timed differently: {base_method[key]} in the baseline, {cand_method[key]} in the "
                          f"candidate (the kernel benchmarks' --kernel-timing, or a case that could not be captured)")
        if reason is not None:
            report.rows.append(Row(verdict=CANNOT_JUDGE, reason=reason, direction=DIRECTION, case=name, arm=group,
                                   metric=METRIC))
            continue
        try:
            comparison = compare_samples(base[key], cand[key], DIRECTION, settings)
        except ValueError as err:
            report.rows.append(Row(verdict=CANNOT_JUDGE, reason=str(err), direction=DIRECTION, case=name, arm=group,
                                   metric=METRIC))
            continue
        report.rows.append(Row(**vars(comparison), case=name, arm=group, metric=METRIC))
    if not report.rows:
        report.problems.append("neither file holds any benchmark")
    return report
