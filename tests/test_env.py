"""Datasheet lookup, environment collection and its text report (dslab.report.hardware and
dslab.report.environment), on CPU with faked GPUs and a faked NVML."""

from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import dslab
from dslab.report import environment
from dslab.report.environment import (
    UNKNOWN_GPU,
    collect_environment,
    collect_nvml,
    format_environment,
    gpu_entry,
)
from dslab.report.hardware import GPU_SPECS, lookup_gpu

# Names exactly as torch.cuda.get_device_name / nvidia-smi print them.
KNOWN_NAMES = {
    "Tesla V100-SXM2-16GB": "V100 SXM2 16GB",
    "Tesla V100-SXM2-32GB": "V100 SXM2 32GB",
    "Tesla V100-PCIE-16GB": "V100 PCIe 16GB",
    "Tesla V100-PCIE-32GB": "V100 PCIe 32GB",
    "NVIDIA A100-SXM4-40GB": "A100 SXM4 40GB",
    "NVIDIA A100-SXM4-80GB": "A100 SXM4 80GB",
    "NVIDIA A100-PCIE-40GB": "A100 PCIe 40GB",
    "NVIDIA A100 80GB PCIe": "A100 PCIe 80GB",
    "NVIDIA H100 80GB HBM3": "H100 SXM5 80GB",
    "NVIDIA H100 PCIe": "H100 PCIe 80GB",
    "NVIDIA H100 NVL": "H100 NVL 94GB",
    "NVIDIA H200": "H200 SXM 141GB",
    "NVIDIA H200 NVL": "H200 NVL 141GB",
    "NVIDIA L40S": "L40S 48GB",
    "NVIDIA B200": "B200 180GB",
}

UNKNOWN_NAMES = [
    "Fake GPU 9000",
    "NVIDIA GeForce RTX 4090",
    "NVIDIA L40",  # not the L40S
    "NVIDIA GH200 480GB",  # contains "H200" but is another product
    "NVIDIA A100",  # 40 GB or 80 GB: ambiguous
    "NVIDIA A100-SXM4-40GB MIG 1g.5gb",  # a MIG slice has no datasheet peak
    "Tesla V100-FHHL-16GB",  # an unlisted form factor
    "",
]


@pytest.mark.parametrize("name, expected", sorted(KNOWN_NAMES.items()))
def test_lookup_known_names(name, expected):
    spec = lookup_gpu(name)
    assert spec is not None and spec.name == expected


@pytest.mark.parametrize("name", UNKNOWN_NAMES)
def test_lookup_unknown_names(name):
    assert lookup_gpu(name) is None


def test_lookup_is_case_and_separator_insensitive():
    assert lookup_gpu("nvidia a100 sxm4 80gb") == lookup_gpu("NVIDIA A100-SXM4-80GB")


def test_datasheet_values():
    h100 = lookup_gpu("NVIDIA H100 80GB HBM3")
    assert h100.bf16_tflops == pytest.approx(989.5)  # 1979 with sparsity, halved
    assert h100.fp32_tflops == 67 and h100.memory_bandwidth_tbs == 3.35 and h100.memory_gb == 80
    assert lookup_gpu("Tesla V100-SXM2-16GB").bf16_tflops is None
    assert lookup_gpu("Tesla V100-SXM2-16GB").fp16_tflops == 125
    assert lookup_gpu("NVIDIA A100-SXM4-80GB").memory_bandwidth_tbs == 2.039
    assert lookup_gpu("NVIDIA A100 80GB PCIe").memory_bandwidth_tbs == 1.935
    assert lookup_gpu("NVIDIA H100 PCIe").bf16_tflops == pytest.approx(756.5)
    assert lookup_gpu("NVIDIA L40S").bf16_tflops == pytest.approx(362.05)


def test_every_spec_is_reachable_and_plausible():
    names = {spec.name for spec in GPU_SPECS}
    assert len(names) == len(GPU_SPECS)
    reached = {lookup_gpu(name).name for name in KNOWN_NAMES} | {lookup_gpu("Tesla V100S-PCIE-32GB").name}
    assert reached == names
    for spec in GPU_SPECS:
        assert spec.fp16_tflops > spec.fp32_tflops > 0, spec.name
        assert spec.bf16_tflops is None or spec.bf16_tflops == spec.fp16_tflops, spec.name
        assert spec.memory_bandwidth_tbs > 0 and spec.memory_gb > 0 and spec.source, spec.name


