"""The Scaling tab of a data-parallel run without a browser: the figures' traces carry exactly the
measured tokens/s, the weak-scaling efficiency (worked out here by hand from the report's numbers),
the peak GiB per GPU; the dslab-against-peer table and the arm table list failed and skipped arms
with their status and never as points; the tab is shown only for reports with process-count cases."""

from __future__ import annotations

import pytest
from dash.development.base_component import Component
from report_factory import (
    SCALING_OOM,
    SCALING_RUN_ID,
    SCALING_SKIPPED,
    SCALING_SUITE,
    make_report,
    make_scaling_report,
    write_run,
)

from dashboards import pages, scaling_view
from dashboards.app import render
from dashboards.data import RunStore
from dslab.report import report_from_dict

PLAIN_RUN = "20261205T100000Z-plain0"
RUN = f"/run/{SCALING_SUITE}/{SCALING_RUN_ID}"
ARMS_355M = ["dslab-zero0", "ddp", "dslab-zero3", "fsdp2"]  # deepspeed-zero3 was skipped: no trace
# tokens/s(N) / (N x tokens/s(1)) of report_factory.SCALING_TOKENS, by hand
EFFICIENCY_355M = {"dslab-zero0": [1.0, 19000 / 20000, 36000 / 40000], "ddp": [1.0, 16650 / 18000, 30600 / 36000],
                   "dslab-zero3": [1.0, 14400 / 16000, 25600 / 32000], "fsdp2": [1.0, 12800 / 16000]}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("scaling_reports")
    write_run(root, make_scaling_report())
    write_run(root, make_report(PLAIN_RUN, "gpt2"))
    return RunStore(root)


def _find(component, component_id: str):
    """The component with ``id`` ``component_id`` in a Dash component tree (or list of them)."""
    if isinstance(component, (list, tuple)):
        for c in component:
            found = _find(c, component_id)
            if found is not None:
                return found
        return None
    if getattr(component, "id", None) == component_id:
        return component
    children = getattr(component, "children", None)
    return _find(children, component_id) if isinstance(children, (list, tuple, Component)) else None


def _traces(figure) -> dict[str, tuple[list, list]]:
    return {t.name: (list(t.x), list(t.y)) for t in figure.data}


def test_points_and_series():
    report = report_from_dict(make_scaling_report())
    pts = scaling_view.points(report)
    assert scaling_view.has_scaling(report)
    assert scaling_view.model_cases(pts) == ["355m", "124m"]
    assert scaling_view.process_counts(pts, "355m") == [1, 2, 4] and scaling_view.process_counts(pts, "124m") == [1, 2]
    rows = {s["arm"]: s for s in scaling_view.series(pts, "355m")}
    assert list(rows) == ARMS_355M
    assert rows["fsdp2"]["nprocs"] == [1, 2] and rows["fsdp2"]["case"] == ["355m-n1", "355m-n2"]
    assert rows["dslab-zero3"]["peak_gib"] == pytest.approx([12.0, 7.0, 4.5])
    for arm, efficiency in EFFICIENCY_355M.items():
        assert rows[arm]["efficiency"] == pytest.approx(efficiency)
    assert [s["arm"] for s in scaling_view.series(pts, "124m")] == ["dslab-zero0", "ddp"]
    assert scaling_view.chosen_model_case(report, pts, None) == "355m"
    assert scaling_view.chosen_model_case(report, pts, "124m") == "124m"
    assert scaling_view.chosen_model_case(report, pts, "124m-n2") == "124m"  # a process count's case
    assert scaling_view.chosen_model_case(report, pts, "nope") == "355m"


