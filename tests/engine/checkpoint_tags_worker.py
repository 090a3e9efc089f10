"""One rank of test_checkpoint_tags.py, started by torchrun: ZeRO stage 1 on GPT-2 tiny, saved
with one tag on both ranks, then with a tag per rank under each ``checkpoint.tag_validation``."""

import json
import logging
import sys
from pathlib import Path

import torch

import dslab
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny


class Kept(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def save(root: Path, mode: str, per_rank: bool) -> dict:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0, layers=2), kernels="torch")
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 1}, "checkpoint": {"tag_validation": mode}}
    engine, *_ = dslab.initialize(model=model, config=config)
    ids = torch.randint(0, 1000, (2, 16))
    loss = engine(ids, labels=ids)
    engine.backward(loss)
    engine.step()
    kept = Kept()
    logging.getLogger("dslab.engine.checkpoint_tags").addHandler(kept)
    save_dir = root / f"{mode}-{per_rank}"
    result = {}
    try:
        engine.save_checkpoint(save_dir, tag=f"step-r{engine.rank}" if per_rank else "agreed")
    except ValueError as err:
        result["error"] = str(err)
    finally:
        logging.getLogger("dslab.engine.checkpoint_tags").removeHandler(kept)
    torch.distributed.barrier()
    result["warnings"] = kept.messages
    result["dirs"] = sorted(p.name for p in save_dir.iterdir() if p.is_dir()) if save_dir.is_dir() else []
    engine.destroy()
    return result


def main(root: str, out: str) -> None:
    root = Path(root)
    results = {"same": save(root, "Warn", False), "warn": save(root, "Warn", True),
               "fail": save(root, "Fail", True), "ignore": save(root, "Ignore", True)}
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
