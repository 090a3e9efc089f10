"""The one door to ``torch.distributed``.

Every collective dslab issues goes through the functions here, so that observers (the comms
logger, tests) see each call with its size, group and handle, and each replay of a CUDA graph that
holds collectives, as its owner announces it (:func:`recording_calls`, :func:`announce_replay`).
Nothing else in dslab calls ``torch.distributed`` collectives directly.
"""

from dslab.comm.collectives import (
    CollectiveCall,
    IssuerWaitedWork,
    P2POp,
    ReduceOp,
    add_observer,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    announce_replay,
    averaging_op,
    barrier,
    batch_isend_irecv,
    broadcast,
    irecv,
    isend,
    recording_calls,
    recv,
    reduce_scatter_tensor,
    remove_observer,
    send,
    staging_device,
)
from dslab.comm.process import (
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    new_group,
)

__all__ = [
    "CollectiveCall",
    "IssuerWaitedWork",
    "P2POp",
    "ReduceOp",
    "add_observer",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "announce_replay",
    "averaging_op",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "irecv",
    "is_initialized",
    "isend",
    "new_group",
    "log_summary",
    "recording_calls",
    "recv",
    "reduce_scatter_tensor",
    "remove_observer",
    "send",
    "staging_device",
    "set_summary_provider",
]


_summary_provider = None


def set_summary_provider(provider) -> None:
    """Register the function behind :func:`log_summary` (the comms logger does, when it starts;
    None unregisters). The comm layer keeps no records itself."""
    global _summary_provider
    _summary_provider = provider


def log_summary(show_straggler: bool = False, return_dict: bool = False):
    """Print (and with ``return_dict`` return) the comms logger's per-op summary.

    DeepSpeed's ``deepspeed.comm.log_summary``; needs the comms logger running
    (``"comms_logger": {"enabled": true}`` in the engine config)."""
    if _summary_provider is None:
        raise RuntimeError(
            "the comms logger is not running: add \"comms_logger\": {\"enabled\": true} to the config"
        )
    return _summary_provider(show_straggler=show_straggler, return_dict=return_dict)
