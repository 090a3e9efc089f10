"""Collectives with observers.

Each function issues one ``torch.distributed`` collective and tells every registered observer
about it: ``before(call)`` just before the op is issued on the current stream and
``after(call, work)`` right after it returns (``work`` is the async handle, or None for a blocking
call). Observers must not synchronize the device; they record and move on.

Gradient buckets. The engine passes ``bucket=<index>`` where it reduces one bucket of gradients
(stage 0's bucketed all-reduce, ZeRO's per-unit reduce-scatter), and observers read it as
``call.bucket``; the comms logger uses it to tell how much gradient communication backward hid
(see ``dslab.profilers.comms``). Without observers the tag costs nothing.

In a single process (no process group) the collectives are the identity and observers are not
called: nothing was communicated.

A collective issued while a CUDA graph is captured does not run then: it runs at each replay of
the graph. Observers still see it at capture (``before``/``after``, inside the capture), and can
tell by ``torch.cuda.is_current_stream_capturing()``. The graph's owner records the calls issued
while it captures (:func:`recording_calls`) and announces them at each replay
(:func:`announce_replay`) to the observers that have a ``replayed(call)`` method; the comm layer
cannot see a replay by itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from dslab.comm.process import hold_graph_with_collectives, is_initialized

ReduceOp = dist.ReduceOp


@dataclass
class CollectiveCall:
    """What an observer learns about one collective."""

    op: str
    seq: int
    numel: int
    dtype: torch.dtype
    element_size: int
    group_size: int
    group_ranks: list[int]
    async_op: bool
    device: torch.device = torch.device("cpu")
    group_name: str = ""
    extra: dict = field(default_factory=dict)
    #: the gradient bucket (stage 0) or ZeRO unit this collective reduces; None for any other
    bucket: int | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


class CommObserver(Protocol):
    """``before`` and ``after`` every collective issued. An observer may also have
    ``replayed(call)``, called by :func:`announce_replay` for each collective of a replayed CUDA
    graph; those without it are not told of replays."""

    def before(self, call: CollectiveCall) -> None: ...

    def after(self, call: CollectiveCall, work) -> None: ...


class _Recordings(threading.local):
    """The lists of the :func:`recording_calls` blocks open on this thread (a block records the
    collectives its own thread issues, and no other thread's outside a CUDA graph capture)."""

    def __init__(self):
        self.lists: list[list[CollectiveCall]] = []


_observers: list[CommObserver] = []
_recordings = _Recordings()
#: the lists of the recording blocks given a graph, on every thread: a backward captured by
#: ``torch.autograd`` runs on the autograd engine's device thread, into the same capture
_capture_lists: list[list[CollectiveCall]] = []
_capture_lock = threading.Lock()
_seq = itertools.count()


def _capturing_here() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _open_recordings() -> list[list[CollectiveCall]]:
    """The recording lists a call issued now on this thread belongs to: this thread's blocks, and
    where this thread issues into a CUDA graph capture that another thread opened a block for
    (the autograd engine's thread, running a captured backward), those blocks too."""
    own = _recordings.lists
    if not _capture_lists:
        return own
    with _capture_lock:
        others = [calls for calls in _capture_lists if not any(calls is mine for mine in own)]
    if others and _capturing_here():
        return own + others
    return own


def add_observer(observer: CommObserver) -> None:
    if observer not in _observers:
        _observers.append(observer)


def remove_observer(observer: CommObserver) -> None:
    if observer in _observers:
        _observers.remove(observer)


@contextlib.contextmanager
def recording_calls(graph=None) -> Iterator[list[CollectiveCall]]:
    """A list that receives every collective this thread issues inside the block, observers or
    not (nested blocks each receive them); with ``graph``, also those another thread issues into
    a CUDA graph capture meanwhile (the autograd engine's thread runs a captured backward). A CUDA graph's owner wraps its capture in it and passes
    the list to :func:`announce_replay` at each replay. Without a process group nothing is issued
    and the list stays empty. With ``graph`` (the ``torch.cuda.CUDAGraph`` being captured), a
    capture that issued collectives is reset before the process group is destroyed at exit
    (:func:`dslab.comm.process.hold_graph_with_collectives`)."""
    calls: list[CollectiveCall] = []
    _recordings.lists.append(calls)
    if graph is not None:
        with _capture_lock:
            _capture_lists.append(calls)
    try:
        yield calls
    finally:
        _recordings.lists[:] = [other for other in _recordings.lists if other is not calls]
        if graph is not None:
            with _capture_lock:
                _capture_lists[:] = [other for other in _capture_lists if other is not calls]
        if graph is not None and calls:
            hold_graph_with_collectives(graph)


def announce_replay(calls: Iterable[CollectiveCall]) -> None:
    """Tell the observers that have a ``replayed(call)`` method that ``calls`` (recorded by
    :func:`recording_calls` while a CUDA graph was captured) ran again: the graph was just
    replayed. Each announcement is a copy of the recorded call with a fresh ``seq``, so every run
    of a collective is a distinct call, as an eager one is."""
    listeners = [obs for obs in _observers if hasattr(obs, "replayed")]
    if not listeners:
        return
    for recorded in calls:
        call = dataclasses.replace(recorded, seq=next(_seq))
        for obs in listeners:
            obs.replayed(call)


def _group_ranks(group) -> list[int]:
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def _group_name(group) -> str:
    try:
        return (group or dist.group.WORLD).group_name
    except (AttributeError, RuntimeError):
        return ""


def _issue(op: str, tensor: torch.Tensor, group, async_op: bool, fn, ranks: list[int] | None = None,
           bucket: int | None = None, **extra):
    """Run ``fn`` (the torch.distributed call) between the observers' hooks, and record it in
    the open :func:`recording_calls` lists. ``ranks``: the ranks taking part when they are not
    the whole group (a point-to-point transfer's sender and receiver); ``bucket``: the gradient
    bucket the call reduces (:attr:`CollectiveCall.bucket`)."""
    recordings = _open_recordings()
    if not _observers and not recordings:
        return fn()
    call = _call(op, tensor, group, async_op, ranks, extra)
    call.bucket = bucket
    for calls in recordings:
        calls.append(call)
    for obs in _observers:
        obs.before(call)
    work = fn()
    if async_op and work is not None and op not in POINT_TO_POINT and not _has_future(work):
        work = IssuerWaitedWork(work)
    for obs in _observers:
        obs.after(call, work)
    return work


#: ops whose future-less handles (gloo's send and recv) are passed on unwrapped: they stay untimed
POINT_TO_POINT = frozenset({"send", "recv"})


def _has_future(work) -> bool:
    try:
        work.get_future()
    except RuntimeError:
        return False
    return True


class IssuerWaitedWork:
    """An async collective's handle whose backend gives it no future (gloo's reduce_scatter), as
    :func:`_issue` hands it to the observers and the issuer while observers are present.

    gloo's reduce_scatter writes its output inside ``wait()``; a second waiter beside the issuer
    can write it again after the issuer has moved on (ZeRO's reducer divides the slice it received
    by the world size), so no observer may wait on the handle itself. Instead
    :meth:`get_future` is completed when the issuer's ``wait()`` returns (with True) or raises
    (with False): the op's end as the issuer sees it, which is when its output exists. Anything
    else is the wrapped handle's."""

    __slots__ = ("work", "_future")

    def __init__(self, work):
        self.work = work
        self._future = torch.futures.Future()

    def wait(self, *args, **kwargs):
        try:
            result = self.work.wait(*args, **kwargs)
        except BaseException:
            if not self._future.done():
                self._future.set_result(False)
            raise
        if not self._future.done():
            self._future.set_result(True)
        return result

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future

    def __getattr__(self, name):
        return getattr(self.work, name)


def _call(op: str, tensor: torch.Tensor, group, async_op: bool, ranks: list[int] | None,
          extra: dict) -> CollectiveCall:
    ranks = _group_ranks(group) if ranks is None else ranks
    return CollectiveCall(
        op=op,
        seq=next(_seq),
        numel=tensor.numel(),
        dtype=tensor.dtype,
        element_size=tensor.element_size(),
        group_size=len(ranks),
        group_ranks=ranks,
        async_op=async_op,
        device=tensor.device,
        group_name=_group_name(group),
        extra=extra,
    )


def averaging_op(group=None):
    """``ReduceOp.AVG`` when ``group``'s backend averages inside the collective (nccl), else None
    (gloo has no AVG: divide by the group's size before a SUM)."""
    if not is_initialized():
        return None
    return ReduceOp.AVG if dist.get_backend(group) == "nccl" else None


def staging_device(tensor: torch.Tensor, group=None) -> torch.device | None:
    """The device a host ``tensor`` must be copied to before a collective over ``group``: the
    current CUDA device when the group's backend has no CPU path (nccl), else None (gloo, or the
    tensor is already on a device)."""
    if tensor.device.type != "cpu" or not is_initialized():
        return None
    backend = str(dist.get_backend(group))
    if backend == "nccl" or ("cpu:" not in backend and "gloo" not in backend and "mpi" not in backend):
        return torch.device("cuda", torch.cuda.current_device())
    return None


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False,
               bucket: int | None = None):
    """In-place all-reduce of ``tensor`` across ``group``; ``bucket`` tags a gradient bucket's
    reduction for observers (:attr:`CollectiveCall.bucket`)."""
    if not is_initialized():
        return None
    return _issue(
        "all_reduce", tensor, group, async_op,
        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op), bucket=bucket,
    )


