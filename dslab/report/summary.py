"""Plain-text tables of run reports, for the terminal (``dslab bench`` and ``dslab report``).

The header and the arms' table are read from the report's frames (:mod:`dslab.report.frames`:
``runs``, ``results`` and ``trials``); the MoE routing and the inference figures, which no frame
holds, from their records. :func:`runs_table` is ``dslab report list``'s table of many runs."""

from __future__ import annotations

from pathlib import Path

from dslab.report import frames
from dslab.report.schema import RATIO_ARM, RATIO_METRIC, STATUS_PARTIAL, RunReport
from dslab.report.store import read_report

# What describe() says of a run at the tiny scale: its trials are seconds on a CPU, so neither
# its times nor its ratios measure speed.
TINY_SCALE_NOTE = ("tiny scale: it checks the pipeline end to end on a CPU in seconds; "
                   "its times and dslab/arm ratios are not speed measurements")
RUNS_HEADER = ["suite", "run id", "status", "hardware", "dslab samples/s (first case)"]


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    return format(value * scale, spec)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    for r in rows:
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return out


def _moe_lines(report: RunReport, case: str) -> list[str]:
    """The case's MoE routing (``profilers["moe"][case]``), one line per MoE layer."""
    moe = report.profilers.get("moe") if isinstance(report.profilers, dict) else None
    record = moe.get(case) if isinstance(moe, dict) else None
    if not isinstance(record, dict) or not isinstance(record.get("layers"), list):
        return []
    lines = [f"  routing of the dslab arm's last step ({record.get('num_experts', '?')} experts, "
             f"top-{record.get('k', '?')}): dropped {_fmt(record.get('dropped_fraction'), '.2%')} of "
             f"{record.get('assignments', '?')} assignments"]
    for layer in record["layers"]:
        if not isinstance(layer, dict) or not isinstance(layer.get("exp_counts"), list):
            continue
        lines.append(f"    layer {layer.get('layer', '?')}: assignments per expert {layer['exp_counts']}, "
                     f"max/mean {_fmt(layer.get('max_over_mean'), '.2f')}")
    return lines


def _inference_lines(report: RunReport, case: str) -> list[str]:
    """The case's inference figures (``report.inference[case]``): prefill and per-token times per
    arm, and each arm's greedy tokens against the reference arm's."""
    record = report.inference.get(case) if isinstance(report.inference, dict) else None
    if not isinstance(record, dict) or not isinstance(record.get("arms"), dict):
        return []
    lines = [f"  batch {record.get('batch', '?')}, prompt {record.get('prompt_len', '?')} + "
             f"{record.get('max_new_tokens', '?')} new tokens:"]
    for arm, m in record["arms"].items():
        if not isinstance(m, dict):
            continue
        memory = ""
        if m.get("weights_bytes") is not None:
            memory = f", weights {_fmt(m.get('weights_bytes'), '.3f', 1 / 2**30)} GiB"
        if m.get("kv_cache_bytes") is not None:
            memory += f", KV cache {_fmt(m.get('kv_cache_bytes'), '.3f', 1 / 2**30)} GiB"
        lines.append(f"    {arm}: prefill {_fmt(m.get('prefill_ms'), '.2f')} ms, per token "
                     f"p50 {_fmt(m.get('per_token_ms_p50'), '.3f')} / p90 {_fmt(m.get('per_token_ms_p90'), '.3f')} ms"
                     f"{memory}")
    greedy = record.get("greedy")
    if isinstance(greedy, dict) and isinstance(greedy.get("arms"), dict):
        for arm, g in greedy["arms"].items():
            if not isinstance(g, dict):
                continue
            where = ("the same tokens" if g.get("equal") else
                     f"first differs at new token {g.get('first_divergence')}, agreement {_fmt(g.get('agreement'), '.1%')}")
            lines.append(f"    greedy {arm} vs {greedy.get('reference_arm', '?')} over "
                         f"{greedy.get('compared_tokens', '?')} new tokens: {where}")
    return lines


