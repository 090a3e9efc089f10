"""A run's page as Dash components, built from a :class:`dashboards.data.RunStore`: its header
(status, notes, the Perfetto trace's link), the tabs' navigation and the tabs (the Flops, Comms,
Memory and Trace tabs in their own modules; the runs and compare pages in
:mod:`dashboards.runs_page`). An autotuning run's Run tab draws its experiments
(:mod:`dashboards.autotune_view`) instead of a section per case. The navigation lists only the
tabs with something to show for the run (:func:`visible_tabs`); the address of a hidden one still
answers, saying why it is empty.

A tab builds the frames it draws (:mod:`dslab.report.frames`: the run's ``results`` and
``trials``, the chosen case's profiler records with ``strict=True``) and hands them to
:mod:`dashboards.views`. Every section of a page is built through :func:`guarded`: a section
whose data is malformed turns into a warning naming the problem while the rest of the page is drawn.
"""

from __future__ import annotations

from urllib.parse import quote

from dash import dcc, html

from dashboards import autotune_view, experts_view, figures, io_view, pipeline_view, scaling_view, trace_view, views
from dashboards import inference as inference_view
from dashboards.comms_tab import comms_tab
from dashboards.components import PAGE_SIZE, case_links, graph, guarded, key_value, table, warning
from dashboards.data import RunStore
from dashboards.flops_tab import flops_tab
from dashboards.memory_tab import memory_tab
from dslab.report import frames, timeline

# The Run tab and the tabs of the profilers' sections, then the tabs of a kind of run or view.
TABS = (("", "Run"), ("flops", "Flops"), ("comms", "Comms"), ("memory", "Memory"),
        ("telemetry", "Telemetry"), ("io", "I/O"))
VIEW_TABS = (("experts", "Expert load"), ("inference", "Inference"), ("scaling", "Scaling"),
             ("pipeline", "Pipeline"), ("trace", "Trace"))
ALL_TABS = TABS + VIEW_TABS
BEST_PLAIN_NOTE = ("The best plain-PyTorch arm of a case is its fastest arm other than dslab (torch, torch-compile, "
                   "torch-compile-ro, hf, sdpa, liger, and the peers of the parallel suites) that finished all its "
                   "trials; dslab/best plain is dslab's samples/s over "
                   "that arm's, both medians of trials interleaved in the same run.")
PERFETTO = "https://ui.perfetto.dev"
ENVIRONMENT_KEY_WIDTH = 48


def _has_records(report, section: str) -> bool:
    """Whether profiler section ``section`` has a record of some case; a section that is not
    ``{case: record}`` counts, so that its tab can say what is wrong with it."""
    raw = report.profilers.get(section)
    if raw is None:
        return False
    return not isinstance(raw, dict) or any(v is not None for v in raw.values())


def _has_rank_memory(report) -> bool:
    """Whether some trial recorded per-rank peaks (a multi-process run)."""
    try:
        return not frames.rank_memory(report).empty
    except Exception:  # malformed trials: the Memory tab says what is wrong with them
        return True


def visible_tabs(report) -> list[str]:
    """The tabs of the run's page that have something to show: the Run tab always; Flops, Comms,
    Telemetry and I/O with records of their profiler; Memory with memory records, a wall-clock
    breakdown or per-rank peaks; the others with the records their views draw. A hidden tab's
    address still answers, with the reason it has nothing."""
    shown = {
        "": True,
        "flops": _has_records(report, "flops"),
        "comms": _has_records(report, "comms"),
        "memory": _has_records(report, "memory") or _has_records(report, "wall_clock") or _has_rank_memory(report),
        "telemetry": _has_records(report, "telemetry"),
        "io": bool(report.profilers.get("io")),
        "experts": experts_view.has_moe(report),
        "inference": inference_view.has_inference(report),
        "scaling": scaling_view.has_scaling(report),
        "pipeline": pipeline_view.has_pipeline(report),
        "trace": trace_view.has_trace_view(report),
    }
    return [tab for tab, _ in ALL_TABS if shown[tab]]


def _nav(suite: str, run_id: str, current: str, visible: list[str]) -> html.Div:
    links = []
    for tab, label in ALL_TABS:
        if tab not in visible and tab != current:
            continue
        href = f"/run/{quote(suite)}/{quote(run_id)}" + (f"/{tab}" if tab else "")
        links.append(dcc.Link(label, href=href, className="tab current" if tab == current else "tab"))
    return html.Div(links, className="tabs", id="run-tabs")


