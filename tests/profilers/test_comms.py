"""The comms logger in one process: its config section, what it observes (a one-rank gloo group),
``prof_ops``, ``debug``, ``verbose``, the ``log_summary`` door and its records."""

import inspect
import json

import pytest
import torch
import torch.distributed as dist

from dslab import comm
from dslab.comm import collectives
from dslab.config_base import parse_section
from dslab.profilers.comms import CommsLogger, CommsLoggerConfig, from_config


@pytest.fixture
def one_rank_group(tmp_path):
    comm.init_distributed(dist_backend="gloo", init_method=f"file://{tmp_path / 'store'}",
                          rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def make_logger():
    loggers = []

    def make(max_records=10_000, **section):
        logger = CommsLogger(CommsLoggerConfig(enabled=True, **section), max_records=max_records)
        loggers.append(logger)
        return logger

    yield make
    for logger in loggers:
        logger.close()


def test_config_defaults_and_deepspeed_keys():
    cfg = CommsLoggerConfig()
    assert (cfg.enabled, cfg.verbose, cfg.prof_all, cfg.prof_ops, cfg.debug) == (
        False, False, True, [], False)
    ds = {"enabled": True, "verbose": False, "prof_all": False,
          "prof_ops": ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"],
          "debug": False}
    cfg = parse_section(CommsLoggerConfig, ds, "comms_logger")
    assert cfg.prof_ops == ["all_reduce", "all_gather", "reduce_scatter"]


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"comms_logger\.prof_alll'; did you mean 'comms_logger\.prof_all'"):
        parse_section(CommsLoggerConfig, {"prof_alll": True}, "comms_logger")
    with pytest.raises(ValueError, match=r"comms_logger\.prof_ops'.*'all_reduse'.*did you mean 'all_reduce'"):
        parse_section(CommsLoggerConfig, {"prof_ops": ["all_reduse"]}, "comms_logger")
    with pytest.raises(ValueError, match=r"comms_logger\.prof_ops'.*nothing would be logged"):
        parse_section(CommsLoggerConfig, {"enabled": True, "prof_all": False}, "comms_logger")


def test_disabled_registers_nothing(one_rank_group):
    observers = list(collectives._observers)
    assert from_config(CommsLoggerConfig()) is None
    assert from_config({"enabled": False, "debug": True}) is None
    assert from_config(None) is None
    assert CommsLogger.from_config(CommsLoggerConfig(debug=True)) is None
    assert collectives._observers == observers
    comm.all_reduce(torch.ones(4))
    with pytest.raises(RuntimeError, match="comms logger is not running"):
        comm.log_summary()


def test_from_config_enabled_observes_and_close_unregisters(one_rank_group):
    logger = from_config({"enabled": True})
    try:
        assert isinstance(logger, CommsLogger) and logger in collectives._observers
        comm.all_reduce(torch.ones(4))
        assert comm.log_summary(return_dict=True)["all_reduce"][16]["count"] == 1
    finally:
        logger.close()
    assert logger not in collectives._observers
    with pytest.raises(RuntimeError):
        comm.log_summary()


def test_records_each_call(one_rank_group, make_logger, capsys):
    logger = make_logger()
    x = torch.ones(100, dtype=torch.float16)
    for _ in range(3):
        comm.all_reduce(x)
    comm.all_reduce(torch.ones(10), async_op=True).wait()
    out = torch.empty(6)
    comm.all_gather_into_tensor(out, torch.ones(6), async_op=True).wait()
    comm.broadcast(torch.ones(3, dtype=torch.float64), src=0)
    records = logger.local_records()
    assert [(r["op"], r["bytes"], r["seq"]) for r in records] == [
        ("all_reduce", 200, 0), ("all_reduce", 200, 1), ("all_reduce", 200, 2),
        ("all_reduce", 40, 3), ("all_gather", 24, 0), ("broadcast", 24, 0)]
    assert records[0]["dtype"] == "float16" and records[0]["group"] == "0"
    assert [r["async"] for r in records] == [False] * 3 + [True, True, False]
    assert all(r["latency_ms"] is not None and r["latency_ms"] >= 0 for r in records)

    result = comm.log_summary(return_dict=True)
    assert result["all_reduce"][200]["count"] == 3 and result["all_reduce"][40]["count"] == 1
    assert result["all_reduce"][200]["total_latency_ms"] == pytest.approx(
        sum(r["latency_ms"] for r in records[:3]))
    assert result["stragglers"] is None and result["straggler"] is None
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].split()[:3] == ["Comm.", "Op", "Message"]
    assert "all_gather\n" in printed and "200.00 B" in printed

    report = logger.records()
    json.dumps(report)
    assert report["per_rank"]["0"] == records
    assert report["stragglers"] == []
    assert {(row["op"], row["size_bytes"]) for row in report["ops"]} == {
        ("all_reduce", 200), ("all_reduce", 40), ("all_gather", 24), ("broadcast", 24)}
    assert "nccl-tests" in report["definitions"]


