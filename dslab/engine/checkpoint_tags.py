"""The ``checkpoint`` section (DeepSpeed's keys) and the check that every rank saves under one tag.

``save_checkpoint`` is called on every rank, and each writes its files (rank 0 the model and the
optimizer's metadata, every ZeRO rank its shard) under ``<save_dir>/<tag>``. A tag that differs
across ranks (a timestamp taken on each rank, say) scatters one checkpoint over several
directories, none of which loads. ``checkpoint.tag_validation`` says what happens then:
``"Warn"`` (the default, as in DeepSpeed) logs which ranks used which tag, ``"Fail"`` raises on
every rank before anything is written, ``"Ignore"`` skips the check (and its collective).
"""

from __future__ import annotations

import logging

from pydantic import field_validator

from dslab import comm
from dslab.config_base import ConfigSection, accepted_off

log = logging.getLogger(__name__)

TAG_VALIDATION_MODES = ("Ignore", "Warn", "Fail")


class CheckpointConfig(ConfigSection):
    """DeepSpeed's ``checkpoint`` section: ``tag_validation`` (any case of Ignore, Warn, Fail);
    ``use_node_local_storage`` and ``load_universal`` are accepted only when false."""

    tag_validation: str = "Warn"
    use_node_local_storage: bool = False
    load_universal: bool = False

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _mode(cls, value):
        if isinstance(value, str):
            for mode in TAG_VALIDATION_MODES:
                if value.lower() == mode.lower():
                    return mode
        raise ValueError(f"config key 'checkpoint.tag_validation' must be one of "
                         f"{', '.join(TAG_VALIDATION_MODES)} (any case), got {value!r}")

    _off = accepted_off("use_node_local_storage", "load_universal",
                        why="a DeepSpeed feature dslab does not support yet")


def check_tag(tag: str, mode: str) -> None:
    """Compare ``tag`` across the ranks (a collective, unless ``mode`` is ``"Ignore"`` or there is
    one rank): when they differ, log it (``"Warn"``) or raise ``ValueError`` on every rank
    (``"Fail"``), naming each tag and its ranks."""
    if mode == "Ignore" or not comm.is_initialized() or comm.get_world_size() == 1:
        return
    tags = comm.all_gather_object(str(tag))
    if len(set(tags)) == 1:
        return
    ranks_of: dict[str, list[int]] = {}
    for rank, each in enumerate(tags):
        ranks_of.setdefault(each, []).append(rank)
    detail = "; ".join(f"{each!r} on rank(s) {', '.join(map(str, ranks))}" for each, ranks in ranks_of.items())
    message = (f"save_checkpoint was called with different tags on different ranks ({detail}): each rank "
               f"writes its files under its own tag, and no directory holds a whole checkpoint")
    if mode == "Fail":
        raise ValueError(f"{message} (config key 'checkpoint.tag_validation' is Fail)")
    log.warning("%s (config key 'checkpoint.tag_validation' is Warn)", message)
