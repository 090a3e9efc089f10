"""The Flops tab's data on real GPU reports (``fixtures/training_reports``: GPT-2 124M and
BERT-large on an H100, per-module device times): one table row per module with DeepSpeed's
figures, every attention block at depth 3 in the table and the types per depth, the treemap's own
ops as a named child whose value is the parent's flops less its children's, readable headers with
units, the roofline's legend per depth, and one message with the reason for a profile that never
ran."""

from __future__ import annotations

import copy
from pathlib import Path

import dash_ag_grid as dag
import plotly.colors
import pytest
from dash import dcc, html
from table_reader import read_plain_table

from dashboards import figures, flops_view
from dashboards.flops_tab import flops_tab
from dslab.report import RunReport, frames, read_report

TRAINING = Path(__file__).parent / "fixtures" / "training_reports"
GPT2 = TRAINING / "gpt2" / "20261127T050756Z-85c737" / "run.json"
BERT = TRAINING / "bert_large" / "20261127T045725Z-bf1a36" / "run.json"
CASES = [(GPT2, "124m", 12), (BERT, "seq128", 24)]  # (report, case, transformer layers)
TEXT_FIELDS = {"module", "type", "timed_by", "part"}
UNITLESS = {"depth", "calls", "modules"}


def _records(path: Path, case: str) -> dict[str, dict]:
    """The profile's module records as written, by dotted name ("" for the model)."""
    return {m["name"]: m for m in read_report(path).profilers["flops"][case]["modules"]}


def _walk(component):
    yield component
    children = getattr(component, "children", None)
    for child in children if isinstance(children, list) else [children] if children is not None else []:
        if not isinstance(child, str):
            yield from _walk(child)


def _found(out: list, kind) -> dict:
    return {c.id: c for top in out for c in _walk(top) if isinstance(c, kind) and getattr(c, "id", None)}


@pytest.fixture(scope="module", params=CASES, ids=["gpt2-124m", "bert-seq128"])
def profile(request):
    path, case, layers = request.param
    report = read_report(path)
    nodes = flops_view.flops_tree(frames.flops_modules(report, case=case, strict=True))
    return report, case, layers, nodes, _records(path, case)


def test_the_table_has_one_row_per_module_with_deepspeeds_figures(profile):
    report, case, layers, nodes, records = profile
    rows = flops_view.module_rows(nodes)
    assert [r["module"] for r in rows] == [name or "(root)" for name in records]  # the model's order
    model = records[""]
    model_flops = model["forward_flops"] + model["backward_flops"]
    model_ms = model["forward_device_ms"] + model["backward_device_ms"]
    for row in rows:
        m = records["" if row["module"] == "(root)" else row["module"]]
        flops = m["forward_flops"] + m["backward_flops"]
        assert (row["type"], row["depth"], row["calls"]) == (m["type"], m["depth"], m["calls"])
        assert row["params_m"] == pytest.approx(m["params"] / 1e6)
        assert row["fwd_gmacs"] == pytest.approx(m["forward_flops"] / 2 / 1e9)
        assert row["gflops"] == pytest.approx(flops / 1e9)
        assert row["flops_pct"] == pytest.approx(100 * flops / model_flops)
        if "forward_device_ms" in m:
            assert (row["fwd_ms"], row["bwd_ms"], row["timed_by"]) == \
                (m["forward_device_ms"], m["backward_device_ms"], "device kernels")
            assert row["time_pct"] == pytest.approx(100 * (m["forward_device_ms"] + m["backward_device_ms"]) / model_ms)
        else:
            assert (row["fwd_ms"], row["bwd_ms"], row["timed_by"]) == \
                (m["forward_latency_ms"], m["backward_latency_ms"], "CUDA-event span")
    assert rows[0]["module"] == "(root)" and rows[0]["flops_pct"] == 100.0