EXPECTED_KEYS = {
    "python", "platform", "hostname", "cpu_count", "torch", "triton", "dslab", "cuda", "nvml",
    "environment_variables",
}


def test_collect_environment_keys_and_json():
    env = collect_environment()
    assert set(env) == EXPECTED_KEYS
    assert json.loads(json.dumps(env)) == env
    assert env["python"]["version"] == platform.python_version()
    assert env["python"]["executable"] == sys.executable
    assert env["torch"]["version"] == torch.__version__
    assert env["cuda"]["available"] == torch.cuda.is_available()
    assert env["dslab"]["version"] is not None
    commit = env["dslab"]["git_commit"]
    assert commit is None or re.fullmatch(r"[0-9a-f]{40}", commit)
    assert (env["dslab"]["git_dirty"] is None) == (commit is None)
    assert set(env["nvml"]) == {"available", "driver_version", "gpus", "reason"}


def _fake_properties(name, total_memory, major, minor, sms):
    return types.SimpleNamespace(
        name=name, total_memory=total_memory, major=major, minor=minor, multi_processor_count=sms,
        uuid=f"uuid-{name}",
    )


def test_collect_environment_with_faked_gpus(monkeypatch):
    devices = [
        _fake_properties("NVIDIA H100 80GB HBM3", 85_045_510_144, 9, 0, 132),
        _fake_properties("Fake GPU 9000", 2**34, 8, 9, 10),
    ]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(devices))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: devices[index])
    env = collect_environment()
    json.dumps(env)
    h100, fake = env["cuda"]["gpus"]
    assert env["cuda"]["device_count"] == 2
    assert h100["compute_capability"] == "9.0" and h100["multiprocessor_count"] == 132
    assert h100["uuid"] == "uuid-NVIDIA H100 80GB HBM3"
    assert h100["spec"]["name"] == "H100 SXM5 80GB" and h100["spec_note"] is None
    assert fake["spec"] is None and fake["spec_note"] == UNKNOWN_GPU
    text = format_environment(env, {"layer_norm": "triton"})
    h100_line = next(line for line in text.splitlines() if "NVIDIA H100 80GB HBM3" in line)
    assert "989.5" in h100_line and "79.2 GiB" in h100_line
    fake_line = next(line for line in text.splitlines() if "Fake GPU 9000" in line)
    assert "unknown GPU" in fake_line


def test_format_environment_kernels_and_unknown_gpu():
    env = collect_environment()
    env["cuda"]["gpus"] = [
        gpu_entry(0, "Fake GPU 9000", 2**34, (8, 0), 12),
        gpu_entry(1, "Tesla V100-SXM2-32GB", 32 * 2**30, (7, 0), 80),
    ]
    kernels = {"layer_norm": "triton", "attention": "torch", "FusedAdam": "unavailable"}
    text = format_environment(env, kernels)
    lines = text.splitlines()
    for op, backend in kernels.items():
        assert any(line.split() == [op, backend] for line in lines), op
    assert "unknown GPU: no datasheet peaks" in text
    v100_line = next(line for line in lines if "Tesla V100-SXM2-32GB" in line)
    assert v100_line.split()[6:8] == ["80", "-"]  # SMs, then no bf16 peak on V100
    assert env["python"]["version"] in text and env["torch"]["version"] in text


def test_format_environment_without_gpus_or_kernels():
    env = collect_environment()
    env["cuda"]["gpus"] = []
    text = format_environment(env, {})
    assert "none visible to torch" in text and "NVML" in text


def test_nvml_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    nvml = collect_nvml()
    assert nvml["available"] is False and nvml["gpus"] == [] and nvml["driver_version"] is None
    assert "nvidia-ml-py" in nvml["reason"]
    env = collect_environment()
    assert env["nvml"] == nvml
    assert "NVML  unavailable: pynvml does not import" in format_environment(env, {})


