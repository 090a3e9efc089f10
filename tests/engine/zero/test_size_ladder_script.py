"""benchmarks/size_ladder.py end to end on CPU (``--tiny``): each size in its own process, the
rows and the table, and a config's ladder stopping at its first size that does not train."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))
import size_ladder  # noqa: E402


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    out = tmp_path_factory.mktemp("ladder") / "ladder.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # deepspeed is not installed here: its first size fails and its ladder stops there
    cmd = [sys.executable, str(REPO / "benchmarks" / "size_ladder.py"), "--tiny",
           "--configs", "stage3,offload-split,deepspeed-stage3", "--accumulate-on", "cpu", "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout, json.loads(out.read_text())["rows"]


def test_each_config_climbs_until_a_size_fails(ladder):
    stdout, rows = ladder
    done = [(r["config"], r["size"], r["status"]) for r in rows]
    assert done[:4] == [("stage3", "tiny-a", "ok"), ("stage3", "tiny-b", "ok"),
                        ("offload-split", "tiny-a", "ok"), ("offload-split", "tiny-b", "ok")]
    assert done[4][:2] == ("deepspeed-stage3", "tiny-a") and done[4][2] == "error"
    assert len(done) == 5  # the failed config's larger size is not tried
    assert "| offload-split | tiny-b |" in stdout


def test_rows_hold_the_measurements(ladder):
    _, rows = ladder
    for row in rows[:4]:
        assert len(row["losses"]) == 3 and all(math.isfinite(x) for x in row["losses"])
        assert row["losses"][-1] < row["losses"][0]  # it trains
        assert row["tokens_per_step"] == 2 * 64 * 2
        assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["step_s"])
        layers, hidden, _ = size_ladder.SIZES[row["size"]]
        flops = size_ladder.model_flops_per_step(layers, hidden, 64, row["tokens_per_step"])
        assert row["model_tflops"] == pytest.approx(flops / row["step_s"] / 1e12)
    offloaded = [r for r in rows if r["config"] == "offload-split"]
    assert all(r["param_offload_per_step"]["fetches"] > 0 for r in offloaded)
    # --accumulate-on cpu: the second micro-step's shards are added on the host, none go back
    assert all(r["grad_offload_per_step"]["host_adds"] > 0 and r["grad_offload_per_step"]["grad_h2d_bytes"] == 0
               for r in offloaded)
    assert all(r["grad_offload_per_step"]["add_s"] > 0 for r in offloaded)
    assert "gradients out/back GB/step" in ladder[0] and "(worker: copy wait / adding)" in ladder[0]


def test_model_flops_is_megatrons_count():
    # 72 B s L h^2 (1 + s / 6h + V / 12 L h) for one sequence of 1024 at GPT-3 1.3B's shape
    flops = size_ladder.model_flops_per_step(24, 2048, 1024, 1024)
    expected = 72 * 1024 * 24 * 2048**2 * (1 + 1024 / (6 * 2048) + 50257 / (12 * 24 * 2048))
    assert flops == pytest.approx(expected)
    assert size_ladder.parameter_count(24, 2048, 1024) == pytest.approx(1.31e9, rel=0.01)


@pytest.mark.parametrize("config", ["offload", "offload-split", "offload-opt", "offload-nvme"])
def test_accumulate_on_reaches_every_dslab_offload_config(config, tmp_path):
    args = size_ladder.parse_args(["--accumulate-on", "cpu", "--nvme-path", str(tmp_path)])
    zero = size_ladder.engine_config(config, args)["zero_optimization"]
    assert zero["offload_optimizer"]["accumulate_on"] == "cpu"
    assert "accumulate_on" not in size_ladder.engine_config(
        "deepspeed-offload", args)["zero_optimization"]["offload_optimizer"]  # not DeepSpeed's key
    assert "stage3_prefetch_bucket_size" not in zero  # the engine's default unless asked
    fetched = size_ladder.parse_args(["--fetch-dtype", "bf16"])
    offload_param = size_ladder.engine_config(config, fetched)["zero_optimization"].get("offload_param", {})
    assert offload_param.get("fetch_dtype") == ("bf16" if config in ("offload", "offload-split") else None)
    assert "fetch_dtype" not in size_ladder.engine_config("deepspeed-offload", fetched)["zero_optimization"]["offload_param"]
    staged = size_ladder.parse_args(["--accumulate-on", "cpu", "--staging-buffers", "8", "--nvme-path", str(tmp_path)])
    assert size_ladder.engine_config(config, staged)["zero_optimization"]["offload_optimizer"]["staging_buffers"] == 8
    assert "staging_buffers" not in zero["offload_optimizer"]  # the engine's default unless asked
    narrow = size_ladder.parse_args(["--accumulate-on", "cpu", "--staging-dtype", "bf16", "--nvme-path", str(tmp_path)])
    assert size_ladder.engine_config(config, narrow)["zero_optimization"]["offload_optimizer"]["staging_dtype"] == "bf16"
    assert "staging_dtype" not in zero["offload_optimizer"]
    split = size_ladder.engine_config("deepspeed-offload-split", size_ladder.parse_args(["--ratio", "0.3"]))
    assert split["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "ratio": 0.3}
    assert split["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    prefetched = size_ladder.parse_args(["--prefetch", "400000000"])
    for name in (config, "deepspeed-offload"):
        assert size_ladder.engine_config(name, prefetched)["zero_optimization"]["stage3_prefetch_bucket_size"] == 4e8


@pytest.mark.parametrize("config", ["offload", "offload-split", "offload-opt", "deepspeed-offload"])
def test_overlap_step_reaches_the_dslab_parameter_offload_configs_only(config):
    zero = size_ladder.engine_config(config, size_ladder.parse_args(["--overlap-step"]))["zero_optimization"]
    assert zero["offload_optimizer"].get("overlap_step", False) == (config in ("offload", "offload-split"))
    plain = size_ladder.engine_config(config, size_ladder.parse_args([]))["zero_optimization"]
    assert "overlap_step" not in plain["offload_optimizer"]  # the engine's default unless asked


def test_the_table_shows_the_cpu_steps_time_and_a_background_steps_waits():
    row = {"config": "offload", "size": "2.7b", "status": "ok", "params": 2.65e9, "step_s": 8.0,
           "param_offload_per_step": {"h2d_bytes": 1e11, "copy_stall_ms": 900.0, "disk_read_bytes": 0,
                                      "disk_write_bytes": 0, "update_wait_s": 0.31},
           "grad_offload_per_step": {"grad_d2h_bytes": 1e10, "grad_h2d_bytes": 0, "host_adds": 0,
                                     "cpu_step_s": 0.05, "overlap_step_s": 1.25}}
    serial = {**row, "grad_offload_per_step": {"grad_d2h_bytes": 1e10, "grad_h2d_bytes": 0, "host_adds": 0,
                                               "cpu_step_s": 1.5, "overlap_step_s": 0.0}}
    table = size_ladder.fmt_table([row, serial, {**row, "grad_offload_per_step": {}}])
    header, _, first, second, third = table.splitlines()
    assert header.endswith("| CPU step s/step (background: fetches waited) |")
    assert first.endswith("| 1.30 (bg 1.25: 0.31) |")
    assert second.endswith("| 1.50 |")
    assert third.endswith("|  |")
    assert all(line.count("|") == header.count("|") for line in table.splitlines())


def test_sizes_by_name_or_by_layer_count():
    assert size_ladder.size_shape("13b") == (40, 5120, 40)
    assert size_ladder.size_shape("13b-80l") == (80, 5120, 40)
    assert size_ladder.size_shape("6.7b-64l") == (64, 4096, 32)
    layers, hidden, _ = size_ladder.size_shape("13b-80l")
    assert size_ladder.parameter_count(layers, hidden, 1024) == pytest.approx(25.43e9, rel=1e-3)
    for bad in ("14b", "13b-0l", "13b-80", "13b-x1l", "-8l"):
        with pytest.raises(ValueError, match="unknown size"):
            size_ladder.size_shape(bad)
    with pytest.raises(SystemExit):
        size_ladder.parse_args(["--sizes", "1.3b,13b-80"])
    with pytest.raises(SystemExit):
        size_ladder.parse_args(["--nproc", "0"])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ladder2") / "ladder.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(REPO / "benchmarks" / "size_ladder.py"), "--tiny", "--nproc", "2",
           "--configs", "offload", "--sizes", "tiny-a", "--json", str(out)]  # stage 3, parameters on the host
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout, json.loads(out.read_text())["rows"], out.parent / "size_ladder_rows"


def test_two_processes_join_one_group_and_count_both_ranks_tokens(two_ranks):
    stdout, rows, row_dir = two_ranks
    assert [(r["config"], r["status"], r["world_size"]) for r in rows] == [("offload", "ok", 2)]
    for row in rows:
        assert row["tokens_per_step"] == 2 * (2 * 64 * 2)  # two ranks, each micro-batch 2 x seq 64 x accum 2
        assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["step_s"])
        assert len(row["losses"]) == 3 and row["losses"][-1] < row["losses"][0]
    assert rows[0]["param_offload_per_step"]["fetches"] > 0
    assert "| offload x2 | tiny-a |" in stdout
    assert sorted(p.name for p in row_dir.iterdir()) == ["offload-tiny-a.json"]


FAKE_RANK = """
import json, os, signal, sys, time
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--json") + 1])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
assert "--rank-json" in args and os.environ["MASTER_PORT"].isdigit()
if rank == world - 1:
    if os.environ["FAKE_FAILURE"] == "oom":
        row = {"config": "stage3", "size": "tiny-a", "status": "oom", "where": "step 1", "rank": rank}
        out.with_name(f"{out.stem}.rank{rank}.json").write_text(json.dumps(row))
        sys.exit(0)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)  # the others wait in a collective for the rank that is gone
"""


@pytest.mark.parametrize("failure", ["oom", "killed"])
def test_a_rank_that_fails_stops_the_others_and_is_named(failure, tmp_path, monkeypatch):
    script = tmp_path / "fake_rank.py"
    script.write_text(FAKE_RANK)
    monkeypatch.setattr(size_ladder, "__file__", str(script))
    monkeypatch.setattr(size_ladder, "RANK_GRACE_S", 0.5)
    monkeypatch.setenv("FAKE_FAILURE", failure)
    args = size_ladder.parse_args(["--tiny", "--nproc", "3"])
    row = size_ladder.run_size("stage3", "tiny-a", args, tmp_path, timeout=60)
    assert row["seconds"] < 30 and row["world_size"] == 3
    if failure == "oom":
        assert (row["status"], row["where"], row["rank"]) == ("oom", "step 1", 2)
    else:
        assert row["status"] == "killed" and row["error"] == "signal 9 (host memory) (rank 2)"
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".json"] == ["stage3-tiny-a.json"]
    assert json.loads((tmp_path / "stage3-tiny-a.json").read_text()) == row