def _trace_line(store: RunStore, report, suite: str, run_id: str) -> html.P:
    """The Perfetto trace's link; else why there is none (``dslab bench`` writes one with every
    run and notes in the report when it could not)."""
    if store.trace_file(suite, run_id) is not None:
        return html.P(["Perfetto trace: ", html.A("trace.pftrace", href=f"/trace/{quote(suite)}/{quote(run_id)}",
                                                   id="trace-file"),
                       " - open it at ", html.A("ui.perfetto.dev", href=PERFETTO, target="_blank"),
                       " (Open trace file); the Trace tab draws its profiled step."], id="trace-link")
    problem = timeline.trace_problem(report)
    if problem is not None:
        return html.P(f"No Perfetto trace: dslab bench could not write it ({problem}).", id="trace-link",
                      className="warning")
    return html.P(["No Perfetto trace in this run's directory (a run from before dslab bench wrote one with every "
                   "run, or its file was removed); ", html.Code(f"dslab trace {suite}/{run_id}"), " writes it."],
                  id="trace-link")


def _trace_lines(store: RunStore, report, suite: str, run_id: str) -> list:
    """The trace's line; none for an autotuning run without a trace (``dslab autotune`` writes none)."""
    if autotune_view.is_autotune(report) and store.trace_file(suite, run_id) is None:
        return []
    return [_trace_line(store, report, suite, run_id)]


def _header(store: RunStore, report, suite: str, run_id: str, tab: str) -> list:
    problems = [f"this report lacks {', '.join(report.missing)} (older or cut short)"] if report.missing else []
    problems += list(report.warnings)
    if report.suite != suite or report.run_id != run_id:
        problems.append(f"the report names itself {report.suite}/{report.run_id}")
    notes = [n for n in report.notes if not str(n).startswith(timeline.TRACE_NOT_WRITTEN)]
    return [
        html.H2(f"{suite} / {run_id}"),
        html.P(f"status {report.status} - created {report.created or '?'} - finished {report.finished or '-'}"),
        *[warning(p) for p in problems],
        *[html.P(f"note: {n}", className="note") for n in notes],
        *_trace_lines(store, report, suite, run_id),
        _nav(suite, run_id, tab, visible_tabs(report)),
    ]


def run_page(store: RunStore, suite: str, run_id: str, tab: str = "", case: str | None = None) -> list:
    """The run's page: its header, navigation, and the chosen tab's sections (drawn once per
    version of the report and trace: :meth:`dashboards.data.RunStore.page`)."""
    body = _tab_bodies().get(tab)
    if body is None:
        store.run_path(suite, run_id)  # a bad run reference is the error to show first
        raise FileNotFoundError(f"no page {tab!r}")
    return store.page(suite, run_id, (tab, case),
                      lambda report: _header(store, report, suite, run_id, tab) + body(report, suite, run_id, case))


def _tab_bodies() -> dict:
    return {"": _run_tab, "flops": flops_tab, "comms": comms_tab, "memory": memory_tab,
            "telemetry": _telemetry_tab, "io": _io_tab, "experts": _experts_tab, "inference": _inference_tab,
            "scaling": _scaling_tab, "pipeline": _pipeline_tab, "trace": trace_view.trace_tab}


def _run_tab(report, suite, run_id, case) -> list:
    if autotune_view.is_autotune(report):
        return _autotune_sections(report) + guarded(
            "Environment", lambda: environment_table(views.environment_rows(report)))
    columns = [("case", "case"), ("arm", "arm"), ("status", "status"), ("trials", "trials"),
               ("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s"), ("step_time_ms", "step ms"),
               ("spread_pct", "spread %"), ("model_tflops", "TFLOP/s"), ("mfu_pct", "MFU %"), ("peak_gib", "peak GiB"),
               ("dslab_over_arm", "dslab/arm"), ("best_plain", "best plain"), ("error", "error")]
    if experts_view.has_moe(report):
        columns.insert(9, ("expert_tflops", "expert TFLOP/s"))
    results, trials = frames.results(report), frames.trials(report)
    out = guarded("dslab against the best plain-PyTorch arm", lambda: _best_plain_section(results))
    out += guarded("Arms", lambda: table("arms-table", views.arm_rows(results, trials), columns))
    for c in report.cases():
        out += guarded(f"Case {c}", lambda c=c: html.Div([graph(f"arms-{c}", figures.arms_bar(results, trials, c)),
                                                          graph(f"trials-{c}", figures.trials_strip(trials, c))],
                                                         className="pair"))
    out += guarded("Environment", lambda: environment_table(views.environment_rows(report)))
    return out


