"""What a number was measured on: software versions, the repo state, GPUs with their datasheet
peaks, and NVML. ``dslab env`` prints it; reports record it next to every result.

torch is imported inside the functions, so that importing :mod:`dslab.report` (the dashboard
does) stays light.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

from dslab.report.hardware import lookup_gpu

UNKNOWN_GPU = "unknown GPU: no datasheet peaks"
ENVIRONMENT_VARIABLES = ("DSLAB_KERNELS", "CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")
_GIT_TIMEOUT_S = 5.0
SOURCE_DIGEST_HEX_CHARS = 16


def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _git(directory: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(directory), *args],
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state(package_dir: Path) -> dict:
    """``{"commit": sha or None, "dirty": bool or None}`` of the checkout holding ``package_dir``.

    Only when ``package_dir``'s parent is the top of a git work tree (an editable install or a
    source checkout); an installed copy inside some unrelated repository gives None. Dirty means
    ``git status --porcelain`` lists anything: tracked changes or untracked files not ignored.
    """
    unknown = {"commit": None, "dirty": None}
    toplevel = _git(package_dir, "rev-parse", "--show-toplevel")
    if toplevel is None or Path(toplevel).resolve() != package_dir.resolve().parent:
        return unknown
    commit = _git(package_dir, "rev-parse", "HEAD")
    if commit is None:
        return unknown
    status = _git(package_dir, "status", "--porcelain")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def source_digest(package_dir: Path) -> str | None:
    """The first 16 hex characters of a sha256 over the Python source of the package at
    ``package_dir``, or None when it is not a directory or something in it cannot be read.

    Every ``*.py`` file under ``package_dir`` (recursively, ``__pycache__`` skipped) in the order
    of its POSIX path relative to ``package_dir``, each hashed as that path (UTF-8), NUL, its size
    in bytes (decimal), NUL, its bytes. Unlike :func:`git_state` it names the code that ran
    wherever it ran, a tree copied over a stale ``.git`` included. Only the package's ``.py``
    files count, so the digest of any commit is that of its archive (at the top of a checkout)::

        mkdir d && git archive COMMIT dslab | tar -x -C d
        python -c "import pathlib, dslab.report.environment as e; print(e.source_digest(pathlib.Path('d/dslab')))"
    """
    root = Path(package_dir)
    if not root.is_dir():
        return None

    def fail(error: OSError) -> None:
        raise error

    files = []
    digest = hashlib.sha256()
    try:
        for directory, subdirectories, names in os.walk(root, onerror=fail):
            subdirectories[:] = [name for name in subdirectories if name != "__pycache__"]
            for name in names:
                if name.endswith(".py"):
                    path = Path(directory, name)
                    files.append((path.relative_to(root).as_posix(), path))
        for relative, path in sorted(files):
            data = path.read_bytes()
            digest.update(relative.encode("utf-8", "surrogateescape") + b"\0")
            digest.update(str(len(data)).encode() + b"\0")
            digest.update(data)
    except OSError:
        return None
    return digest.hexdigest()[:SOURCE_DIGEST_HEX_CHARS]


def _dslab_package_dir() -> Path | None:
    spec = importlib.util.find_spec("dslab")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def gpu_entry(
    index: int,
    name: str,
    total_memory_bytes: int,
    capability: tuple[int, int],
    multiprocessor_count: int,
    uuid: str | None = None,
) -> dict:
    """One GPU as the environment records it, with its datasheet spec or the unknown-GPU note."""
    spec = lookup_gpu(name)
    return {
        "index": index,
        "name": name,
        "total_memory_bytes": int(total_memory_bytes),
        "compute_capability": f"{capability[0]}.{capability[1]}",
        "multiprocessor_count": int(multiprocessor_count),
        "uuid": uuid,
        "spec": None if spec is None else dataclasses.asdict(spec),
        "spec_note": UNKNOWN_GPU if spec is None else None,
    }


def _cuda_gpus() -> list[dict]:
    import torch

    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        gpus.append(
            gpu_entry(
                index,
                props.name,
                props.total_memory,
                (props.major, props.minor),
                props.multi_processor_count,
                None if uuid is None else str(uuid),
            )
        )
    return gpus


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def collect_nvml() -> dict:
    """NVML through ``pynvml`` (package nvidia-ml-py): driver version and each GPU's UUID.

    Returns ``{"available", "driver_version", "gpus": [{"index", "name", "uuid"}], "reason"}``;
    ``reason`` says why NVML is not available (not installed, no driver) and is None when it is.
    NVML indices are physical: they ignore ``CUDA_VISIBLE_DEVICES``, unlike torch's.
    """
    result = {"available": False, "driver_version": None, "gpus": [], "reason": None}
    try:
        import pynvml
    except ImportError as exc:
        result["reason"] = f"pynvml does not import (pip install nvidia-ml-py): {exc}"
        return result
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError and its many subclasses; no driver, no library
        result["reason"] = f"nvmlInit failed: {exc}"
        return result
    try:
        result["driver_version"] = _text(pynvml.nvmlSystemGetDriverVersion())
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            result["gpus"].append(
                {
                    "index": index,
                    "name": _text(pynvml.nvmlDeviceGetName(handle)),
                    "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
                }
            )
        result["available"] = True
    except Exception as exc:  # a query failing after init: report it, keep what was read
        result["reason"] = f"NVML query failed: {exc}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # shutting down is best effort; the answers are already read
            pass
    return result


def collect_environment() -> dict:
    """Everything about the software and hardware that a result depends on, JSON-serialisable.

    Keys: ``python``, ``platform``, ``hostname``, ``cpu_count``, ``torch``, ``triton``,
    ``dslab``, ``cuda``, ``nvml``, ``environment_variables``; versions that cannot be read are
    None, never an exception. ``dslab`` holds ``version``, ``path``, ``git_commit``,
    ``git_dirty`` (:func:`git_state`) and ``source_digest`` (:func:`source_digest`).
    """
    import torch

    package_dir = _dslab_package_dir()
    git = git_state(package_dir) if package_dir is not None else {"commit": None, "dirty": None}
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    cuda_available = torch.cuda.is_available()
    return {
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "torch": {
            "version": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": cudnn,
        },
        "triton": _distribution_version("triton", "pytorch-triton"),
        "dslab": {
            "version": _distribution_version("dslab"),
            "path": None if package_dir is None else str(package_dir),
            "git_commit": git["commit"],
            "git_dirty": git["dirty"],
            "source_digest": None if package_dir is None else source_digest(package_dir),
        },
        "cuda": {
            "available": cuda_available,
            "device_count": torch.cuda.device_count() if cuda_available else 0,
            "gpus": _cuda_gpus() if cuda_available else [],
        },
        "nvml": collect_nvml(),
        "environment_variables": {name: os.environ.get(name) for name in ENVIRONMENT_VARIABLES},
    }


def _or_dash(value) -> str:
    return "-" if value is None else str(value)


def _or_none(value) -> str:
    return "none" if value is None else str(value)


def _aligned(rows: list[tuple[str, str]], indent: str = "  ") -> list[str]:
    width = max(len(key) for key, _ in rows)
    return [f"{indent}{key.ljust(width)}  {value}" for key, value in rows]


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]], indent: str = "  ") -> list[str]:
    widths = [max(len(cells[column]) for cells in (header, *rows)) for column in range(len(header))]
    return [
        indent + "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()
        for cells in (header, *rows)
    ]


def _gpu_lines(gpus: list[dict]) -> list[str]:
    header = (
        "#", "name", "memory", "cc", "SMs", "bf16 TF/s", "fp16 TF/s", "fp32 TF/s", "mem TB/s", "datasheet"
    )
    rows = []
    for gpu in gpus:
        spec = gpu["spec"]
        peaks = (
            ("?", "?", "?", "?", gpu["spec_note"] or UNKNOWN_GPU)
            if spec is None
            else (
                _or_dash(spec["bf16_tflops"]),
                _or_dash(spec["fp16_tflops"]),
                _or_dash(spec["fp32_tflops"]),
                _or_dash(spec["memory_bandwidth_tbs"]),
                spec["name"],
            )
        )
        memory = f"{gpu['total_memory_bytes'] / 2**30:.1f} GiB"
        device = (gpu["name"], memory, gpu["compute_capability"], str(gpu["multiprocessor_count"]))
        rows.append((str(gpu["index"]), *device, *peaks))
    return _table(header, rows)


def _nvml_line(nvml: dict) -> str:
    if not nvml["available"]:
        return f"NVML  unavailable: {nvml['reason']}"
    uuids = ", ".join(f"{gpu['index']}={gpu['uuid']}" for gpu in nvml["gpus"]) or "no GPUs"
    return f"NVML  driver {nvml['driver_version']}; {uuids}"


def format_environment(env: dict, kernels: dict[str, str]) -> str:
    """A plain-text report of ``env`` (from :func:`collect_environment`) to paste into a bug report.

    ``kernels`` maps each dslab kernel op to the implementation it runs as ("triton", "torch").
    Peaks are datasheet values, dense; "?" marks a GPU without a datasheet entry.
    """
    dslab = env["dslab"]
    if dslab["git_commit"] is None:
        checkout = "not a git checkout"
    else:
        checkout = f"git {dslab['git_commit'][:12]}" + (", dirty" if dslab["git_dirty"] else "")
    torch_info = env["torch"]
    cuda_version, cudnn_version = (_or_none(torch_info[key]) for key in ("cuda", "cudnn"))
    cuda = env["cuda"]
    variables = ", ".join(
        f"{name}={'unset' if value is None else value}"
        for name, value in env["environment_variables"].items()
    )
    lines = ["dslab environment"]
    lines += _aligned(
        [
            ("dslab", f"{_or_dash(dslab['version'])} ({checkout}) at {_or_dash(dslab['path'])}"),
            ("source digest", _or_dash(dslab.get("source_digest"))),
            ("python", f"{env['python']['version']} ({env['python']['executable']})"),
            ("platform", env["platform"]),
            ("hostname", env["hostname"]),
            ("cpus", _or_dash(env["cpu_count"])),
            ("torch", f"{torch_info['version']} (CUDA {cuda_version}, cuDNN {cudnn_version})"),
            ("triton", _or_dash(env["triton"])),
            ("CUDA available", f"{'yes' if cuda['available'] else 'no'} ({cuda['device_count']} GPUs)"),
            ("environment", variables),
        ]
    )
    lines.append("")
    if cuda["gpus"]:
        lines.append("GPUs (peaks: datasheet, dense)")
        lines += _gpu_lines(cuda["gpus"])
    else:
        lines.append("GPUs  none visible to torch")
    lines.append(_nvml_line(env["nvml"]))
    lines.append("")
    if kernels:
        lines.append("kernels (implementation each op runs as)")
        lines += _aligned(list(kernels.items()))
    else:
        lines.append("kernels  none given")
    return "\n".join(lines) + "\n"
