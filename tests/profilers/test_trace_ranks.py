"""The Perfetto trace of a multi-rank report puts every rank of every case on a process track of
its own holding all that rank's collectives (the largest dashboard fixture: four ranks of a ZeRO
run, thousands of calls), and lays the profiled step out by the device time of each module's
kernels where the profile has device-time records."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dashboards"))

from test_trace import parse, slices  # noqa: E402

from dslab.profilers.trace import build_trace  # noqa: E402
from dslab.report import read_report  # noqa: E402

ZERO_RUN = Path(__file__).resolve().parents[1] / "dashboards/fixtures/zero_reports/zero/20261128T212522Z-68abb2"


@pytest.fixture(scope="module")
def zero():
    report = read_report(ZERO_RUN)
    return report, parse(build_trace(report))


def test_every_rank_has_a_process_with_all_its_collectives(zero):
    report, tracks = zero
    checked = 0
    for case, comms in report.profilers["comms"].items():
        for rank, records in comms["per_rank"].items():
            process = tracks[f"{case} rank {rank}"]
            calls = [c for name, events in process.items() if name.startswith("collectives") for c in slices(events)]
            assert len(calls) == len(records), (case, rank)
            assert sorted(c[3]["seq"] for c in calls) == sorted(r["seq"] for r in records)
            checked += bool(records)
    assert checked >= 13  # the n4 cases' four ranks and the n1 cases' one that logged calls


def test_the_profiled_step_is_laid_out_by_device_time(zero):
    report, tracks = zero
    case = "355m-n4 dslab-zero2"
    flops = report.profilers["flops"][case]
    spans = slices(tracks[f"{case} rank 0"]["profiled step"])
    phases = {s[0]: s for s in spans if s[4] == 0}
    for phase in ("forward", "backward", "optimizer"):
        name, begin, end, args, _ = phases[phase]
        assert end - begin == pytest.approx(flops["device_time"][f"{phase}_ms"] * 1e6, abs=1)
        assert args["timed_by"] == "device kernels" and args["step"] == flops["device_time"]["step"]
    module = next(m for m in flops["modules"] if m["name"] == "layers.0.mlp.fc_in")
    (fwd,) = [s for s in spans if s[0] == module["name"] and s[1] < phases["forward"][2]]
    assert fwd[2] - fwd[1] == pytest.approx(module["forward_device_ms"] * 1e6, abs=1)
