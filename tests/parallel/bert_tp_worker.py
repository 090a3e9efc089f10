"""Two or four gloo ranks (torchrun): BERT split over the tensor-parallel group against the dense
model built from the same seed on every rank - loss, logits, every gradient, and steps through
the engine with the grid as mpu (see test_bert_tensor_parallel.py). Writes rank 0's findings."""

import sys
from pathlib import Path

import torch

import dslab
from dslab import comm
from dslab.models.bert import BertForPreTraining, bert_tiny
from dslab.parallel.tensor_parallel import gather_tensor_parallel
from dslab.parallel.topology import PipelineParallelGrid, PipeModelDataParallelTopology


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 1000, (4, 24), generator=g)
    labels = torch.where(torch.rand(4, 24, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    mask = torch.ones(4, 24, dtype=torch.long)
    mask[1, 18:] = 0  # a padded row: the key padding mask reaches every rank's heads
    return ids, torch.randint(0, 2, (4, 24), generator=g), mask, labels, torch.randint(0, 2, (4,), generator=g)


def main(out: str, pre_ln: int):
    comm.init_distributed(dist_backend="gloo")
    tp = comm.get_world_size()
    grid = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=tp, num_dp=1))
    group = grid.get_model_parallel_group()
    config = bert_tiny(hidden_dropout=0.0, attention_dropout=0.0, pre_ln=bool(pre_ln), sparse_mlm=False)
    torch.manual_seed(0)
    dense = BertForPreTraining(config, "torch")
    torch.manual_seed(0)
    split = BertForPreTraining(bert_tiny(hidden_dropout=0.0, attention_dropout=0.0, pre_ln=bool(pre_ln),
                                         sparse_mlm=False, tp_size=tp), "torch", tp_group=group)
    found = {}
    # the engine (mpu) adds each rank's stream for its heads' dropout: inside a fork every rank
    # draws its own numbers, outside the same ones
    from dslab.parallel.random import get_rng_tracker, model_parallel_seed
    model_parallel_seed(9, group)
    with get_rng_tracker().fork():
        inside = torch.rand(4)
    outside = torch.rand(4)
    found["fork_draws"] = comm.all_gather_object((inside.tolist(), outside.tolist()), group=group)
    # the same seed builds the slices of the dense model
    gathered = split.dense_state_dict()
    found["init_max_diff"] = max((gathered[k] - v).abs().max().item() for k, v in dense.state_dict().items())
    ids, types, mask, labels, nsp = batch(0)
    loss_dense = dense(ids, types, mask, labels, nsp)
    loss_split = split(ids, types, mask, labels, nsp)
    found["loss"] = (loss_dense.item(), loss_split.item())
    loss_dense.backward()
    loss_split.backward()
    diffs = {}
    for name, p in split.named_parameters():
        grad = p.grad
        if getattr(p, "tensor_model_parallel", False):
            grad = gather_tensor_parallel(grad, group, p.partition_dim, p.partition_stride)
        reference = dict(dense.named_parameters())[name].grad
        diffs[name] = ((grad - reference).abs().max() / reference.abs().max().clamp(min=1e-12)).item()
    found["grad_rel_diff"] = diffs
    with torch.no_grad():
        logits_dense, _ = dense(ids, types, mask)
        logits_split, _ = split(ids, types, mask)
    found["logits_max_diff"] = (logits_dense - logits_split).abs().max().item()
    # training through the engine with the grid as mpu, against the dense engine
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5,
           "optimizer": {"type": "SGD", "params": {"lr": 0.2}}}
    plain, _, _, _ = dslab.initialize(model=dense, config=cfg, dist_init_required=False)
    engine, _, _, _ = dslab.initialize(model=split, config=cfg, mpu=grid)
    for module in (dense, split):
        module.zero_grad(set_to_none=True)
    losses = []
    for step in range(4):
        ids, types, mask, labels, nsp = batch(step + 1)
        row = []
        for e in (plain, engine):
            loss = e(ids, types, mask, labels, nsp)
            e.backward(loss)
            e.step()
            row.append(loss.item())
        losses.append(row)
    found["engine_losses"] = losses
    if comm.get_rank() == 0:
        torch.save(found, Path(out))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
