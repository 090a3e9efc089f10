"""The decode kernels compiled for Hopper (sm_90) on this CPU, with Triton's own CUDA backend and
ptxas (no GPU needed): with ``USE_GDC`` their PTX waits for the kernel before (``griddepcontrol.wait``)
before any store or atomic, and decode_linear requests weights before the wait while attention
reads nothing before it; without ``USE_GDC`` there is no grid dependency control at all. A kernel
that stored, or read an activation, before the wait would race the kernel before it under a
dependent launch (tests/inference/test_dependent_launch_gpu.py checks the results on a GPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

# The tests' conftest runs Triton kernels under the interpreter (TRITON_INTERPRET=1), where
# triton.jit makes interpreted functions that do not compile: the kernels are compiled in a child
# process without it, each with and without USE_GDC, and their PTX handed back.
COMPILE = textwrap.dedent('''
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dslab.kernels.decode import decode_attention_triton, decode_linear_triton

    INT_POINTERS = {"X_ROWS", "R_ROWS", "R_OFFSET", "WRITE_POS", "COUNTERS", "START", "END"}
    FP32_POINTERS = {"SCALE", "COS", "SIN", "PARTIAL", "M_PART", "L_PART", "ACC_PART"}
    # bf16 pointers by kernel module (decode_linear's K is a size, attention's the key cache)
    POINTERS = {"linear": {"X", "R", "A_OUT", "NORM_W", "NORM_B", "W", "BIAS", "Y", "Q_OUT", "K_CACHE", "V_CACHE"},
                "attention": {"Q", "K", "V", "OUT"}}
    MODULES = {"linear": decode_linear_triton, "attention": decode_attention_triton}

    def ptx(module, name, meta, use_gdc):
        kernel = getattr(MODULES[module], name)
        pointers = INT_POINTERS | FP32_POINTERS | POINTERS[module]
        signature, constexprs = {}, {}
        for param in kernel.params:
            if param.is_constexpr:
                signature[param.name] = "constexpr"
                constexprs[(param.num,)] = (use_gdc if param.name == "USE_GDC" else
                                            meta[param.name] if param.name in meta else param.default)
            elif param.name in pointers:
                signature[param.name] = ("*i32" if param.name in INT_POINTERS else
                                         "*fp32" if param.name in FP32_POINTERS else "*bf16")
            else:
                signature[param.name] = "fp32" if param.name in {"eps", "qk_scale"} else "i32"
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=4, num_stages=1, launch_pdl=use_gdc))
        return compiled.asm["ptx"]

    cases = json.loads(sys.stdin.read())
    print(json.dumps({key: [ptx(*case, False), ptx(*case, True)] for key, case in cases.items()}))
''')

LINEAR = dict(HAS_X_ROWS=False, HAS_R=True, HAS_R_ROWS=False, HAS_R_OFFSET=False, WRITE_A=True, HAS_NORM=True,
              RMS_NORM=True, INT8=False, HAS_BIAS=False, ACT=0, KV_SCATTER=False, ROPE=False, SPLIT_K=1,
              STATS_BLOCK=2048, SINGLE_BLOCK=True, BLOCK_M=1, BLOCK_N=2, BLOCK_K=2048, PAIRED=False,
              DOT_FP32=False, PRECISION="tf32", BF16_BY_HAND=False)
CASES = {
    "linear-norm": ["linear", "_decode_linear_kernel", LINEAR],
    # the down projection's launch shape: K split over programs, partials and a counter per tile
    "linear-split-k": ["linear", "_decode_linear_kernel",
                       dict(LINEAR, HAS_R=False, WRITE_A=False, HAS_NORM=False, RMS_NORM=False, SPLIT_K=2,
                            SINGLE_BLOCK=False, BLOCK_K=1024)],
    # the gate/up projection's: two weight rows per output column, SwiGLU of the pair
    "linear-swiglu-pair": ["linear", "_decode_linear_kernel", dict(LINEAR, ACT=3, PAIRED=True)],
    "attention-split": ["attention", "_decode_split_kernel",
                        dict(HEAD_DIM=64, BLOCK_N=64, SPLITS=4, BF16_BY_HAND=False, KV_GROUP=4, FUSED_COMBINE=False,
                             BLOCK_SPLITS=4)],
    # the split kernel that combines its row when it arrives last: a counter per row
    "attention-split-fused-combine": ["attention", "_decode_split_kernel",
                                      dict(HEAD_DIM=64, BLOCK_N=64, SPLITS=4, BF16_BY_HAND=False, KV_GROUP=4,
                                           FUSED_COMBINE=True, BLOCK_SPLITS=4)],
    "attention-combine": ["attention", "_decode_combine_kernel",
                          dict(HEAD_DIM=64, SPLITS=4, BLOCK_SPLITS=4, BF16_BY_HAND=False)],
}


@pytest.fixture(scope="module")
def compiled() -> dict[str, list[str]]:
    """``{case: [PTX without USE_GDC, PTX with it]}``; the module skips where Triton's CUDA
    backend cannot compile (no such backend, no ptxas)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", COMPILE], input=json.dumps(CASES), capture_output=True, text=True,
                          env=env, timeout=300)
    if proc.returncode != 0:
        if "nvidia" not in proc.stderr and "ptxas" not in proc.stderr.lower():
            raise AssertionError(proc.stderr[-4000:])
        pytest.skip(f"Triton cannot compile for CUDA here: {proc.stderr.strip().splitlines()[-1]}")
    return json.loads(proc.stdout)


def before_wait(text: str) -> list[str]:
    """The memory instructions ahead of the first ``griddepcontrol.wait`` (parameter loads aside)."""
    head = text[:text.index("griddepcontrol.wait")]
    return [line.strip() for line in head.splitlines()
            if re.search(r"\b(ld|st|atom|red)\.", line) and ".param" not in line]


def bf16_elements_loaded(lines: list[str]) -> int:
    """The 16-bit elements the ``ld.global`` lines among ``lines`` load: registers times their
    width over 16 bits (``ld.global.b16 {%rs1}`` 1, ``ld.global.v4.b32 {...}`` 8)."""
    total = 0
    for line in lines:
        match = re.search(r"\bld\.global(?:\.\w+)*?\.b(\d+)\s*\{([^}]*)\}", line)
        if match:
            total += len(match.group(2).split(",")) * int(match.group(1)) // 16
    return total


@pytest.mark.parametrize("case", ["linear-norm", "linear-split-k", "linear-swiglu-pair"])
def test_decode_linear_reads_weights_then_waits_before_anything_else(compiled, case):
    plain, text = compiled[case]
    assert "griddepcontrol.wait" in text and "griddepcontrol.launch_dependents" in text
    early = before_wait(text)
    assert early and all(re.search(r"\bld\.global", line) for line in early), early  # loads only
    # exactly the first weight tile (one or two weight rows a column) over the 128 threads, so no
    # activation, residual or norm weight is read before the wait
    meta = CASES[case][2]
    tile = meta["BLOCK_N"] * meta["BLOCK_K"] * (2 if meta["PAIRED"] else 1)
    assert bf16_elements_loaded(early) == tile // 128
    assert text.index("griddepcontrol.wait") < text.index("griddepcontrol.launch_dependents")
    assert "griddepcontrol" not in plain


@pytest.mark.parametrize("case", ["attention-split", "attention-split-fused-combine", "attention-combine"])
def test_decode_attention_waits_before_its_first_access(compiled, case):
    plain, text = compiled[case]
    assert "griddepcontrol.launch_dependents" in text
    assert before_wait(text) == []
    assert "griddepcontrol" not in plain

