"""Registers, spills and shared memory of dslab's hottest Triton kernels at the configurations a
GPU would run, compiled for an H200 (sm_90) on any machine: no GPU needed
(:mod:`dslab.kernels.register_audit`: Triton's CUDA backend and its ptxas).

    python3 benchmarks/register_audit.py [--only decode|attention_fwd|attention_bwd|layer_norm] [--spills-only]

- ``decode``: decode_linear's launches (:func:`dslab.kernels.decode.decode_linear_triton.plan`, an
  H200's 132 SMs) for Llama-3.2-1B's and GPT-2 1.5B's projections at 1, 8, 16 and 64 rows, and int8
  weights at 1 row;
- ``attention_fwd``: every autotune candidate of the attention forward per head dim, causal and
  with dropout;
- ``attention_bwd``: every candidate of each backward launch plan (dQ only, dK/dV only, both in
  one launch, dK/dV with atomic dQ, and fused at its widest key block) per head dim, causal;
- ``layer_norm``: the LayerNorm forward and backward (with the residual's gradient) at the row
  widths of GPT-2 124M to a 13B model and the widest the kernels take (8192), whose shared memory
  must fit an SM's 227 KB (rows of 5120 once asked for 288 KB and did not compile on an H200).

A row marked ``SPILLS`` moves registers through local memory: the autotuner times it anyway (and
may keep it when every other candidate is slower), a fixed configuration runs it always. Runs
itself without the Triton interpreter (it cannot compile).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dslab.kernels.register_audit import assemble  # noqa: E402

SMS = 132  # an H200's
BF16 = "*bf16"


def decode_rows() -> list[tuple[str, object]]:
    """decode_linear's launches as the engine makes them (from ``PROLOGUE_KERNEL_MIN_ROWS`` rows
    without the norm, which its own kernel runs first), and that prologue kernel."""
    import importlib

    from dslab.kernels.decode import decode_linear_triton as kernels
    from dslab.kernels.decode import decode_prologue_triton as prologue
    from dslab.kernels.decode import decode_row_triton as row

    linear = importlib.import_module("dslab.kernels.decode.decode_linear")  # the package attribute is the function

    types = {name: BF16 for name in ("X", "R", "A_OUT", "NORM_W", "NORM_B", "W", "BIAS", "Y", "Q_OUT", "K_CACHE",
                                     "V_CACHE")}
    types.update({name: "*i32" for name in ("X_ROWS", "R_ROWS", "R_OFFSET", "WRITE_POS", "COUNTERS")})
    types.update({name: "*fp32" for name in ("SCALE", "COS", "SIN", "PARTIAL")}, eps="fp32")
    # name: (N, K, RMSNorm or LayerNorm in front, ACT (3 SwiGLU, 1 GELU), rotary QKV epilogue, GPT-2 QKV scatter)
    models = {
        "llama3_1b": {"qkv": (3072, 2048, True, 0, True), "o_proj": (2048, 2048, False, 0, False),
                      "gate_up": (16384, 2048, True, 3, False), "down": (2048, 8192, False, 0, False)},
        "gpt2_1558m": {"qkv": (4800, 1600, True, 0, False), "attn out": (1600, 1600, False, 0, False),
                       "mlp up": (6400, 1600, True, 1, False), "mlp down": (1600, 6400, False, 0, False)},
    }
    rows = []
    for model, projections in models.items():
        for m, int8 in ((1, False), (1, True), (8, False), (16, False), (64, False)):
            for name, (n, k, norm, act, rope) in projections.items():
                if int8 and name not in ("o_proj", "down", "attn out", "mlp down"):
                    continue
                paired = act == 3 or rope
                block_m = kernels.row_block(m)
                in_linear = norm and m < linear.PROLOGUE_KERNEL_MIN_ROWS
                if m == 1:  # the persistent one-row kernel: its configuration and its sweep's
                    for config in [None, *row.ROW_SWEEP]:
                        with row.forced_row_config(config):
                            shape = row.plan(False, n, k, SMS, int8, paired)
                        c = shape["constexprs"]
                        meta = dict(HAS_X_ROWS=False, HAS_R=norm, HAS_R_ROWS=False, HAS_R_OFFSET=False, WRITE_A=norm,
                                    HAS_NORM=norm, RMS_NORM=norm and model.startswith("llama"), INT8=int8,
                                    HAS_BIAS=not rope, ACT=act, KV_SCATTER=rope or (name == "qkv"), ROPE=rope,
                                    PAIRED=paired, DOT_FP32=False, PRECISION="tf32", BF16_BY_HAND=False,
                                    STATS_BLOCK=min(1 << (k - 1).bit_length(), 4096), **c)
                        kinds = dict(types, W="*i8") if int8 else types
                        label = (f"decode_row {model} {name}{' int8' if int8 else ''} "
                                 f"{c['BLOCK_N']}x{c['BLOCK_K']} w{shape['options']['num_warps']} "
                                 f"{'default' if config is None else 'sweep'}")
                        rows.append((label, lambda kinds=kinds, meta=meta, options=shape["options"]: assemble(
                            row._decode_row_kernel, kinds, meta, **options)))
                    continue
                shape = kernels.plan(block_m, False, -(-m // block_m), n, k, 2 * SMS, int8, in_linear, paired)
                meta = dict(HAS_X_ROWS=False, HAS_R=in_linear, HAS_R_ROWS=False, HAS_R_OFFSET=False, WRITE_A=in_linear,
                            HAS_NORM=in_linear, RMS_NORM=in_linear and model.startswith("llama"), INT8=int8,
                            HAS_BIAS=not rope,
                            ACT=act, KV_SCATTER=rope or (name == "qkv"), ROPE=rope, PAIRED=paired, DOT_FP32=False,
                            PRECISION="tf32", BF16_BY_HAND=False,
                            STATS_BLOCK=min(1 << (k - 1).bit_length(), 4096 // block_m), **shape["constexprs"])
                kinds = dict(types, W="*i8") if int8 else types
                label = (f"decode_linear {model} {name} x{m}{' int8' if int8 else ''} "
                         f"{shape['constexprs']['BLOCK_N']}x{shape['constexprs']['BLOCK_K']} "
                         f"w{shape['options']['num_warps']} s{shape['options']['num_stages']}")
                rows.append((label, lambda kinds=kinds, meta=meta, options=shape["options"]: assemble(
                    kernels._decode_linear_kernel, kinds, meta, **options)))
    prologue_types = dict({name: BF16 for name in ("X", "R", "A_OUT", "H_OUT", "NORM_W", "NORM_B")},
                          eps="fp32", **{name: "*i32" for name in ("X_ROWS", "R_ROWS", "R_OFFSET")})
    for model, k, rms in (("llama3_1b", 2048, True), ("gpt2_1558m", 1600, False), ("llama3_8b", 4096, True)):
        block_k, options = prologue.plan(False, k)
        meta = dict(HAS_X_ROWS=False, HAS_R=True, HAS_R_ROWS=False, HAS_R_OFFSET=False, WRITE_A=True, RMS_NORM=rms,
                    BF16_BY_HAND=False, BLOCK_K=block_k)
        rows.append((f"decode_prologue {model} {'rms' if rms else 'layer'} norm {block_k} w{options['num_warps']}",
                     lambda meta=meta, options=options: assemble(prologue._decode_prologue_kernel, prologue_types,
                                                                 meta, **options)))
    return rows


def attention_types(backward: bool) -> dict[str, str]:
    types = {name: BF16 for name in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "DB")}
    types.update(LSE="*fp32", DELTA="*fp32", KPM="*i8", SEED="*i64", KEEP="*i8", qk_scale="fp32", sm_scale="fp32",
                 dropout_p="fp32")
    return types


def attention_fwd_rows() -> list[tuple[str, object]]:
    from dslab.kernels.attention import attention_triton as fwd

    rows = []
    for head_dim, tiles in fwd._FWD_TILES.items():
        for bm, bn, warps, stages in tiles:
            for variant, causal, dropout in (("causal", True, False), ("dropout", False, True)):
                meta = dict(HEAD_DIM=head_dim, CAUSAL=causal, HAS_KPM=False, HAS_DROPOUT=dropout,
                            KEEP_MODE=fwd.KEEP_DRAW, DOT_FP32=False, KV_GROUP=1, BLOCK_M=bm, BLOCK_N=bn)
                rows.append((f"attention fwd d{head_dim} {variant} {bm}x{bn} w{warps} s{stages}",
                             lambda meta=meta, w=warps, s=stages: assemble(
                                 fwd._attention_fwd_kernel, attention_types(False), meta, w, s)))
    return rows


def attention_bwd_rows() -> list[tuple[str, object]]:
    from dslab.kernels.attention import attention_triton as fwd
    from dslab.kernels.attention import attention_triton_bwd as bwd

    plans = {"dq": (bwd.DQ_ONLY, bwd._DQ_TILES, lambda t: (16, 16, *t)),
             "dkdv": (bwd.DKDV_ONLY, bwd._DKDV_TILES, lambda t: (t[0], t[1], 16, 16, t[2], t[3])),
             "both": (bwd.BOTH, bwd._BOTH_TILES, lambda t: t),
             "atomic": (bwd.ATOMIC, bwd._ATOMIC_TILES, lambda t: (t[0], t[1], 16, 16, t[2], t[3]))}
    # FUSED: one key block covers seq_k (at most FUSED_MAX_SEQ_K), audited at that widest block
    plans["fused"] = (bwd.FUSED, bwd._FUSED_TILES, lambda t: (t[0], bwd.FUSED_MAX_SEQ_K, 16, 16, t[1], t[2]))
    rows = []
    for plan, (roles, table, unpack) in plans.items():
        for head_dim, tiles in table.items():
            for tile in tiles:
                bm1, bn1, bm2, bn2, warps, stages = unpack(tile)
                meta = dict(HEAD_DIM=head_dim, CAUSAL=True, HAS_KPM=False, HAS_DROPOUT=False, KEEP_MODE=fwd.KEEP_DRAW,
                            DOT_FP32=False, ROLES=roles, HAS_DB=False, DB_SLOT=False, EVEN_N=True, KV_GROUP=1,
                            BLOCK_M1=bm1, BLOCK_N1=bn1, BLOCK_M2=bm2, BLOCK_N2=bn2)
                rows.append((f"attention bwd {plan} d{head_dim} {bm1}x{bn1}/{bm2}x{bn2} w{warps} s{stages}",
                             lambda meta=meta, w=warps, s=stages: assemble(
                                 bwd._attention_bwd_kernel, attention_types(True), meta, w, s)))
    return rows


def layer_norm_rows() -> list[tuple[str, object]]:
    from dslab.kernels.norm import layer_norm_triton as ln

    types = {name: BF16 for name in ("X", "R", "W", "B", "Y", "H", "XB", "DY", "Hin", "DH", "DX", "DXD")}
    types.update(Mean="*fp32", Rstd="*fp32", Partials="*fp32", SEED="*i64", eps="fp32", threshold="i32", scale="fp32")
    rows = []
    for n in (768, 1024, 1600, 2048, 4096, 5120, 8192):
        block_m, block_n, warps = ln._forward_config(n)
        meta = dict(HAS_RESIDUAL=True, HAS_WEIGHT=True, HAS_BIAS=True, HAS_XBIAS=False, APPLY_DROPOUT=False,
                    BLOCK_M=block_m, BLOCK_N=block_n)
        rows.append((f"layer_norm fwd N={n} {block_m}x{block_n} w{warps}",
                     lambda meta=meta, w=warps: assemble(ln._layer_norm_fwd_kernel, types, meta, w, 1)))
        block_m, block_n, warps, stages = ln._backward_config(n)
        meta = dict(HAS_DH=True, HAS_WEIGHT=True, COMPUTE_DW=True, COMPUTE_DB=True, APPLY_DROPOUT=False,
                    COMPUTE_DXB=False, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages)
        # launched without num_stages (Triton's default, 3); STAGES pipelines the row loop
        rows.append((f"layer_norm bwd N={n} {block_m}x{block_n} w{warps} stages {stages}",
                     lambda meta=meta, w=warps: assemble(ln._layer_norm_bwd_kernel, types, meta, w, 3)))
    return rows


SECTIONS = {"decode": decode_rows, "attention_fwd": attention_fwd_rows, "attention_bwd": attention_bwd_rows,
            "layer_norm": layer_norm_rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=list(SECTIONS), action="append", default=None)
    parser.add_argument("--spills-only", action="store_true", help="print only the rows that spill")
    args = parser.parse_args(argv)
    spilling = 0
    print(f"{'configuration':<78} {'regs':>5} {'spill B':>8} {'smem B':>8}")
    for section in args.only or list(SECTIONS):
        for label, run in SECTIONS[section]():
            try:
                report = run()
            except Exception as err:  # a configuration that does not compile is a finding, not a crash
                print(f"{label:<78} does not compile: {str(err).strip().splitlines()[-1][:120]}")
                continue
            spilling += report.spill_bytes > 0
            if args.spills_only and not report.spill_bytes:
                continue
            shared = max(report.shared_bytes, report.dynamic_shared_bytes)
            print(f"{label:<78} {report.registers:>5} {report.spill_bytes:>8} {shared:>8}"
                  f"{'  SPILLS' if report.spill_bytes else ''}", flush=True)
    print(f"{spilling} configuration(s) spill")
    return 0


if __name__ == "__main__":
    sys.exit(main())
