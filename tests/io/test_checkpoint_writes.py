"""Checkpoint files written through the async handle: torch.save's content, the manifest's
sizes and sha256 taken on the way, atomic on failure, and an engine that resumes bit for bit."""

from __future__ import annotations

import hashlib
import json
import resource
import signal
import sys
from pathlib import Path

import pytest
import torch

import dslab
from dslab.engine.checkpoint_io import CheckpointError, load_checkpoint_files, save_checkpoint_files
from dslab.io import AsyncIOError, AsyncIOHandle, save_through_handle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from helpers import TinyNet, base_config, make_data  # noqa: E402


def _objects() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(300, 77, generator=g), "b": torch.randn(13, generator=g).half(),
                      "steps": torch.tensor(3)},
            "client_state": {"epoch": 2, "names": ["a", "b"], "blob": b"\x00\x01"},
            "big": {"x": torch.randn(5 << 20, generator=g)}}  # 20 MiB: more than one 16 MiB buffer


@pytest.fixture
def handle():
    with AsyncIOHandle(block_size=65536, queue_depth=8, intra_op_parallelism=2, overlap_events=True) as h:
        yield h


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_save_through_handle_is_torch_save_hashed_on_the_way(handle, tmp_path):
    for name, obj in _objects().items():
        path = tmp_path / f"{name}.pt"
        size, digest = save_through_handle(obj, path, handle)
        assert size == path.stat().st_size
        assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
        assert _equal(torch.load(path, weights_only=True), obj), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.pt", "client_state.pt", "model.pt"]


def test_a_failed_write_leaves_neither_file_nor_temporary(handle, tmp_path):
    old = tmp_path / "big.pt"
    old.write_bytes(b"previous")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(AsyncIOError, match=r"big.pt.tmp-[0-9a-f]+ at offset \d+"):
            save_through_handle(_objects()["big"], old, handle)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert [p.name for p in tmp_path.iterdir()] == ["big.pt"] and old.read_bytes() == b"previous"


def test_checkpoint_files_through_the_handle_match_torch_save(handle, tmp_path):
    objects = _objects()
    plain = save_checkpoint_files(tmp_path / "plain", "t", objects, {"k": 1})
    fast = save_checkpoint_files(tmp_path / "fast", "t", objects, {"k": 1}, handle=handle)
    assert sorted(p.name for p in plain.iterdir()) == sorted(p.name for p in fast.iterdir())
    manifest = json.loads((fast / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        data = (fast / entry["file"]).read_bytes()
        assert entry["bytes"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()
    _, plain_loaded, _ = load_checkpoint_files(tmp_path / "plain")
    _, fast_loaded, metadata = load_checkpoint_files(tmp_path / "fast")
    assert metadata == {"k": 1} and _equal(fast_loaded, plain_loaded) and _equal(fast_loaded, objects)
    with open(fast / "big.pt", "r+b") as f:  # the manifest still guards what the handle wrote
        f.truncate(1000)
    with pytest.raises(CheckpointError, match="big.pt is truncated"):
        load_checkpoint_files(tmp_path / "fast")


def _engine(tmp_path, seed=0):
    torch.manual_seed(seed)
    cfg = base_config(aio={"block_size": 16384, "queue_depth": 4, "intra_op_parallelism": 2})
    engine, _, _, _ = dslab.initialize(model=TinyNet(dropout=0.1), config=cfg)
    return engine


def _train(engine, steps, start):
    x, y = make_data(8 * (start + steps), seed=4)
    for s in range(start, start + steps):
        loss = engine(x[s * 8:(s + 1) * 8], y[s * 8:(s + 1) * 8])
        engine.backward(loss)
        engine.step()


def test_an_engine_with_an_aio_section_checkpoints_through_it_and_resumes_bit_for_bit(tmp_path):
    engine = _engine(tmp_path)
    _train(engine, 2, 0)
    path = engine.save_checkpoint(tmp_path / "ckpt")
    records = engine.profiler_records()["io"]
    _train(engine, 2, 2)
    expected = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    written = {Path(e["path"]).name: e for e in records["events"] if e["kind"] == "checkpoint_write"}
    assert sorted(written) == ["client_state.pt", "engine.pt", "model.pt", "optimizer.pt"]
    for name, event in written.items():
        assert event["nbytes"] == (path / name).stat().st_size and event["GBps"] > 0
    (operation,) = [op for op in records["operations"] if op["kind"] == "checkpoint_write"]
    assert operation["count"] == 4 and operation["bytes"] == sum(e["nbytes"] for e in written.values())
    resumed = _engine(tmp_path, seed=1)
    resumed.load_checkpoint(tmp_path / "ckpt")
    _train(resumed, 2, 2)
    for key, value in expected.items():
        assert torch.equal(resumed.module.state_dict()[key], value), key
    resumed.destroy()
