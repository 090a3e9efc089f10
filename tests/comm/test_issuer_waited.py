"""gloo's reduce_scatter handle has no future and writes its output inside ``wait()``; a second
waiter beside the issuer wrote it again after ZeRO's reducer had scaled it. The comm layer hands
such a handle out as ``comm.IssuerWaitedWork``, whose future completes at the issuer's wait, and
the comms logger never waits on a handle it is given."""

import itertools
import threading

import pytest
import torch
import torch.distributed as dist

from dslab import comm
from dslab.profilers.comms import CommsLogger, CommsLoggerConfig

_seq = itertools.count(50_000)


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


class CountingWork:
    """A future-less handle that counts its waiters; ``fail`` makes wait() raise."""

    def __init__(self, fail=False):
        self.waits, self.fail = 0, fail
        self.lock = threading.Lock()

    def get_future(self):
        raise RuntimeError("Work::getFuture not implemented.")

    def wait(self, timeout=None):
        with self.lock:
            self.waits += 1
        if self.fail:
            raise RuntimeError("peer went away")
        return True

    def source_rank(self):
        return 7


def _call(op="reduce_scatter"):
    return comm.CollectiveCall(op=op, seq=next(_seq), numel=64, dtype=torch.float32, element_size=4,
                               group_size=1, group_ranks=[0], async_op=True)


def test_the_future_completes_at_the_issuers_wait():
    raw = CountingWork()
    work = comm.IssuerWaitedWork(raw)
    assert not work.get_future().done() and not work.is_completed()
    assert work.wait() is True
    assert work.get_future().done() and work.get_future().value() is True and work.is_completed()
    assert raw.waits == 1
    assert work.source_rank() == 7  # anything else is the wrapped handle's


def test_a_failed_wait_completes_the_future_with_false_and_still_raises():
    work = comm.IssuerWaitedWork(CountingWork(fail=True))
    with pytest.raises(RuntimeError, match="peer went away"):
        work.wait()
    assert work.get_future().value() is False


def test_gloo_reduce_scatter_is_wrapped_only_while_observed(one_rank_group, logger):
    out = torch.empty(5)
    work = comm.reduce_scatter_tensor(out, torch.arange(5.0), async_op=True)
    assert isinstance(work, comm.IssuerWaitedWork)
    work.wait()
    assert torch.equal(out, torch.arange(5.0))
    # an op with a future of its own (gloo's all_reduce) is passed on as torch gave it
    assert not isinstance(comm.all_reduce(torch.ones(3), async_op=True), comm.IssuerWaitedWork)
    logger.close()
    assert not isinstance(comm.reduce_scatter_tensor(out, torch.arange(5.0), async_op=True),
                          comm.IssuerWaitedWork)


def test_the_logger_times_a_reduce_scatter_to_its_issuers_wait_and_never_waits_itself(logger):
    raw = CountingWork()
    work = comm.IssuerWaitedWork(raw)
    call = _call()
    logger.before(call)
    logger.after(call, work)
    assert raw.waits == 0
    work.wait()
    (record,) = logger.local_records()
    assert record["latency_ms"] is not None and record["latency_ms"] >= 0
    assert raw.waits == 1


def test_records_read_before_the_issuer_waits_leave_the_call_untimed_once(logger):
    raw = CountingWork()
    work = comm.IssuerWaitedWork(raw)
    call = _call()
    logger.before(call)
    logger.after(call, work)
    (record,) = logger.local_records()  # does not block on the unwaited handle
    assert record["latency_ms"] is None and raw.waits == 0
    work.wait()  # the late stamp is dropped: the call is not counted twice
    (stats,) = logger.summary()["reduce_scatter"].values()
    assert stats["count"] == 1
    assert logger.local_records()[0]["latency_ms"] is None


@pytest.mark.parametrize("op", ["reduce_scatter", "recv"])
def test_a_raw_future_less_handle_stays_untimed_and_unwaited(logger, op):
    raw = CountingWork()
    call = _call(op)
    logger.before(call)
    logger.after(call, raw)
    (record,) = logger.local_records()
    assert record["latency_ms"] is None and raw.waits == 0