def test_every_attention_block_shows_at_depth_3(profile):
    """The old top-5-per-depth table kept only the MLPs at depth 3 (they have more flops)."""
    report, case, layers, nodes, records = profile
    rows = flops_view.module_rows(nodes)
    attention = [r["module"] for r in rows if r["depth"] == 3 and r["type"] == "SelfAttention"]
    assert attention == [f"layers.{i}.attention" for i in range(layers)]
    types = {(r["depth"], r["type"]): r for r in flops_view.type_rows(nodes)}
    summed = sum(records[f"layers.{i}.attention"]["forward_flops"] + records[f"layers.{i}.attention"]["backward_flops"]
                 for i in range(layers))
    model = records[""]["forward_flops"] + records[""]["backward_flops"]
    row = types[(3, "SelfAttention")]
    assert row["modules"] == layers and row["gflops"] == pytest.approx(summed / 1e9)
    assert row["flops_pct"] == pytest.approx(100 * summed / model)
    assert {t for d, t in types if d == 3} == {"SelfAttention", "FeedForward", "LayerNorm"}
    assert len(types) == len({(m["depth"], m["type"]) for m in records.values()})  # every type, no cap


def test_the_treemap_names_each_parents_own_ops(profile):
    report, case, layers, nodes, records = profile
    drawn = flops_view.treemap_nodes(nodes)
    by_id = {n["id"]: n for n in drawn}
    assert len(by_id) == len(drawn) and all(n["label"] for n in drawn)
    model = records[""]["forward_flops"] + records[""]["backward_flops"]
    top = sum(m["forward_flops"] + m["backward_flops"] for m in records.values() if m["depth"] == 1)
    root_own = by_id["(root) (own ops)"]
    assert (root_own["label"], root_own["parent"]) == ("(own ops)", "(root)")
    assert root_own["flops"] == model - top > 0
    attention = records["layers.0.attention"]
    projections = sum(records[f"layers.0.attention.{p}"]["forward_flops"] + records[f"layers.0.attention.{p}"]["backward_flops"]
                      for p in ("qkv", "out_proj"))
    core = by_id["layers.0.attention (own ops)"]
    assert core["flops"] == attention["forward_flops"] + attention["backward_flops"] - projections > 0
    # the core's time is the block's device time less its projections'
    block_ms = attention["forward_device_ms"] + attention["backward_device_ms"]
    projection_ms = sum(records[f"layers.0.attention.{p}"]["forward_device_ms"]
                        + records[f"layers.0.attention.{p}"]["backward_device_ms"] for p in ("qkv", "out_proj"))
    assert core["latency_ms"] == pytest.approx(block_ms - projection_ms)
    # branchvalues="total": every parent is exactly the sum of its children
    for parent in drawn:
        below = [n["flops"] for n in drawn if n["parent"] == parent["id"]]
        if below:
            assert sum(below) == parent["flops"], parent["id"]
    fig = figures.flops_treemap(drawn, case)
    trace = fig.data[0]
    assert trace.branchvalues == "total" and "(own ops)" in trace.labels
    assert trace.values[list(trace.ids).index("(root) (own ops)")] == model - top
    # a node without a time is grey; the others take the scale's colour of their TFLOP/s
    colours = dict(zip(trace.ids, trace.marker.colors))
    for n in drawn:
        assert (colours[n["id"]] == figures.UNTIMED_COLOUR) == (n["tflops"] is None), n["id"]
    fastest = max(drawn, key=lambda n: n["tflops"] or 0.0)
    assert colours[fastest["id"]] == plotly.colors.sample_colorscale("Viridis", [1.0])[0]
    assert fig.data[1].marker.cmax == fastest["tflops"] and fig.data[1].marker.showscale


def test_every_header_on_the_tab_is_readable_with_units():
    report = read_report(GPT2)
    out = flops_tab(report, "gpt2", report.run_id, "124m")
    grids = _found(out, dag.AgGrid)
    assert set(grids) == {"flops-modules"}
    plain = _found(out, dcc.Markdown)
    assert set(plain) == {"flops-breakdown", "flops-types"}  # a few rows, in their order: plain tables
    columns = {grid_id: [(c["field"], c["headerName"]) for c in grid.columnDefs] for grid_id, grid in grids.items()}
    for table_id, table in plain.items():
        columns[table_id] = read_plain_table(table).headers
    assert columns["flops-breakdown"] == flops_view.BREAKDOWN_COLUMNS
    for grid_id, pairs in columns.items():
        for field, header in pairs:
            assert "_" not in header, (grid_id, header)
            if field not in TEXT_FIELDS | UNITLESS:
                assert "(" in header or "TFLOP/s" in header, (grid_id, header)  # a unit
    modules = grids["flops-modules"]
    assert [c["headerName"] for c in modules.columnDefs] == [h for _, h in flops_view.MODULE_COLUMNS]
    assert len(modules.rowData) == len(_records(GPT2, "124m"))
    filters = {c["field"]: c["filter"] for c in modules.columnDefs}
    assert filters["depth"] == "agNumberColumnFilter" and filters["module"] == "agTextColumnFilter"
    assert modules.defaultColDef["sortable"] and modules.defaultColDef["floatingFilter"]
    assert columns["flops-types"] == flops_view.TYPE_COLUMNS
    assert set(_found(out, dcc.Graph)) == {"flops-treemap", "flops-roofline"}