def test_the_page_draws_the_three_figures(store):
    page = render(store, RUN + "/scaling")
    assert "could not be drawn" not in str(page)

    throughput = _find(page, "scaling-throughput").figure
    assert _traces(throughput) == {
        "dslab-zero0": ([1, 2, 4], [10000.0, 19000.0, 36000.0]), "ddp": ([1, 2, 4], [9000.0, 16650.0, 30600.0]),
        "dslab-zero3": ([1, 2, 4], [8000.0, 14400.0, 25600.0]), "fsdp2": ([1, 2], [8000.0, 12800.0])}
    assert [t.name for t in throughput.data] == ARMS_355M
    assert all(t.mode == "lines+markers" for t in throughput.data)
    assert list(throughput.layout.xaxis.tickvals) == [1, 2, 4]

    efficiency = _find(page, "scaling-efficiency").figure
    assert [t.name for t in efficiency.data] == ARMS_355M
    for t in efficiency.data:
        assert list(t.x) == [1, 2, 4][:len(EFFICIENCY_355M[t.name])]
        assert list(t.y) == pytest.approx(EFFICIENCY_355M[t.name])
        assert t.y[0] == 1.0  # N=1 by definition
    (line,) = efficiency.layout.shapes
    assert (line.y0, line.y1, line.line.dash) == (1.0, 1.0, "dash")

    memory = _find(page, "scaling-memory").figure
    assert {t.type for t in memory.data} == {"bar"} and memory.layout.barmode == "group"
    bars = _traces(memory)
    assert list(bars) == ARMS_355M
    assert bars["dslab-zero0"] == ([1, 2, 4], [12.0, 12.0, 12.0])
    assert bars["dslab-zero3"] == ([1, 2, 4], [12.0, 7.0, 4.5])
    assert bars["fsdp2"] == ([1, 2], [12.5, 7.5])
    # the same arm is the same colour in every figure
    assert throughput.data[2].line.color == efficiency.data[2].line.color == memory.data[2].marker.color


def test_the_peer_table(store):
    page = render(store, RUN + "/scaling")
    rows = _find(page, "scaling-peers").rowData
    shown = [(r["case"], r["arm"], r["peer"], r["status"], r["speedup"], r["memory_ratio"]) for r in rows]
    skipped = f"{SCALING_SKIPPED} skipped"
    assert shown == [
        ("355m-n1", "dslab-zero0", "ddp", "ok", pytest.approx(10000 / 9000, rel=1e-3), pytest.approx(12 / 13, rel=1e-3)),
        ("355m-n1", "dslab-zero3", "fsdp2", "ok", 1, pytest.approx(12 / 12.5, rel=1e-3)),
        ("355m-n1", "dslab-zero3", SCALING_SKIPPED, skipped, None, None),
        ("355m-n2", "dslab-zero0", "ddp", "ok", pytest.approx(19000 / 16650, rel=1e-3), pytest.approx(12 / 13, rel=1e-3)),
        ("355m-n2", "dslab-zero3", "fsdp2", "ok", 1.125, pytest.approx(7 / 7.5, rel=1e-3)),
        ("355m-n2", "dslab-zero3", SCALING_SKIPPED, skipped, None, None),
        ("355m-n4", "dslab-zero0", "ddp", "ok", pytest.approx(36000 / 30600, rel=1e-3), pytest.approx(12 / 13, rel=1e-3)),
        ("355m-n4", "dslab-zero3", "fsdp2", "fsdp2 failed", None, None),
        ("355m-n4", "dslab-zero3", SCALING_SKIPPED, skipped, None, None),
    ]
    headers = [c["headerName"] for c in _find(page, "scaling-peers").columnDefs]
    assert headers == ["case", "dslab arm", "peer", "status", "speedup \u00d7", "memory \u00d7"]
    # the unrounded ratios, as the library computes them
    report = report_from_dict(make_scaling_report())
    exact = scaling_view.peer_rows(report, scaling_view.points(report), "355m")
    assert exact[0]["speedup"] == pytest.approx(10000 / 9000) and exact[0]["memory_ratio"] == pytest.approx(12 / 13)
    assert [r["case"] for r in scaling_view.peer_rows(report, scaling_view.points(report))][-2:] == ["124m-n1", "124m-n2"]


