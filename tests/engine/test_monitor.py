"""CSV and TensorBoard monitors (dslab.engine.monitor)."""

import csv
import random
import sys
import warnings

import pytest

from dslab.config_base import parse_section
from dslab.engine.monitor import CSVMonitorConfig, Monitor, TensorBoardConfig, metric_file_name

LOSS, LR, SCALE = "Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/loss_scale"


def random_events(steps, seed):
    rng = random.Random(seed)
    events = []
    for step in steps:
        events += [(LOSS, rng.uniform(0.1, 5.0), step), (LR, rng.uniform(1e-5, 1e-3), step),
                   (SCALE, float(2 ** rng.randint(8, 16)), step)]
    return events


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


# --- config -----------------------------------------------------------------------------------

def test_config_sections_take_deepspeed_keys():
    for model, key in ((CSVMonitorConfig, "csv_monitor"), (TensorBoardConfig, "tensorboard")):
        default = model()
        assert (default.enabled, default.output_path, default.job_name) == (False, "", "dslab_job")
        cfg = parse_section(model, {"enabled": True, "output_path": "/tmp/x", "job_name": "j"},
                            key)
        assert (cfg.enabled, cfg.output_path, cfg.job_name) == (True, "/tmp/x", "j")
        typo = f"unknown config key '{key}.job_nme'.*'{key}.job_name'"
        with pytest.raises(ValueError, match=typo):
            parse_section(model, {"job_nme": "j"}, key)
        with pytest.raises(ValueError, match=f"config key '{key}.job_name': must not be empty"):
            parse_section(model, {"job_name": " "}, key)
        with pytest.raises(ValueError, match=f"{key}.enabled"):
            parse_section(model, {"enabled": "sometimes"}, key)


def test_metric_file_name():
    assert metric_file_name(LOSS) == "Train_Samples_train_loss.csv"


# --- CSV --------------------------------------------------------------------------------------

def test_csv_writes_one_file_per_metric(tmp_path):
    csv_cfg = CSVMonitorConfig(enabled=True, output_path=str(tmp_path / "out"), job_name="run1")
    monitor = Monitor(csv_cfg, TensorBoardConfig(), rank=0)
    assert monitor.enabled
    first, second = random_events([1, 2], seed=1), random_events([3], seed=2)
    monitor.write_events(first)
    monitor.write_events(second)
    directory = tmp_path / "out" / "run1"
    assert monitor.csv_dir == directory
    assert sorted(p.name for p in directory.iterdir()) == [
        "Train_Samples_loss_scale.csv", "Train_Samples_lr.csv", "Train_Samples_train_loss.csv"]
    for name in (LOSS, LR, SCALE):
        rows = read_csv(directory / metric_file_name(name))
        expected = [(s, v) for n, v, s in first + second if n == name]
        assert rows[0] == ["step", name]
        assert [(int(s), float(v)) for s, v in rows[1:]] == expected
    monitor.close()
    monitor.close()


def test_csv_rows_are_on_disk_before_close_and_resume_appends(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = CSVMonitorConfig(enabled=True)
    monitor = Monitor(cfg, TensorBoardConfig(), rank=0)
    monitor.write_events([(LOSS, 1.5, 10)])
    path = tmp_path / "csv_monitor" / "dslab_job" / metric_file_name(LOSS)
    assert read_csv(path) == [["step", LOSS], ["10", "1.5"]]   # flushed, not yet closed
    monitor.close()

    with Monitor(cfg, TensorBoardConfig(), rank=0) as resumed:
        resumed.write_events([(LOSS, 0.25, 11)])
    assert read_csv(path) == [["step", LOSS], ["10", "1.5"], ["11", "0.25"]]


def test_bad_events(tmp_path):
    monitor = Monitor(CSVMonitorConfig(enabled=True, output_path=str(tmp_path)),
                      TensorBoardConfig(), rank=0)
    with pytest.raises(ValueError, match="events"):
        monitor.write_events((LOSS, 1.0, 1))
    with pytest.raises(ValueError, match=r"events\[1\]"):
        monitor.write_events([(LOSS, 1.0, 1), (LOSS, 1.0)])
    with pytest.raises(ValueError, match=r"events\[0\].*step"):
        monitor.write_events([(LOSS, 1.0, 1.5)])
    with pytest.raises(ValueError, match=r"events\[0\].*value"):
        monitor.write_events([(LOSS, "high", 1)])
    monitor.close()
    with pytest.raises(ValueError, match="rank"):
        Monitor(CSVMonitorConfig(), TensorBoardConfig(), rank=-1)


# --- TensorBoard ------------------------------------------------------------------------------

def test_tensorboard_writes_event_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitor = Monitor(CSVMonitorConfig(),
                      TensorBoardConfig(enabled=True, output_path=str(tmp_path), job_name="tb"),
                      rank=0)
    assert monitor.enabled and monitor.tensorboard_dir == tmp_path / "tb"
    events = random_events([1, 2, 3], seed=3)
    monitor.write_events(events)
    monitor.close()
    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted([LOSS, LR, SCALE])
    for name in (LOSS, LR, SCALE):
        got = [(e.step, e.value) for e in acc.Scalars(name)]
        want = [(s, v) for n, v, s in events if n == name]
        assert [s for s, _ in got] == [s for s, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)  # float32


def test_missing_tensorboard_warns_once_and_continues(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.warns(RuntimeWarning, match="'tensorboard' package is not installed") as record:
        monitor = Monitor(CSVMonitorConfig(enabled=True, output_path=str(tmp_path)),
                          TensorBoardConfig(enabled=True, output_path=str(tmp_path / "tb")),
                          rank=0)
    assert len(record) == 1
    assert monitor.tensorboard_dir is None and monitor.enabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monitor.write_events([(LOSS, 2.0, 1)])
    monitor.close()
    assert not (tmp_path / "tb").exists()
    assert read_csv(tmp_path / "dslab_job" / metric_file_name(LOSS))[1] == ["1", "2.0"]

    with pytest.warns(RuntimeWarning):
        tb_only = Monitor(CSVMonitorConfig(), TensorBoardConfig(enabled=True), rank=0)
    assert not tb_only.enabled


# --- ranks ------------------------------------------------------------------------------------

def test_nonzero_rank_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for cfg_path in ("", str(tmp_path / "explicit")):
        monitor = Monitor(CSVMonitorConfig(enabled=True, output_path=cfg_path),
                          TensorBoardConfig(enabled=True, output_path=cfg_path), rank=3)
        assert not monitor.enabled
        assert monitor.csv_dir is None and monitor.tensorboard_dir is None
        monitor.write_events(random_events([1], seed=4))
        monitor.close()
    assert list(tmp_path.iterdir()) == []


def test_disabled_monitor_is_a_noop(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monitor = Monitor(CSVMonitorConfig(), TensorBoardConfig(), rank=0)
    assert not monitor.enabled
    monitor.write_events(random_events([1], seed=5))
    monitor.close()
    assert list(tmp_path.iterdir()) == []
