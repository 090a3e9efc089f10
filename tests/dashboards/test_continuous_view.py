"""The profile over the run in the Flops tab, without a browser: the MFU figure carries each
profile's MFU against both peaks (TFLOP/s when the report has none), the module figure a line per
top module with a gap where a profile did not keep it, the table a row per profile; the section
shows only for runs with a continuous series, and a malformed series is a warning, not a broken
page. :func:`make_continuous_report` is the run the browser test draws too."""

from __future__ import annotations

import copy

import pytest
from report_factory import make_report, write_run

from dashboards import continuous_view
from dashboards.app import render
from dashboards.data import RunStore
from dslab.report import frames, report_from_dict

CONTINUOUS_RUN_ID = "20261210T100000Z-cont00"
CONTINUOUS_SUITE = "gpt2"
CASE = "seq128"
EVERY = 100
STEPS = (4, 104, 204, 304)
MFU_MEASURED = (0.40, 0.42, 0.38, 0.41)
MFU_DATASHEET = (0.30, 0.315, 0.285, 0.3075)
FAILED_STEP = 404
PLAIN_RUN = "20261210T100000Z-plain0"


def _profile(i: int) -> dict:
    """Profile ``i``: the model, two depth-1 and two depth-2 modules; layers.2 is among the top of
    depth 2 except in profile 2, where layers.0 takes its place."""
    step_ms = 100.0 + i
    layers = {"layers.1": 30.0 + i, "layers.2": 25.0 + 4 * i} if i != 2 else {"layers.1": 32.0, "layers.0": 24.0}
    modules = [{"name": "", "depth": 0, "forward_ms": 30.0 + i, "backward_ms": 60.0 + 2 * i},
               {"name": "layers", "depth": 1, "forward_ms": 25.0 + i, "backward_ms": 50.0 + 2 * i},
               {"name": "lm_head", "depth": 1, "forward_ms": 3.0, "backward_ms": 6.0}]
    modules += [{"name": n, "depth": 2, "forward_ms": ms / 3, "backward_ms": 2 * ms / 3} for n, ms in layers.items()]
    return {"step": STEPS[i], "forward_ms": 30.0 + i, "backward_ms": 60.0 + 2 * i, "optimizer_ms": 5.0,
            "busy_ms": 95.0 + 3 * i, "span_ms": 99.0 + 3 * i, "step_ms": step_ms, "window_steps": 4,
            "achieved_tflops": 300.0 + i, "mfu": {"measured": MFU_MEASURED[i], "datasheet": MFU_DATASHEET[i]},
            "modules": modules, "timer": "kernels" if i == 0 else "events", "host_lead": None if i == 0 else i != 3}


def continuous_series() -> dict:
    profiles = [_profile(i) for i in range(len(STEPS))] + [{"step": FAILED_STEP, "error": "RuntimeError: no CUPTI"}]
    return {"every_n_steps": EVERY, "interval_steps": EVERY, "max_profiles": 256, "window_steps": 4,
            "taken": len(profiles), "method": "test", "profiles": profiles}


def make_continuous_report(run_id: str = CONTINUOUS_RUN_ID) -> dict:
    """A run whose flops profiler took a profile every 100 steps in case seq128 (one of them failed)."""
    data = make_report(run_id, CONTINUOUS_SUITE)
    data["profilers"]["flops"][CASE]["continuous"] = continuous_series()
    return data


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("continuous_reports")
    write_run(root, make_continuous_report())
    write_run(root, make_report(PLAIN_RUN, CONTINUOUS_SUITE))
    broken = make_continuous_report("20261210T100000Z-broken")
    broken["profilers"]["flops"][CASE]["continuous"]["profiles"] = "not a list"
    write_run(root, broken)
    return RunStore(root)


def _series(data: dict | None = None):
    return frames.flops_series(report_from_dict(data or make_continuous_report()), case=CASE, strict=True)


