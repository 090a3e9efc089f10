"""The flops profile as data (:func:`build_records`) and as DeepSpeed's text layout
(:func:`render_text`, drawn from the data alone), with units that fit the quantity: counts with
k/M/G/T suffixes, latencies in us/ms/s, rates in FLOPS, MFU against a stated peak.

MFU is reported against two peaks: the one measured on the device and passed in (a matmul
benchmark; None when nobody measured), and the datasheet's for ``torch.cuda.get_device_name()``
(:func:`dslab.report.hardware.lookup_gpu`), taken per dtype of the matmuls that ran (bf16 and fp16
tensor-core rates, plain FP32 for fp32: TF32 tensor cores may exceed that). With several dtypes the
datasheet MFU is ``sum(flops_d / peak_d) / duration``, the time the ops would take at peak over
the time they took.
"""

from __future__ import annotations

import torch

from dslab.comm import get_world_size
from dslab.profilers import flops_formulas
from dslab.profilers.flops_formulas import CPU_ATTENTION, ELEMENTWISE, MATMUL
from dslab.report.hardware import lookup_gpu

_SUFFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
_DATASHEET_FIELD = {"bfloat16": "bf16_tflops", "float16": "fp16_tflops", "float32": "fp32_tflops"}


def number_to_string(value: float, unit: str = "", precision: int = 2) -> str:
    """``1.29e6`` -> ``"1.29 M"``; ``unit`` follows the suffix (``"3.14 GMACs"``)."""
    for scale, suffix in _SUFFIXES:
        if abs(value) >= scale:
            return f"{value / scale:.{precision}f} {suffix}{unit}"
    if float(value).is_integer():
        return f"{int(value)} {unit}".rstrip()
    return f"{value:.{precision}f} {unit}".rstrip()


def duration_to_string(seconds: float | None, precision: int = 2) -> str:
    """Seconds as ``"x s"``, ``"x ms"`` or ``"x us"``; None as ``"n/a"``."""
    if seconds is None:
        return "n/a"
    if seconds >= 1.0:
        return f"{seconds:.{precision}f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.{precision}f} ms"
    return f"{seconds * 1e6:.{precision}f} us"


def rate_to_string(flops: float, seconds: float | None) -> str:
    """Floating-point operations per second, ``"81.90 TFLOPS"``; ``"n/a"`` without a time."""
    if not seconds:
        return "n/a"
    return number_to_string(flops / seconds, "FLOPS")


def _percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.2f}%" if whole else "0.00%"


