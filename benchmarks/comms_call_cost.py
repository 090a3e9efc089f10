"""Host cost per collective of the comms logger's ways of timing an async NCCL call, on one GPU
(a process group of one, as a suite runs N = 1; start under torchrun):

    python -m torch.distributed.run --nproc_per_node 1 benchmarks/comms_call_cost.py [--calls 400]

Each variant issues ``--calls`` async all-reduces of 64 KiB and reports the host microseconds per
call: the bare call, the call with ``work.get_future()``, with a no-op ``then()`` callback, with
``then()`` recording an end event, and through ``dslab.comm`` with the comms logger observing.
"""

import argparse
import time

import torch
import torch.distributed as dist

from dslab import comm
from dslab.profilers.comms import CommsLogger, CommsLoggerConfig


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=400)
    args = p.parse_args(argv)
    comm.init_distributed()
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.ones(16384, device=device)

    def bare():
        dist.all_reduce(x, async_op=True)

    def future():
        dist.all_reduce(x, async_op=True).get_future()

    def then_noop():
        dist.all_reduce(x, async_op=True).get_future().then(lambda f: None)

    def then_event():
        def record(_f):
            torch.cuda.Event(enable_timing=True).record()
        dist.all_reduce(x, async_op=True).get_future().then(record)

    def event_after():
        dist.all_reduce(x, async_op=True)
        torch.cuda.Event(enable_timing=True).record()

    pool = [torch.cuda.Event(enable_timing=True) for _ in range(3 * (args.calls + 20))]
    for event in pool:
        event.record()  # created (CUDA creates an event at its first record)
    torch.cuda.synchronize()
    pooled = iter(pool)

    def create_event():
        dist.all_reduce(x, async_op=True)
        torch.cuda.Event(enable_timing=True)

    def pooled_after():
        dist.all_reduce(x, async_op=True)
        next(pooled).record()

    def then_pooled():
        end = next(pooled)
        dist.all_reduce(x, async_op=True).get_future().then(lambda _f: end.record())

    def then_pooled_stream():
        end = next(pooled)
        dist.all_reduce(x, async_op=True).get_future().then(lambda _f: torch.cuda.current_stream().record_event(end))

    def through_comm():
        comm.all_reduce(x, async_op=True)

    variants = [("bare", bare), ("get_future", future), ("then(no-op)", then_noop),
                ("then(record event)", then_event), ("event after the call", event_after),
                ("Event() object only", create_event), ("pooled event after", pooled_after),
                ("then(record pooled event)", then_pooled), ("then(stream.record_event)", then_pooled_stream),
                ("dslab.comm, no observer", through_comm)]
    rows = []
    for name, fn in variants:
        rows.append((name, timed(fn, args.calls)))
    logger = CommsLogger(CommsLoggerConfig(enabled=True))
    try:
        rows.append(("dslab.comm + comms logger", timed(through_comm, args.calls)))
    finally:
        logger.close()
    if comm.get_rank() == 0:
        print(f"{'variant':<28} host us/call ({args.calls} async all-reduces of 64 KiB)")
        for name, us in rows:
            print(f"{name:<28} {us:10.1f}")


def timed(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


if __name__ == "__main__":
    main()
