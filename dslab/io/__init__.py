"""dslab.io: async tensor I/O with DeepNVMe's API, and the I/O tuner.

- :class:`AsyncIOHandle` (``aio_handle``): ``sync_pread``/``sync_pwrite``/``async_pread``/
  ``async_pwrite``/``wait`` for CPU and CUDA tensors, ``O_DIRECT`` with aligned (pinned where
  CUDA is) buffers, kernel AIO lanes (:mod:`.handle`, :mod:`.lanes`, :mod:`.kernel_aio`).
- :class:`AioConfig`: the config's ``aio`` section (:mod:`.config`).
- :func:`save_through_handle`: ``torch.save`` through a handle, hashed as it goes
  (:mod:`.stream`), what checkpoint writes use.
- :mod:`.events`: the bytes and seconds of every swap and checkpoint write, for the run report.
- :mod:`.tune`: ``dslab nvme-tune``, beside fio (:mod:`.fio`).

This layer imports only :mod:`dslab.report` (and :mod:`dslab.config_base`).
"""

from dslab.io.config import AioConfig
from dslab.io.handle import AsyncIOHandle, aio_handle
from dslab.io.lanes import AsyncIOError, Request
from dslab.io.stream import HandleFileWriter, save_through_handle

__all__ = ["AioConfig", "AsyncIOError", "AsyncIOHandle", "HandleFileWriter", "Request",
           "aio_handle", "save_through_handle"]
