"""CUDA tensors through the async handle (pinned staging buffers), the tuner with CUDA tensors,
and NVMe optimizer offload on a GPU against CPU offload. Run on a CUDA machine:
``bin/test -m gpu tests/io``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dslab import cli
from dslab.io import AsyncIOError, AsyncIOHandle
from dslab.io import handle as handle_module

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from nvme_worker import ONE_PROCESS_CHUNKS, chunk_units, state, train_one_process  # noqa: E402


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)


@pytest.mark.parametrize("staging", [handle_module.CUDA_STAGING_BYTES, 64 << 10])
def test_cuda_tensors_round_trip_at_odd_sizes_and_offsets(tmp_path, monkeypatch, staging):
    # 64 KiB staging buffers: a request is many segments, both buffers in turn
    monkeypatch.setattr(handle_module, "CUDA_STAGING_BYTES", staging)
    with AsyncIOHandle(block_size=16384, queue_depth=4, intra_op_parallelism=2, overlap_events=True) as h:
        for n in (1, 4095, 4097, 1_000_003):
            data = _bytes(n, n)
            h.sync_pwrite(data, tmp_path / f"c{n}")
            assert (tmp_path / f"c{n}").stat().st_size == n
            back = torch.zeros_like(data)
            h.async_pread(back, tmp_path / f"c{n}")
            assert h.wait() == 1
            assert torch.equal(back, data), n
            if n > 10_000:
                part = torch.empty(n - 5001, dtype=torch.uint8, device="cuda")
                h.sync_pread(part, tmp_path / f"c{n}", 5001)
                assert torch.equal(part, data[5001:])
        values = torch.randn(333_333, device="cuda", dtype=torch.bfloat16)
        h.sync_pwrite(values, tmp_path / "bf16")
        cpu = torch.empty(333_333, dtype=torch.bfloat16)
        h.sync_pread(cpu, tmp_path / "bf16")  # written from the GPU, read into CPU memory
        assert torch.equal(cpu, values.cpu())


def test_a_cuda_write_waits_for_the_kernels_that_produce_it(tmp_path):
    with AsyncIOHandle() as h:
        data = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(200_000_000)  # keep the stream busy, then produce the data
        data.fill_(7)
        h.async_pwrite(data, tmp_path / "late.bin")
        h.wait()
    assert set((tmp_path / "late.bin").read_bytes()[:: 1 << 20]) == {7}


def test_a_short_read_into_a_cuda_tensor_names_the_file(tmp_path):
    with AsyncIOHandle() as h:
        h.sync_pwrite(_bytes(5000), tmp_path / "short.bin")
        with pytest.raises(AsyncIOError, match="short.bin holds 5000 bytes"):
            h.sync_pread(torch.empty(6000, dtype=torch.uint8, device="cuda"), tmp_path / "short.bin")


def test_locked_tensors_are_pinned():
    with AsyncIOHandle() as h:
        assert h.new_cpu_locked_tensor(1000, torch.float32).is_pinned()


def test_nvme_tune_with_cuda_tensors(tmp_path, capsys):
    sweep = tmp_path / "sweep.json"
    sweep.write_text('{"block_size": [1048576], "queue_depth": [8, 32], "intra_op_parallelism": [1], '
                     '"single_submit": [false], "overlap_events": [true]}')
    target = tmp_path / "disk"
    target.mkdir()
    assert cli.main(["nvme-tune", "--path", str(target), "--size", "64M", "--trials", "2",
                     "--device", "cuda", "--sweep-config", str(sweep), "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "cuda tensors" in out and '"aio": {' in out
    assert list(target.iterdir()) == []


def _train(offload: dict):
    engine = train_one_process(offload, "cuda")
    result = state(engine), chunk_units(engine)
    engine.destroy()
    return result


def test_nvme_offload_on_a_gpu_matches_cpu_offload(tmp_path):
    # the sub-groups are those of test_nvme_offload.py's one-process test on the CPU: two of two
    # units, so the prefetch and the write-behind run
    cpu, cpu_chunks = _train({"device": "cpu", "pin_memory": True})
    nvme, chunks = _train({"device": "nvme", "pin_memory": True, "nvme_path": str(tmp_path / "swap")})
    assert chunks == cpu_chunks == ONE_PROCESS_CHUNKS
    for key in cpu:
        assert torch.equal(cpu[key], nvme[key]), key
