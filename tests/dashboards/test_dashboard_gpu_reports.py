"""The dashboard, the trace and the plots on real suite reports: ``dslab bench suites/bert_large``
and ``suites/gpt2`` (124m and 1.5b) at full scale on an H100, every profiler on, kept as fixtures
under ``fixtures/gpu_reports``. Every page of every case renders in Chromium without console
errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from report_factory import serve_dashboard

FIXTURES = Path(__file__).parent / "fixtures" / "gpu_reports"
RUNS = {"bert_large/20261123T195220Z-eb4df9": ("seq128", "seq512"),
        "gpt2/20261123T200744Z-0aa422": ("124m", "1.5b")}
# Five arms (torch-compile-ro too), flops profiles with per-module device time and the steady state.
RUNS_V2 = {"bert_large/20261125T002038Z-fe42e8": ("seq128", "seq512")}
TABS = [("flops", 2, "Module types per depth"), ("memory", 1, "Memory"),
        ("telemetry", 1, "Time series per GPU"), ("io", 0, "I/O")]


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_screenshots")


@pytest.fixture(scope="module")
def gpu_reports(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpu_reports")
    shutil.copytree(FIXTURES, root, dirs_exist_ok=True)
    return root


@pytest.fixture(scope="module")
def gpu_server(gpu_reports):
    yield from serve_dashboard(gpu_reports)


@pytest.mark.browser
@pytest.mark.parametrize("run", sorted({**RUNS, **RUNS_V2}))
def test_every_page_of_a_real_suite_report_renders(browser, gpu_server, shots, run):
    from test_dashboard_browser import _check_page

    suite = run.split("/")[0]
    page = _check_page(browser, gpu_server, shots, f"gpu_{suite}", f"/run/{run}", 4, "Arms")
    cases = {**RUNS, **RUNS_V2}[run]
    assert "H100" in page and all(case in page for case in cases)
    for case in cases:
        for tab, graphs, text in TABS:
            name = f"gpu_{suite}_{case}_{tab.strip('/')}"
            _check_page(browser, gpu_server, shots, name, f"/run/{run}/{tab}?case={case}", graphs, text)
        # One process: the comms logger saw no collective, and the page says so instead of
        # drawing empty charts.
        from test_dashboard_browser import _load, _severe

        browser.get_log("browser")
        _load(browser, f"{gpu_server}/run/{run}/comms?case={case}", shots, f"gpu_{suite}_{case}_comms")
        text = browser.find_element("id", "page").text
        assert "no timed collectives" in text and "could not be drawn" not in text
        assert _severe(browser) == []


@pytest.mark.browser
def test_runs_page_lists_both_suites(browser, gpu_server, shots):
    from test_dashboard_browser import _check_page

    text = _check_page(browser, gpu_server, shots, "gpu_runs", "/", 1, "Runs (3)")
    assert "bert_large" in text and "gpt2" in text


def test_trace_and_plots_of_real_reports(gpu_reports, tmp_path):
    from dashboards.plots import write_plots
    from dslab.profilers.trace import write_trace
    from dslab.report import read_report

    for run, cases in {**RUNS, **RUNS_V2}.items():
        trace = write_trace(gpu_reports / run)
        assert trace.name == "trace.pftrace" and trace.stat().st_size > 1000
        written, warnings = write_plots(read_report(gpu_reports / run / "run.json"), tmp_path / run)
        assert warnings == []
        names = " ".join(p.name for p in written)
        assert all(case in names for case in cases), names


def test_real_reports_of_schema_1_show_their_best_plain_arm(gpu_reports):
    """Written before reports stored the best plain arm: it is derived on reading, and the Run page
    shows it."""
    from dashboards import views
    from dashboards.app import render
    from dashboards.data import RunStore
    from dslab.report import frames, read_report

    for run, cases in RUNS.items():
        report = read_report(gpu_reports / run / "run.json")
        assert report.schema_version == 1 and not report.missing
        rows = {r["case"]: r for r in views.best_plain_rows(frames.results(report))}
        assert set(rows) == set(cases)
        for case, row in rows.items():
            # torch-compile was the fastest plain arm of every case of these runs
            assert row["best_plain_arm"] == "torch-compile"
            assert row["dslab_over_best_plain"] == report.ratios[case]["dslab/torch-compile"]
        text = str(render(RunStore(gpu_reports), f"/run/{run}"))
        assert "best-plain-table" in text and "could not be drawn" not in text
