"""decode_linear's launch configurations (``block_config``) compiled for an H200 (sm_90) on this
CPU with Triton's CUDA backend, then assembled by its ptxas with ``-v``: none spills registers to
local memory. A spilling configuration streams its weights at a fraction of the bandwidth, which
only a GPU benchmark would otherwise show. The launches are Llama-3.2-1B's decode projections
(QKV with RMSNorm and rope, the output projection, gate/up with SwiGLU, down with K split) at 1
row (the batch-1 path), 8 rows (the small-row path), 16 and 64 rows (tensor-core tiles), and int8
weights at 1 row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

COMPILE = textwrap.dedent('''
    import json, re, subprocess, sys, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource
    from dslab.kernels.decode import decode_linear_triton as kernels

    INT_POINTERS = {"X_ROWS", "R_ROWS", "R_OFFSET", "WRITE_POS", "COUNTERS"}
    FP32_POINTERS = {"SCALE", "COS", "SIN", "PARTIAL"}
    POINTERS = INT_POINTERS | FP32_POINTERS | {"X", "R", "A_OUT", "NORM_W", "NORM_B", "W", "BIAS", "Y", "Q_OUT",
                                               "K_CACHE", "V_CACHE"}
    SMS = 132  # an H200's
    kernel = kernels._decode_linear_kernel

    def launch_meta(m, n, k, int8, norm, act, rope):
        block_m = kernels.row_block(m)
        paired = act == 3 or rope
        block_n, block_k, warps, stages = kernels.block_config(block_m, n, k, int8, norm, paired)
        columns = kernels.tiles_n(n, block_n, block_m, paired)
        split_k, _ = kernels.plan_split_k(columns * -(-m // block_m), k, block_k, 2 * SMS)
        meta = dict(HAS_X_ROWS=False, HAS_R=norm, HAS_R_ROWS=False, HAS_R_OFFSET=False, WRITE_A=norm,
                    HAS_NORM=norm, RMS_NORM=norm, INT8=int8, HAS_BIAS=False, ACT=act, KV_SCATTER=rope, ROPE=rope,
                    SPLIT_K=split_k, STATS_BLOCK=min(1 << (k - 1).bit_length(), 4096 // block_m),
                    SINGLE_BLOCK=split_k == 1 and k <= block_k, BLOCK_M=block_m,
                    BLOCK_N=kernels.pair_block_n(block_n, block_m) if paired else block_n, BLOCK_K=block_k,
                    PAIRED=paired, DOT_FP32=False, PRECISION="tf32", BF16_BY_HAND=False, USE_GDC=False)
        return meta, warps, stages

    def assemble(m, n, k, int8, norm, act, rope):
        meta, warps, stages = launch_meta(m, n, k, int8, norm, act, rope)
        signature, constexprs, attrs = {}, {}, {}
        for param in kernel.params:
            if param.is_constexpr:
                signature[param.name] = "constexpr"
                constexprs[(param.num,)] = meta[param.name]
            elif param.name in POINTERS:
                signature[param.name] = ("*i32" if param.name in INT_POINTERS else "*fp32" if param.name in
                                         FP32_POINTERS else "*i8" if param.name == "W" and int8 else "*bf16")
                attrs[(param.num,)] = [["tt.divisibility", 16]]
            else:
                signature[param.name] = "fp32" if param.name == "eps" else "i32"
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
        with tempfile.TemporaryDirectory() as tmp:
            with open(f"{tmp}/k.ptx", "w") as f:
                f.write(compiled.asm["ptx"])
            log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f"{tmp}/k.ptx", "-o",
                                  f"{tmp}/k.cubin"], capture_output=True, text=True, check=True).stderr
        registers = int(re.search(r"Used (\\d+) registers", log).group(1))
        spills = sum(int(x) for x in re.findall(r"(\\d+) bytes spill (?:stores|loads)", log))
        return dict(meta={key: meta[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K")}, warps=warps,
                    registers=registers, spills=spills)

    cases = json.loads(sys.stdin.read())
    print(json.dumps({name: assemble(*case) for name, case in cases.items()}))
''')

# (rows, N, K, int8, RMSNorm in front, ACT (3: SwiGLU), rotary QKV epilogue) at Llama-3.2-1B's widths
PROJECTIONS = {"qkv": (3072, 2048, False, True, 0, True), "o_proj": (2048, 2048, False, False, 0, False),
               "gate_up": (16384, 2048, False, True, 3, False), "down": (2048, 8192, False, False, 0, False)}
CASES = {f"{name} x{rows}": (rows, *shape) for rows in (1, 8, 16, 64) for name, shape in PROJECTIONS.items()}
CASES.update({f"{name} int8 x1": (1, n, k, True, norm, act, rope)
              for name, (n, k, _, norm, act, rope) in PROJECTIONS.items() if name in ("o_proj", "down")})


@pytest.fixture(scope="module")
def assembled() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", COMPILE], input=json.dumps(CASES), capture_output=True, text=True,
                          env=env, timeout=600)
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
        if "ImportError" in proc.stderr or "ptxas" in proc.stderr.lower() and "No such file" in proc.stderr:
            pytest.skip(f"Triton cannot compile and assemble for CUDA here: {last}")
        raise AssertionError(proc.stderr[-4000:])
    return json.loads(proc.stdout)


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_launch_configuration_spills(assembled, case):
    result = assembled[case]
    assert result["spills"] == 0, result
    assert 0 < result["registers"] <= 255, result
