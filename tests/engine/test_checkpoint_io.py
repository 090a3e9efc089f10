"""Checkpoint file layer (dslab.engine.checkpoint_io) and RNG capture/restore (dslab.engine.rng)."""

import collections
import json
import os
import pathlib
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from dslab.engine import checkpoint_io
from dslab.engine.checkpoint_io import (
    CheckpointError,
    check_weights_only,
    load_checkpoint_files,
    save_checkpoint_files,
)
from dslab.engine.rng import capture_rng_state, restore_rng_state


def assert_same(a, b, where="obj"):
    """Structural equality, tensors compared bit-for-bit with dtype and shape."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
        assert a.requires_grad == b.requires_grad, where
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def make_training_state(seed):
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.GELU(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(2):
        loss = model(torch.randn(4, 7, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    model_state = {
        "module": model.state_dict(),
        "fp16_copy": {k: v.half() for k, v in model.state_dict().items()},
        "bf16_copy": {k: v.bfloat16() for k, v in model.state_dict().items()},
        "step_counts": torch.randint(0, 1000, (3,), generator=gen, dtype=torch.int64),
        "mask": torch.rand(5, generator=gen) > 0.5,
        "bytes": torch.randint(0, 255, (6,), generator=gen, dtype=torch.uint8),
        "complex": torch.randn(3, generator=gen, dtype=torch.complex64),
        "shape": torch.Size([4, 7]),
        "dtype": torch.bfloat16,
        "global_steps": 17,
        "skipped_steps": 0,
        "loss_scale": 65536.0,
        "name": "gpt2",
        "none": None,
        "ordered": collections.OrderedDict([("b", 1), ("a", (2, 3.5))]),
    }
    client_state = {"epoch": 3, "sampler": {"indices": [3, 1, 2], "offset": 8},
                    "rng": capture_rng_state()}
    return model_state, {"optimizer": opt.state_dict()}, client_state


def save_a(tmp_path, tag="step10", seed=0, **kw):
    model_state, optim_state, client_state = make_training_state(seed)
    files = {"mp_rank_00_model_states": model_state, "optim_states": optim_state,
             "client_state": client_state}
    path = save_checkpoint_files(tmp_path, tag, files, {"global_steps": seed, "tag": tag}, **kw)
    return path, files


def leftovers(root):
    return sorted(p.name for p in pathlib.Path(root).iterdir() if p.name.startswith("."))


# --- round trip and manifest -------------------------------------------------------------------

def test_round_trip_nested_state(tmp_path):
    path, files = save_a(tmp_path, seed=1)
    assert path == tmp_path / "step10"
    assert sorted(os.listdir(path)) == ["client_state.pt", "manifest.json",
                                        "mp_rank_00_model_states.pt", "optim_states.pt"]
    loaded_path, loaded, metadata = load_checkpoint_files(tmp_path)
    assert loaded_path == path
    assert metadata == {"global_steps": 1, "tag": "step10"}
    assert_same(files, loaded)
    assert leftovers(tmp_path) == []


def test_manifest_records_sizes_and_hashes(tmp_path):
    import hashlib

    path, files = save_a(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == checkpoint_io.FORMAT_VERSION
    assert manifest["dslab_version"] not in ("", None)
    assert set(manifest["files"]) == set(files)
    for name, entry in manifest["files"].items():
        data = (path / f"{name}.pt").read_bytes()
        assert entry["bytes"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()


def test_loads_map_to_cpu_and_are_weights_only(tmp_path, monkeypatch):
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    save_a(tmp_path)
    load_checkpoint_files(tmp_path, "step10")
    assert calls and all(c.get("weights_only") is True and c.get("map_location") == "cpu"
                         for c in calls)


# --- latest -----------------------------------------------------------------------------------

def test_latest_follows_saves(tmp_path):
    save_a(tmp_path, "step10", seed=10)
    save_a(tmp_path, "step20", seed=20)
    assert (tmp_path / "latest").read_text() == "step20"
    assert load_checkpoint_files(tmp_path)[2]["global_steps"] == 20
    assert load_checkpoint_files(tmp_path, "step10")[2]["global_steps"] == 10

    save_a(tmp_path, "step30", seed=30, save_latest=False)
    assert (tmp_path / "latest").read_text() == "step20"
    assert load_checkpoint_files(tmp_path)[2]["global_steps"] == 20


def test_resaving_a_tag_replaces_it(tmp_path):
    save_a(tmp_path, "step10", seed=1)
    _, files = save_a(tmp_path, "step10", seed=2)
    _, loaded, metadata = load_checkpoint_files(tmp_path)
    assert metadata["global_steps"] == 2
    assert_same(files, loaded)
    assert leftovers(tmp_path) == []


def test_missing_latest_says_to_pass_tag(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"pass tag") as err:
        load_checkpoint_files(tmp_path)
    assert str(tmp_path) in str(err.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint_files(tmp_path / "nowhere")


def test_missing_tag_dir(tmp_path):
    save_a(tmp_path)
    with pytest.raises(CheckpointError, match="step99"):
        load_checkpoint_files(tmp_path, "step99")


# --- crashes ----------------------------------------------------------------------------------

def _fail_on_second_save(monkeypatch):
    real_save = torch.save
    count = {"n": 0}

    def flaky(obj, f, *args, **kwargs):
        count["n"] += 1
        if count["n"] == 2:
            raise OSError("disk full (simulated)")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", flaky)


@pytest.mark.parametrize("second_tag", ["step20", "step10"])
def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch, second_tag):
    _, files = save_a(tmp_path, "step10", seed=1)
    _fail_on_second_save(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        save_a(tmp_path, second_tag, seed=2)
    monkeypatch.undo()
    if second_tag != "step10":
        assert not (tmp_path / second_tag).exists()
    assert leftovers(tmp_path) == []
    assert (tmp_path / "latest").read_text() == "step10"
    _, loaded, metadata = load_checkpoint_files(tmp_path)
    assert metadata["global_steps"] == 1
    assert_same(files, loaded)


def test_crash_between_renames_never_leaves_a_wrong_tag(tmp_path, monkeypatch):
    save_a(tmp_path, "step10", seed=1)
    real_rename = os.rename
    calls = {"n": 0}

    def crash_on_second(src, dst):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        save_a(tmp_path, "step10", seed=2)
    monkeypatch.undo()
    # The old step10 was moved aside and the new one never moved in: no step10 to load at all.
    assert not (tmp_path / "step10").exists()
    with pytest.raises(CheckpointError, match="step10"):
        load_checkpoint_files(tmp_path)
    # The next save cleans what the crash left and works.
    _, files = save_a(tmp_path, "step20", seed=3)
    assert leftovers(tmp_path) == []
    assert_same(files, load_checkpoint_files(tmp_path)[1])


def test_killed_process_leaves_previous_checkpoint(tmp_path):
    """A process killed (os._exit, no cleanup) while writing the second file."""
    _, files = save_a(tmp_path, "step10", seed=1)
    script = textwrap.dedent(f"""
        import os, torch
        from dslab.engine.checkpoint_io import save_checkpoint_files
        real_save, n = torch.save, [0]
        def dying(obj, f, *a, **k):
            n[0] += 1
            if n[0] == 2:
                os._exit(3)
            return real_save(obj, f, *a, **k)
        torch.save = dying
        files = {{"a": {{"w": torch.ones(3)}}, "b": {{"w": torch.zeros(3)}}}}
        save_checkpoint_files({str(tmp_path)!r}, "step10", files, {{"global_steps": 99}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == 3, proc.stderr.decode()
    assert any(".partial-" in name for name in leftovers(tmp_path))
    _, loaded, metadata = load_checkpoint_files(tmp_path)
    assert metadata["global_steps"] == 1
    assert_same(files, loaded)
    save_a(tmp_path, "step20", seed=2)
    assert leftovers(tmp_path) == []


def test_leftover_partial_is_ignored_by_loads(tmp_path):
    save_a(tmp_path, "step10", seed=1)
    fake = tmp_path / ".step20.partial-0123456789abcdef"
    fake.mkdir()
    (fake / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError, match="step20"):
        load_checkpoint_files(tmp_path, "step20")
    assert load_checkpoint_files(tmp_path)[2]["global_steps"] == 1
    save_a(tmp_path, "step30", seed=3)
    assert not fake.exists()


# --- corruption -------------------------------------------------------------------------------

def test_truncated_file_is_named(tmp_path):
    path, _ = save_a(tmp_path)
    target = path / "optim_states.pt"
    size = target.stat().st_size
    with open(target, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint_files(tmp_path)
    msg = str(err.value)
    assert str(target) in msg and "truncated" in msg
    assert f"{size - 100} bytes, expected {size}" in msg


def test_flipped_byte_is_named(tmp_path):
    path, _ = save_a(tmp_path)
    target = path / "mp_rank_00_model_states.pt"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted") as err:
        load_checkpoint_files(tmp_path)
    assert str(target) in str(err.value)


def test_missing_manifest(tmp_path):
    path, _ = save_a(tmp_path)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="is not a complete dslab checkpoint"):
        load_checkpoint_files(tmp_path)


def test_missing_file(tmp_path):
    path, _ = save_a(tmp_path)
    (path / "client_state.pt").unlink()
    with pytest.raises(CheckpointError, match="client_state.pt"):
        load_checkpoint_files(tmp_path)


class Opaque:
    """Not loadable with weights_only=True."""

    def __init__(self, x):
        self.x = x


def test_load_failure_names_the_file(tmp_path):
    """A file that matches its manifest but holds a pickled class: weights_only refuses it."""
    import hashlib

    path, _ = save_a(tmp_path)
    target = path / "client_state.pt"
    torch.save({"sampler": Opaque(3)}, target)
    manifest = json.loads((path / "manifest.json").read_text())
    data = target.read_bytes()
    manifest["files"]["client_state"].update(bytes=len(data),
                                             sha256=hashlib.sha256(data).hexdigest())
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="cannot be loaded") as err:
        load_checkpoint_files(tmp_path)
    assert str(target) in str(err.value)


# --- what may be stored -----------------------------------------------------------------------

Point = collections.namedtuple("Point", "x y")

ALLOWED = {
    "tensor": torch.randn(3),
    "parameter": torch.nn.Parameter(torch.randn(2)),
    "scalars": [1, 2.5, True, "s", None, b"raw", bytearray(b"ab"), 1 + 2j],
    "dtype_device_size": (torch.float16, torch.device("cpu"), torch.Size([2, 3])),
    "ordered": collections.OrderedDict(a=1),
    "counter": collections.Counter("aab"),
    "set": {1, 2, "x"},
    "int_and_float_keys": {0: "a", 1.5: "b", "k": {3: torch.ones(1)}},
}

REFUSED = {
    "object": Opaque(1),
    "numpy_array": np.arange(3),
    "numpy_scalar": np.float64(1.0),
    "defaultdict": collections.defaultdict(int),
    "namedtuple": Point(1, 2),
    "function": len,
}


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_allowed_objects_load_weights_only(name, tmp_path):
    check_weights_only({"v": ALLOWED[name]}, "state")
    torch.save(ALLOWED[name], tmp_path / "x.pt")
    torch.load(tmp_path / "x.pt", weights_only=True)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_objects_really_fail_weights_only(name, tmp_path):
    with pytest.raises(ValueError, match=r"state\['v'\]: a .* cannot be stored in a checkpoint"):
        check_weights_only({"v": REFUSED[name]}, "state")
    torch.save(REFUSED[name], tmp_path / "x.pt")
    with pytest.raises(Exception):
        torch.load(tmp_path / "x.pt", weights_only=True)


def test_unsupported_object_names_its_path_and_writes_nothing(tmp_path):
    files = {"model": {"w": torch.ones(2)},
             "client_state": {"epoch": 1, "sampler": Opaque(5)}}
    with pytest.raises(ValueError) as err:
        save_checkpoint_files(tmp_path, "step1", files, {})
    assert str(err.value) == (
        "client_state['sampler']: a Opaque cannot be stored in a checkpoint "
        "(only tensors, numbers, strings, lists and dicts)")
    assert list(tmp_path.iterdir()) == []

    nested = {"client_state": {"hist": [1, 2, {"deep": np.zeros(2)}]}}
    with pytest.raises(ValueError, match=r"client_state\['hist'\]\[2\]\['deep'\]: a ndarray"):
        save_checkpoint_files(tmp_path, "step1", nested, {})
    with pytest.raises(ValueError, match=r"dict key of type tuple"):
        save_checkpoint_files(tmp_path, "step1", {"s": {(1, 2): 3}}, {})


@pytest.mark.parametrize("tag", ["", "a/b", "../x", ".hidden", "latest", None, 3])
def test_bad_tags(tmp_path, tag):
    with pytest.raises(ValueError, match="tag"):
        save_checkpoint_files(tmp_path, tag, {"m": {}}, {})
    if tag is not None:
        with pytest.raises(ValueError, match="tag"):
            load_checkpoint_files(tmp_path, tag)
    assert list(tmp_path.iterdir()) == []


def test_bad_file_names_and_metadata(tmp_path):
    with pytest.raises(ValueError, match="files key"):
        save_checkpoint_files(tmp_path, "t", {"a/b": {}}, {})
    with pytest.raises(ValueError, match="files key"):
        save_checkpoint_files(tmp_path, "t", {".x": {}}, {})
    with pytest.raises(ValueError, match="metadata"):
        save_checkpoint_files(tmp_path, "t", {"a": {}}, {"when": object()})
    with pytest.raises(ValueError, match="metadata"):
        save_checkpoint_files(tmp_path, "t", {"a": {}}, [1])
    assert list(tmp_path.iterdir()) == []


# --- RNG --------------------------------------------------------------------------------------

def draw_everything():
    return {
        "random": [random.random() for _ in range(5)] + [random.gauss(0, 1)],
        "numpy": np.concatenate([np.random.rand(5), np.random.randn(3)]).tolist(),
        "torch": torch.cat([torch.randn(7), torch.rand(4)]),
        "torch_int": torch.randint(0, 2**30, (5,)),
    }


def test_rng_restore_reproduces_draws():
    random.seed(123)
    np.random.seed(456)
    torch.manual_seed(789)
    draw_everything()
    random.gauss(0, 1)       # leaves a cached gaussian in python's state
    np.random.randn(1)       # leaves a cached gaussian in numpy's legacy state
    state = capture_rng_state()
    first = draw_everything()
    draw_everything()
    restore_rng_state(state)
    second = draw_everything()
    assert first["random"] == second["random"]
    assert first["numpy"] == second["numpy"]
    assert torch.equal(first["torch"], second["torch"])
    assert torch.equal(first["torch_int"], second["torch_int"])


def test_rng_state_survives_a_checkpoint(tmp_path):
    state = capture_rng_state()
    first = draw_everything()
    check_weights_only(state, "rng")
    save_checkpoint_files(tmp_path, "t", {"rng": state}, {})
    _, loaded, _ = load_checkpoint_files(tmp_path)
    draw_everything()
    restore_rng_state(loaded["rng"])
    second = draw_everything()
    assert first["random"] == second["random"]
    assert first["numpy"] == second["numpy"]
    assert torch.equal(first["torch"], second["torch"])


def test_rng_bad_state():
    with pytest.raises(ValueError, match="state"):
        restore_rng_state([1, 2])
    good = capture_rng_state()
    with pytest.raises(ValueError, match="torch_cpu"):
        restore_rng_state({k: v for k, v in good.items() if k != "torch_cpu"})
    with pytest.raises(ValueError, match=r"state\['python'\]"):
        restore_rng_state({**good, "python": [3, [1, 2], None]})
    with pytest.raises(ValueError, match=r"state\['numpy'\]"):
        restore_rng_state({**good, "numpy": {"keys": []}})


@pytest.mark.gpu
def test_rng_restore_reproduces_cuda_draws():
    torch.cuda.init()
    torch.cuda.manual_seed_all(5)
    state = capture_rng_state()
    assert len(state["cuda"]) == torch.cuda.device_count()
    first = torch.randn(1000, device="cuda")
    torch.randn(10, device="cuda")
    restore_rng_state(state)
    assert torch.equal(first, torch.randn(1000, device="cuda"))
