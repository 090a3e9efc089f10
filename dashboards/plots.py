"""Static PNG figures of a run's main views, for CI artifacts (``dslab report plot RUN``).

Drawn with matplotlib's Agg backend from the same :mod:`dashboards.views` tables (over the same
:mod:`dslab.report.frames`) as the Dash pages, so a PNG and the dashboard show the same numbers.
matplotlib is imported when a figure is drawn, never at import time. One PNG per view and case,
written atomically; a view whose data is missing (for that case) is skipped and one whose data is
malformed is reported in the returned warnings.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from dashboards import comms_view, experts_view, flops_view, memory_view, views
from dslab.report import RunReport, frames

DPI = 110


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=DPI, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _record(report: RunReport, section: str, case: str) -> dict | None:
    """``case``'s record of profiler ``section``; None when the section has none for it."""
    _, chosen, data = views.section(report, section, case)
    return data if chosen == case else None


def _arms(plt, report: RunReport, case: str):
    spread = views.trial_spread(frames.trials(report)).get(case, {})
    if not spread:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    arms = list(spread)
    ax.boxplot([spread[a] for a in arms], tick_labels=arms)
    for i, arm in enumerate(arms, start=1):
        ax.scatter([i] * len(spread[arm]), spread[arm], s=12, color="tab:blue", zorder=3)
    ax.set_ylabel("samples/s per trial")
    title = f"{report.suite} / {case}: arms and the spread of trials"
    best = views.best_plain_of(frames.results(report), case)
    if best is not None:
        title += f"\ndslab/best plain arm ({best[0]}): {best[1]:.3f}"
    ax.set_title(title)
    return fig


def _flops(plt, report: RunReport, case: str):
    data = _record(report, "flops", case)
    if data is None:
        return None
    nodes = flops_view.flops_tree(frames.flops_modules(report, case=case, strict=True))
    top = [r for r in flops_view.top_modules(nodes, per_depth=6) if r["depth"] > 0][:24]
    activations = frames.memory_activations(report, case=case)
    points = flops_view.roofline_points(nodes, activations, report.config.get("precision"))
    roofs = flops_view.ceilings(report, data)
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, max(4, 0.28 * len(top) + 1)))
    left.barh([r["module"] for r in top], [r["gflops"] for r in top],
              color=plt.cm.viridis([min(1.0, (r["tflops"] or 0) / max(1e-9, max(t["tflops"] or 0 for t in top)))
                                    for r in top]))
    left.invert_yaxis()
    left.set_xlabel("GFLOP (forward + backward); colour: achieved TFLOP/s")
    left.set_title(f"{case}: top modules per depth")
    if points:
        xs = [p["intensity"] for p in points]
        right.scatter(xs, [p["tflops"] for p in points], c=[p["depth"] for p in points], cmap="plasma")
        lo, hi = min(xs) / 4, max(xs) * 4
        for kind, style in (("measured", "-"), ("datasheet", "--")):
            peak, bw = roofs[f"{kind}_tflops"], roofs[f"{kind}_gbps"]
            if peak and bw:
                lo = min(lo, peak * 1e3 / bw / 4)
                grid = [lo * (hi / lo) ** (i / 60) for i in range(61)]
                right.plot(grid, [min(peak, ai * bw / 1e3) for ai in grid], style, label=f"{kind} roof")
            elif peak:
                right.axhline(peak, linestyle=style, label=f"{kind} peak")
        right.set_xscale("log")
        right.set_yscale("log")
        right.set_xlabel("arithmetic intensity (flop/byte, estimated)")
        right.set_ylabel("achieved TFLOP/s")
        if right.get_legend_handles_labels()[0]:
            right.legend()
    right.set_title(f"{case}: roofline")
    return fig


def _comms(plt, report: RunReport, case: str):
    data = _record(report, "comms", case)
    if data is None:
        return None
    calls = frames.comms_calls(report, case=case, strict=True)
    points = comms_view.bandwidth_points(calls)
    reference = comms_view.reference_busbw(report)
    matrix = comms_view.straggler_matrix(calls, frames.stragglers(report, case=case, strict=True))
    if not points and not matrix["labels"]:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.5))
    for op in sorted({p["op"] for p in points}):
        mine = [p for p in points if p["op"] == op]
        left.scatter([p["bytes"] for p in mine], [p["busbw_GBps"] for p in mine], s=14, label=op)
    if reference is not None and reference["points"]:
        left.plot([p["size_bytes"] for p in reference["points"]], [p["busbw_GBps"] for p in reference["points"]],
                  "k--o", markersize=3, label=reference["label"])
    left.set_xscale("log")
    if points:
        left.set_yscale("log")
    left.set_xlabel("message bytes")
    left.set_ylabel("bus bandwidth (GB/s)")
    left.set_title(f"{case}: bus bandwidth per collective")
    if points:
        left.legend()
    if matrix["labels"]:
        z = [[float("nan") if v is None else v for v in row] for row in matrix["lateness_ms"]]
        image = right.imshow(z, aspect="auto", cmap="Reds", interpolation="nearest", vmin=0,
                             vmax=matrix["colour_max_ms"])
        named = set(matrix["stragglers"])
        right.set_yticks(range(len(matrix["ranks"])), [f"rank {r}" + (" (straggler)" if r in named else "")
                                                       for r in matrix["ranks"]])
        right.scatter(range(len(matrix["last"])), [matrix["ranks"].index(r) for r in matrix["last"]],
                      marker="x", color="black", s=16)
        right.set_xlabel("collective (in order of first arrival)")
        fig.colorbar(image, ax=right, label=f"late by (ms, colour to {matrix['colour_max_ms']:.3g})")
    right.set_title(f"{case}: lateness per rank and collective")
    return fig


