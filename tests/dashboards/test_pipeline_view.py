"""The Pipeline tab without a browser: the utilisation figure and table carry the report's busy and
idle times and the bubble, the timeline one bar per forward and backward of each stage's latest
batch; the tab is shown only for runs with pipeline records."""

from __future__ import annotations

import pytest
from report_factory import (
    PIPELINE_BUSY,
    PIPELINE_CASE,
    PIPELINE_RUN_ID,
    PIPELINE_TIMELINES,
    make_pipeline_report,
    make_report,
    write_run,
)

from dashboards import pipeline_view
from dashboards.app import render
from dashboards.data import RunStore
from dslab.report import report_from_dict

PLAIN_RUN = "20261205T100000Z-plain0"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_reports")
    write_run(root, make_pipeline_report())
    write_run(root, make_report(PLAIN_RUN, "gpt2"))
    return RunStore(root)


def test_utilisation_rows_and_figure():
    record = pipeline_view.records(report_from_dict(make_pipeline_report()))[PIPELINE_CASE]
    rows = pipeline_view.utilisation_rows(record)
    for row, (stage, (busy, wall)) in zip(rows, PIPELINE_BUSY.items()):
        assert row["stage"] == stage and row["busy_ms"] == busy and row["wall_ms"] == wall
        assert row["idle_pct"] == pytest.approx(100 * (1 - busy / wall), abs=0.05)
        assert row["over_bubble_pts"] == pytest.approx(100 * (1 - busy / wall - 1 / 3), abs=0.05)
    fig = pipeline_view.utilisation_figure(record, "t")
    busy, idle = fig.data
    assert list(busy.y) == [60.0, 70.0] and list(idle.y) == [40.0, 30.0]
    assert fig.layout.shapes[0].y0 == pytest.approx(100 * 2 / 3)


def test_timeline_has_a_bar_per_forward_and_backward():
    record = pipeline_view.records(report_from_dict(make_pipeline_report()))[PIPELINE_CASE]
    fig = pipeline_view.timeline_figure(record, "t")
    forward, backward = fig.data
    expected = [(f"stage {s}", start, end - start, f"F{i}") for s, spans in PIPELINE_TIMELINES.items()
                for kind, i, start, end in spans if kind == "forward"]
    assert list(zip(forward.y, forward.base, forward.x, forward.text)) == expected
    assert len(backward.y) == 4 and set(backward.text) == {"B0", "B1"}


def test_the_tab_shows_only_for_pipeline_runs(store):
    page = str(render(store, f"/run/parallel/{PIPELINE_RUN_ID}/pipeline"))
    assert "pipeline-utilisation" in page and "pipeline-timeline" in page and "pipeline-stages" in page
    assert "could not be drawn" not in page
    assert "/pipeline" in str(render(store, f"/run/parallel/{PIPELINE_RUN_ID}"))
    assert "/pipeline" not in str(render(store, f"/run/gpt2/{PLAIN_RUN}"))
    assert "pipeline-empty" in str(render(store, f"/run/gpt2/{PLAIN_RUN}/pipeline"))