def results_table(report: RunReport) -> str:
    """One block per case: each arm's medians over trials, its spread, and dslab's ratio to it
    (``dslab/arm``, samples/s over samples/s); under it, dslab against the case's best plain arm
    (the fastest ok arm other than dslab, :meth:`RunReport.fastest_other`). A case with MoE
    records adds each arm's expert TFLOP/s and the dslab arm's routing; an inference case its
    prefill and per-token times and the greedy-token comparison."""
    results = frames.results(report)
    metrics = frames.metric_names(results, "results")
    by_arm: dict[tuple[str, str], dict] = {}
    for row in frames.records(results):
        by_arm.setdefault((row["case"], row["arm"]), row)
    steps: dict[tuple[str, str], list[float]] = {}
    for trial in frames.records(frames.trials(report)):
        if trial.get("step_time_ms") is not None:
            steps.setdefault((trial["case"], trial["arm"]), []).append(trial["step_time_ms"])
    arms = list(dict.fromkeys(arm for _, arm in by_arm))
    lines = []
    for case in dict.fromkeys(case for case, _ in by_arm):
        lines.append(f"{report.suite} / {case}")
        rows = []
        problems = []
        base = by_arm.get((case, RATIO_ARM))
        experts = any(m.get("expert_tflops") is not None for (c, _), m in by_arm.items() if c == case)
        for arm in arms:
            m = by_arm.get((case, arm))
            if m is None:
                continue
            if m["status"] != "ok" or all(m[name] is None for name in metrics):
                rows.append([arm, m["status"], "", "", "", "", "", "", ""] + ([""] if experts else []))
                if m["error"]:
                    problems.append(f"    {arm}: {m['status']}: {m['error'].splitlines()[0][:160]}")
                continue
            spread = "-"
            step_medians = steps.get((case, arm), [])
            if len(step_medians) > 1:
                spread = f"±{(max(step_medians) - min(step_medians)) / 2 / m['step_time_ms'] * 100:.1f}%"
            ratio = "-"
            if arm != RATIO_ARM and base is not None and base.get(RATIO_METRIC) and m.get(RATIO_METRIC):
                ratio = f"{base[RATIO_METRIC] / m[RATIO_METRIC]:.3f}"
            rows.append([
                arm,
                _fmt(m.get("samples_per_s"), ",.1f"),
                _fmt(m.get("tokens_per_s"), ",.0f"),
                _fmt(m.get("step_time_ms"), ".2f"),
                spread,
                _fmt(m.get("model_tflops"), ".3g"),
                _fmt(m.get("mfu_measured"), ".1%") if m.get("mfu_measured") is not None else _fmt(m.get("mfu_datasheet"), ".1%"),
                _fmt(m.get("peak_memory_bytes"), ".2f", 1 / 2**30),
                ratio,
            ] + ([_fmt(m.get("expert_tflops"), ".3g")] if experts else []))
        header = ["arm", "samples/s", "tokens/s", "step ms", "spread", "TFLOP/s", "MFU", "peak GiB", "dslab/arm"]
        header += ["expert TFLOP/s"] if experts else []
        lines.extend("  " + line for line in _table(header, rows))
        best = report.fastest_other(case, RATIO_ARM, RATIO_METRIC)
        if best is not None and base is not None and base.get(RATIO_METRIC):
            ratio = base[RATIO_METRIC] / best.metrics[RATIO_METRIC]
            lines.append(f"  dslab/best plain arm ({best.arm}): {ratio:.3f}")
        lines.extend(_moe_lines(report, case))
        lines.extend(_inference_lines(report, case))
        lines.extend(problems)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def describe(report: RunReport) -> str:
    """The header of a report: identity, status, hardware, versions, and what is missing."""
    run = frames.records(frames.runs(report))[0]

    def shown(key: str) -> str:
        return "?" if run[key] is None else str(run[key])

    commit = run["git_commit"] or "unknown commit"
    if run["git_dirty"]:
        commit += " (dirty)"
    if run["source_digest"]:
        commit += f", source {run['source_digest']}"
    lines = [
        f"run {report.run_id}  suite {report.suite}  status {report.status}",
        f"  created {report.created or '?'}  finished {report.finished or '-'}",
        f"  hardware {shown('hardware')}  torch {shown('torch_version')}  dslab {shown('dslab_version')} @ {commit}",
        f"  scale {shown('scale')}  precision {shown('precision')}  trials {shown('trials')}  "
        f"steps {shown('steps')} (+{shown('warmup_steps')} warm-up)",
    ]
    if (run["world_size"] or 1) > 1 or run["zero_stage"]:
        lines.append(f"  processes {run['world_size'] or 1}  ZeRO stage {run['zero_stage'] or 0}")
    peaks = report.peaks or {}
    if peaks.get("bf16_matmul_tflops"):
        lines.append(f"  measured peaks: bf16 matmul {peaks['bf16_matmul_tflops']:.0f} TFLOP/s, "
                     f"copy {peaks.get('copy_gbps', 0):.0f} GB/s")
    if report.data.get("description"):
        lines.append(f"  data: {report.data['description']}")
    if run["scale"] == "tiny":
        lines.append(f"  {TINY_SCALE_NOTE}")
    if report.status == STATUS_PARTIAL:
        failed = [f"{r.case}/{r.arm} ({r.status})" for r in report.failed_results()]
        lines.append(f"  partial: {len(failed)} arm(s) did not finish: {', '.join(failed)}; "
                     f"each one's error is under its case")
    for note in report.notes:
        lines.append(f"  note: {note}")
    if report.missing:
        lines.append(f"  warning: this report lacks {', '.join(report.missing)} (older or cut short)")
    for w in report.warnings:
        lines.append(f"  warning: {w}")
    return "\n".join(lines) + "\n"


def runs_table(paths: list[Path]) -> str:
    """``dslab report list``: a header line, then one line per run directory of ``paths`` (in
    their order): suite, run id, status, hardware, and the dslab arm's samples/s on the run's
    first case. A run whose report cannot be read says so in the status column, with the reason."""
    rows = []
    for path in paths:
        try:
            report = read_report(path)
        except ValueError as err:
            rows.append([path.parent.name, path.name, "unreadable", "", str(err)])
            continue
        results = frames.records(frames.results(report))
        first_case = results[0]["case"] if results else None
        dslab = next((row for row in results if row["case"] == first_case and row["arm"] == RATIO_ARM), None)
        value = dslab.get(RATIO_METRIC) if dslab else None
        figure = "-" if value is None else f"{value:,.1f} ({first_case})"
        hardware = frames.records(frames.runs(report))[0]["hardware"] or "?"
        rows.append([report.suite, report.run_id, report.status, hardware, figure])
    widths = [max(len(row[i]) for row in [RUNS_HEADER, *rows]) for i in range(len(RUNS_HEADER) - 1)]
    return "".join("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]).rstrip() + "\n"
                   for row in [RUNS_HEADER, *rows])
