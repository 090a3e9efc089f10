"""Joining and leaving the process group (dslab.comm.process)."""

import pytest

from dslab import comm
from dslab.comm import process


def test_joining_registers_one_exit_handler_that_yields_then_leaves(tmp_path, monkeypatch):
    registered = []
    monkeypatch.setattr(process.atexit, "register", registered.append)
    monkeypatch.setattr(process, "_exit_handler_registered", False)
    store = f"file://{tmp_path / 'store'}"
    assert comm.init_distributed(dist_backend="gloo", init_method=store, rank=0, world_size=1)
    assert comm.init_distributed(dist_backend="gloo", init_method=store, rank=0, world_size=1)
    assert registered == [process._leave_at_exit]
    slept = []
    monkeypatch.setattr(process.time, "sleep", slept.append)
    process._leave_at_exit()
    # the group's worker threads get the GIL before the group goes
    assert slept == [process._EXIT_GRACE_S] and process._EXIT_GRACE_S > 0
    assert not comm.is_initialized()
    process._leave_at_exit()  # nothing left to leave
    assert slept == [process._EXIT_GRACE_S]


def test_no_environment_joins_nothing_and_registers_nothing(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    registered = []
    monkeypatch.setattr(process.atexit, "register", registered.append)
    monkeypatch.setattr(process, "_exit_handler_registered", False)
    assert comm.init_distributed() is False
    assert registered == []


def test_incomplete_environment_names_what_is_missing(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    for key in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"):
        comm.init_distributed()
