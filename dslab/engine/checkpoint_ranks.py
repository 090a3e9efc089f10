"""One atomic checkpoint written by several ranks (ZeRO shards, experts per expert-parallel rank).

Rank 0 begins the hidden partial directory (:func:`~dslab.engine.checkpoint_io.begin_checkpoint`),
every rank writes and fsyncs its own files there, rank 0 writes its files and the manifest (with
every file's size and sha256) and renames the directory into place. The ranks need a file system
they share. A failure on any rank fails the save on every rank: each step ends with an
all-gather of every rank's outcome.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from dslab import comm
from dslab.engine.checkpoint_io import (
    CheckpointError,
    abort_checkpoint,
    begin_checkpoint,
    commit_checkpoint,
    write_checkpoint_file,
)


def agree(value, error: str | None, what: str) -> list:
    """All-gather ``(value, error)``; raise on every rank when any rank failed, else return every
    rank's value in rank order."""
    results = comm.all_gather_object((value, error))
    errors = [e for _, e in results if e]
    if errors:
        raise CheckpointError(f"{what} failed: " + "; ".join(errors))
    return [v for v, _ in results]


def save_from_ranks(rank: int, save_dir, tag: str, own_files: dict[str, object],
                    rank0_files: Callable[[], dict], metadata: dict, save_latest: bool,
                    handle=None) -> Path:
    """Write ``<save_dir>/<tag>``: every rank its ``own_files`` (name -> object; names unique
    across ranks), rank 0 also ``rank0_files()`` (called on rank 0 only), through ``handle``
    when given (an :class:`~dslab.io.handle.AsyncIOHandle`). Call on every rank; returns the
    checkpoint's path."""
    partial, error = None, None
    if rank == 0:
        try:
            partial = str(begin_checkpoint(save_dir, tag))
        except Exception as err:  # every rank must hear of it, or the others wait forever
            error = f"rank 0: {err}"
    partial = agree(partial, error, "starting the checkpoint")[0]
    entries, error = {}, None
    for name, obj in own_files.items():
        try:
            entries[name] = write_checkpoint_file(partial, name, obj, handle)
        except Exception as err:
            error = f"rank {rank} writing {name}.pt: {err}"
            break
    try:
        written = agree(entries, error, "writing the ranks' files")
    except CheckpointError:
        if rank == 0:
            abort_checkpoint(partial)
        raise
    path, error = None, None
    if rank == 0:
        try:
            files = {n: write_checkpoint_file(partial, n, obj, handle)
                     for n, obj in rank0_files().items()}
            for rank_entries in written:
                files.update(rank_entries)
            path = str(commit_checkpoint(save_dir, tag, partial, files, metadata, save_latest))
        except Exception as err:
            abort_checkpoint(partial)
            error = f"rank 0 committing: {err}"
    return Path(agree(path, error, "committing the checkpoint")[0])