def test_rows_per_profile_in_step_order():
    rows = continuous_view.model_rows(_series())
    assert [r["step"] for r in rows] == [*STEPS, FAILED_STEP]
    assert [r["mfu_measured_pct"] for r in rows[:4]] == pytest.approx([100 * m for m in MFU_MEASURED])
    assert rows[1]["device_ms"] == pytest.approx(31.0 + 62.0) and rows[1]["step_ms"] == 101.0
    assert rows[4]["error"] == "RuntimeError: no CUPTI" and rows[4]["mfu_measured_pct"] is None
    assert [r["timer"] for r in rows] == ["kernels", "events", "events", "events", None]
    assert [r["host_ahead"] for r in rows] == [None, "yes", "yes", "no", None]


def test_mfu_figure_draws_each_peak_over_the_steps():
    fig = continuous_view.mfu_figure(_series(), "t")
    assert [t.name for t in fig.data] == ["MFU, measured peak", "MFU, datasheet peak"]
    for trace, values in zip(fig.data, (MFU_MEASURED, MFU_DATASHEET)):
        assert list(trace.x) == list(STEPS)  # the failed profile has no point
        assert list(trace.y) == pytest.approx([100 * v for v in values])


def test_mfu_figure_without_peaks_draws_tflops():
    data = make_continuous_report()
    for p in data["profilers"]["flops"][CASE]["continuous"]["profiles"]:
        p["mfu"] = {"measured": None, "datasheet": None}
    fig = continuous_view.mfu_figure(_series(data), "t")
    assert [t.name for t in fig.data] == ["achieved TFLOP/s"]
    assert list(fig.data[0].y) == [300.0, 301.0, 302.0, 303.0]
    assert "no peak" in fig.layout.yaxis.title.text


def test_module_figure_has_a_line_per_top_module_with_gaps():
    series = _series()
    names = continuous_view.top_modules(series)
    assert names[:2] == ["layers", "layers.1"] and set(names) == {"layers", "layers.1", "layers.2", "lm_head",
                                                                  "layers.0"}
    fig = continuous_view.module_time_figure(series, "t")
    traces = {t.name: t for t in fig.data}
    assert list(traces["layers"].x) == list(STEPS)
    assert list(traces["layers"].y) == pytest.approx([75.0 + 3 * i for i in range(4)])
    assert list(traces["layers.2"].y) == pytest.approx([25.0, 29.0, None, 37.0])
    assert list(traces["layers.0"].y) == [None, None, pytest.approx(24.0), None]
    assert continuous_view.module_time_figure(series, "t", limit=2).data[1].name == "layers.1"


def test_section_only_for_runs_with_a_series():
    report = report_from_dict(make_continuous_report())
    data = report.profilers["flops"][CASE]
    assert continuous_view.section(report, CASE, report.profilers["flops"]["seq512"]) == []
    assert continuous_view.section(report, CASE, copy.deepcopy({**data, "continuous": None})) == []
    shown = str(continuous_view.section(report, CASE, data))
    assert "a profile every 100 steps" in shown and "flops-continuous-mfu" in shown


def test_flops_tab_shows_the_series(store):
    page = str(render(store, f"/run/{CONTINUOUS_SUITE}/{CONTINUOUS_RUN_ID}/flops"))
    assert all(i in page for i in ("flops-continuous-mfu", "flops-continuous-modules", "flops-continuous'"))
    assert "could not be drawn" not in page
    other_case = str(render(store, f"/run/{CONTINUOUS_SUITE}/{CONTINUOUS_RUN_ID}/flops", "?case=seq512"))
    plain = str(render(store, f"/run/{CONTINUOUS_SUITE}/{PLAIN_RUN}/flops"))
    assert "flops-continuous" not in other_case and "flops-continuous" not in plain
    broken = str(render(store, f"/run/{CONTINUOUS_SUITE}/20261210T100000Z-broken/flops"))
    assert "Over the run (a profile every 100 steps): could not be drawn" in broken
    assert "flops.continuous.profiles should be a list" in broken and "flops-treemap" in broken
