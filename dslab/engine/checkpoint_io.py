"""The file layer under the engine's checkpoints: write a set of objects as one checkpoint
atomically, and read it back with every byte checked.

Layout (DeepSpeed's, plus a manifest)::

    <save_dir>/latest                  the newest tag, as text (written atomically)
    <save_dir>/<tag>/manifest.json     format version, dslab version, metadata, size and
                                       sha256 of every file
    <save_dir>/<tag>/<name>.pt         one torch.save file per entry of ``files``

A save first writes everything into ``<save_dir>/.<tag>.partial-<random>``, fsyncs the files,
the manifest and the directory, and only then renames it to ``<tag>`` (an existing ``<tag>`` is
renamed aside first and removed after). A crash therefore leaves either the previous ``<tag>``,
the new one, or no ``<tag>`` at all, never a half-written ``<tag>``; ``latest`` moves only after
the new directory is in place. Leftover ``.partial``/``.old`` directories are never read and are
removed by the next save into the same ``save_dir``; so one writer per ``save_dir`` at a time
(the engine writes from one rank, or each rank into its own directory).

With an async I/O handle (the engine's ``aio`` section) each file is serialised straight through
it (:func:`dslab.io.stream.save_through_handle`: ``O_DIRECT`` writes from pinned buffers, the
sha256 taken from the bytes as they go, the file fsynced and renamed into the partial
directory) instead of ``torch.save`` to a path and a second pass to hash it; the layout, the
manifest and the atomicity are the same, and the files load the same.

Everything is checked, before any byte is written, to be loadable by
``torch.load(weights_only=True)``, the only way this module loads: a checkpoint never runs
arbitrary pickled code when it is read back.
"""

from __future__ import annotations

import collections
import hashlib
import importlib.metadata
import json
import os
import pathlib
import re
import secrets
import shutil
from typing import Any

import torch

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"

_LEFTOVER = re.compile(r"^\..+\.(partial|old)-[0-9a-f]{16}$|^\.latest\.tmp-[0-9a-f]{16}$")

# Types torch.load(weights_only=True) rebuilds. Exact types: a subclass (numpy.float64 is a
# float, an IntEnum is an int, a namedtuple is a tuple) pickles as its own class and is refused.
_SCALARS = (int, float, bool, str, bytes, bytearray, complex, type(None), torch.device)
_SEQUENCES = (list, tuple, torch.Size, set)
_MAPPINGS = (dict, collections.OrderedDict, collections.Counter)
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_KEY_SCALARS = (int, float, bool, str, type(None))

_ALLOWED_HINT = "only tensors, numbers, strings, lists and dicts"


class CheckpointError(RuntimeError):
    """A checkpoint on disk is missing, incomplete, corrupted or cannot be loaded."""


def _dslab_version() -> str:
    try:
        return importlib.metadata.version("dslab")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def validate_tag(tag: Any, param: str = "tag") -> str:
    """A tag names a directory directly under the checkpoint dir: a non-empty string with no path
    separator, not starting with '.', and not ``latest``. Raises ValueError naming ``param``."""
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"{param} must be a non-empty string, got {tag!r}")
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    if any(s in tag for s in seps) or "\0" in tag:
        raise ValueError(f"{param} must not contain a path separator, got {tag!r}")
    if tag.startswith("."):
        raise ValueError(f"{param} must not start with '.', got {tag!r}")
    if tag == LATEST_NAME:
        raise ValueError(f"{param} must not be {LATEST_NAME!r}: that file holds the newest tag")
    return tag


def _refuse(path: str, obj: Any) -> ValueError:
    return ValueError(
        f"{path}: a {type(obj).__qualname__} cannot be stored in a checkpoint ({_ALLOWED_HINT})")


def check_weights_only(obj: Any, path: str) -> None:
    """Raise ValueError naming the first place inside ``obj`` (written as ``path['key'][3]``)
    that torch.load(weights_only=True) could not rebuild."""
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(obj, path)]
    while stack:
        item, where = stack.pop()
        kind = type(item)
        if kind in _SCALARS or isinstance(item, torch.dtype):
            continue
        if kind in _TENSORS:
            extra = getattr(item, "__dict__", None)
            if extra:
                stack.extend((v, f"{where}.{k}") for k, v in extra.items())
            continue
        if id(item) in seen:
            continue
        if kind in _SEQUENCES:
            seen.add(id(item))
            if kind is set:
                stack.extend((v, f"{where}{{element {i}}}") for i, v in enumerate(item))
            else:
                stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
            continue
        if kind in _MAPPINGS:
            seen.add(id(item))
            for key, value in item.items():
                if type(key) not in _KEY_SCALARS:
                    raise ValueError(
                        f"{where}: a dict key of type {type(key).__name__} ({key!r}) cannot be "
                        f"stored in a checkpoint (keys must be strings or numbers)")
                stack.append((value, f"{where}[{key!r}]"))
            continue
        raise _refuse(where, item)


