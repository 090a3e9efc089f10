"""Collectives inside a CUDA graph run at each replay, not at capture: the graph's owner records
the calls it issued while capturing (``recording_calls``) and announces them after each replay
(``announce_replay``) to the observers that have ``replayed``. Checked here on a one-rank gloo
group, with no graph: the comm layer's side does not depend on one."""

import threading

import pytest
import torch
import torch.distributed as dist

from dslab import comm
from dslab.comm import collectives


@pytest.fixture
def one_rank_group(tmp_path):
    comm.init_distributed(dist_backend="gloo", init_method=f"file://{tmp_path / 'store'}",
                          rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Recorder:
    """Sees every call before and after it is issued."""

    def __init__(self):
        self.seen = []

    def before(self, call):
        self.seen.append(("before", call.op, call.seq))

    def after(self, call, work):
        self.seen.append(("after", call.op, call.seq))


class ReplayRecorder(Recorder):
    """Also told of replays."""

    def __init__(self):
        super().__init__()
        self.replays = []

    def replayed(self, call):
        self.replays.append(call)


@pytest.fixture
def observe():
    added = []

    def add(observer):
        comm.add_observer(observer)
        added.append(observer)
        return observer

    yield add
    for observer in added:
        comm.remove_observer(observer)


def test_records_the_calls_issued_inside_the_block_without_observers(one_rank_group):
    assert collectives._observers == []
    comm.all_reduce(torch.ones(3))
    with comm.recording_calls() as calls:
        comm.all_reduce(torch.ones(4, dtype=torch.float16))
        with comm.recording_calls() as inner:
            comm.broadcast(torch.ones(2), src=0)
    comm.all_reduce(torch.ones(5))
    assert [(c.op, c.numel, c.nbytes, c.group_ranks) for c in calls] == [
        ("all_reduce", 4, 8, [0]), ("broadcast", 2, 8, [0])]
    assert inner == calls[1:]
    assert calls[1].extra == {"src": 0}
    assert collectives._recordings.lists == []


def test_observers_still_see_the_recorded_calls(one_rank_group, observe):
    recorder = observe(Recorder())
    with comm.recording_calls() as calls:
        comm.all_reduce(torch.ones(4))
    (call,) = calls
    assert recorder.seen == [("before", "all_reduce", call.seq), ("after", "all_reduce", call.seq)]


def test_without_a_process_group_nothing_is_issued_or_recorded():
    assert not comm.is_initialized()
    with comm.recording_calls() as calls:
        comm.all_reduce(torch.ones(4))
        comm.broadcast(torch.ones(4), src=0)
    assert calls == []


def test_records_only_the_calls_of_its_own_thread(one_rank_group):
    with comm.recording_calls() as calls:
        other = threading.Thread(target=lambda: comm.all_reduce(torch.ones(7)))
        other.start()
        other.join()
        comm.all_reduce(torch.ones(4))
    assert [c.numel for c in calls] == [4]


def test_a_capture_records_what_another_thread_issues_into_it(one_rank_group, monkeypatch):
    """A backward captured through ``torch.autograd`` runs on the autograd engine's device thread,
    whose current stream is the capture's: its collectives belong to the capture. Another
    thread's calls outside any capture, and every other thread's calls into a block opened
    without a graph, do not."""
    capturing = threading.local()
    monkeypatch.setattr(collectives, "_capturing_here", lambda: getattr(capturing, "on", False))

    def issue(numel, into_capture):
        def work():
            capturing.on = into_capture
            comm.all_reduce(torch.ones(numel))
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()

    graph = FakeGraph()
    with comm.recording_calls(graph) as captured:
        issue(7, into_capture=True)
        issue(9, into_capture=False)
        comm.all_reduce(torch.ones(4))
    with comm.recording_calls() as plain:
        issue(11, into_capture=True)
    assert [c.numel for c in captured] == [7, 4]
    assert plain == []
    issue(13, into_capture=True)  # no block open: nothing recorded, nothing kept
    assert collectives._capture_lists == [] and collectives._recordings.lists == []


def test_announce_replay_tells_the_observers_with_replayed_only(one_rank_group, observe):
    with comm.recording_calls() as calls:
        comm.all_reduce(torch.ones(4))
        comm.broadcast(torch.ones(2), src=0)
    plain, replaying = observe(Recorder()), observe(ReplayRecorder())
    for _ in range(3):
        comm.announce_replay(calls)
    assert plain.seen == [] and replaying.seen == []
    assert [(c.op, c.numel, c.group_ranks, c.extra) for c in replaying.replays] == 3 * [
        ("all_reduce", 4, [0], {}), ("broadcast", 2, [0], {"src": 0})]
    # each announcement is a distinct call: a copy with a fresh seq, the recorded calls untouched
    seqs = [c.seq for c in replaying.replays]
    assert len(set(seqs)) == 6 and min(seqs) > max(c.seq for c in calls)
    assert all(c is not r for c in calls for r in replaying.replays)
    assert [c.op for c in calls] == ["all_reduce", "broadcast"]


def test_announce_replay_without_listeners_takes_no_seq(one_rank_group, observe):
    with comm.recording_calls() as calls:
        comm.all_reduce(torch.ones(4))
    observe(Recorder())
    comm.announce_replay(calls)
    with comm.recording_calls() as later:
        comm.all_reduce(torch.ones(4))
    assert later[0].seq == calls[0].seq + 1


class FakeGraph:
    """Stands in for a ``torch.cuda.CUDAGraph``: counts its resets."""

    def __init__(self):
        self.resets = 0

    def reset(self):
        self.resets += 1


def test_a_graph_that_captured_collectives_is_reset_before_the_group_goes(one_rank_group):
    from dslab.comm import process

    with_calls, without_calls = FakeGraph(), FakeGraph()
    with comm.recording_calls(with_calls):
        comm.all_reduce(torch.ones(4))
    with comm.recording_calls(without_calls):
        torch.ones(4).add_(1)
    assert process.release_graphs_with_collectives() == 1
    assert (with_calls.resets, without_calls.resets) == (1, 0)
    assert process.release_graphs_with_collectives() == 0  # released once


def test_the_exit_handler_resets_live_graphs_and_holds_none_alive(tmp_path):
    from dslab.comm import process

    comm.init_distributed(dist_backend="gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    kept, dropped = FakeGraph(), FakeGraph()
    for graph in (kept, dropped):
        with comm.recording_calls(graph):
            comm.broadcast(torch.ones(2), src=0)
    del dropped  # only a weak reference is held: a graph its owner dropped is not kept alive
    process._leave_at_exit()
    assert kept.resets == 1 and not comm.is_initialized()
    assert len(process._graphs_with_collectives) == 0
