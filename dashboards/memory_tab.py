"""The Memory tab of a run: the memory tracer's timeline with the trials and profiled steps
marked, the profiled step phase by phase and its peak by allocation site, activation memory as a module tree, the measurement
beside the estimate, each rank's peak, and where the step's wall time went
(:mod:`dashboards.memory_view`)."""

from __future__ import annotations

from dash import html

from dashboards import figures, memory_view, views
from dashboards.components import case_links, graph, guarded, plain_table, table
from dslab.report import frames


def rank_memory_section(report, case: str | None) -> list:
    """Each rank's peak memory in ``case`` (``frames.rank_memory``) as a table and a bar per rank;
    nothing for a run of one rank."""
    if case is None or memory_view.rank_count(frames.rank_memory(report, case=case)) < 2:
        return []

    def build():
        rows = memory_view.rank_memory_rows(frames.rank_memory(report, case=case, strict=True))
        return [table("memory-ranks", rows, [
                    ("arm", "arm"), ("rank", "rank"), ("kind", "memory"), ("trials", "trials"),
                    ("peak_gib", "peak GiB"), ("peak_over_mean", "peak / mean"),
                    ("model_states_gib", "model states GiB")]),
                graph("memory-ranks-bar", figures.rank_memory_bar(rows, case)),
                html.P(memory_view.RANK_MEMORY_NOTE, className="note")]

    return guarded("Memory per rank", build)


def wall_clock_section(report, case: str | None) -> list:
    """The engine's ``wall_clock`` breakdown of ``case`` against the profiled arm's median step
    time, as a table and a stacked bar; nothing when the run has none for it."""
    if case is None or frames.wall_clock(report, case=case).empty:
        return []

    def build():
        result = memory_view.profiled_result(report, case)
        step_ms = result.metrics.get("step_time_ms") if result is not None else None
        rows = memory_view.wall_clock_rows(frames.wall_clock(report, case=case, strict=True), step_ms)
        return [plain_table("memory-wall-clock", rows, memory_view.WALL_CLOCK_COLUMNS),
                graph("memory-wall-clock-bar", memory_view.wall_clock_bar(rows, step_ms, case)),
                html.P(memory_view.WALL_CLOCK_NOTE, className="note")]

    return guarded("Where the step's wall time went", build)


def memory_tab(report, suite, run_id, case) -> list:
    cases, chosen, data = views.section(report, "memory", case)
    if data is None:
        cases = report.cases()
        wall_cases = views.section(report, "wall_clock")[0]
        cases = cases + [c for c in wall_cases if c not in cases]
        chosen = case if case in cases else (cases[0] if cases else None)
        extra = rank_memory_section(report, chosen) + wall_clock_section(report, chosen)
        return [html.P("no memory trace in this run (memory_tracer off)"),
                *([case_links(suite, run_id, "memory", cases, chosen), *extra] if extra else [])]
    out = [case_links(suite, run_id, "memory", cases, chosen)]
    if data.get("note"):
        out.append(html.P(str(data["note"]), className="note"))

    def timeline():
        series = memory_view.memory_timeline(frames.memory_timeline(report, case=chosen, strict=True))
        if not series["step"]:
            return [html.P("no per-step allocator peaks (CPU run or tracer off)", className="note")]
        marks = memory_view.timeline_marks(report, chosen, series["step"], data)
        note = memory_view.TIMELINE_NOTE + (f" ({marks['note']}.)" if marks["note"] else "")
        return [graph("memory-timeline", figures.memory_timeline(series, marks, chosen)), html.P(note, className="note")]

    def profiled_step():
        rows = memory_view.phase_rows(data)
        if not rows:
            return [html.P("no phase deltas in this trace (the tracer reads them from the CUDA allocator)",
                           className="note")]
        step = data.get("profile_step")
        series = memory_view.memory_timeline(frames.memory_timeline(report, case=chosen, strict=True))
        peak = dict(zip(series["step"], series["peak_allocated"])).get(step)
        out = [plain_table("memory-phases", rows, memory_view.PHASE_COLUMNS)]
        levels = memory_view.phase_levels(data)
        if levels:
            out.append(graph("memory-phase-levels", memory_view.profiled_step_figure(
                levels, peak / 2**30 if peak is not None else None, step, chosen)))
        return out

    def activations():
        nodes = memory_view.activation_tree(frames.memory_activations(report, case=chosen, strict=True))
        if not nodes:
            return [html.P("no activations recorded", className="note")]
        return [graph("memory-activations", memory_view.activation_treemap(
                    memory_view.folded_activation_nodes(nodes), chosen)),
                plain_table("memory-activations-top", memory_view.activation_top_rows(nodes),
                            memory_view.ACTIVATION_COLUMNS),
                html.P(memory_view.ACTIVATION_NOTE, className="note")]

    def peak_sites():
        rows = memory_view.peak_site_rows(data)
        if not rows:
            return [html.P("no allocation sites: the run recorded no allocator snapshot "
                           "(memory_tracer.snapshot, CUDA only)", className="note")]
        peak = data["peak_sites"]["peak_bytes"] / 2**30
        return [html.P(f"traced peak: {peak:.2f} GiB"),
                plain_table("memory-peak-sites", rows, memory_view.PEAK_SITE_COLUMNS),
                html.P(memory_view.PEAK_SITE_NOTE, className="note")]

    out += guarded("Timeline", timeline)
    out += guarded("The profiled step, phase by phase", profiled_step)
    out += guarded("The profiled step's peak, by allocation site", peak_sites)
    out += guarded("Activation memory per module, as a tree", activations)
    out += guarded("Measured beside the estimate", lambda: graph(
        "memory-estimate", figures.measured_vs_estimate(memory_view.memory_measured_vs_estimate(data), chosen)))
    out += rank_memory_section(report, chosen)
    out += wall_clock_section(report, chosen)
    return out