# torch 2.13 renamed the flat-tensor collectives (*_single) and deprecates the old names; older
# releases (the GPU machines run 2.11) have only the old ones.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False, bucket: int | None = None):
    """Reduce ``input`` across ranks and leave this rank's equal slice in ``output``.

    The observed size is the input's (nccl-tests' convention for reduce_scatter); ``bucket`` tags
    a gradient bucket's reduction for observers (:attr:`CollectiveCall.bucket`).
    """
    if not is_initialized():
        output.copy_(input.view(-1)[: output.numel()].view_as(output))
        return None
    return _issue(
        "reduce_scatter", input, group, async_op,
        lambda: _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op),
        bucket=bucket,
    )


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Gather every rank's ``input`` into ``output`` (rank order along dim 0).

    The observed size is the output's (nccl-tests' convention for all_gather).
    """
    if not is_initialized():
        output.copy_(input.view_as(output))
        return None
    return _issue(
        "all_gather", output, group, async_op,
        lambda: _all_gather_single(output, input, group=group, async_op=async_op),
    )


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    if not is_initialized():
        return None
    return _issue(
        "broadcast", tensor, group, async_op,
        lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op), src=src,
    )


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group=None, async_op: bool = False):
    """Scatter slices of ``input`` (along dim 0) to the ranks of ``group`` and gather theirs into
    ``output``. Without split sizes the slices are equal; with them, ``input_split_sizes[r]`` rows
    go to rank r and ``output_split_sizes[r]`` rows come from it (an expert-parallel exchange of
    variable token counts).

    The observed size is the input's; the record's ``extra`` carries the split sizes when given.
    """
    if not is_initialized():
        output.copy_(input)
        return None
    extra = {}
    if output_split_sizes is not None or input_split_sizes is not None:
        extra = {"input_split_sizes": list(input_split_sizes or []),
                 "output_split_sizes": list(output_split_sizes or [])}
    return _issue(
        "all_to_all", input, group, async_op,
        lambda: dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                       input_split_sizes=input_split_sizes, group=group,
                                       async_op=async_op),
        **extra,
    )


def barrier(group=None):
    if not is_initialized():
        return None
    empty = torch.empty(0)
    return _issue("barrier", empty, group, False, lambda: dist.barrier(group=group))


def all_gather_object(obj, group=None) -> list:
    """Every rank's picklable ``obj``, in rank order (used for small metadata such as RNG states).

    Observers see it with a size of 0 bytes: its pickled size is not known before it runs.
    """
    if not is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    _issue("all_gather_object", torch.empty(0), group, False,
           lambda: dist.all_gather_object(out, obj, group=group))
    return out


# -- point to point --------------------------------------------------------------------------
#
# A transfer is observed on both sides: op "send" on the sender, "recv" on the receiver, each with
# ``group_ranks`` [sender, receiver] (global ranks) and ``group_size`` 2, so that the n-th send
# from a to b and the n-th receive of b from a carry the same per-(group, op) count in a logger.


@dataclass
class P2POp:
    """One side of a point-to-point transfer for :func:`batch_isend_irecv`: ``op`` "send" (to
    ``peer``) or "recv" (from ``peer``), ``peer`` a global rank, ``group`` the process group the
    transfer runs in (None: the default group)."""

    op: str
    tensor: torch.Tensor
    peer: int
    group: object = None

    def __post_init__(self):
        if self.op not in ("send", "recv"):
            raise ValueError(f"P2POp.op must be 'send' or 'recv', got {self.op!r}")


def _pair(op: str, peer: int) -> list[int]:
    me = dist.get_rank()
    if peer == me:
        raise ValueError(f"rank {me} cannot {op} to or from itself")
    return [me, peer] if op == "send" else [peer, me]


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    """Send ``tensor`` to global rank ``dst`` and wait until it is handed over."""
    _require_group("send")
    _issue("send", tensor, group, False, lambda: dist.send(tensor, dst=dst, group=group),
           ranks=_pair("send", dst))


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    """Receive into ``tensor`` from global rank ``src`` (blocking)."""
    _require_group("recv")
    _issue("recv", tensor, group, False, lambda: dist.recv(tensor, src=src, group=group),
           ranks=_pair("recv", src))


def isend(tensor: torch.Tensor, dst: int, group=None):
    """Start sending ``tensor`` to global rank ``dst``; returns the work handle."""
    _require_group("isend")
    return _issue("send", tensor, group, True, lambda: dist.isend(tensor, dst=dst, group=group),
                  ranks=_pair("send", dst))


def irecv(tensor: torch.Tensor, src: int, group=None):
    """Start receiving into ``tensor`` from global rank ``src``; returns the work handle."""
    _require_group("irecv")
    return _issue("recv", tensor, group, True, lambda: dist.irecv(tensor, src=src, group=group),
                  ranks=_pair("recv", src))


def batch_isend_irecv(ops: list[P2POp]) -> list:
    """Post every transfer of ``ops`` at once (torch's ``batch_isend_irecv``: on nccl one
    grouped launch, so that a send and a receive between the same two ranks cannot wait on each
    other); returns one work handle per op (wait on all of them). Observers see each op."""
    _require_group("batch_isend_irecv")
    if not ops:
        return []
    recordings = _open_recordings()
    observed = bool(_observers or recordings)
    calls = []
    if observed:
        for op in ops:
            call = _call(op.op, op.tensor, op.group, True, _pair(op.op, op.peer), {})
            calls.append(call)
            for recorded in recordings:
                recorded.append(call)
            for obs in _observers:
                obs.before(call)
    torch_ops = [dist.P2POp(dist.isend if op.op == "send" else dist.irecv, op.tensor, op.peer,
                            group=op.group) for op in ops]
    works = list(dist.batch_isend_irecv(torch_ops))
    if len(works) != len(ops):  # a coalesced launch answers with one handle for all
        works = [works[-1]] * len(ops) if works else [None] * len(ops)
    for call, work in zip(calls, works):
        for obs in _observers:
            obs.after(call, work)
    return works


def _require_group(op: str) -> None:
    if not is_initialized():
        raise RuntimeError(f"{op} needs a process group: a single process has no peer to talk to")
