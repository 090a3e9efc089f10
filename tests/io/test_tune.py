"""``dslab nvme-tune``: sizes and sweep spaces, fio's output, the successive-halving rounds, and
the command on a few MiB writing a report that the dashboard's I/O page shows."""

from __future__ import annotations

import json
import shutil

import pytest

from dslab import cli
from dslab.io import fio as fio_runner
from dslab.io import tune
from dslab.report import find_run, read_report

FIO_JSON = """note: both iodepth >= 1 and synchronous I/O engine are selected
{"fio version": "fio-3.33", "jobs": [{"jobname": "dslab-nvme-tune-read", "error": 0,
 "read": {"bw_bytes": 1478983228, "runtime": 726}, "write": {"bw_bytes": 0}}]}"""


@pytest.mark.parametrize("text, expected", [("1G", 1 << 30), ("256M", 256 << 20), ("4096", 4096),
                                            ("512KiB", 512 << 10), ("1.5g", 3 << 29), ("8mb", 8 << 20)])
def test_sizes_read_as_fio_reads_them(text, expected):
    assert tune.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "1X", "-1G", "0", "0.3K", "G"])
def test_bad_sizes_name_the_option(text):
    with pytest.raises(ValueError, match="--size"):
        tune.parse_size(text)


def test_the_default_space_and_its_errors(tmp_path):
    configs = tune.sweep_configs()
    assert len(configs) == 3 * 3 * 3 * 2 * 2 == len(set(configs))
    assert tune.sweep_configs({"block_size": [1 << 20], "queue_depth": [8]})[0].aio()["block_size"] == 1 << 20
    with pytest.raises(ValueError, match="unknown sweep key 'queue_dept'; did you mean 'queue_depth'"):
        tune.sweep_configs({"queue_dept": [8]})
    with pytest.raises(ValueError, match="'block_size' must be a non-empty list"):
        tune.sweep_configs({"block_size": 4096})
    with pytest.raises(ValueError, match="multiple of 4096"):
        tune.sweep_configs({"block_size": [5000]})
    bad = tmp_path / "sweep.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="--sweep-config .*sweep.json must hold a JSON object"):
        tune.load_sweep_config(bad)
    with pytest.raises(FileNotFoundError, match="--sweep-config .*missing.json"):
        tune.load_sweep_config(tmp_path / "missing.json")


def test_fio_output_and_command():
    assert fio_runner.parse_fio_json(FIO_JSON, "read") == pytest.approx(1.478983228)
    with pytest.raises(ValueError, match="jobs\\[0\\].write.bw_bytes|no JSON"):
        fio_runner.parse_fio_json("fio: no such file", "write")
    command = fio_runner.fio_command("fio", "/x/f", 1 << 30, "write", bs=4 << 20, iodepth=64)
    assert {"--ioengine=libaio", "--direct=1", "--bs=4194304", "--iodepth=64", "--rw=write",
            "--size=1073741824", "--filename=/x/f"} <= set(command)
    with pytest.raises(ValueError, match="unknown fio job key 'depth'"):
        fio_runner.fio_command("fio", "/x/f", 1, "read", depth=3)
    # several jobs split the file in whole pages and report as one
    split = fio_runner.fio_command("fio", "/x/f", 1 << 30, "read", numjobs=4, iodepth=16, ioengine="io_uring")
    assert {"--size=268435456", "--offset_increment=268435456", "--group_reporting", "--numjobs=4",
            "--ioengine=io_uring"} <= set(split)
    with pytest.raises(ValueError, match="numjobs must be >= 1"):
        fio_runner.fio_command("fio", "/x/f", 1 << 20, "read", numjobs=0)


def test_matched_fio_jobs_follow_the_configuration(tmp_path):
    config = tune.sweep_configs({"block_size": [1 << 20], "queue_depth": [8], "intra_op_parallelism": [4],
                                 "single_submit": [False], "overlap_events": [True]})[0]
    jobs = tune._Fio(tmp_path / "f", 1 << 20, lambda _: None, []).matched_jobs(config)
    assert {(j["ioengine"], j["iodepth"], j["numjobs"]) for j in jobs} == {
        ("libaio", 32, 1), ("libaio", 8, 4), ("io_uring", 32, 1), ("io_uring", 8, 4)}
    assert all(j["bs"] == 1 << 20 for j in jobs)


def test_the_tuner_transfers_random_bytes_not_zeros(tmp_path):
    """A virtual disk may keep zero blocks as holes and read them back without the drive."""
    buffer = tune._Bench(tmp_path / "f", 1 << 16, "cpu").buffer
    assert (buffer == 0).float().mean() < 0.01