def test_failed_and_skipped_arms_are_rows_not_points(store):
    page = render(store, RUN + "/scaling")
    rows = _find(page, "scaling-points").rowData
    by_key = {(r["arm"], r["nprocs"]): r for r in rows}
    assert len(rows) == 15  # five arms at three process counts, the failed and skipped ones included
    assert [r["arm"] for r in rows][:3] == ["dslab-zero0"] * 3
    failed = by_key[("fsdp2", 4)]
    assert (failed["status"], failed["tokens_per_s"], failed["efficiency"], failed["peak_gib"]) == ("failed", None, None, None)
    assert failed["error"] == SCALING_OOM  # the first line only
    for n in (1, 2, 4):
        skipped = by_key[(SCALING_SKIPPED, n)]
        assert skipped["status"] == "skipped" and skipped["case"] == f"355m-n{n}" and skipped["tokens_per_s"] is None
        assert "deepspeed is not importable" in skipped["error"]
    assert by_key[("ddp", 4)]["efficiency"] == pytest.approx(0.85) and by_key[("ddp", 4)]["peak_gib"] == 13
    for fig_id in ("scaling-throughput", "scaling-efficiency", "scaling-memory"):
        figure = _find(page, fig_id).figure
        assert SCALING_SKIPPED not in {t.name for t in figure.data}
        assert 4 not in list(next(t for t in figure.data if t.name == "fsdp2").x)


def test_the_model_case_is_picked_by_the_query(store):
    for query in ("?case=124m", "?case=124m-n2"):
        page = render(store, RUN + "/scaling", query)
        assert _traces(_find(page, "scaling-throughput").figure) == {
            "dslab-zero0": ([1, 2], [30000.0, 57000.0]), "ddp": ([1, 2], [30000.0, 54000.0])}
        assert [t.y for t in _find(page, "scaling-efficiency").figure.data] == [
            pytest.approx([1.0, 0.95]), pytest.approx([1.0, 0.9])]
        assert [r["case"] for r in _find(page, "scaling-peers").rowData] == ["124m-n1", "124m-n2"]
    text = str(render(store, RUN + "/scaling"))
    assert "/scaling?case=124m" in text and "/scaling?case=355m" in text


def test_the_tab_is_shown_only_for_runs_with_process_counts(store):
    assert "Scaling" in str(render(store, RUN)) and f"{RUN}/scaling" in str(render(store, RUN))
    plain = report_from_dict(make_report(PLAIN_RUN, "gpt2"))
    assert not scaling_view.has_scaling(plain) and scaling_view.points(plain) == []
    run_page = str(render(store, f"/run/gpt2/{PLAIN_RUN}"))
    assert "Scaling" not in run_page and "/scaling" not in run_page
    shown = render(store, f"/run/gpt2/{PLAIN_RUN}/scaling")
    assert _find(shown, "scaling-empty") is not None
    assert _find(shown, "scaling-throughput") is None and _find(shown, "scaling-peers") is None
    assert [tab for tab, _ in pages.TABS] == ["", "flops", "comms", "memory", "telemetry", "io"]


def test_no_single_process_run_leaves_efficiency_empty():
    data = make_scaling_report()
    data["results"] = [r for r in data["results"] if not r["case"].endswith("-n1")]
    data["config"]["cases"] = [c for c in data["config"]["cases"] if c["nprocs"] != 1]
    report = report_from_dict(data)
    pts = scaling_view.points(report)
    rows = scaling_view.series(pts, "355m")
    colours = scaling_view.arm_colours(report)
    assert all(e is None for s in rows for e in s["efficiency"])
    efficiency = scaling_view.efficiency_figure(rows, "355m", [2, 4], colours)
    assert len(efficiency.data) == 0 and "no arm ran ok on one process" in efficiency.layout.annotations[0].text
    assert [t.name for t in scaling_view.throughput_figure(rows, "355m", [2, 4], colours).data] == ARMS_355M
