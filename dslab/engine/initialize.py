"""``dslab.initialize`` and ``dslab.add_config_arguments``: DeepSpeed's entry points."""

from __future__ import annotations

import argparse

from dslab import comm
from dslab.engine.autotuning.experiment import attach_from_env as attach_autotuning_experiment
from dslab.engine.config import load_config
from dslab.engine.data import build_dataloader
from dslab.engine.engine import DslabEngine
from dslab.engine.pipe_engine import PipelineEngine
from dslab.parallel.pipe.module import PipelineModule


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
               lr_scheduler=None, mpu=None, config=None, collate_fn=None, dist_init_required=None,
               config_params=None):
    """Build the engine around ``model``.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)`` as DeepSpeed does; the
    dataloader is None unless ``training_data`` is given (its sampler splits the data over the
    data-parallel ranks). ``config_params`` is DeepSpeed's older name for ``config``.

    ``mpu``: a Megatron-style model-parallel unit (or dslab's ``PipelineParallelGrid``): data
    parallelism then runs over its data-parallel group (:mod:`dslab.engine.model_parallel`). A
    :class:`~dslab.parallel.pipe.PipelineModule` gets the pipeline engine
    (:class:`~dslab.engine.pipe_engine.PipelineEngine`, ``train_batch``), with its own grid.
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
    engine_class = PipelineEngine if isinstance(model, PipelineModule) else DslabEngine
    engine = engine_class(model, cfg, optimizer=optimizer, model_parameters=model_parameters,
                          lr_scheduler=lr_scheduler, mpu=mpu)
    # an autotuning experiment (DSLAB_AUTOTUNING_EXPERIMENT set): times its steps, then exits
    attach_autotuning_experiment(engine)
    loader = None
    if training_data is not None:
        loader = build_dataloader(training_data, engine.train_micro_batch_size_per_gpu(),
                                  engine.dp_rank, engine.dp_world_size, collate_fn)
        if isinstance(engine, PipelineEngine):
            engine.training_dataloader = loader
            engine.set_dataiterator(RepeatingLoader(loader))
    return engine, engine.optimizer, loader, engine.lr_scheduler


class RepeatingLoader:
    """An iterator over ``loader`` that starts it again when it ends (DeepSpeed's name): the
    pipeline engine reads micro-batches across epochs."""

    def __init__(self, loader):
        self.loader = loader
        self._it = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            return next(self._it)
