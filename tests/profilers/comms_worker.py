"""One rank of the comms-logger test, started by torchrun (see test_comms_multiprocess.py).

Rank 1 sleeps SLEEP_S before each all_reduce and each all_gather: it is the straggler. Rank 0
pickles its ``log_summary(show_straggler=True, return_dict=True)`` and ``records()`` to argv[1].
"""

import pickle
import sys
import time

import torch
import torch.distributed as dist

from dslab import comm
from dslab.profilers.comms import CommsLogger, CommsLoggerConfig

SLEEP_S = 0.05
ALL_REDUCES, ALL_GATHERS, BROADCASTS = 10, 4, 5


def main(out_path: str) -> None:
    comm.init_distributed(dist_backend="gloo")
    rank, world = comm.get_rank(), comm.get_world_size()
    logger = CommsLogger(CommsLoggerConfig(enabled=True))
    grads = torch.ones(1000)  # 4000 bytes
    for _ in range(ALL_REDUCES):
        if rank == 1:
            time.sleep(SLEEP_S)
        comm.all_reduce(grads)
    shard, full = torch.full((256,), float(rank)), torch.empty(256 * world)  # 3072 bytes gathered
    for _ in range(ALL_GATHERS):
        if rank == 1:
            time.sleep(SLEEP_S)
        comm.all_gather_into_tensor(full, shard, async_op=True).wait()
    meta = torch.zeros(384)  # 1536 bytes
    for _ in range(BROADCASTS):
        comm.broadcast(meta, src=0)
    summary = comm.log_summary(show_straggler=True, return_dict=True)
    records = logger.records()
    logger.close()
    if rank == 0:
        with open(out_path, "wb") as f:
            pickle.dump({"world": world, "summary": summary, "records": records,
                         "all_reduce_result": grads[0].item()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