def test_the_roofline_has_a_legend_per_depth_and_axes_with_units():
    report = read_report(GPT2)
    nodes = flops_view.flops_tree(frames.flops_modules(report, case="124m", strict=True))
    points = flops_view.roofline_points(nodes, frames.memory_activations(report, case="124m"), "bf16")
    fig = figures.roofline(points, flops_view.ceilings(report, report.profilers["flops"]["124m"]), "124m")
    depths = sorted({p["depth"] for p in points})
    assert len(depths) > 2
    markers = [t for t in fig.data if t.mode == "markers"]
    assert [t.name for t in markers] == ["the model (depth 0)" if d == 0 else f"modules at depth {d}" for d in depths]
    for depth, trace in zip(depths, markers):
        assert list(trace.text) == [p["module"] for p in points if p["depth"] == depth]
        assert list(trace.y) == [p["tflops"] for p in points if p["depth"] == depth]
    colours = [t.marker.color for t in markers] + [t.line.color for t in fig.data if t.mode == "lines"]
    assert len(set(colours)) == len(colours)  # each depth and each ceiling told apart
    assert fig.layout.showlegend is not False
    assert "FLOP/byte" in fig.layout.xaxis.title.text and "TFLOP/s" in fig.layout.yaxis.title.text


def _no_profile_sections(out: list) -> None:
    assert not _found(out, dcc.Graph) and not _found(out, dag.AgGrid)
    assert not [c for top in out for c in _walk(top) if isinstance(c, html.H3)]


def test_a_profile_that_never_ran_shows_its_reason_and_nothing_else():
    report = copy.copy(read_report(GPT2))
    report.profilers = {**report.profilers, "flops": {"124m": {"profiled": False, "profile_step": 40}}}
    out = flops_tab(report, "gpt2", report.run_id, "124m")
    message = _found(out, html.P)["flops-no-profile"].children
    assert "did not profile this case" in message and "step 40 (flops_profiler.profile_step)" in message
    _no_profile_sections(out)
    # a record that says why, and one case profiled beside it: the links stay, the reason is the record's
    report.profilers["flops"] = {"124m": {"profiled": False, "profile_step": 3, "reason": "RuntimeError: CUPTI busy"},
                                 "1.5b": read_report(GPT2).profilers["flops"]["1.5b"]}
    out = flops_tab(report, "gpt2", report.run_id, "124m")
    assert _found(out, html.P)["flops-no-profile"].children.endswith("RuntimeError: CUPTI busy")
    assert [c.children for top in out for c in _walk(top) if isinstance(c, dcc.Link)] == ["124m", "1.5b"]
    assert flops_view.why_no_profile(report, report.profilers["flops"]["1.5b"]) is None


def test_a_missing_section_says_whether_the_profiler_was_on():
    off = RunReport(run_id="20261201T000000Z-off000", suite="gpt2")
    assert flops_view.why_no_profile(off, None) == "no flops profile in this run (flops_profiler off)"
    failed = RunReport(run_id="20261201T000000Z-fail00", suite="gpt2",
                       config={"engine": {"flops_profiler": {"enabled": True, "profile_step": 3}}},
                       notes=["124m: profiler records failed: RuntimeError: gather timed out"])
    out = flops_tab(failed, "gpt2", failed.run_id, None)
    message = _found(out, html.P)["flops-no-profile"].children
    assert message == ("the flops profiler was on (flops_profiler.enabled) but this report holds no profile: "
                       "124m: profiler records failed: RuntimeError: gather timed out")
    _no_profile_sections(out)
