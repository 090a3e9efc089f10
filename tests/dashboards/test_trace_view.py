"""The run page's Trace tab, hidden tabs and trace link: the profiled step drawn in the page is
the one the Perfetto trace holds (the same spans, device-timed where the profile has device
times), the step's collectives on every rank with their clock offsets and waits, the largest
fixture's step as its records say; tabs without records are left out of the navigation but
their addresses still answer; the header links the trace, or says why there is none; a drawn
page is kept until its report or trace changes."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import dash_ag_grid as dag
import pytest
from dash import dcc, html
from report_factory import STRAGGLER_RANK, WORLD, make_report, write_run

from dashboards import app as dash_app
from dashboards import pages, trace_view
from dashboards.data import RunStore
from dslab.report import report_from_dict
from dslab.report.timeline import TRACE_FILE, TRACE_NOT_WRITTEN, step_collectives, step_spans, step_timing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "profilers"))

FIXTURES = Path(__file__).parent / "fixtures"
ZERO = ("zero", "20261128T212522Z-68abb2")
INFERENCE = ("gpt2_inference", "20261126T044232Z-e33ccf")
RUN_ID = "20261120T100000Z-trace0"
DEVICE_STEP = 2


def with_device_times(data: dict) -> dict:
    """``data`` with device-time records in seq128's profile: each module's kernels took half its
    forward timer and a quarter of its backward one; the device-timed step is step 2."""
    data = copy.deepcopy(data)
    flops = data["profilers"]["flops"]["seq128"]
    for m in flops["modules"]:
        m["forward_device_ms"] = m["forward_latency_ms"] / 2
        m["backward_device_ms"] = m["backward_latency_ms"] / 4
    root = next(m for m in flops["modules"] if m["name"] == "")
    flops["device_time"] = {"step": DEVICE_STEP, "forward_ms": root["forward_device_ms"],
                            "backward_ms": root["backward_device_ms"], "optimizer_ms": 1.5}
    return data


def nodes(components, kind) -> list:
    """Every component of type ``kind`` in a tree of Dash components."""
    out, stack = [], list(components) if isinstance(components, list) else [components]
    while stack:
        c = stack.pop()
        if isinstance(c, kind):
            out.append(c)
        children = getattr(c, "children", None)
        stack.extend(children if isinstance(children, list) else [children] if children is not None else [])
    return out


def text(components) -> str:
    parts = []
    for c in nodes(components, (html.Div, html.P, html.H2, html.H3, html.Code, html.A, html.Pre, dcc.Link)):
        parts.extend(x for x in (c.children if isinstance(c.children, list) else [c.children]) if isinstance(x, str))
    return " ".join(parts)


def figure(components, graph_id):
    return next(g.figure for g in nodes(components, dcc.Graph) if getattr(g, "id", None) == graph_id)


def bars(fig) -> list[tuple[str, str, float, float]]:
    """``(trace name, bar label, start ms, end ms)`` of every bar of a timeline figure."""
    out = []
    for t in fig.data:
        labels = t.hovertext if t.hovertext is not None else t.y
        out += [(t.name, label, b, b + x) for label, b, x in zip(labels, t.base, t.x)]
    return out


def test_the_page_draws_the_spans_the_trace_holds():
    parse_mod = pytest.importorskip("test_trace")
    from dslab.profilers.trace import build_trace

    report = report_from_dict(with_device_times(make_report(RUN_ID)))
    flops = report.profilers["flops"]["seq128"]
    assert step_timing(flops) == "device"
    page = trace_view.trace_tab(report, "gpt2_medium", RUN_ID, "seq128")
    drawn = bars(figure(page, "trace-step"))
    traced = parse_mod.slices(parse_mod.parse(build_trace(report))["seq128 rank 0"]["profiled step"])
    origin = min(begin for _, begin, *_ in traced)
    assert sorted((name, round(b * 1e6), round(e * 1e6)) for _, name, b, e in drawn) == sorted(
        (name, begin - origin, end - origin) for name, begin, end, _, _ in traced)
    phases = {name: (b, e) for phase, name, b, e in drawn if name == phase}
    assert phases["forward"][1] - phases["forward"][0] == pytest.approx(flops["device_time"]["forward_ms"])
    assert phases["optimizer"][1] - phases["optimizer"][0] == pytest.approx(1.5)
    qkv = next(m for m in flops["modules"] if m["name"] == "layers.0.attention.qkv")
    (fwd,) = [(b, e) for phase, name, b, e in drawn if name == qkv["name"] and phase == "forward"]
    assert fwd[1] - fwd[0] == pytest.approx(qkv["forward_device_ms"])
    assert "its kernels' device time" in figure(page, "trace-step").layout.title.text


def test_a_profile_without_device_times_is_laid_out_by_its_timers():
    report = report_from_dict(make_report(RUN_ID))
    flops = report.profilers["flops"]["seq128"]
    assert step_timing(flops) == "timers"
    spans = step_spans(flops)
    forward = next(s for s in spans if s["name"] == "forward")
    assert forward["duration_ns"] == int(flops["forward_latency_ms"] * 1e6)
    page = trace_view.trace_tab(report, "gpt2_medium", RUN_ID, "seq128")
    assert "CUDA events around its calls" in figure(page, "trace-step").layout.title.text


def test_the_collectives_of_the_profiled_step_on_every_rank():
    data = with_device_times(make_report(RUN_ID))
    comms = data["profilers"]["comms"]["seq128"]
    comms["clock_offsets_ns"]["1"] = 2_000_000  # rank 1's clock runs 2 ms ahead of rank 0's
    for r in comms["per_rank"]["1"]:
        r["arrival_ns"] += 2_000_000
    report = report_from_dict(data)
    shown, calls = step_collectives(report.profilers["comms"]["seq128"], DEVICE_STEP)
    records = {rank: [r for r in comms["per_rank"][str(rank)] if r["step"] == DEVICE_STEP] for rank in range(WORLD)}
    assert shown == DEVICE_STEP and len(calls) == sum(len(v) for v in records.values())
    origin = min(r["arrival_ns"] - (2_000_000 if rank == 1 else 0) for rank, rs in records.items() for r in rs)
    first = min(records[1], key=lambda r: r["arrival_ns"])
    mine = min((c for c in calls if c["rank"] == 1), key=lambda c: c["start_ms"])
    assert mine["start_ms"] == pytest.approx((first["arrival_ns"] - 2_000_000 - origin) / 1e6)
    assert mine["latency_ms"] == pytest.approx(first["latency_ms"])
    assert all(c["wait_ms"] == 0.0 for c in calls if c["rank"] == STRAGGLER_RANK)
    assert all(c["wait_ms"] > 3.5 for c in calls if c["rank"] != STRAGGLER_RANK)
    fig = figure(trace_view.trace_tab(report, "gpt2_medium", RUN_ID, "seq128"), "trace-collectives")
    assert f"step {DEVICE_STEP}, {WORLD} ranks" in fig.layout.title.text
    assert sorted((row, round(b, 6)) for _, row, b, _ in bars(fig)) == sorted(
        (f"rank {c['rank']}", round(c["start_ms"], 6)) for c in calls)
    shown, _ = step_collectives(report.profilers["comms"]["seq128"], 99)
    assert shown == 3  # a step with no collectives falls back to the last one logged


def test_the_largest_fixture_step_as_its_records_say():
    store = RunStore(FIXTURES / "zero_reports")
    case = "355m-n4 dslab-zero2"
    page = dash_app.render(store, f"/run/{ZERO[0]}/{ZERO[1]}/trace", f"?case={case}")
    report = store.report(*ZERO)
    flops, comms = report.profilers["flops"][case], report.profilers["comms"][case]
    drawn = bars(figure(page, "trace-step"))
    (forward,) = [(b, e) for phase, name, b, e in drawn if name == "forward"]
    assert forward[1] - forward[0] == pytest.approx(flops["device_time"]["forward_ms"])
    step = flops["device_time"]["step"]
    collectives = bars(figure(page, "trace-collectives"))
    for rank in range(4):
        logged = [r for r in comms["per_rank"][str(rank)] if r["step"] == step]
        assert len([c for c in collectives if c[1] == f"rank {rank}"]) == len(logged) > 0
    top = next(g for g in nodes(page, dag.AgGrid) if getattr(g, "id", None) == "trace-top-modules").rowData
    totals = [r["total_ms"] for r in top]
    assert totals == sorted(totals, reverse=True) and len(top) == trace_view.TOP_MODULES
    module = next(m for m in flops["modules"] if m["name"] == top[0]["module"])
    assert top[0]["total_ms"] == pytest.approx(module["forward_device_ms"] + module["backward_device_ms"], rel=1e-3)


def test_tabs_without_records_are_hidden_and_still_answer():
    store = RunStore(FIXTURES / "inference_reports")
    assert pages.visible_tabs(store.report(*INFERENCE)) == ["", "memory", "telemetry", "inference"]
    page = dash_app.render(store, f"/run/{INFERENCE[0]}/{INFERENCE[1]}/inference")
    tabs = next(d for d in nodes(page, html.Div) if getattr(d, "id", None) == "run-tabs").children
    assert [t.children for t in tabs] == ["Run", "Memory", "Telemetry", "Inference"]
    for tab, why in (("flops", "no flops profile in this run"), ("comms", "no comms log in this run"),
                     ("io", "no I/O tuner results in this run"), ("trace", "no profiled step and no rank's collectives")):
        hidden = dash_app.render(store, f"/run/{INFERENCE[0]}/{INFERENCE[1]}/{tab}")
        shown = next(d for d in nodes(hidden, html.Div) if getattr(d, "id", None) == "run-tabs").children
        assert [t.href.rsplit("/", 1)[-1] for t in shown if t.className == "tab current"] == [tab]
        assert len(shown) == 5 and "Not found" not in text(hidden) and why in text(hidden), tab
    zero = RunStore(FIXTURES / "zero_reports")
    assert pages.visible_tabs(zero.report(*ZERO)) == ["", "flops", "comms", "memory", "telemetry", "scaling", "trace"]


def test_the_header_links_the_trace_or_says_why_there_is_none(tmp_path):
    from dslab.profilers.trace import write_trace

    data = make_report(RUN_ID)
    run = write_run(tmp_path, data)
    store = RunStore(tmp_path)

    def line():
        page = dash_app.render(store, f"/run/gpt2_medium/{RUN_ID}")
        return next(p for p in nodes(page, html.P) if getattr(p, "id", None) == "trace-link"), text(page)

    p, _ = line()
    assert f"dslab trace gpt2_medium/{RUN_ID}" in text([p])
    data["notes"] = ["kept", TRACE_NOT_WRITTEN + "ValueError: no perfetto"]
    write_run(tmp_path, data)
    p, page_text = line()
    assert p.children == "No Perfetto trace: dslab bench could not write it (ValueError: no perfetto)."
    assert "note: kept" in page_text and page_text.count("no perfetto") == 1
    write_trace(run)
    p, _ = line()
    link = next(a for a in nodes([p], html.A) if getattr(a, "id", None) == "trace-file")
    assert link.href == f"/trace/gpt2_medium/{RUN_ID}" and "dslab trace" not in text([p])
    client = dash_app.create_app(tmp_path).server.test_client()
    assert client.get(link.href).data == (run / TRACE_FILE).read_bytes()


def test_a_drawn_page_is_kept_until_its_report_or_trace_changes(tmp_path):
    from dslab.profilers.trace import write_trace

    run = write_run(tmp_path, make_report(RUN_ID))
    store = RunStore(tmp_path)
    first = pages.run_page(store, "gpt2_medium", RUN_ID, "trace")
    assert pages.run_page(store, "gpt2_medium", RUN_ID, "trace") is first
    assert pages.run_page(store, "gpt2_medium", RUN_ID, "trace", "seq512") is not first
    stamp = (run / "run.json").stat()
    os.utime(run / "run.json", ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))
    second = pages.run_page(store, "gpt2_medium", RUN_ID, "trace")
    assert second is not first and pages.run_page(store, "gpt2_medium", RUN_ID, "trace") is second
    write_trace(run)
    assert pages.run_page(store, "gpt2_medium", RUN_ID, "trace") is not second


def test_the_environment_is_one_block_of_every_row():
    rows = [("torch.version", "2.13.0+cu128"), ("cuda.gpus[0].name", "NVIDIA H100\n80GB"), ("a" * 60, "x")]
    block = pages.environment_table(rows)
    lines = block.children.split("\n")
    assert isinstance(block, html.Pre) and len(lines) == 3
    assert lines[0].split() == ["torch.version", "2.13.0+cu128"] and lines[1].endswith("NVIDIA H100 80GB")
    assert lines[0].index("2.13") == pages.ENVIRONMENT_KEY_WIDTH + 2
