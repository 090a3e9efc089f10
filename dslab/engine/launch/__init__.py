"""``dslab launch``: one torchrun per host, from a DeepSpeed-style hostfile.

:mod:`.hostfile` reads ``hostname slots=N`` files, :mod:`.resources` applies ``--include`` /
``--exclude`` / ``--num_nodes`` / ``--num_gpus``, :mod:`.environment` gathers what remote hosts
must inherit (``.dslab_env``, ``NCCL_*``, ``PYTHON*``), :mod:`.commands` builds the command
lines and :mod:`.runner` starts them, waits and returns the worst exit status.
"""