def test_prof_ops_filters(one_rank_group, make_logger):
    logger = make_logger(prof_all=False, prof_ops=["all_reduce", "all_to_all_single"])
    comm.all_reduce(torch.ones(4))
    comm.broadcast(torch.ones(4), src=0)
    comm.all_to_all_single(torch.empty(4), torch.ones(4))
    comm.all_reduce(torch.ones(4))
    assert [(r["op"], r["seq"]) for r in logger.local_records()] == [
        ("all_reduce", 0), ("all_to_all", 0), ("all_reduce", 1)]


def test_prof_all_wins_over_prof_ops(one_rank_group, make_logger):
    logger = make_logger(prof_all=True, prof_ops=["all_reduce"])
    comm.broadcast(torch.ones(4), src=0)
    assert [r["op"] for r in logger.local_records()] == ["broadcast"]


def test_debug_records_the_caller(one_rank_group, make_logger):
    logger = make_logger(debug=True)
    line = inspect.currentframe().f_lineno + 1
    comm.all_reduce(torch.ones(4))
    (record,) = logger.local_records()
    assert record["caller"] == f"tests/profilers/test_comms.py:{line} (test_debug_records_the_caller)"
    assert list(logger.summary()) == [f"all_reduce | [Caller: {record['caller']}]"]


def test_verbose_prints_each_call(one_rank_group, make_logger, capsys):
    make_logger(verbose=True)
    comm.all_reduce(torch.ones(256))
    line = capsys.readouterr().out.strip()
    assert line.startswith("rank=0 | comm op: all_reduce | time (ms): ")
    assert "| msg size: 1.00 KB | algbw (Gbps): " in line


def test_verbose_lines_go_to_the_output_dir_when_one_is_set(one_rank_group, make_logger, capsys, tmp_path):
    """A benchmark run sets an output directory: the per-call lines go to its comms_calls.txt (named
    in the records), and to stdout as well only with echo_text."""
    logger = make_logger(verbose=True)
    assert logger.records()["text_file"] is None
    logger.set_output_dir(tmp_path / "profiles")
    comm.all_reduce(torch.ones(256))
    assert capsys.readouterr().out == ""
    path = tmp_path / "profiles" / "comms_calls.txt"
    assert path.read_text().startswith("rank=0 | comm op: all_reduce | time (ms): ")
    assert logger.records()["text_file"] == str(path)
    logger.set_output_dir(tmp_path / "profiles", echo_text=True)
    comm.broadcast(torch.ones(4), src=0)
    assert capsys.readouterr().out.startswith("rank=0 | comm op: broadcast")
    assert len(path.read_text().splitlines()) == 2


def test_records_are_bounded_but_the_summary_counts_every_call(one_rank_group, make_logger):
    logger = make_logger(max_records=3)
    for _ in range(5):
        comm.all_reduce(torch.ones(2))
    assert [r["seq"] for r in logger.local_records()] == [2, 3, 4]
    assert logger.summary()["all_reduce"][8]["count"] == 5
    assert logger.records()["dropped_records"] == 2
    with pytest.raises(ValueError, match="max_records"):
        CommsLogger(CommsLoggerConfig(enabled=True), max_records=0)


def test_not_distributed_observes_nothing(make_logger):
    logger = make_logger()
    comm.all_reduce(torch.ones(4))
    assert logger.local_records() == []
    assert logger.records()["per_rank"] == {"0": []}


class FakeEvent:
    """A CUDA event on a fake device clock that advances 1 ms per record; while ``busy``, newly
    recorded events stay incomplete until synchronized."""

    clock_ms = 0.0
    busy = False
    incomplete: list = []

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        FakeEvent.clock_ms += 1.0
        self.t = FakeEvent.clock_ms
        if FakeEvent.busy:
            FakeEvent.incomplete.append(self)

    def query(self):
        return self.t is not None and all(e is not self for e in FakeEvent.incomplete)

    def synchronize(self):
        FakeEvent.incomplete = [e for e in FakeEvent.incomplete if e is not self]

    def elapsed_time(self, end):
        return end.t - self.t


