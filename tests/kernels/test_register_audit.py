"""dslab.kernels.register_audit on this CPU (Triton's CUDA backend and ptxas, no GPU), and what it
guards: ptxas's report is parsed; decode_linear's launch configurations for Llama-3.2-1B's
projections spill no registers on an H200 (sm_90) at 1 row (the persistent row kernel), 8 and 16
rows, and with int8 weights (a
paired launch of 16 rows on 32 x 128 tiles with 4 warps spilled 224 bytes a thread); every
attention launch plan's candidate list at head dim 128 (Llama-3B/8B's, where the 4-warp tiles
spill) ends with an 8-warp configuration that spills nothing, which the autotuner can pick. The kernels compile in a child process: the
tests' conftest runs Triton under its interpreter, whose functions do not compile. The norm
kernel that runs in front of decode_linear from 2 rows spills nothing either."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dslab.kernels.register_audit import parse_ptxas_log

REPO = Path(__file__).resolve().parents[2]

AUDIT = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import register_audit as audit
    from dslab.kernels.attention import attention_triton_bwd as bwd

    rows = [row for row in audit.decode_rows()
            if row[0].startswith("decode_linear llama3_1b") and " x64 " not in row[0]
            or row[0].startswith("decode_row llama3_1b") and row[0].endswith(" default")]
    prologue = [row for row in audit.decode_rows() if row[0].startswith("decode_prologue")]
    # at head dim 128, the candidate each plan's list ends with (the one chosen to spill nothing)
    from dslab.kernels.attention import attention_triton as fwd
    last = {"attention fwd d128 causal": "{}x{} w{} s{}".format(*fwd._FWD_TILES[128][-1]),
            "attention bwd dq d128": "16x16/{}x{} w{} s{}".format(*bwd._DQ_TILES[128][-1]),
            "attention bwd dkdv d128": "{}x{}/16x16 w{} s{}".format(*bwd._DKDV_TILES[128][-1]),
            "attention bwd both d128": "{}x{}/{}x{} w{} s{}".format(*bwd._BOTH_TILES[128][-1]),
            "attention bwd atomic d128": "{}x{}/16x16 w{} s{}".format(*bwd._ATOMIC_TILES[128][-1])}
    wanted = {f"{plan} {tile}" for plan, tile in last.items()}
    rows += [row for row in audit.attention_fwd_rows() + audit.attention_bwd_rows() if row[0] in wanted]
    assert len(rows) == 14 + len(wanted), [row[0] for row in rows]
    assert len(prologue) == 3, [row[0] for row in prologue]
    rows += prologue
    out = {}
    for label, run in rows:
        report = run()
        out[label] = [report.registers, report.spill_bytes]
    print(json.dumps(out))
''')


def test_parse_ptxas_log():
    log = ("ptxas info    : Function properties for k\\n    0 bytes stack frame, 16 bytes spill stores, "
           "24 bytes spill loads\\nptxas info    : Used 255 registers, used 1 barriers, 8 bytes smem\\n")
    report = parse_ptxas_log(log, 4096)
    assert (report.registers, report.spill_bytes, report.shared_bytes, report.dynamic_shared_bytes) == (255, 40, 8, 4096)
    with pytest.raises(ValueError, match="no register count"):
        parse_ptxas_log("ptxas fatal: nothing")


@pytest.fixture(scope="module")
def audited() -> dict[str, list[int]]:
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", AUDIT, str(REPO / "benchmarks")], capture_output=True, text=True,
                          env=env, timeout=900, cwd=REPO)
    if proc.returncode != 0:
        if "No module named 'triton.backends.nvidia" in proc.stderr:
            pytest.skip("Triton's CUDA backend is not installed")
        raise AssertionError(proc.stderr[-4000:])
    return json.loads(proc.stdout)


def test_decode_linear_launches_spill_nothing(audited):
    decode = {label: figures for label, figures in audited.items()
              if label.startswith(("decode_linear", "decode_row"))}
    # 4 projections at 8 and 16 rows (the tile kernel); at 1 row (the persistent row kernel's
    # default configurations), and 2 of them with int8 weights
    assert len(decode) == 14 and sum(label.startswith("decode_row") for label in decode) == 6
    assert {label: figures for label, figures in decode.items() if figures[1]} == {}


def test_the_decode_prologue_kernel_spills_nothing(audited):
    """The norm kernel in front of decode_linear from 2 rows, at Llama-1B's, GPT-2 1.5B's and
    Llama-8B's widths (8 warps spilled 8 bytes at 4096 with RMSNorm)."""
    prologue = {label: figures for label, figures in audited.items() if label.startswith("decode_prologue")}
    assert len(prologue) == 3 and {label: f for label, f in prologue.items() if f[1]} == {}


@pytest.mark.parametrize("plan", ["attention fwd", "attention bwd dq", "attention bwd dkdv", "attention bwd both",
                                  "attention bwd atomic"])
def test_every_attention_plan_at_head_dim_128_has_a_candidate_that_spills_nothing(audited, plan):
    (figures,) = [figures for label, figures in audited.items() if label.startswith(plan + " ")]
    assert figures[1] == 0, figures