def _autotune_sections(report) -> list:
    """The Run tab of an autotuning run (:mod:`dashboards.autotune_view`): the summary line, the
    metric per experiment with the running best, the estimated memory against the budget, and
    every experiment in run order; the reason when the report has no autotuning section."""
    try:
        data = autotune_view.section(report)
    except ValueError as err:
        return [warning(f"Autotuning: {err}")]
    if data is None:
        return [html.P(autotune_view.empty_message(report), id="autotune-empty", className="warning")]
    rows, facts = [], {}

    def summary():
        rows.extend(autotune_view.experiment_rows(report))
        facts.update(autotune_view.summary(report, rows))
        return html.P(autotune_view.summary_line(facts), id="autotune-summary")

    out = guarded("Autotuning", summary)
    if not facts:
        return out
    out += guarded("Metric per experiment", lambda: graph(
        "autotune-metric", autotune_view.metric_figure(rows, facts["spec"])))
    out += guarded("Estimated memory against the budget", lambda: graph(
        "autotune-memory", autotune_view.memory_figure(rows, facts["budget_gb"])))
    out += guarded("Experiments", lambda: table("autotune-experiments", rows, autotune_view.columns(facts["spec"]),
                                                page_size=PAGE_SIZE))
    out.append(html.P(autotune_view.NOTE, className="note"))
    return out


def environment_table(rows: list[tuple[str, str]]) -> html.Pre:
    """The environment's ``(key, value)`` rows as one block of aligned text: a couple of hundred
    rows as one component rather than three Dash components a row, which the browser took a
    second to lay out."""
    width = min(ENVIRONMENT_KEY_WIDTH, max((len(str(k)) for k, _ in rows), default=0))
    text = "\n".join(f"{str(k):<{width}}  {' '.join(str(v).split())}" for k, v in rows)
    return html.Pre(text, className="kv-text", id="environment")


def _best_plain_section(results) -> list:
    rows = views.best_plain_rows(results)
    if not rows:
        return [html.P("no case has both a dslab result and an ok plain-PyTorch arm to compare", id="best-plain-empty")]
    return [table("best-plain-table", rows, [
                ("case", "case"), ("best_plain_arm", "best plain arm"), ("dslab_samples_per_s", "dslab samples/s"),
                ("best_plain_samples_per_s", "best plain samples/s"), ("dslab_over_best_plain", "dslab/best plain")]),
            html.P(BEST_PLAIN_NOTE, className="note")]


def _telemetry_tab(report, suite, run_id, case) -> list:
    cases, chosen, data = views.section(report, "telemetry", case)
    if data is None:
        return [html.P("no telemetry in this run (telemetry off)")]
    out = [case_links(suite, run_id, "telemetry", cases, chosen)]
    if not data.get("available", True):
        out.append(html.P(f"telemetry was not available: {data.get('reason') or 'no reason given'}", className="note"))
    out += guarded("Time series per GPU", lambda: graph("telemetry-series", figures.telemetry(
        views.telemetry_series(frames.telemetry_timeline(report, case=chosen, strict=True)), chosen)))
    return out


def _experts_tab(report, suite, run_id, case) -> list:
    cases, chosen, data = views.section(report, "moe", case)
    if data is None:
        return [html.P("no MoE records in this run (not a mixture-of-experts suite)", id="experts-empty")]
    out = [case_links(suite, run_id, "experts", cases, chosen)]
    load = {}

    def heatmap():
        load.update(experts_view.expert_load(data))
        return graph("expert-load-heatmap", figures.expert_load_heatmap(load, chosen))

    out += guarded("Expert load per MoE layer", heatmap)

    def summary():
        if not load:
            return []
        return [key_value([("dropped assignments", f"{load['dropped_pct']:.2f}%"),
                           ("experts, top-k", f"{load['num_experts']}, top-{load['k']}"),
                           ("tokens per step (this rank)", str(load["tokens_per_step"])),
                           ("dropless", "yes" if load["drop_tokens"] is False else "no"),
                           ("source", str(data.get("source", "-")))], "kv"),
                table("expert-load-layers", load["rows"], [
                    ("layer", "layer"), ("assignments", "assignments"), ("dropped", "dropped"),
                    ("dropped_pct", "dropped %"), ("max_over_mean", "max / mean"), ("capacity", "capacity")])]

    out += guarded("Dropped assignments", summary)
    out += guarded("Expert TFLOP/s per arm", lambda: table(
        "expert-tflops", experts_view.expert_tflops_rows(frames.results(report), chosen, data), [
            ("arm", "arm"), ("status", "status"), ("expert_gflops_per_step", "expert GFLOP per step"),
            ("step_time_ms", "step ms"), ("expert_tflops", "expert TFLOP/s")]))
    rows = experts_view.all_to_all_rows(data)
    if rows:
        out += guarded("all_to_all (expert parallelism)", lambda: table("expert-all-to-all", rows))
    out.append(html.P(experts_view.EXPERT_LOAD_NOTE, className="note"))
    return out


