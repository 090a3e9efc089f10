"""benchmarks/kernel_gate_summary.py: the kernel-gate table from gate_gpu.sh's files."""

import importlib.util
import json
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("kernel_gate_summary", REPO / "benchmarks" / "kernel_gate_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_run(path: Path, seed: int, dslab_scale: float = 1.0, injected: float | None = None) -> None:
    """A pytest-benchmark file of one process: a dslab and a torch benchmark, 15 rounds each
    scattered by 0.05% around a median the process shifts by 0.2%."""
    rng = np.random.default_rng(seed)
    benchmarks = []
    for arm, scale in (("dslab", dslab_scale), ("torch", 1.0)):
        offset = rng.normal(0, 0.002)
        data = list(1e-3 * scale * np.exp(offset + rng.normal(0, 0.0005, 15)))
        extra = {"timing": "graph"}
        if arm == "dslab" and injected is not None:
            extra["injected_fraction"] = injected
        name = f"test_kernel[ln-{arm}]"
        benchmarks.append({"name": name, "fullname": f"benchmarks/kernels/test_kernels_bench.py::{name}",
                           "group": "ln", "stats": {"data": data, "median": float(np.median(data))},
                           "extra_info": extra})
    path.write_text(json.dumps({"machine_info": {"machine": "x86_64", "gpu": {"name": "H200"}},
                                "benchmarks": benchmarks}))


def test_summary_counts_false_alarms_and_catches(tmp_path, capsys):
    summary = _load()
    write_run(tmp_path / "kernels_base.json", 0)
    for i in range(1, 4):
        write_run(tmp_path / f"kernels_aa_{i}.json", 10 + i)
        write_run(tmp_path / f"kernels_slow_{i}.json", 20 + i, dslab_scale=1.03, injected=0.03)
    header, rows = summary.summarize(tmp_path, 0.03, [0.0, 0.003])
    table = {row[0]: dict(zip(header, row)) for row in rows}
    dslab, torch_ = table["ln-dslab"], table["ln-torch"]
    assert dslab["injected (measured)"] == "+3.00%"
    assert dslab["slowed caught (noise 0.30%)"] == "3 of 3"
    assert dslab["A/A flagged (noise 0.30%)"] == "0 of 3"
    assert torch_["slowed caught (noise 0.30%)"] == "0 of 3"  # only the dslab arm was slowed
    assert dslab["slowed change"].startswith("+2.") or dslab["slowed change"].startswith("+3.")
    noise, processes, widest, spread = summary.run_noise(tmp_path)
    assert widest in ("ln-dslab", "ln-torch") and spread >= noise * 0.7
    assert processes == 4 and 0.0005 < noise < 0.006  # each process shifts its medians by 0.2%
    assert summary.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| ln-dslab |" in out and f"run-to-run noise: {noise:.2%}" in out
    assert summary.main([str(tmp_path / "absent")]) == 1


def test_summary_counts_slowed_runs_too_spread_to_catch(tmp_path):
    """Rounds that swing by 8% (a power-bound kernel timed in short rounds) pass a 3% slowdown:
    the table counts those passes as unresolved, not as a clean miss."""
    summary = _load()

    def spread_run(path, seed, scale):
        rng = np.random.default_rng(seed)
        data = list(1e-3 * scale * np.exp(rng.normal(0, 0.05, 10)))
        name = "test_kernel[ce-dslab]"
        path.write_text(json.dumps({"machine_info": {"machine": "x86_64", "gpu": {"name": "H200"}}, "benchmarks": [
            {"name": name, "fullname": f"benchmarks/kernels/test_kernels_bench.py::{name}", "group": "ce",
             "stats": {"data": data, "median": float(np.median(data))},
             "extra_info": {"timing": "graph", "injected_fraction": 0.03}}]}))

    spread_run(tmp_path / "kernels_base.json", 0, 1.0)
    for i in range(1, 3):
        spread_run(tmp_path / f"kernels_slow_{i}.json", i, 1.03)
    header, rows = summary.summarize(tmp_path, 0.03, [0.003])
    caught = dict(zip(header, rows[0]))["slowed caught (noise 0.30%)"]
    assert caught == "0 of 2 (2 unresolved)", caught