class _FakeNVMLError(Exception):
    pass


def _fake_pynvml(init_error=None, calls=None):
    module = types.ModuleType("pynvml")
    calls = [] if calls is None else calls

    def init():
        calls.append("init")
        if init_error is not None:
            raise init_error

    module.nvmlInit = init
    module.nvmlShutdown = lambda: calls.append("shutdown")
    module.nvmlSystemGetDriverVersion = lambda: b"550.54.15"  # old pynvml returns bytes
    module.nvmlDeviceGetCount = lambda: 2
    module.nvmlDeviceGetHandleByIndex = lambda index: index
    module.nvmlDeviceGetName = lambda handle: "NVIDIA H100 80GB HBM3"
    module.nvmlDeviceGetUUID = lambda handle: f"GPU-{handle:08d}"
    return module


def test_nvml_present(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(calls=calls))
    nvml = collect_nvml()
    assert nvml == {
        "available": True,
        "driver_version": "550.54.15",
        "gpus": [
            {"index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-00000000"},
            {"index": 1, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-00000001"},
        ],
        "reason": None,
    }
    assert calls == ["init", "shutdown"]
    env = collect_environment()
    assert "NVML  driver 550.54.15; 0=GPU-00000000, 1=GPU-00000001" in format_environment(env, {})


def test_nvml_init_fails(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(_FakeNVMLError("Driver Not Loaded"), calls))
    nvml = collect_nvml()
    assert nvml["available"] is False and nvml["reason"] == "nvmlInit failed: Driver Not Loaded"
    assert calls == ["init"]


def _git(directory, *args):
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(directory), *args],
        check=True, capture_output=True,
    )


needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git executable")


@needs_git
def test_git_state_of_a_checkout(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "initial")
    state = environment.git_state(package)
    assert re.fullmatch(r"[0-9a-f]{40}", state["commit"]) and state["dirty"] is False
    (package / "__init__.py").write_text("x = 1\n")
    assert environment.git_state(package) == {"commit": state["commit"], "dirty": True}


@needs_git
def test_git_state_fails_soft(tmp_path, monkeypatch):
    unknown = {"commit": None, "dirty": None}
    package = tmp_path / "outer" / "site-packages" / "pkg"
    package.mkdir(parents=True)
    assert environment.git_state(package) == unknown  # not in a git work tree
    _git(tmp_path / "outer", "init", "-q")
    assert environment.git_state(package) == unknown  # in a repo, but not at its top

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(environment.subprocess, "run", no_git)
    assert environment.git_state(package) == unknown
    json.dumps(collect_environment())


def _write_tree(root, files):
    """Files ``{relative POSIX path: bytes}`` under ``root``; returns ``root``."""
    for relative, data in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


PACKAGE_FILES = {
    "__init__.py": b'__version__ = "0.1.0"\n',
    "kernels/__init__.py": b"",
    "kernels/layer_norm.py": b"def forward(x):\n    return x\n",
    "report/environment.py": b"DIGEST = 1\n",
}


def test_source_digest_is_short_hex_and_depends_only_on_the_tree(tmp_path):
    first = environment.source_digest(_write_tree(tmp_path / "a" / "dslab", PACKAGE_FILES))
    second = environment.source_digest(_write_tree(tmp_path / "elsewhere" / "deeper" / "dslab", PACKAGE_FILES))
    assert re.fullmatch(r"[0-9a-f]{16}", first)
    assert first == second
    assert environment.source_digest(tmp_path / "a" / "dslab") == first  # stable


def test_source_digest_changes_with_one_byte_and_with_a_rename(tmp_path):
    base = environment.source_digest(_write_tree(tmp_path / "base", PACKAGE_FILES))
    changed = dict(PACKAGE_FILES, **{"kernels/layer_norm.py": b"def forward(x):\n    return y\n"})
    assert environment.source_digest(_write_tree(tmp_path / "changed", changed)) != base
    renamed = {("kernels/layernorm.py" if k == "kernels/layer_norm.py" else k): v for k, v in PACKAGE_FILES.items()}
    assert environment.source_digest(_write_tree(tmp_path / "renamed", renamed)) != base
    moved = {("layer_norm.py" if k == "kernels/layer_norm.py" else k): v for k, v in PACKAGE_FILES.items()}
    assert environment.source_digest(_write_tree(tmp_path / "moved", moved)) != base
    added = dict(PACKAGE_FILES, **{"kernels/extra.py": b""})
    assert environment.source_digest(_write_tree(tmp_path / "added", added)) != base


