"""``dslab report plot``: PNG figures of a run's main views, matplotlib imported only when drawing."""

from __future__ import annotations

import subprocess
import sys

import pytest
from report_factory import make_report, partial_report, write_run

from dashboards.plots import write_plots
from dslab import cli
from dslab.report import report_from_dict

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_ID = "20261120T100000Z-aaaa00"


def one_case(data: dict, case: str = "seq128") -> dict:
    """``data`` cut to one case (half the figures to draw)."""
    data["results"] = [r for r in data["results"] if not isinstance(r, dict) or r.get("case") == case]
    for name, section in data["profilers"].items():
        if isinstance(section, dict):
            data["profilers"][name] = {c: v for c, v in section.items() if c == case}
    return data


def test_plots_of_every_view(tmp_path):
    written, warnings = write_plots(report_from_dict(one_case(make_report(RUN_ID))), tmp_path / "plots")
    assert warnings == []
    assert sorted(p.name for p in written) == [f"{v}_seq128.png" for v in ("arms", "comms", "flops", "memory", "telemetry")]
    for path in written:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, path.name
    assert not [p for p in (tmp_path / "plots").iterdir() if p.name.startswith(".")]


def test_a_case_without_profiler_records_gets_only_its_arms(tmp_path):
    data = make_report(RUN_ID)
    data["profilers"] = {name: {"seq128": section["seq128"]} for name, section in data["profilers"].items()}
    data["profilers"]["memory"] = {"seq512": make_report(RUN_ID)["profilers"]["memory"]["seq512"]}
    written, warnings = write_plots(report_from_dict(data), tmp_path)
    assert warnings == []
    assert sorted(p.name for p in written) == ["arms_seq128.png", "arms_seq512.png", "comms_seq128.png",
                                               "flops_seq128.png", "memory_seq512.png", "telemetry_seq128.png"]


def test_malformed_sections_become_warnings(tmp_path):
    written, warnings = write_plots(report_from_dict(one_case(partial_report())), tmp_path)
    assert [p.name for p in written] == ["arms_seq128.png"]
    assert any(w.startswith("flops of seq128") and "should be a list" in w for w in warnings)
    assert any(w.startswith("memory of seq128") for w in warnings)


def test_report_plot_command(tmp_path, capsys):
    data = one_case(make_report(RUN_ID))
    data["profilers"] = {"flops": data["profilers"]["flops"]}
    write_run(tmp_path, data)
    out = tmp_path / "figures"
    assert cli.main(["report", "plot", RUN_ID, "--reports", str(tmp_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / "arms_seq128.png"), str(out / "flops_seq128.png")]
    assert cli.main(["report", "plot", "20991231T000000Z-000000", "--reports", str(tmp_path)]) == 1


def test_no_heavy_imports_at_import_or_help_time():
    code = ("import sys, contextlib, io\n"
            "import dashboards.plots, dashboards.views, dashboards.data\n"
            "from dslab import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    cli.main(['--help'])\n"
            "print(sorted(m for m in ('matplotlib', 'dash', 'plotly', 'torch', 'perfetto') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["report", "plot"], ["dashboard", "--port", "x"], ["trace"]])
def test_usage_errors(argv, capsys):
    assert cli.main(argv) == 2
    assert "usage: dslab" in capsys.readouterr().err
