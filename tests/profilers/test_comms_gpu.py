"""The comms logger on CUDA (one-rank NCCL group): calls are timed with events and never make the
host wait for the device; arrivals are when the stream reached the op."""

import time

import pytest
import torch
import torch.distributed as dist

from dslab import comm
from dslab.profilers.comms import CommsLogger, CommsLoggerConfig

pytestmark = pytest.mark.gpu


@pytest.fixture
def nccl_group(tmp_path):
    comm.init_distributed(dist_backend="nccl", init_method=f"file://{tmp_path / 'store'}",
                          rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sleep_cycles_for(ms: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for ``ms`` milliseconds, measured.

    The kernel is launched once before it is timed: its first launch loads the module between the
    two events, which would inflate the measured time and so shorten every later sleep."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    cycles = 10**8
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * ms / start.elapsed_time(end))


def test_cuda_timing_never_waits_for_the_device(nccl_group):
    logger = CommsLogger(CommsLoggerConfig(enabled=True))
    try:
        x = torch.ones(2**24, device="cuda")  # 64 MiB
        comm.all_reduce(x)  # communicator set-up and the logger's reference event
        cycles = sleep_cycles_for(200.0)
        torch.cuda.synchronize()

        torch.cuda._sleep(cycles)  # the stream is busy for ~200 ms
        host_start = time.perf_counter()
        work = comm.all_reduce(x, async_op=True)
        comm.all_reduce(x)
        logger.on_step_end(0)  # reads only completed events
        issued_ms = (time.perf_counter() - host_start) * 1e3
        assert issued_ms < 50, f"issuing took {issued_ms:.1f} ms: something waited for the GPU"
        work.wait()

        records = logger.local_records()
        assert [(r["op"], r["async"]) for r in records] == [
            ("all_reduce", False), ("all_reduce", True), ("all_reduce", False)]
        for r in records[1:]:
            assert r["latency_ms"] is not None and 0 < r["latency_ms"] < 100, r
            # the stream reached the op after the sleep, well after the host issued it
            assert r["arrival_ns"] - r["host_arrival_ns"] > 100e6, r
        summary = logger.summary()["all_reduce"][2**26]
        assert summary["count"] == 3 and summary["timed_count"] == 3
    finally:
        logger.close()


def test_ops_queued_on_one_nccl_stream_are_each_charged_their_own_time(nccl_group):
    logger = CommsLogger(CommsLoggerConfig(enabled=True))
    try:
        part = torch.ones(256 * 2**20, device="cuda")  # 1 GiB: each gather copies it
        whole = torch.empty_like(part)
        comm.all_gather_into_tensor(whole, part)  # warm-up
        torch.cuda.synchronize()
        works = [comm.all_gather_into_tensor(whole, part, async_op=True) for _ in range(6)]
        for work in works:
            work.wait()
        torch.cuda.synchronize()
        records = [r for r in logger.local_records() if r["op"] == "all_gather"][1:]
        assert len(records) == 6 and all(r["latency_ms"] is not None for r in records)
        latencies = [r["latency_ms"] for r in records]
        # Issued together, the six ran one after another on NCCL's stream: timed from their start
        # events the last would read about 6x the first (dslab/profilers/comms_timing.py).
        assert max(latencies) < 1.5 * min(latencies), latencies
    finally:
        logger.close()
