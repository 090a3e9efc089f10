"""Gradient overlap of the comms logger in one process: the ``bucket`` tag of the comm layer, the
logger's phase marks and bucket spans driven through its hooks with known sleeps, and the interval
arithmetic of :func:`dslab.profilers.comms_overlap.summarize_overlap`."""

import itertools
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dslab import comm
from dslab.profilers.comms import CommsLogger, CommsLoggerConfig
from dslab.profilers.comms_overlap import PHASES, summarize_overlap

_seq = itertools.count(10_000)


@pytest.fixture
def one_rank_group(tmp_path):
    comm.init_distributed(dist_backend="gloo", init_method=f"file://{tmp_path / 'store'}",
                          rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def logger():
    made = CommsLogger(CommsLoggerConfig(enabled=True))
    yield made
    made.close()


class _Seen:
    def __init__(self):
        self.buckets = []

    def before(self, call):
        self.buckets.append((call.op, call.bucket))

    def after(self, call, work):
        pass


def test_bucket_tag_reaches_observers_and_the_records(one_rank_group, logger):
    seen = _Seen()
    comm.add_observer(seen)
    try:
        grads = torch.ones(6)
        comm.all_reduce(grads, bucket=3)
        comm.reduce_scatter_tensor(torch.empty(6), grads, bucket=4, async_op=True).wait()
        comm.all_reduce(grads)
    finally:
        comm.remove_observer(seen)
    assert seen.buckets == [("all_reduce", 3), ("reduce_scatter", 4), ("all_reduce", None)]
    records = logger.local_records()
    assert [r.get("bucket") for r in records] == [3, 4, None]
    # gloo's reduce_scatter handle has no future: its completion is still stamped, at its
    # issuer's wait
    assert all(r["latency_ms"] is not None for r in records)


def _call(bucket, async_op=False, op="all_reduce"):
    return comm.CollectiveCall(op=op, seq=next(_seq), numel=256, dtype=torch.float32, element_size=4,
                               group_size=2, group_ranks=[0, 1], async_op=async_op, bucket=bucket)


class _FutureWork:
    def __init__(self):
        self.future = torch.futures.Future()

    def get_future(self):
        return self.future


class _WaitOnlyWork:
    """A handle without a future (gloo's reduce_scatter): completes when ``done`` is set."""

    def __init__(self):
        self.done = threading.Event()

    def get_future(self):
        raise RuntimeError("Work::getFuture not implemented.")

    def wait(self):
        self.done.wait()
        return True


def _micro_step(logger, step, optimizer=True, bucket_sleep_s=0.0, exposed_sleep_s=0.0, wait_only=False):
    """One micro-step through the engine's hooks: bucket 0 blocking inside backward, bucket 1
    async, completing ``exposed_sleep_s`` after backward ends; an untagged call in the optimizer."""
    logger.on_step_begin(step)
    logger.on_forward_begin()
    logger.on_backward_begin()
    first = _call(0)
    logger.before(first)
    time.sleep(bucket_sleep_s)
    logger.after(first, None)
    second = _call(1, async_op=True, op="reduce_scatter")
    # a future-less handle reaches the observers wrapped by the comm layer (comm.IssuerWaitedWork)
    work = comm.IssuerWaitedWork(_WaitOnlyWork()) if wait_only else _FutureWork()
    logger.before(second)
    logger.after(second, work)
    logger.on_mark("backward_compute_end")
    time.sleep(exposed_sleep_s)
    if wait_only:
        work.work.done.set()
        work.wait()  # the issuer's wait: the op's output exists from here
    else:
        work.future.set_result(None)
    logger.on_backward_end()
    if optimizer:
        logger.on_optimizer_step_begin()
        untagged = _call(None)
        logger.before(untagged)
        logger.after(untagged, None)
    logger.on_step_end(step)


@pytest.mark.parametrize("wait_only", [False, True])
def test_logger_places_buckets_against_the_phases(logger, wait_only):
    _micro_step(logger, 0, bucket_sleep_s=0.03, exposed_sleep_s=0.04, wait_only=wait_only)
    _micro_step(logger, 1, optimizer=False)  # an accumulation micro-step: not the profiled one
    records = logger.records(gather=False)
    overlap = records["overlap"]["per_rank"]["0"]
    assert overlap["step"] == 0 and overlap["clock"] == "host"
    assert list(overlap["phases_ms"]) == list(PHASES)
    marks = [overlap["phases_ms"][p] for p in PHASES]
    assert marks == sorted(marks) and marks[0] == 0.0
    first, second = overlap["buckets"]
    assert (first["bucket"], first["op"], first["bytes"]) == (0, "all_reduce", 1024)
    assert (second["bucket"], second["op"]) == (1, "reduce_scatter")
    # bucket 0 ran 30 ms inside backward and ended before it: all hidden
    assert first["overlapped_ms"] >= 30 and first["exposed_ms"] == 0
    # bucket 1 was issued in backward and completed 40 ms after it: at least that is exposed
    assert second["exposed_ms"] >= 40
    assert second["overlapped_ms"] == pytest.approx(overlap["phases_ms"]["backward_end"] - second["start_ms"])
    totals = overlap["totals"]
    assert totals["bytes"] == 2048 and totals["buckets"] == 2
    assert totals["exposed_ms"] == pytest.approx(second["exposed_ms"])
    assert totals["overlapped_ms"] == pytest.approx(first["overlapped_ms"] + second["overlapped_ms"])
    assert "Gradient communication" in records["overlap"]["definitions"]
    # the per-call records carry the tag; the untagged call has none
    assert [r.get("bucket") for r in records["per_rank"]["0"] if r["step"] == 0] == [0, 1, None]


def test_no_overlap_without_tagged_buckets(logger):
    logger.on_step_begin(0)
    logger.on_forward_begin()
    logger.on_backward_begin()
    untagged = _call(None)
    logger.before(untagged)
    logger.after(untagged, None)
    logger.on_backward_end()
    logger.on_optimizer_step_begin()
    logger.on_step_end(0)
    assert "overlap" not in logger.records(gather=False)


def test_summarize_overlap_per_bucket_and_over_the_union():
    phases = {"forward_begin": 0.0, "backward_begin": 10.0, "backward_end": 30.0, "optimizer_begin": 46.0,
              "step_end": 50.0}
    calls = [{"bucket": 0, "op": "all_reduce", "bytes": 100, "issue_ms": 12.0, "start_ms": 12.0, "end_ms": 20.0},
             {"bucket": 1, "op": "all_reduce", "bytes": 200, "issue_ms": 18.0, "start_ms": 18.0, "end_ms": 40.0},
             {"bucket": 2, "op": "all_reduce", "bytes": 300, "issue_ms": 30.5, "start_ms": 35.0, "end_ms": 45.0},
             {"bucket": 3, "op": "all_reduce", "bytes": 400, "issue_ms": 29.0, "start_ms": None, "end_ms": None}]
    out = summarize_overlap(phases, phases, calls, clock="host", step=7)
    figures = [(b["comm_ms"], b["overlapped_ms"], b["exposed_ms"]) for b in out["buckets"]]
    assert figures == [(8.0, 8.0, 0.0), (22.0, 12.0, 10.0), (10.0, 0.0, 10.0), (None, None, None)]
    # the union of the timed spans is [12, 45]: 18 ms inside backward, 15 after
    assert out["totals"] == {"buckets": 4, "bytes": 1000, "comm_ms": 33.0, "overlapped_ms": 18.0,
                             "exposed_ms": 15.0, "backward_ms": 20.0}
    assert out["step"] == 7 and list(out["phases_ms"]) == list(PHASES)
    with pytest.raises(ValueError, match="backward_end"):
        summarize_overlap({"backward_begin": 0.0}, {}, calls, clock="host")


@pytest.mark.gpu
def test_cuda_marks_and_spans_are_events_read_at_records(tmp_path):
    """On CUDA (one-rank NCCL group) the phase marks and a tagged async all-reduce are events:
    the bucket's span lies inside the step, and a device sleep after backward's mark is exposed
    time of a bucket issued behind it on the stream."""
    comm.init_distributed(dist_backend="nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    logger = CommsLogger(CommsLoggerConfig(enabled=True))
    try:
        logger.attach(torch.nn.Linear(4, 4).cuda())
        grads = torch.ones(1 << 20, device="cuda")
        logger.on_step_begin(0)
        logger.on_forward_begin()
        logger.on_backward_begin()
        comm.all_reduce(grads, bucket=0, async_op=True)
        logger.on_mark("backward_compute_end")
        torch.cuda._sleep(20_000_000)
        work = comm.all_reduce(grads, bucket=1, async_op=True)
        work.wait()
        logger.on_backward_end()
        logger.on_optimizer_step_begin()
        logger.on_step_end(0)
        overlap = logger.records(gather=False)["overlap"]["per_rank"]["0"]
    finally:
        logger.close()
        dist.destroy_process_group()
    assert overlap["clock"] == "cuda_events"
    marks = [overlap["phases_ms"][p] for p in PHASES]
    assert marks == sorted(marks)
    first, second = overlap["buckets"]
    assert first["exposed_ms"] < 1.0  # a 4 MiB one-rank all-reduce is done long before the 20M-cycle sleep ends
    assert second["overlapped_ms"] == 0.0 and second["start_ms"] >= overlap["phases_ms"]["backward_end"]
    for b in overlap["buckets"]:
        assert b["overlapped_ms"] + b["exposed_ms"] == pytest.approx(b["comm_ms"])