def test_rounds_drop_the_clearly_worse():
    assert tune._rounds(4, 3) == [(1.0, 3)]
    assert tune._rounds(5, 3) == [(0.25, 1), (0.5, 2), (1.0, 3)]
    configs = tune.sweep_configs({"queue_depth": [1, 2, 3, 4, 5, 6]})[:6]
    rows = [tune.Measured(c, "read", trials=[v]) for c, v in zip(configs, [10, 9.5, 9.0, 7.9, 8.5, 1])]
    kept = tune._survivors(rows, 4, 1)
    # the top four, less the one under 80% of the best (7.9 < 8.0)
    assert [m.median for m in kept] == [10, 9.5, 9.0, 8.5]
    assert [m.dropped_after for m in rows] == [None, None, None, 1, None, 1]


def test_nvme_tune_on_a_few_mib_writes_a_report_the_dashboard_shows(tmp_path, capsys):
    target = tmp_path / "disk"
    target.mkdir()
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"block_size": [65536], "queue_depth": [2, 8],
                                 "intra_op_parallelism": [2], "single_submit": [False],
                                 "overlap_events": [True]}))
    reports = tmp_path / "reports"
    code = cli.main(["nvme-tune", "--path", str(target), "--size", "4M", "--trials", "2",
                     "--sweep-config", str(sweep), "--out", str(reports)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert list(target.iterdir()) == []  # the test file is gone
    assert "[nvme-tune] round 1/1: 2 configurations, 4M x 2 trial(s) each" in err
    assert '"aio": {' in out and '"block_size": 65536' in out
    with_fio = shutil.which("fio") is not None
    assert ("fio matched" in out) and (("note: fio is not installed" in out) != with_fio)
    report = read_report(find_run(reports, "nvme_tune/" + out.rsplit("/", 2)[-2]))
    record = report.profilers["io"]["tune"]
    assert record["kind"] == "tune" and record["file_bytes"] == 4 << 20 and record["direct_io"]
    assert {(r["op"], r["queue_depth"]) for r in record["configs"]} == {
        ("read", 2), ("read", 8), ("write", 2), ("write", 8)}
    assert all(len(r["trials"]) == 2 and r["GBps"] > 0 for r in record["configs"])
    assert {(r.case, r.arm) for r in report.results} >= {("read", "dslab"), ("write", "dslab")}
    if with_fio:
        matched = record["fio"]["matched"]["write"]
        assert record["fio"]["read"]["GBps"] > 0 and matched["iodepth"] * matched["numjobs"] in (4, 16)
        assert matched["GBps"] == max(v["GBps"] for v in matched["variants"])
        assert {(v["iodepth"], v["numjobs"]) for v in matched["variants"]} <= {(4, 1), (2, 2), (16, 1), (8, 2)}

    from dashboards.app import render
    from dashboards.data import RunStore

    page = str(render(RunStore(reports), f"/run/nvme_tune/{report.run_id}/io"))
    assert "Configuration x GB/s" in page and "bs=64K qd=8 p=2 ss=0 oe=1" in page
    assert "Best configuration beside fio" in page and "could not be drawn" not in page


def test_nvme_tune_refuses_bad_input_by_name(tmp_path, capsys):
    assert cli.main(["nvme-tune", "--path", str(tmp_path / "nowhere"), "--size", "4M"]) == 1
    assert "--path" in capsys.readouterr().err
    assert cli.main(["nvme-tune", "--path", str(tmp_path), "--size", "5000", "--no-fio"]) == 1
    assert "--size must be a positive multiple of 4096" in capsys.readouterr().err
    assert cli.main(["nvme-tune", "--path", str(tmp_path), "--trials", "0"]) == 1
    assert "--trials must be >= 1" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_io_page_shows_an_engine_runs_swaps(tmp_path):
    from dashboards import io_view
    from dashboards.app import render
    from dashboards.data import RunStore
    from dslab.io.events import IoEvent, IoRecorder
    from dslab.report import RunReport, frames, write_report

    recorder = IoRecorder()
    for step in range(3):
        recorder.on_io(IoEvent("swap_out", "/nvme/chunk00000.states", 8 << 20, 0.004, step=step))
        recorder.on_io(IoEvent("swap_in", "/nvme/chunk00000.states", 8 << 20, 0.008, wait_s=0.001, step=step))
    recorder.on_io(IoEvent("checkpoint_write", "/ckpt/model.pt", 3 << 20, 0.01))
    record = recorder.records()
    report = RunReport(run_id="20261125T000000Z-abcdef", suite="gpt2", status="complete")
    report.profilers["io"] = {"124m": record}
    rows = {r["kind"]: r for r in io_view.operation_rows(frames.io_records(report, case="124m", strict=True))}
    assert rows["swap_in"]["count"] == 3 and rows["swap_in"]["GBps"] == pytest.approx(8 * 2**20 / 0.008 / 1e9)
    assert rows["swap_in"]["waited_s"] == pytest.approx(0.003)
    write_report(report, tmp_path)
    page = str(render(RunStore(tmp_path), f"/run/gpt2/{report.run_id}/io"))
    assert "Storage I/O of the run" in page and "checkpoint_write" in page and "swap_in" in page