def test_source_digest_frames_each_file(tmp_path):
    """Bytes moved from one file to the next give another digest, and an empty file counts."""
    trees = [
        {"a.py": b"xy", "b.py": b""},
        {"a.py": b"x", "b.py": b"y"},
        {"a.py": b"", "b.py": b"xy"},
        {"a.py": b"xy"},
    ]
    digests = {environment.source_digest(_write_tree(tmp_path / str(i), files)) for i, files in enumerate(trees)}
    assert len(digests) == len(trees)


def test_source_digest_ignores_caches_and_other_files(tmp_path):
    base = environment.source_digest(_write_tree(tmp_path / "base", PACKAGE_FILES))
    noisy = dict(PACKAGE_FILES, **{
        "__pycache__/__init__.cpython-311.pyc": b"\x00compiled",
        "kernels/__pycache__/layer_norm.py": b"a stray source in a cache",
        "kernels/notes.txt": b"text",
        "kernels/layer_norm.pyc": b"\x00compiled",
        "data/table.json": b"{}",
    })
    assert environment.source_digest(_write_tree(tmp_path / "noisy", noisy)) == base


def test_source_digest_fails_soft(tmp_path, monkeypatch):
    assert environment.source_digest(tmp_path / "missing") is None
    (tmp_path / "file.py").write_text("")
    assert environment.source_digest(tmp_path / "file.py") is None  # not a directory
    package = _write_tree(tmp_path / "pkg", PACKAGE_FILES)

    def unreadable(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(environment.Path, "read_bytes", unreadable)
    assert environment.source_digest(package) is None


def test_collect_environment_records_the_installed_source_digest():
    package_dir = Path(dslab.__file__).resolve().parent
    env = collect_environment()
    digest = env["dslab"]["source_digest"]
    assert digest is not None and digest == environment.source_digest(package_dir)
    text = format_environment(env, {})
    assert any(line.split() == ["source", "digest", digest] for line in text.splitlines())
    env["dslab"]["source_digest"] = None
    assert any(line.split() == ["source", "digest", "-"] for line in format_environment(env, {}).splitlines())


@needs_git
def test_source_digest_names_the_code_over_a_stale_git(tmp_path):
    """A work tree copied over an older ``.git`` (as on a lent machine): git_state names the old
    commit, the source digest names the code, and equals the digest of the newer commit's archive."""
    repo = tmp_path / "repo"
    package = _write_tree(repo / "dslab", PACKAGE_FILES)
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "old")
    stale = environment.git_state(package)["commit"]
    stale_git = tmp_path / "stale.git"
    shutil.copytree(repo / ".git", stale_git)
    (package / "kernels" / "layer_norm.py").write_bytes(b"def forward(x):\n    return 2 * x\n")
    (repo / "README.md").write_text("not part of the digest\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "new")
    new = environment.git_state(package)["commit"]
    archived = tmp_path / "archived"
    archived.mkdir()
    archive = subprocess.run(["git", "-C", str(repo), "archive", new, "dslab"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(archived)], input=archive.stdout, check=True)
    lent = tmp_path / "lent"
    shutil.copytree(repo, lent, ignore=shutil.ignore_patterns(".git"))
    shutil.copytree(stale_git, lent / ".git")
    state = environment.git_state(lent / "dslab")
    assert state["commit"] == stale != new and state["dirty"] is True
    assert environment.source_digest(lent / "dslab") == environment.source_digest(archived / "dslab")
    assert environment.source_digest(lent / "dslab") == environment.source_digest(package)
    _git(repo, "checkout", "-q", stale)
    assert environment.source_digest(package) != environment.source_digest(lent / "dslab")
