"""One rank of the sequence-parallel GPT-2 test, started by torchrun (see
test_gpt2_sequence_parallel.py):

    gpt2_sp_worker.py OUT_DIR

Every rank builds the same tiny GPT-2 (same seed) unsplit, and split over a sequence-parallel
group: the whole world (the default group), and, on 4 ranks, the size-2 groups of
``initialize_sequence_parallel(2)`` (two replicas of two chunks each). The split model gets the
same whole batch (ignored labels spread over the chunks): its loss must equal the unsplit one's on
every rank, and its gradients summed over the group (what the engine's reduction over the group
does) the unsplit model's, the learned positions' rows included; three SGD steps keep the losses
equal. For both kernel sets; the dslab set's split model also checkpoints its layers. Without
labels each rank gets its chunk of the logits. A failed check raises and the process exits
non-zero. Each rank writes ``rank<r>.json``: its losses, its groups and the errors it caught.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dslab import comm
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny
from dslab.parallel.sequence import initialize_sequence_parallel

TOL = dict(rtol=2e-5, atol=2e-6)


def batch(vocab: int, seq: int):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (2, seq), generator=g)
    labels = ids.clone()
    labels[0, 1:4] = -100  # in the first chunk
    labels[1, seq - 3:] = -100  # in the last chunk
    return ids, labels


def run(kernels: str, size: int, group) -> dict:
    checkpoint_layers = 1 if kernels == "dslab" else 0
    torch.manual_seed(5)
    whole = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels=kernels)
    split = GPT2LMHeadModel(gpt2_tiny(dropout=0.0, sequence_parallel_size=size, checkpoint_layers=checkpoint_layers),
                            kernels=kernels, sp_group=group)
    split.load_state_dict(whole.state_dict())
    ids, labels = batch(whole.config.vocab_size, 8 * size)
    opt_whole = torch.optim.SGD(whole.parameters(), lr=0.5)
    opt_split = torch.optim.SGD(split.parameters(), lr=0.5)
    losses = []
    for step in range(3):
        ref = whole(ids, labels)
        loss = split(ids, labels)
        torch.testing.assert_close(loss, ref, **TOL, msg=f"{kernels} sp {size} step {step}: loss")
        ref.backward()
        loss.backward()
        for (name, p), q in zip(split.named_parameters(), whole.parameters()):
            comm.all_reduce(p.grad, group=group)
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=f"{kernels} sp {size} step {step}: {name}")
        # every chunk's positions got their gradient; the last position (scored against nothing,
        # and seen by no other under causal attention) and the rows past the sequence none
        seq = ids.shape[1]
        assert split.wpe.weight.grad[:seq - 1].abs().sum(dim=1).gt(0).all()
        assert split.wpe.weight.grad[seq - 1:].eq(0).all()
        for opt in (opt_whole, opt_split):
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], f"{kernels} sp {size}: the loss did not fall: {losses}"
    with torch.no_grad():  # without labels: this rank's chunk of the logits
        chunk = split(ids)
        full = whole(ids)
        rank, step = comm.get_rank(group), ids.shape[1] // size
        torch.testing.assert_close(chunk, full[:, rank * step:(rank + 1) * step], **TOL)
    return {"losses": losses}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    result = {"rank": rank, "world": world}
    for kernels in ("torch", "dslab"):
        result[f"{kernels}_world"] = run(kernels, world, None)
    if world == 4:
        groups = initialize_sequence_parallel(2)
        assert initialize_sequence_parallel(2) is groups  # made once
        result["groups"] = {"rank": groups.rank, "ranks": groups.ranks(), "dp_rank": groups.data_parallel_rank,
                            "dp_size": groups.data_parallel_size,
                            "dp_ranks": dist.get_process_group_ranks(groups.data_parallel_group)}
        result["torch_pairs"] = run("torch", 2, groups.group)
    try:
        GPT2LMHeadModel(gpt2_tiny(hidden=256, heads=8, sequence_parallel_size=2 * world), kernels="torch")
    except ValueError as err:
        result["wrong_size"] = str(err)
    try:
        model = GPT2LMHeadModel(gpt2_tiny(sequence_parallel_size=world), kernels="torch")
        model(torch.zeros(1, 8 * world + 1, dtype=torch.long))
    except ValueError as err:
        result["indivisible_seq"] = str(err)
    try:
        initialize_sequence_parallel(3)
    except ValueError as err:
        result["indivisible_world"] = str(err)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears its sockets down while another still sends on them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