def test_cuda_path_reads_events_late_and_times_async_ops_by_their_future(make_logger, monkeypatch):
    """The CUDA plumbing with fake events: blocking calls end on the current stream in after();
    async calls end in the future's callback; on_step_end reads completed events only; records
    wait for the rest; arrivals follow the device clock."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(FakeEvent, "incomplete", [])
    logger = make_logger()
    monkeypatch.setattr(logger, "_on_cuda", lambda call: True)

    def call(seq, async_op):
        return collectives.CollectiveCall(op="all_reduce", seq=seq, numel=1024, dtype=torch.float32,
                                          element_size=4, group_size=2, group_ranks=[0, 1],
                                          async_op=async_op)

    blocking = call(0, False)
    logger.before(blocking)
    FakeEvent.clock_ms += 2.0  # the device spends 2 ms in the op
    logger.after(blocking, None)

    future = torch.futures.Future()
    work = type("Work", (), {"get_future": lambda self: future})()
    asynchronous = call(1, True)
    logger.before(asynchronous)
    logger.after(asynchronous, work)
    logger.on_step_end(0)
    first, second = logger._records
    assert first["latency_ms"] == pytest.approx(3.0)
    assert second["latency_ms"] is None  # its end event is not recorded until the op completes

    FakeEvent.clock_ms += 5.0
    monkeypatch.setattr(FakeEvent, "busy", True)
    future.set_result(None)  # completion: the callback records the end event
    logger.on_step_end(1)
    assert second["latency_ms"] is None  # recorded but not reached by the device yet
    records = logger.local_records()  # waits for it
    assert records[1]["latency_ms"] == pytest.approx(6.0)
    # the starts were recorded at device times 4 ms and 8 ms
    assert records[1]["arrival_ns"] - records[0]["arrival_ns"] == pytest.approx(4e6)
    assert logger.summary()["all_reduce"][4096]["timed_count"] == 2


def _cuda_call(seq, op="all_reduce", numel=1024):
    return collectives.CollectiveCall(op=op, seq=seq, numel=numel, dtype=torch.float32, element_size=4,
                                      group_size=2, group_ranks=[0, 1], async_op=False,
                                      device=torch.device("cuda", 0))


def test_calls_inside_a_graph_count_at_each_replay_not_at_capture(make_logger, monkeypatch):
    """A call issued while a CUDA graph is captured has not run: not counted. Each replay the
    graph's owner announces counts it, untimed, with the next per-group seq."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    logger = make_logger()
    captured = _cuda_call(0)
    logger.before(captured)
    logger.after(captured, None)
    assert logger.local_records() == [] and logger.summary() == {}

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for seq in range(1, 4):
        logger.replayed(_cuda_call(seq))
    records = logger.local_records()
    assert [(r["op"], r["seq"], r["bytes"], r["group"], r["graph_replay"]) for r in records] == [
        ("all_reduce", 0, 4096, "0,1", True), ("all_reduce", 1, 4096, "0,1", True),
        ("all_reduce", 2, 4096, "0,1", True)]
    assert all(r["latency_ms"] is None for r in records)
    stats = logger.summary()["all_reduce"][4096]
    assert (stats["count"], stats["timed_count"], stats["avg_latency_ms"]) == (3, 0, None)
    json.dumps(logger.records(gather=False))


def test_replays_follow_prof_ops_and_suspension(make_logger):
    logger = make_logger(prof_all=False, prof_ops=["all_reduce"])
    logger.replayed(_cuda_call(0, op="broadcast"))
    logger.replayed(_cuda_call(1))
    logger._suspended = True
    logger.replayed(_cuda_call(2))
    logger._suspended = False
    assert [(r["op"], r["seq"]) for r in logger.local_records()] == [("all_reduce", 0)]


def test_replays_and_eager_calls_share_the_per_group_seq(one_rank_group, make_logger, capsys):
    """Announced through the comm layer: the eager calls and the replays of one group and op are
    numbered in the order they ran; the summary and the printed table take the untimed replays."""
    logger = make_logger()
    with comm.recording_calls() as calls:
        comm.all_reduce(torch.ones(4))  # eager here (gloo, no graph): counted and timed
    comm.announce_replay(calls)
    comm.announce_replay(calls)
    records = logger.local_records()
    assert [(r["seq"], r.get("graph_replay", False), r["latency_ms"] is None) for r in records] == [
        (0, False, False), (1, True, True), (2, True, True)]
    stats = comm.log_summary(return_dict=True)["all_reduce"][16]
    assert (stats["count"], stats["timed_count"]) == (3, 1)
    assert "all_reduce" in capsys.readouterr().out
