"""dslab: a profiling-first performance lab for PyTorch.

The training loop is DeepSpeed's::

    engine, optimizer, loader, scheduler = dslab.initialize(model=model, config="ds_config.json")
    loss = engine(batch)
    engine.backward(loss)
    engine.step()
"""

__version__ = "0.1.0"

from dslab.comm import init_distributed  # noqa: E402
from dslab.engine.initialize import add_config_arguments, initialize  # noqa: E402

__all__ = ["__version__", "add_config_arguments", "init_distributed", "initialize"]
