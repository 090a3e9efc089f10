"""``dslab.initialize`` and ``dslab.add_config_arguments``: DeepSpeed's entry points."""

from __future__ import annotations

import argparse

from dslab import comm
from dslab.engine.config import load_config
from dslab.engine.data import build_dataloader
from dslab.engine.engine import DslabEngine


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--deepspeed``, ``--deepspeed_config`` and ``--dslab_config`` to ``parser``."""
    group = parser.add_argument_group("dslab", "dslab configuration")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable the dslab engine (kept for DeepSpeed scripts)")
    group.add_argument("--deepspeed_config", "--dslab_config", dest="deepspeed_config", default=None,
                       type=str, help="path to the JSON config (DeepSpeed's keys)")
    return parser


def _config_from(args, config):
    path = None
    if args is not None:
        path = getattr(args, "deepspeed_config", None) or getattr(args, "dslab_config", None)
    if path is not None and config is not None:
        raise ValueError("a config was given both as args.deepspeed_config and as config=; keep one")
    chosen = config if config is not None else path
    if chosen is None:
        raise ValueError("no config: pass config= (a dict or a JSON path) or args.deepspeed_config")
    return load_config(chosen)


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, config=None, collate_fn=None, dist_init_required=None,
               config_params=None):
    """Build the engine around ``model``.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)`` as DeepSpeed does; the
    dataloader is None unless ``training_data`` is given. ``config_params`` is DeepSpeed's older
    name for ``config``.
    """
    if model is None:
        raise ValueError("initialize() needs a model")
    if config is None and config_params is not None:
        config = config_params
    cfg = _config_from(args, config)
    if dist_init_required is None or dist_init_required:
        joined = comm.init_distributed()
        if dist_init_required and not joined:
            raise ValueError(
                "dist_init_required=True but no distributed environment was found "
                "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); launch with torchrun or dslab launch"
            )
    engine = DslabEngine(model, cfg, optimizer=optimizer, model_parameters=model_parameters,
                         lr_scheduler=lr_scheduler)
    loader = None
    if training_data is not None:
        loader = build_dataloader(training_data, engine.train_micro_batch_size_per_gpu(),
                                  engine.rank, engine.world_size, collate_fn)
    return engine, engine.optimizer, loader, engine.lr_scheduler
