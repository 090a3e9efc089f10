"""One rank of the sequence-parallel Llama test, started by torchrun (see
test_llama_sequence_parallel.py):

    llama_sp_worker.py OUT_DIR

Every rank builds the same tiny grouped-query Llama (same seed) twice: unsplit, and split over
the world (``sequence_parallel_size`` = world). Both get the same whole batch (ignored labels
spread over the chunks). The split model's loss must equal the unsplit one's on every rank, and
its gradients summed over the ranks (what a data-parallel reduction over the group does) the
unsplit model's; then three SGD steps, the split model's gradients summed each step, keep the
losses equal. For both kernel sets. A failed check raises and the process exits non-zero. Each
rank writes ``rank<r>.json``: its losses and the checks it passed.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dslab import comm
from dslab.models.llama import LlamaForCausalLM, llama_tiny

TOL = dict(rtol=2e-5, atol=2e-6)


def batch(vocab: int, seq: int):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (2, seq), generator=g)
    labels = ids.clone()
    labels[0, 1:4] = -100  # in the first chunk
    labels[1, seq - 3:] = -100  # in the last chunk
    return ids, labels


def run(kernels: str, world: int) -> dict:
    base = llama_tiny(layers=2, heads=4, kv_heads=2)
    split_config = llama_tiny(layers=2, heads=4, kv_heads=2, sequence_parallel_size=world)
    torch.manual_seed(5)
    whole = LlamaForCausalLM(base, kernels=kernels)
    split = LlamaForCausalLM(split_config, kernels=kernels)
    split.load_state_dict(whole.state_dict())
    ids, labels = batch(base.vocab_size, 8 * world)
    opt_whole = torch.optim.SGD(whole.parameters(), lr=0.5)
    opt_split = torch.optim.SGD(split.parameters(), lr=0.5)
    losses = []
    for step in range(3):
        ref = whole(ids, labels)
        loss = split(ids, labels)
        torch.testing.assert_close(loss, ref, **TOL, msg=f"{kernels} step {step}: loss")
        ref.backward()
        loss.backward()
        for (name, p), q in zip(split.named_parameters(), whole.parameters()):
            comm.all_reduce(p.grad)
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=f"{kernels} step {step}: {name}")
        opt_whole.step()
        opt_split.step()
        opt_whole.zero_grad()
        opt_split.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], f"{kernels}: the loss did not fall: {losses}"
    with torch.no_grad():  # without labels: this rank's chunk of the logits
        chunk = split(ids)
        full = whole(ids)
        rank, size = dist.get_rank(), world
        step = ids.shape[1] // size
        torch.testing.assert_close(chunk, full[:, rank * step:(rank + 1) * step], **TOL)
    return {"losses": losses}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    result = {"rank": dist.get_rank(), "world": world}
    for kernels in ("torch", "dslab"):
        result[kernels] = run(kernels, world)
    try:
        LlamaForCausalLM(llama_tiny(heads=8, head_dim=16, sequence_parallel_size=2 * world), kernels="torch")
    except ValueError as err:
        result["wrong_size"] = str(err)
    try:
        LlamaForCausalLM(llama_tiny(sequence_parallel_size=world), kernels="torch")(torch.zeros(1, 8 * world + 1,
                                                                                                dtype=torch.long))
    except ValueError as err:
        result["indivisible_seq"] = str(err)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears its sockets down while another still sends on them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