def _memory(plt, report: RunReport, case: str):
    data = _record(report, "memory", case)
    if data is None:
        return None
    timeline = memory_view.memory_timeline(frames.memory_timeline(report, case=case, strict=True))
    acts = memory_view.activation_top_rows(
        memory_view.activation_tree(frames.memory_activations(report, case=case, strict=True)))
    compare = memory_view.memory_measured_vs_estimate(data)
    fig, axes = plt.subplots(1, 3, figsize=(18, max(4, 0.22 * len(acts) + 1)))
    for key in ("peak_allocated", "peak_reserved"):
        axes[0].plot(timeline["step"], [None if v is None else v / 2**30 for v in timeline[key]], "o-", label=key)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("GiB")
    axes[0].set_title(f"{case}: allocator peaks" if timeline["step"] else f"{case}: no per-step peaks")
    if timeline["step"]:
        axes[0].legend()
    axes[1].barh([a["module"] for a in acts], [a["mib"] for a in acts])
    axes[1].invert_yaxis()
    axes[1].set_xlabel("MiB saved for backward (with children)")
    axes[1].set_title(f"activation memory, the {len(acts)} largest modules as a tree")
    bottom = 0.0
    for key, value in compare["measured"].items():
        axes[2].bar(["measured"], [value / 2**30], bottom=bottom, label=key)
        bottom += value / 2**30
    if compare["estimate"] is not None:
        axes[2].bar(["estimate"], [compare["estimate"] / 2**30], label="ZeRO-0 estimate")
    axes[2].set_ylabel("GiB")
    axes[2].set_title("model states: measured beside the estimate")
    axes[2].legend()
    return fig


def _telemetry(plt, report: RunReport, case: str):
    if _record(report, "telemetry", case) is None:
        return None
    series = views.telemetry_series(frames.telemetry_timeline(report, case=case, strict=True))
    if not series:
        return None
    fields = views.TELEMETRY_FIELDS
    fig, axes = plt.subplots(len(fields), 1, figsize=(10, 2.2 * len(fields)), sharex=True)
    for s in series:
        for ax, (key, title) in zip(axes, fields):
            scale = 1 / 2**30 if key == "mem_used_bytes" else 1.0
            ax.plot(s["t"], [None if v is None else v * scale for v in s[key]], label=s["gpu"])
            ax.set_ylabel(title.replace("(bytes)", "(GiB)"), fontsize=8)
    axes[0].legend(fontsize=8)
    axes[0].set_title(f"{case}: GPU telemetry")
    axes[-1].set_xlabel("seconds since sampling began")
    return fig


def _experts(plt, report: RunReport, case: str):
    data = _record(report, "moe", case)
    if data is None:
        return None
    load = experts_view.expert_load(data)
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(load["experts"]) + 3), 1.5 + 0.5 * len(load["layers"])))
    image = ax.imshow(load["share_pct"], aspect="auto", cmap="viridis", vmin=0, interpolation="nearest")
    ax.set_xticks(range(len(load["experts"])), [e.split()[-1] for e in load["experts"]])
    ax.set_yticks(range(len(load["layers"])), load["layers"])
    for row, shares in enumerate(load["share_pct"]):
        for col, share in enumerate(shares):
            ax.text(col, row, f"{share:.0f}", ha="center", va="center", color="white", fontsize=8)
    ax.set_xlabel("expert")
    fig.colorbar(image, ax=ax, label="% of the layer's assignments")
    ax.set_title(f"{case}: expert load\ndropped {load['dropped_pct']:.2f}% of the assignments", fontsize=10)
    return fig


VIEWS = (("arms", _arms), ("flops", _flops), ("comms", _comms), ("memory", _memory), ("telemetry", _telemetry),
         ("experts", _experts))


def write_plots(report: RunReport, out_dir: str | Path) -> tuple[list[Path], list[str]]:
    """PNG figures of ``report`` into ``out_dir`` as ``<view>_<case>.png``; returns the paths
    written and warnings for views that could not be drawn."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written, warnings = [], []
    for case in _cases(report):
        for name, draw in VIEWS:
            try:
                fig = draw(plt, report, case)
            except Exception as err:  # one malformed section must not stop the others
                warnings.append(f"{name} of {case}: not drawn ({type(err).__name__}: {err})")
                continue
            if fig is None:
                continue
            try:
                written.append(_save(fig, out / f"{name}_{_file_part(case)}.png"))
            finally:
                plt.close(fig)
    return written, warnings


def _cases(report: RunReport) -> list[str]:
    """The report's cases and any case a profiler section holds."""
    cases = report.cases()
    for section in ("flops", "memory", "comms", "telemetry", "moe"):
        try:
            cases += views.section(report, section)[0]
        except ValueError:
            continue
    return list(dict.fromkeys(cases))


def _file_part(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name) or "case"
