"""The Comms tab's gradient-overlap section: the view functions on overlap records built by the
producer's own arithmetic (:func:`dslab.profilers.comms_overlap.summarize_overlap`), the tab on the
committed three-rank comms report with such records added (and without them), and in Chromium the
table of buckets."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
from report_factory import serve_dashboard

from dashboards import comms_tab, comms_view
from dslab.profilers.comms_overlap import OVERLAP_DEFINITIONS, summarize_overlap
from dslab.report import read_report

FIXTURES = Path(__file__).parent / "fixtures" / "comms_reports"
SUITE, RUN_ID, CASE = "gpt2", "20261126T020306Z-cbf34f", "124m"
PHASES = {"forward_begin": 0.0, "backward_begin": 10.0, "backward_end": 30.0, "optimizer_begin": 42.0,
          "step_end": 50.0}
# bucket 1 is issued first; bucket 2 runs past backward's end; bucket 3 is untimed
CALLS = [
    {"bucket": 1, "op": "all_reduce", "bytes": 4_000_000, "group": "0,1,2", "seq": 4, "issue_ms": 11.0,
     "start_ms": 11.5, "end_ms": 19.0},
    {"bucket": 0, "op": "all_reduce", "bytes": 2_500_000, "group": "0,1,2", "seq": 5, "issue_ms": 12.0,
     "start_ms": 12.0, "end_ms": 20.0},
    {"bucket": 2, "op": "all_reduce", "bytes": 1_000_000, "group": "0,1,2", "seq": 6, "issue_ms": 25.0,
     "start_ms": 25.0, "end_ms": 41.0},
    {"bucket": 3, "op": "all_reduce", "bytes": 500_000, "group": "0,1,2", "seq": 7, "issue_ms": 29.0,
     "start_ms": None, "end_ms": None},
]


def _overlap(shift_ms: float = 0.0) -> dict:
    calls = [dict(c, end_ms=None if c["end_ms"] is None else c["end_ms"] + shift_ms) for c in CALLS]
    return summarize_overlap(PHASES, PHASES, calls, clock="host", step=3)


def _comms_record(ranks=(0, 1, 2)) -> dict:
    return {"per_rank": {str(r): _overlap(shift_ms=r) for r in ranks}, "definitions": OVERLAP_DEFINITIONS}


def test_rows_are_in_issue_order_with_units():
    rows = comms_view.overlap_rows(_overlap())
    assert [r["bucket"] for r in rows] == [1, 0, 2, 3]
    assert [r["mb"] for r in rows] == [4.0, 2.5, 1.0, 0.5]
    assert [(r["overlapped_ms"], r["exposed_ms"]) for r in rows] == [(7.5, 0.0), (8.0, 0.0), (5.0, 11.0),
                                                                    (None, None)]
    assert [key for key, _ in comms_view.OVERLAP_COLUMNS] == ["bucket", "op", "mb", "issue_ms", "start_ms", "end_ms",
                                                              "overlapped_ms", "exposed_ms"]
    assert all("(ms" in label for key, label in comms_view.OVERLAP_COLUMNS if key.endswith("_ms"))


def test_summary_line_states_hidden_and_exposed():
    line = comms_view.overlap_summary(_overlap(), 0)
    # union of [11.5, 20] and [25, 41]: 8.5 + 5 ms inside backward [10, 30], 11 ms after it
    assert line == ("rank 0, step 3: 13.5 of 24.5 ms of gradient communication hidden behind backward (20 ms); "
                    "11 ms exposed.")


def test_ranks_read_and_malformed_records_refused():
    data = {"rank": 1, "overlap": _comms_record()}
    ranks = comms_view.overlap_ranks(data)
    assert list(ranks) == [0, 1, 2]
    assert comms_view.overlap_rank(ranks, 1) == 1 and comms_view.overlap_rank(ranks, 7) == 0
    assert comms_view.overlap_ranks({"rank": 0}) == {}
    bad = copy.deepcopy(data)
    bad["overlap"]["per_rank"]["0"]["buckets"] = "none"
    with pytest.raises(ValueError, match=r"per_rank\.0\.buckets should be a list"):
        comms_view.overlap_ranks(bad)
    with pytest.raises(ValueError, match="not an integer"):
        comms_view.overlap_ranks({"overlap": {"per_rank": {"x": _overlap()}}})


def test_timeline_splits_each_bucket_at_backward_end():
    fig = comms_view.overlap_timeline(_overlap(), 0, CASE)
    traces = {t.name: t for t in fig.data}
    assert [t.name for t in fig.data][:4] == ["forward", "backward", "gradient wait", "optimizer"]
    assert list(traces["backward"].base) == [10.0] and list(traces["backward"].x) == [20.0]
    hidden, exposed = traces["overlapped with backward"], traces["exposed"]
    assert list(hidden.y) == ["bucket 1 all_reduce", "bucket 0 all_reduce", "bucket 2 all_reduce"]
    assert list(zip(hidden.base, hidden.x)) == [(11.5, 7.5), (12.0, 8.0), (25.0, 5.0)]
    assert list(exposed.y) == ["bucket 2 all_reduce"] and list(zip(exposed.base, exposed.x)) == [(30.0, 11.0)]
    assert list(fig.layout.yaxis.categoryarray) == ["compute", "bucket 1 all_reduce", "bucket 0 all_reduce",
                                                    "bucket 2 all_reduce", "bucket 3 all_reduce"]


def _report_with_overlap(tmp_path: Path, overlap: dict | None) -> Path:
    run = tmp_path / SUITE / RUN_ID
    shutil.copytree(FIXTURES / SUITE / RUN_ID, run)
    doc = json.loads((run / "run.json").read_text())
    if overlap is not None:
        doc["profilers"]["comms"][CASE]["overlap"] = overlap
    (run / "run.json").write_text(json.dumps(doc))
    return run


def test_tab_shows_the_section_only_when_the_record_has_it(tmp_path):
    page = str(comms_tab.comms_tab(read_report(_report_with_overlap(tmp_path / "with", _comms_record())),
                                   SUITE, RUN_ID, CASE))
    assert "Gradient communication against backward" in page and "comms-overlap-buckets" in page
    assert "rank 1, step 3" in page and "could not be drawn" not in page
    page = str(comms_tab.comms_tab(read_report(_report_with_overlap(tmp_path / "without", None)), SUITE, RUN_ID, CASE))
    assert "Gradient communication against backward" not in page and "comms-overlap" not in page


@pytest.fixture(scope="module")
def overlap_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap_reports")
    _report_with_overlap(root, _comms_record())
    yield from serve_dashboard(root)


@pytest.mark.browser
def test_browser_table_shows_the_buckets(browser, overlap_server, tmp_path):
    from test_dashboard_browser import _load, _severe, _text, _wait

    browser.get_log("browser")
    _load(browser, f"{overlap_server}/run/{SUITE}/{RUN_ID}/comms", tmp_path, "comms_overlap")
    assert "13.5 of 24.5 ms of gradient communication hidden behind backward" in _text(browser)
    columns = [key for key, _ in comms_view.OVERLAP_COLUMNS]
    rows = _wait(browser).until(lambda d: d.execute_script(
        "return Array.from(document.querySelectorAll('#comms-overlap-buckets tbody tr'))"
        ".map(r => Object.fromEntries(arguments[0].map(c => [c, r.querySelector('[data-field=\"' + c + '\"]').innerText])))",
        columns))
    assert [r["bucket"] for r in rows] == ["1", "0", "2", "3"]
    assert [r["exposed_ms"] for r in rows][:3] == ["0", "0", "11"]
    headers = browser.execute_script(
        "return Array.from(document.querySelectorAll('#comms-overlap-buckets th')).map(e => e.innerText)")
    assert headers == [label for _, label in comms_view.OVERLAP_COLUMNS]
    bars = browser.execute_script(
        "const g = document.querySelector('#comms-overlap .js-plotly-plot');"
        "return g && g._fullData ? g._fullData.map(t => t.name) : null")
    assert bars[-2:] == ["overlapped with backward", "exposed"]
    assert _severe(browser) == []
