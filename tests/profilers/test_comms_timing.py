"""A CUDA collective's latency in the comms logger runs from when it began running: its start
event, or the end of the op queued ahead of it on the same NCCL stream (dslab/profilers/comms_timing.py).
Here on events with known times; tests/profilers/test_comms_gpu.py queues real NCCL ops behind each
other."""

import pytest

from dslab.profilers.comms_timing import CudaTiming, stream_key


class FakeEvent:
    """An event that fired at ``t`` ms."""

    def __init__(self, t: float):
        self.t = t

    def elapsed_time(self, other: "FakeEvent") -> float:
        return other.t - self.t


def _timing(start, end, behind=None):
    timing = CudaTiming({"op": "all_reduce"}, FakeEvent(start), ref=None, behind=behind)
    timing.end = FakeEvent(end)
    return timing


def test_an_op_queued_behind_another_is_timed_from_that_ones_end():
    first = _timing(0.0, 5.0)
    second = _timing(0.1, 9.0, behind=first)  # reached at 0.1, but the stream ran `first` until 5.0
    third = _timing(7.0, 9.5, behind=second)  # ran from 9.0
    assert first.latency_ms() == 5.0
    assert second.latency_ms() == pytest.approx(4.0)
    assert third.latency_ms() == pytest.approx(0.5)


def test_an_op_issued_after_the_stream_went_idle_is_timed_from_its_start():
    first = _timing(0.0, 1.0)
    later = _timing(3.0, 4.5, behind=first)
    assert later.latency_ms() == pytest.approx(1.5)
    assert later.began() is later.start


def test_an_end_event_of_the_op_ahead_that_fired_after_this_ops_end_is_not_used():
    first = _timing(0.0, 2.004)  # an async op's end, on a pool stream that lagged its completion
    tiny = _timing(1.0, 2.001, behind=first)
    assert tiny.began() is tiny.start and tiny.latency_ms() == pytest.approx(1.001)


def test_the_link_to_the_op_ahead_is_dropped_once_read():
    first = _timing(0.0, 5.0)
    second = _timing(0.0, 6.0, behind=first)
    began = second.began()
    assert second.behind is None and began is first.end
    first.end = FakeEvent(100.0)  # read once: a later change of the op ahead no longer matters
    assert second.latency_ms() == pytest.approx(1.0)


def test_per_peer_ops_are_not_chained_and_groups_and_devices_are_apart():
    assert stream_key("send", "0", 0) is None and stream_key("recv", "0", 0) is None
    assert stream_key("all_reduce", "0", 0) == stream_key("reduce_scatter", "0", 0)
    assert stream_key("all_reduce", "0", 0) != stream_key("all_reduce", "1", 0)
    assert stream_key("all_reduce", "0", 0) != stream_key("all_reduce", "0", 1)
