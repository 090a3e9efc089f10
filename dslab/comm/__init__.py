"""The one door to ``torch.distributed``.

Every collective dslab issues goes through the functions here, so that observers (the comms
logger, tests) see each call with its size, group and handle. Nothing else in dslab calls
``torch.distributed`` collectives directly.
"""

from dslab.comm.collectives import (
    CollectiveCall,
    ReduceOp,
    add_observer,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    reduce_scatter_tensor,
    remove_observer,
)
from dslab.comm.process import (
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
)

__all__ = [
    "CollectiveCall",
    "ReduceOp",
    "add_observer",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "reduce_scatter_tensor",
    "remove_observer",
]