def _ms_to_s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` for a CUDA device, else the device type ("cpu")."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def peaks_and_mfu(total_flops: int, flops_by_dtype: dict[str, int], duration_s: float,
                  name: str, measured_peak_tflops: float | None) -> tuple[dict, dict]:
    """``(peaks, mfu)`` for ``total_flops`` (of which ``flops_by_dtype[dtype]`` in each matmul
    dtype) done in ``duration_s`` on the device called ``name``.

    MFU values are fractions (0.4 = 40%) or None with the reason in ``peaks["note"]``."""
    peaks: dict = {"device": name, "measured_tflops": measured_peak_tflops, "datasheet_tflops": None,
                   "datasheet_gpu": None, "datasheet_by_dtype": {}, "note": None}
    mfu: dict = {"measured": None, "datasheet": None}
    if measured_peak_tflops and duration_s > 0:
        mfu["measured"] = total_flops / duration_s / (measured_peak_tflops * 1e12)
    spec = lookup_gpu(name)
    if spec is None:
        peaks["note"] = f"no datasheet peak for device {name!r}"
        return peaks, mfu
    peaks["datasheet_gpu"] = spec.name
    peaks["datasheet_source"] = spec.source
    seconds_at_peak = 0.0
    for dtype, flops in flops_by_dtype.items():
        field = _DATASHEET_FIELD.get(dtype)
        peak = getattr(spec, field) if field else None
        peaks["datasheet_by_dtype"][dtype] = peak
        if peak is None:
            peaks["note"] = f"the datasheet of {spec.name} has no {dtype} peak"
            return peaks, mfu
        seconds_at_peak += flops / (peak * 1e12)
    if seconds_at_peak > 0:
        peaks["datasheet_tflops"] = total_flops / seconds_at_peak / 1e12
        if duration_s > 0:
            mfu["datasheet"] = seconds_at_peak / duration_s
    return peaks, mfu


def build_records(profiler, profile_step: int | None) -> dict:
    """The profile of a stopped :class:`dslab.profilers.flops.FlopsProfiler` as JSON data.

    Flops are integers; ``total_flops`` is the matmul-like count (``forward_flops +
    backward_flops + optimizer_flops``), ``elementwise_flops`` and ``cpu_attention_flops`` are kept
    beside it. ``modules`` lists the hooked modules in ``named_modules`` order (the root's name is
    ``""``), each with its subtree's figures: ``macs`` is ``(forward_flops + backward_flops) / 2``,
    latencies are summed over calls (backward: the stream time from the first op of its backward
    work to the first op of the next module's). A container that is never called itself
    (``nn.ModuleList``) shows the sum of its submodules, with ``calls`` 0.
    """
    totals = profiler._totals
    matmul = totals[MATMUL]
    total = sum(matmul.values())
    duration_ms = profiler._duration_ms
    root = next((s for s in profiler._stats if s.name == ""), None)
    peaks, mfu = peaks_and_mfu(total, dict(profiler._flops_by_dtype), duration_ms / 1e3,
                               device_name(profiler._device), profiler.measured_peak_tflops)
    figures: dict[int, dict] = {}

    def module_figures(stats) -> dict:
        """A called module's own figures; a container that is never called (ModuleList) sums its
        submodules'."""
        if id(stats) not in figures:
            if stats.calls == 0 and stats.children:
                parts = [module_figures(child) for child in stats.children]
                figures[id(stats)] = {key: sum(p[key] for p in parts) for key in parts[0]}
            else:
                flops = stats.flops[MATMUL]
                figures[id(stats)] = {
                    "forward_flops": flops["forward"], "backward_flops": flops["backward"],
                    "elementwise_flops": sum(stats.flops[ELEMENTWISE].values()),
                    "forward_latency_ms": stats.forward_ms, "backward_latency_ms": stats.backward_ms,
                }
        return figures[id(stats)]

    modules = []
    for stats in profiler._stats:
        f = module_figures(stats)
        modules.append({
            "name": stats.name, "type": stats.type, "depth": stats.depth, "params": stats.params,
            "forward_flops": f["forward_flops"], "backward_flops": f["backward_flops"],
            "macs": (f["forward_flops"] + f["backward_flops"]) // 2,
            "elementwise_flops": f["elementwise_flops"],
            "forward_latency_ms": f["forward_latency_ms"], "backward_latency_ms": f["backward_latency_ms"],
            "calls": stats.calls,
        })
    engine = profiler.ds_engine
    batch = engine.train_micro_batch_size_per_gpu() if hasattr(engine, "train_micro_batch_size_per_gpu") else None
    optimizer_ms = profiler._phase_ms.get("optimizer")
    return {
        "profile_step": profile_step,
        "total_flops": total,
        "forward_flops": matmul["forward"],
        "backward_flops": matmul["backward"],
        "optimizer_flops": matmul["optimizer"],
        "total_macs": total // 2,
        "params": profiler.get_total_params(),
        "duration_ms": duration_ms,
        "forward_latency_ms": root.forward_ms if root is not None else None,
        "backward_latency_ms": profiler._backward_ms,
        "optimizer_latency_ms": optimizer_ms,
        "achieved_tflops": total / (duration_ms / 1e3) / 1e12 if duration_ms > 0 else None,
        "elementwise_flops": {**totals[ELEMENTWISE], "total": sum(totals[ELEMENTWISE].values())},
        "cpu_attention_flops": {**totals[CPU_ATTENTION], "total": sum(totals[CPU_ATTENTION].values())},
        "flops_by_op": {name: {"figure": fig, "flops": n} for name, (fig, n) in sorted(profiler._by_op.items())},
        "flops_by_dtype": dict(profiler._flops_by_dtype),
        "uncounted_autograd_functions": sorted(name for name, n in profiler._functions.items() if n == 0),
        "mfu": mfu,
        "peaks": peaks,
        "world_size": get_world_size(),
        "batch_size": batch,
        "timing": ("CUDA events on the current stream, read after one synchronize at stop_profile"
                   if profiler._clock.cuda else "host clock (CPU work is synchronous)"),
        "counting": "ops executed under a TorchDispatchMode, forward and backward",
        "modules": modules,
    }


# -- text ---------------------------------------------------------------------------------------


def module_times_ms(m: dict) -> tuple[float, float]:
    """A module's forward and backward time: its kernels' device time when the profile has it,
    else the CUDA-event latency of the counted step."""
    if m.get("forward_device_ms") is not None:
        return m["forward_device_ms"], m.get("backward_device_ms") or 0.0
    return m["forward_latency_ms"], m["backward_latency_ms"]

_RULE = "-" * 78


def _summary(r: dict) -> list[str]:
    fwd, bwd = r["forward_flops"], r["backward_flops"]
    fwd_s, bwd_s = _ms_to_s(r["forward_latency_ms"]), _ms_to_s(r["backward_latency_ms"])
    iter_s = _ms_to_s(r["duration_ms"])
    step = "" if r["profile_step"] is None else f" at step {r['profile_step']}"
    lines = [
        "-------------------------- dslab Flops Profiler --------------------------",
        f"Profile Summary{step}:",
        "Notations:",
        "number of parameters (params), number of multiply-accumulate operations (MACs),",
        "number of floating-point operations (flops), floating-point operations per second (FLOPS),",
        "fwd latency (forward propagation latency), bwd latency (backward propagation latency),",
        "step latency (optimizer step), iter latency (start to stop of the profiled step),",
        "model FLOPS utilization (MFU) against the stated peak.",
        "Flops are counted from the ops that ran, forward and backward (matmul-like ops in the",
        "totals; the elementwise estimate is listed apart).",
        "",
        f"world size: {r['world_size']}",
    ]
    if r["batch_size"]:
        lines.append(f"batch size per GPU: {r['batch_size']}")
    lines += [
        f"params per GPU: {number_to_string(r['params'])}",
        f"fwd MACs per GPU: {number_to_string(fwd // 2, 'MACs')}",
        f"fwd flops per GPU: {number_to_string(fwd)}",
        f"bwd flops per GPU: {number_to_string(bwd)}",
        f"fwd+bwd flops per GPU: {number_to_string(fwd + bwd)}",
    ]
    if fwd and bwd:
        lines.append(f"bwd / fwd flops (counted, not assumed): {bwd / fwd:.2f}")
    if r["optimizer_flops"]:
        lines.append(f"step flops per GPU: {number_to_string(r['optimizer_flops'])}")
    lines.append(f"total flops per GPU: {number_to_string(r['total_flops'])}")
    lines.append(f"elementwise flops per GPU (estimate, not in the totals): "
                 f"{number_to_string(r['elementwise_flops']['total'])}")
    if r["cpu_attention_flops"]["total"]:
        lines.append("CPU fused attention flops (not in the totals: torch's flop counter has no formula "
                     f"for it): {number_to_string(r['cpu_attention_flops']['total'])}")
    if r["uncounted_autograd_functions"]:
        lines.append("autograd Functions whose work the dispatcher does not see (backward ran, no flops "
                     f"counted in it): {', '.join(r['uncounted_autograd_functions'])}")
    lines += [
        f"fwd latency: {duration_to_string(fwd_s)}",
        f"bwd latency: {duration_to_string(bwd_s)}",
    ]
    if r["optimizer_latency_ms"] is not None:
        lines.append(f"step latency: {duration_to_string(_ms_to_s(r['optimizer_latency_ms']))}")
    lines += [
        f"iter latency: {duration_to_string(iter_s)}",
        f"fwd FLOPS per GPU = fwd flops per GPU / fwd latency: {rate_to_string(fwd, fwd_s)}",
        f"bwd FLOPS per GPU = bwd flops per GPU / bwd latency: {rate_to_string(bwd, bwd_s)}",
        f"FLOPS per GPU = total flops per GPU / iter latency: {rate_to_string(r['total_flops'], iter_s)}",
    ]
    if r["batch_size"] and iter_s:
        lines.append(f"samples/second: {r['batch_size'] / iter_s:.2f}")
    peaks, mfu = r["peaks"], r["mfu"]
    measured = peaks["measured_tflops"]
    lines.append(f"peak (measured on the device): {f'{measured:.2f} TFLOPS' if measured else 'not given'}")
    if peaks["datasheet_tflops"] is not None:
        dtypes = ", ".join(sorted(peaks["datasheet_by_dtype"]))
        lines.append(f"peak (datasheet, {peaks['datasheet_gpu']}, {dtypes}): {peaks['datasheet_tflops']:.2f} TFLOPS")
    else:
        lines.append(f"peak (datasheet): n/a ({peaks['note'] or 'no matmul flops counted'})")
    for key, label in (("measured", "measured peak"), ("datasheet", "datasheet peak")):
        value = mfu[key]
        lines.append(f"MFU ({label}): {'n/a' if value is None else f'{100 * value:.2f}%'}")
    lines.append(f"timing: {r['timing']}")
    lines += _device_and_steady(r)
    return lines


def _device_and_steady(r: dict) -> list[str]:
    lines = []
    device = r.get("device_time")
    if device and device.get("error"):
        lines.append(f"device time of step {device['step']}: not measured ({device['error']})")
    elif device:
        lines += [
            f"device time of step {device['step']} (module figures below): fwd "
            f"{duration_to_string(_ms_to_s(device['forward_ms']))}, bwd "
            f"{duration_to_string(_ms_to_s(device['backward_ms']))}, step "
            f"{duration_to_string(_ms_to_s(device['optimizer_ms']))}, busy "
            f"{duration_to_string(_ms_to_s(device['busy_ms']))} of a "
            f"{duration_to_string(_ms_to_s(device['span_ms']))} span",
            f"device-timed step ran: {device['mode']}",
        ]
    if device and device.get("steady_busy_ms") is not None:
        how = {True: "another profiler's hooks ran on it, so it ran eagerly",
               False: "no hooks, as the steady state runs"}.get(device.get("steady_busy_hooked"), "hooks not recorded")
        lines.append(f"device busy in step {device['steady_busy_step']} ({how}): "
                     f"{duration_to_string(_ms_to_s(device['steady_busy_ms']))} of a "
                     f"{duration_to_string(_ms_to_s(device['steady_span_ms']))} span")
    steady = r.get("steady_state")
    if steady:
        seconds = _ms_to_s(steady["step_ms"])
        mfu = steady.get("mfu") or {}
        parts = [f"{key} peak {100 * mfu[key]:.2f}%" for key in ("measured", "datasheet") if mfu.get(key) is not None]
        lines += [
            f"steady-state step: {duration_to_string(seconds)} ({steady['source']})",
            f"FLOPS per GPU at the steady state: {rate_to_string(r['total_flops'], seconds)}"
            + (f", MFU {', '.join(parts)}" if parts else ""),
        ]
        if steady.get("device_busy_over_step") is not None:
            lines.append(f"device-timed step's busy time / steady-state step: {steady['device_busy_over_step']:.3f}")
        if steady.get("steady_busy_over_step") is not None:
            lines.append(f"busy time of a step without hooks / steady-state step: {steady['steady_busy_over_step']:.3f}")
    return lines


def _aggregated(r: dict, module_depth: int, top_modules: int) -> list[str]:
    lines = ["----------------------------- Aggregated Profile per GPU -----------------------------",
             f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    by_depth: dict[int, dict[str, dict[str, float]]] = {}
    for m in r["modules"]:
        if module_depth != -1 and m["depth"] > module_depth:
            continue
        agg = by_depth.setdefault(m["depth"], {}).setdefault(
            m["type"], {"params": 0, "macs": 0, "fwd": 0.0, "bwd": 0.0})
        agg["params"] += m["params"]
        agg["macs"] += m["forward_flops"] // 2
        fwd_ms, bwd_ms = module_times_ms(m)
        agg["fwd"] += fwd_ms
        agg["bwd"] += bwd_ms
    for depth in sorted(by_depth):
        types = by_depth[depth]

        def top(key, fmt):
            ranked = sorted(types.items(), key=lambda item: item[1][key], reverse=True)[:top_modules]
            return "{" + ", ".join(f"'{name}': '{fmt(v[key])}'" for name, v in ranked) + "}"

        lines += [
            f"depth {depth}:",
            f"    params      - {top('params', number_to_string)}",
            f"    MACs        - {top('macs', lambda v: number_to_string(v, 'MACs'))}",
            f"    fwd latency - {top('fwd', lambda v: duration_to_string(v / 1e3))}",
            f"    bwd latency - {top('bwd', lambda v: duration_to_string(v / 1e3))}",
        ]
    return lines


def _module_line(m: dict, r: dict, root_fwd_ms: float, root_bwd_ms: float) -> str:
    fwd_ms, bwd_ms = module_times_ms(m)
    fwd_s, bwd_s = fwd_ms / 1e3, bwd_ms / 1e3
    return ", ".join([
        number_to_string(m["params"]), f"{_percent(m['params'], r['params'])} Params",
        number_to_string(m["forward_flops"] // 2, "MACs"), f"{_percent(m['forward_flops'], r['forward_flops'])} MACs",
        duration_to_string(fwd_s), f"{_percent(fwd_ms, root_fwd_ms)} latency",
        rate_to_string(m["forward_flops"], fwd_s),
        f"{number_to_string(m['backward_flops'])} bwd flops", f"{duration_to_string(bwd_s)} bwd latency",
        f"{rate_to_string(m['backward_flops'], bwd_s)} bwd",
        f"{m['calls']} call{'' if m['calls'] == 1 else 's'}",
    ])


def _detailed(r: dict, module_depth: int) -> list[str]:
    device = r.get("device_time") if (r.get("device_time") or {}).get("forward_ms") is not None else None
    lines = [
        "------------------------------ Detailed Profile per GPU ------------------------------",
        "Each module profile is listed after its name in the following order:",
        "params, percentage of total params, fwd MACs, percentage of total fwd MACs, fwd latency,",
        "percentage of total fwd latency, fwd FLOPS, bwd flops, bwd latency, bwd FLOPS, calls",
        "",
        "Note: 1. Functional calls and tensor methods inside a module count for that module, so a parent's",
        "flops can exceed the sum of its submodules'. A module called more than once sums its calls.",
        "2. bwd flops are the backward ops that ran for the module's forward work, not a multiple of fwd.",
        f"3. {flops_formulas.describe_constants()}.",
        "4. latencies are " + (f"the device time of the kernels each module ran on step {device['step']}."
                               if device else "CUDA-event spans on the counted step (host gaps included)."),
        "",
    ]
    shown = [m for m in r["modules"] if module_depth == -1 or m["depth"] <= module_depth]
    if device:
        root_fwd, root_bwd = device["forward_ms"], device["backward_ms"]
    else:
        root_fwd = r["forward_latency_ms"] or max((m["forward_latency_ms"] for m in shown), default=0.0)
        root_bwd = r["backward_latency_ms"] or 0.0
    open_depths: list[int] = []
    for i, m in enumerate(shown):
        while open_depths and open_depths[-1] >= m["depth"]:
            depth = open_depths.pop()
            lines.append("  " * depth + ")")
        label = m["name"].rsplit(".", 1)[-1]
        head = f"({label}): {m['type']}" if m["name"] else m["type"]
        stats = _module_line(m, r, root_fwd, root_bwd)
        has_children = i + 1 < len(shown) and shown[i + 1]["depth"] > m["depth"]
        indent = "  " * m["depth"]
        if has_children:
            lines += [f"{indent}{head}(", f"{indent}  {stats},"]
            open_depths.append(m["depth"])
        else:
            lines.append(f"{indent}{head}({stats})")
    while open_depths:
        lines.append("  " * open_depths.pop() + ")")
    return lines


def render_text(r: dict, module_depth: int = -1, top_modules: int = 1, detailed: bool = True) -> str:
    """DeepSpeed's flops profile layout from :func:`build_records`' data: the summary, the top
    ``top_modules`` module types per depth, and (``detailed``) the module tree down to
    ``module_depth`` (-1: all)."""
    lines = _summary(r) + _aggregated(r, module_depth, top_modules)
    if detailed:
        lines += _detailed(r, module_depth)
    lines.append(_RULE)
    return "\n".join(lines)
