"""The training data loader :func:`dslab.initialize` returns when given ``training_data``."""

from __future__ import annotations

from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler


def build_dataloader(dataset: Dataset, micro_batch_size: int, rank: int, world_size: int,
                     collate_fn=None, seed: int = 0) -> DataLoader:
    """Each rank sees its own shard (a DistributedSampler) in micro-batches, shuffled by ``seed``.

    Call ``loader.sampler.set_epoch(epoch)`` between epochs for a new order when distributed.
    """
    if world_size > 1:
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    else:
        sampler = RandomSampler(dataset)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                      drop_last=world_size > 1)