def _fsync_dir(path: pathlib.Path) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where directories cannot be
    opened, e.g. Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _hash_and_sync(path: pathlib.Path) -> tuple[int, str]:
    """Size and sha256 of the file as it is on disk, fsyncing it on the way."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        os.fsync(f.fileno())
        size = os.fstat(f.fileno()).st_size
    return size, digest


def _sha256(path: pathlib.Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _remove_leftovers(save_dir: pathlib.Path) -> None:
    """Remove what interrupted saves left behind: ``.<tag>.partial-*``, ``.<tag>.old-*`` and
    ``.latest.tmp-*``."""
    for entry in save_dir.iterdir():
        if not _LEFTOVER.match(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            try:
                entry.unlink()
            except OSError:
                pass


def write_latest(save_dir: str | os.PathLike, tag: str) -> None:
    """Point ``<save_dir>/latest`` at ``tag`` atomically (temp file, fsync, os.replace)."""
    save_dir = pathlib.Path(save_dir)
    validate_tag(tag)
    tmp = save_dir / f".latest.tmp-{secrets.token_hex(8)}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, save_dir / LATEST_NAME)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(save_dir)


def save_checkpoint_files(save_dir: str | os.PathLike, tag: str, files: dict[str, object],
                          metadata: dict, save_latest: bool = True, handle=None) -> pathlib.Path:
    """Write ``files`` as the checkpoint ``<save_dir>/<tag>/`` and return that path.

    Args:
        save_dir: the checkpoint root; created if missing.
        tag: the checkpoint's directory name (see :func:`validate_tag`).
        files: file name (without ``.pt``) -> object for torch.save; each object may hold only
            what torch.load(weights_only=True) rebuilds (tensors, numbers, strings, bytes,
            None, lists/tuples/sets, dicts with string or number keys, dtypes, devices).
        metadata: JSON-serialisable dict stored in ``manifest.json`` and returned by loads.
        save_latest: point ``<save_dir>/latest`` at ``tag`` after the save.
        handle: an :class:`~dslab.io.handle.AsyncIOHandle` to write the files through (None:
            ``torch.save``).

    Writes on whatever process calls it; which rank saves is the caller's decision.
    Raises ValueError (naming the parameter, or the path inside a file's object) before writing
    anything when an argument is invalid.
    """
    validate_tag(tag)
    if not isinstance(files, dict):
        raise ValueError(f"files must be a dict of name -> object, got {type(files).__name__}")
    for name, obj in files.items():
        validate_tag(name, param=f"files key {name!r}")
        check_weights_only(obj, name)
    _check_metadata(metadata)
    partial = begin_checkpoint(save_dir, tag)
    try:
        entries = {name: write_checkpoint_file(partial, name, obj, handle)
                   for name, obj in files.items()}
    except BaseException:
        abort_checkpoint(partial)
        raise
    return commit_checkpoint(save_dir, tag, partial, entries, metadata, save_latest)


def _check_metadata(metadata: dict) -> None:
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata must be a dict, got {type(metadata).__name__}")
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as err:
        raise ValueError(f"metadata must be JSON-serialisable: {err}") from None


def begin_checkpoint(save_dir: str | os.PathLike, tag: str) -> pathlib.Path:
    """Create and return the hidden ``<save_dir>/.<tag>.partial-<random>`` directory that
    :func:`write_checkpoint_file` fills and :func:`commit_checkpoint` renames to ``<tag>``.

    The three steps let several processes write one checkpoint (ZeRO: every rank its shard, into
    the directory rank 0 began, on a file system they share); :func:`save_checkpoint_files` is
    them in a row for one writer."""
    validate_tag(tag)
    save_dir = pathlib.Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(save_dir)
    partial = save_dir / f".{tag}.partial-{secrets.token_hex(8)}"
    partial.mkdir()
    return partial


def write_checkpoint_file(directory: str | os.PathLike, name: str, obj: object,
                          handle=None) -> dict:
    """torch.save ``obj`` as ``<directory>/<name>.pt`` (through ``handle`` when given, see the
    module docstring), fsync it, and return its manifest entry ``{"file", "bytes", "sha256"}``.
    Raises ValueError before writing when ``obj`` holds what torch.load(weights_only=True) could
    not rebuild."""
    validate_tag(name, param=f"files key {name!r}")
    check_weights_only(obj, name)
    path = pathlib.Path(directory) / f"{name}.pt"
    if handle is not None:
        from dslab.io.stream import save_through_handle

        size, digest = save_through_handle(obj, path, handle)
    else:
        torch.save(obj, path)
        size, digest = _hash_and_sync(path)
    return {"file": path.name, "bytes": size, "sha256": digest}


def abort_checkpoint(partial: str | os.PathLike) -> None:
    """Remove a begun checkpoint directory that will not be committed."""
    shutil.rmtree(partial, ignore_errors=True)


def commit_checkpoint(save_dir: str | os.PathLike, tag: str, partial: str | os.PathLike,
                      entries: dict[str, dict], metadata: dict, save_latest: bool = True
                      ) -> pathlib.Path:
    """Write the manifest of ``entries`` (name -> entry from :func:`write_checkpoint_file`) into
    ``partial``, fsync it, rename ``partial`` to ``<save_dir>/<tag>`` (an existing ``<tag>`` is
    renamed aside first and removed after) and move ``latest``. Returns the tag's path."""
    _check_metadata(metadata)
    save_dir = pathlib.Path(save_dir)
    partial = pathlib.Path(partial)
    target = save_dir / tag
    try:
        manifest = {
            "format": "dslab-checkpoint",
            "format_version": FORMAT_VERSION,
            "dslab_version": _dslab_version(),
            "tag": tag,
            "metadata": metadata,
            "files": dict(entries),
        }
        with open(partial / MANIFEST_NAME, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(partial)
    except BaseException:
        abort_checkpoint(partial)
        raise

    old = None
    if target.exists() or target.is_symlink():
        old = save_dir / f".{tag}.old-{partial.name.rsplit('-', 1)[-1]}"
        os.rename(target, old)
    os.rename(partial, target)
    _fsync_dir(save_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

    if save_latest:
        write_latest(save_dir, tag)
    return target


def read_latest(load_dir: str | os.PathLike) -> str:
    """The tag that ``<load_dir>/latest`` names."""
    load_dir = pathlib.Path(load_dir)
    latest = load_dir / LATEST_NAME
    if not latest.is_file():
        where = "does not exist" if not load_dir.exists() else f"has no '{LATEST_NAME}' file"
        raise FileNotFoundError(
            f"checkpoint directory {load_dir} {where}; pass tag= to name the checkpoint to load")
    tag = latest.read_text(encoding="utf-8").strip()
    try:
        validate_tag(tag)
    except ValueError as err:
        raise CheckpointError(f"{latest} does not hold a valid tag: {err}") from None
    return tag


def _read_manifest(ckpt_dir: pathlib.Path) -> dict:
    path = ckpt_dir / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError(
            f"{ckpt_dir} is not a complete dslab checkpoint: {MANIFEST_NAME} is missing")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint manifest {path} cannot be read: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != "dslab-checkpoint":
        raise CheckpointError(f"{path} is not a dslab checkpoint manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {version!r}; this dslab "
            f"({_dslab_version()}) reads versions up to {FORMAT_VERSION}")
    if not (isinstance(manifest.get("files"), dict)
            and isinstance(manifest.get("metadata"), dict)):
        raise CheckpointError(f"{path} is malformed: 'files' and 'metadata' must be objects")
    return manifest


def _verify_file(path: pathlib.Path, entry: Any) -> None:
    if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) \
            or not isinstance(entry.get("sha256"), str):
        raise CheckpointError(f"manifest entry for {path} is malformed: {entry!r}")
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"checkpoint file {path} is truncated or corrupted: "
                              f"{size} bytes, expected {entry['bytes']}")
    digest = _sha256(path)
    if digest != entry["sha256"]:
        raise CheckpointError(f"checkpoint file {path} is corrupted: sha256 {digest}, "
                              f"expected {entry['sha256']}")


def load_checkpoint_files(load_dir: str | os.PathLike, tag: str | None = None,
                          names=None) -> tuple[pathlib.Path, dict[str, object], dict]:
    """Read the checkpoint ``<load_dir>/<tag>`` (``tag=None``: the one ``latest`` names); with
    ``names``, only those of its files (names the manifest lacks are left out of the result).

    Returns ``(path of the tag directory, {name: object}, metadata)``. Every file's size and
    sha256 are checked against the manifest before it is loaded with
    ``torch.load(weights_only=True, map_location="cpu")``.

    Raises FileNotFoundError when ``tag`` is None and there is no ``latest``; CheckpointError
    naming the directory or file when the checkpoint is missing, incomplete, corrupted or
    cannot be loaded; ValueError for a malformed ``tag``.
    """
    load_dir = pathlib.Path(load_dir)
    if tag is None:
        tag = read_latest(load_dir)
    else:
        validate_tag(tag)
    ckpt_dir = load_dir / tag
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint {ckpt_dir} does not exist")
    manifest = _read_manifest(ckpt_dir)

    loaded: dict[str, object] = {}
    wanted = None if names is None else set(names)
    for name, entry in manifest["files"].items():
        if wanted is not None and name not in wanted:
            continue
        try:
            validate_tag(name, param="file name")
        except ValueError as err:
            raise CheckpointError(f"{ckpt_dir / MANIFEST_NAME} is malformed: {err}") from None
        path = ckpt_dir / f"{name}.pt"
        _verify_file(path, entry)
        try:
            loaded[name] = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as err:
            raise CheckpointError(f"checkpoint file {path} cannot be loaded: {err}") from err
    return ckpt_dir, loaded, manifest["metadata"]