def _inference_tab(report, suite, run_id, case) -> list:
    cases, chosen, record = inference_view.case_record(report, case)
    if record is None:
        return [html.P("no inference records in this run (not an inference suite)", id="inference-empty")]
    out = [case_links(suite, run_id, "inference", cases, chosen),
           html.P(f"batch {record.get('batch', '?')}, prompt {record.get('prompt_len', '?')} + "
                  f"{record.get('max_new_tokens', '?')} new tokens, model {record.get('model', '?')}",
                  id="inference-shape")]
    rows = []

    def arms():
        rows.extend(inference_view.arm_rows(record))
        return table("inference-arms", rows, [
            ("arm", "arm"), ("prefill_ms", "prefill ms"), ("per_token_ms_p50", "per token p50 ms"),
            ("per_token_ms_p90", "per token p90 ms"), ("tokens_per_s", "tokens/s"), ("weights_gib", "weights GiB"),
            ("kv_cache_gib", "KV cache GiB"), ("peak_gib", "peak GiB"), ("weights_read_floor_ms", "weights-read floor ms")])

    out += guarded("Arms", arms)
    out += guarded("Time per new token", lambda: graph("inference-per-token",
                                                       inference_view.per_token_figure(rows, chosen)))

    def greedy():
        greedy_rows = inference_view.greedy_rows(record)
        if not greedy_rows:
            return [html.P("no greedy comparison (the reference arm did not run)", id="inference-greedy-empty")]
        return table("inference-greedy", greedy_rows, [
            ("arm", "arm"), ("reference", "against"), ("compared_tokens", "new tokens compared"),
            ("same_tokens", "same tokens"), ("first_divergence", "first differing token"),
            ("agreement_pct", "agreement %")])

    out += guarded("Greedy tokens against the reference arm", greedy)
    out.append(html.P(inference_view.NOTE, className="note"))
    return out


def _scaling_tab(report, suite, run_id, case) -> list:
    """A data-parallel run's scaling per model case (:mod:`dashboards.scaling_view`): tokens/s,
    weak-scaling efficiency and peak memory per GPU against the process count, dslab against its
    sharding peers, and every arm and process count with its status."""
    pts = scaling_view.points(report)
    if not pts:
        return [html.P("no cases with a process count in this run (not a data-parallel suite)", id="scaling-empty")]
    base = scaling_view.chosen_model_case(report, pts, case)
    out = [case_links(suite, run_id, "scaling", scaling_view.model_cases(pts), base)]
    counts = scaling_view.process_counts(pts, base)
    colours = scaling_view.arm_colours(report)
    rows = scaling_view.series(pts, base)
    out += guarded("Throughput against processes", lambda: graph(
        "scaling-throughput", scaling_view.throughput_figure(rows, base, counts, colours)))
    out += guarded("Weak-scaling efficiency", lambda: graph(
        "scaling-efficiency", scaling_view.efficiency_figure(rows, base, counts, colours)))
    out += guarded("Peak memory per GPU", lambda: graph(
        "scaling-memory", scaling_view.memory_figure(rows, base, counts, colours)))

    def peers():
        peer_rows = scaling_view.peer_rows(report, pts, base)
        if not peer_rows:
            return [html.P("no dslab arm ran beside a peer that shards the same way", id="scaling-peers-empty")]
        return table("scaling-peers", peer_rows, [
            ("case", "case"), ("arm", "dslab arm"), ("peer", "peer"), ("status", "status"),
            ("speedup", "speedup ×"), ("memory_ratio", "memory ×")])

    out += guarded("dslab against its sharding peers", peers)
    out += guarded("Every arm and process count", lambda: table(
        "scaling-points", scaling_view.point_rows(report, pts, base), [
            ("arm", "arm"), ("nprocs", "N"), ("case", "case"), ("status", "status"), ("tokens_per_s", "tokens/s"),
            ("efficiency", "efficiency"), ("peak_gib", "peak GiB per GPU"), ("error", "error")]))
    out.append(html.P(scaling_view.NOTE, className="note"))
    return out


def _pipeline_tab(report, suite, run_id, case) -> list:
    """Pipeline-parallel arms (:mod:`dashboards.pipeline_view`): per case, each stage's busy and
    idle time against the 1F1B bubble, and the latest batch's timeline per stage."""
    records = pipeline_view.records(report)
    if not records:
        return [html.P("no pipeline records in this run (no pipeline-parallel arm)", id="pipeline-empty")]
    keys = list(records)
    chosen = case if case in records else keys[0]
    record = records[chosen]
    out = [case_links(suite, run_id, "pipeline", keys, chosen)]
    out.append(key_value([("case", chosen), ("stages", str(record.get("stages"))),
                          ("micro-batches per step", str(record.get("micro_batches"))),
                          ("1F1B bubble", f"{100 * (record.get('bubble_fraction') or 0):.1f}%")]))
    out += guarded("Stage utilisation", lambda: graph(
        "pipeline-utilisation", pipeline_view.utilisation_figure(record, f"{chosen}: busy and idle per stage")))
    out += guarded("Stages", lambda: table("pipeline-stages", pipeline_view.utilisation_rows(record), [
        ("stage", "stage"), ("batches", "batches"), ("busy_ms", "busy ms"), ("wall_ms", "wall ms"),
        ("idle_pct", "idle %"), ("bubble_pct", "bubble %"), ("over_bubble_pts", "idle over bubble (points)")]))
    out += guarded("Latest batch, per stage", lambda: graph(
        "pipeline-timeline", pipeline_view.timeline_figure(record, f"{chosen}: forwards and backwards")))
    out.append(html.P(pipeline_view.NOTE, className="note"))
    return out


def _io_tab(report, suite, run_id, case) -> list:
    """``profilers["io"]``: an nvme-tune run's configuration x GB/s beside fio, or an engine
    run's swaps and checkpoint writes (:mod:`dashboards.io_view`). A section that is not
    ``{case: record}`` is shown flattened under a warning."""
    data = report.profilers.get("io")
    if not data:
        return [html.P("no I/O tuner results in this run", id="io-empty"),
                html.P("(dslab nvme-tune writes them; an engine run with an aio section or NVMe "
                       "optimizer offload records its swaps and checkpoint writes)", className="note")]
    try:
        cases, chosen, record = views.section(report, "io", case)
    except ValueError as err:
        return [warning(f"I/O: {err}"), *guarded("I/O tuner", lambda: key_value(views.flatten("io", data)))]
    out = [case_links(suite, run_id, "io", cases, chosen)]

    def rows():
        return frames.io_records(report, case=chosen, strict=True)

    if record.get("kind") == "engine" or "operations" in record:
        out += guarded("Storage I/O of the run", lambda: table(
            "io-operations", io_view.operation_rows(rows()), [
                ("kind", "operation"), ("count", "count"), ("bytes", "bytes"), ("seconds", "seconds"),
                ("GBps", "GB/s"), ("median_GBps", "median GB/s"), ("min_GBps", "min GB/s"),
                ("max_GBps", "max GB/s"), ("waited_s", "step waited (s)")]))
        out += guarded("Each swap and checkpoint write", lambda: table(
            "io-events", io_view.event_rows(rows()), page_size=PAGE_SIZE))
        return out
    if "configs" not in record:
        return out + guarded("I/O", lambda: key_value(views.flatten("io", record)))
    out.append(key_value([
        ("path", str(record.get("path"))), ("file", f"{record.get('file_bytes')} bytes"),
        ("tensors", str(record.get("device"))), ("backend", str(record.get("backend"))),
        ("direct I/O", "yes (O_DIRECT)" if record.get("direct_io") else "no: the page cache"),
        ("trials", str(record.get("trials"))), ("seconds", f"{record.get('seconds', 0):.0f}"),
        ("recommended aio", str(record.get("recommended_aio")))], "kv"))
    out += guarded("Best configuration beside fio", lambda: table(
        "io-comparison", io_view.comparison_rows(record), [
            ("op", "op"), ("best_configuration", "dslab best configuration"), ("dslab_GBps", "dslab GB/s"),
            ("fio_1M_32_GBps", "fio 1M/iodepth 32 GB/s"), ("dslab_beside_matched_GBps", "dslab GB/s (beside matched)"),
            ("fio_matched_GBps", "fio matched GB/s"), ("fio_matched_job", "fio matched job"),
            ("dslab_over_fio_best", "dslab / fio best")]))
    out += guarded("Finalists", lambda: graph("io-finalists", io_view.config_figure(rows(), record, chosen)))
    out += guarded("Configuration x GB/s", lambda: table(
        "io-configs", io_view.config_rows(rows()), page_size=PAGE_SIZE, filters=True))
    for note in record.get("notes") or []:
        out.append(html.P(str(note), className="note"))
    return out
