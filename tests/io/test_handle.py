"""dslab.io's async handle on this machine's disk: exact round trips at odd sizes and offsets,
sync and async, on both backends, with aligned and unaligned memory and through the page cache
where O_DIRECT is refused; errors that name the file and offset; whole-file writes that are
atomic; DeepNVMe's API."""

from __future__ import annotations

import fcntl
import os
import resource
import signal
import struct

import pytest
import torch

from dslab.io import AsyncIOHandle, AsyncIOError, aio_handle
from dslab.io.buffers import aligned_empty, is_aligned
from dslab.io.handle import _validate

SIZES = [1, 4095, 4096, 4097, 12345, 3 * 65536 + 7]
OFFSETS = [0, 1, 4096, 5000]


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["aio", "threads"])
def handle(request):
    # small blocks, several lanes and a short queue: every request is many chunks in flight
    with AsyncIOHandle(block_size=8192, queue_depth=3, intra_op_parallelism=3,
                       overlap_events=True, backend=request.param) as h:
        yield h


def test_whole_file_round_trips_at_odd_sizes(handle, tmp_path):
    for n in [0, *SIZES]:
        data = _bytes(n, n)
        path = tmp_path / f"f{n}"
        assert handle.sync_pwrite(data, path) == n
        assert path.stat().st_size == n
        back = torch.empty_like(data)
        assert handle.sync_pread(back, path) == n
        assert torch.equal(back, data), n
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"f{n}" for n in [0, *SIZES])


def test_async_reads_and_writes_at_odd_offsets(handle, tmp_path):
    path = tmp_path / "base"
    base = _bytes(70_000, 1)
    handle.sync_pwrite(base, path)
    expected = base.clone()
    pieces = []
    for i, (offset, n) in enumerate(zip(OFFSETS, [3, 8192, 9000, 4095])):
        piece = _bytes(n, 10 + i)
        expected[offset:offset + n] = piece
        pieces.append((offset, piece))
    # offsets 0 and 1 overlap: one write after the other
    for offset, piece in pieces:
        assert handle.async_pwrite(piece, path, offset, in_place=True) == 0
        assert handle.wait() == 1
    reads = [(offset, torch.empty(n, dtype=torch.uint8))
             for offset, n in [(0, 70_000), (4097, 333), (65536, 4464)]]
    for offset, buffer in reads:
        handle.async_pread(buffer, path, offset)
    assert handle.wait() == len(reads)
    for offset, buffer in reads:
        assert torch.equal(buffer, expected[offset:offset + buffer.numel()]), offset
    assert path.stat().st_size == 70_000


def test_unaligned_memory_and_other_dtypes_round_trip(handle, tmp_path):
    aligned = aligned_empty(50_001, torch.float32)
    assert is_aligned(aligned)
    unaligned = aligned_empty(50_002, torch.float32)[1:]  # 4 bytes past alignment: bounce slots
    assert not is_aligned(unaligned)
    for i, tensor in enumerate([aligned, unaligned]):
        tensor.copy_(torch.randn(tensor.numel(), generator=torch.Generator().manual_seed(i)))
        handle.sync_pwrite(tensor, tmp_path / f"t{i}")
        back = torch.zeros_like(tensor)
        handle.sync_pread(back, tmp_path / f"t{i}")
        assert torch.equal(back, tensor)
    half = torch.randn(3, 1001).to(torch.bfloat16)
    handle.sync_pwrite(half, tmp_path / "bf16")
    back = torch.empty_like(half)
    handle.sync_pread(back, tmp_path / "bf16")
    assert torch.equal(back, half)
    locked = handle.new_cpu_locked_tensor(12_345, torch.empty(0, dtype=torch.int16))
    assert locked.dtype == torch.int16 and locked.numel() == 12_345 and is_aligned(locked)
    assert handle.free_cpu_locked_tensor(locked) is True
    assert handle.free_cpu_locked_tensor(half) is False


def test_a_file_system_that_refuses_o_direct_goes_through_the_page_cache(tmp_path, monkeypatch):
    # tmpfs before Linux 6.6 (and some network file systems) fail open(O_DIRECT) with EINVAL
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    data = _bytes(100_003, 5)
    with AsyncIOHandle(block_size=16384, queue_depth=4, intra_op_parallelism=2) as h:
        h.sync_pwrite(data, tmp_path / "cached.bin")
        back = torch.empty_like(data)
        h.sync_pread(back, tmp_path / "cached.bin", 0)
        assert torch.equal(back, data)
        assert h.buffered_dirs == {str(tmp_path)}
    with AsyncIOHandle(direct_io=False) as h:  # dslab's switch: page-cache I/O everywhere
        h.sync_pread(back, tmp_path / "cached.bin")
        assert torch.equal(back, data) and h.buffered_dirs == set()


def test_missing_files_and_directories_are_named(handle, tmp_path):
    missing = tmp_path / "nope.bin"
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        handle.sync_pread(torch.empty(10, dtype=torch.uint8), missing)
    with pytest.raises(FileNotFoundError, match="no_dir"):
        handle.async_pwrite(torch.zeros(10), tmp_path / "no_dir" / "x.bin")
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        handle.sync_pwrite(torch.zeros(10), missing, 100)  # an in-place write needs the file
    assert handle.wait() == 0


def test_reading_past_the_end_names_the_file_and_offset(handle, tmp_path):
    path = tmp_path / "short.bin"
    handle.sync_pwrite(_bytes(5000), path)
    with pytest.raises(AsyncIOError,
                       match=r"short.bin holds 5000 bytes: cannot read 100 bytes at offset 4950"):
        handle.sync_pread(torch.empty(100, dtype=torch.uint8), path, 4950)


def test_a_file_truncated_under_the_reader_is_a_short_read(tmp_path):
    # one lane, one request in flight, 4 KiB chunks: the 2048 chunks of an 8 MiB read take far
    # longer than the truncate issued right after submission
    for attempt in range(3):
        path = tmp_path / f"shrinks{attempt}.bin"
        with AsyncIOHandle(block_size=4096, queue_depth=1, backend="threads") as h:
            h.sync_pwrite(_bytes(8 << 20), path)
            h.async_pread(torch.empty(8 << 20, dtype=torch.uint8), path)
            os.truncate(path, 4096)
            try:
                h.wait()
            except AsyncIOError as err:
                message = str(err)
                assert f"short read of {path} at offset " in message
                offset = int(message.split(" at offset ")[1].split(":")[0])
                assert offset >= 4096 and offset % 4096 == 0
                assert "the file ends there" in message
                return
    pytest.fail("three reads of a file truncated under them all succeeded")


def _immutable(path: Path, on: bool) -> bool:
    """Set or clear the ext4/xfs immutable flag (root cannot create files in such a directory)."""
    fs_ioc_getflags, fs_ioc_setflags, immutable = 0x80086601, 0x40086602, 0x10
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = struct.unpack("l", fcntl.ioctl(fd, fs_ioc_getflags, struct.pack("l", 0)))[0]
        flags = flags | immutable if on else flags & ~immutable
        fcntl.ioctl(fd, fs_ioc_setflags, struct.pack("l", flags))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def test_a_read_only_directory_refuses_the_write_by_name(handle, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() == 0:
        if not _immutable(locked, True):
            pytest.skip("running as root on a file system without the immutable flag")
    else:
        locked.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match=r"cannot write .*locked/x.bin"):
            handle.sync_pwrite(torch.zeros(100), locked / "x.bin")
        assert list(locked.iterdir()) == []
    finally:
        if os.geteuid() == 0:
            _immutable(locked, False)
        locked.chmod(0o755)


def test_a_write_that_fails_midway_leaves_the_old_file(handle, tmp_path):
    path = tmp_path / "kept.bin"
    old = _bytes(1000, 3)
    handle.sync_pwrite(old, path)
    limit = 64 << 10
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        with pytest.raises(AsyncIOError,
                           match=r"File too large writing \d+ bytes of .*kept.bin at offset \d+") as err:
            handle.sync_pwrite(_bytes(256 << 10), path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert int(str(err.value).rsplit("at offset ", 1)[1]) >= limit
    back = torch.empty_like(old)
    handle.sync_pread(back, path)
    assert torch.equal(back, old)
    assert [p.name for p in tmp_path.iterdir()] == ["kept.bin"]  # the temporary is gone


def test_deepnvme_api(tmp_path):
    h = aio_handle(block_size=65536, queue_depth=7, single_submit=True, overlap_events=False,
                   intra_op_parallelism=2)
    try:
        assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(),
                h.get_overlap_events(), h.get_intra_op_parallelism(), h.get_thread_count()) == \
            (65536, 7, True, False, 2, 2)
        data = _bytes(300_001, 9)
        assert h.pwrite(data, tmp_path / "p.bin", True, False) == data.numel()  # validate, sync
        back = torch.empty_like(data)
        assert h.pread(back, tmp_path / "p.bin", True, True) == 0  # validate, async
        assert h.wait() == 1 and torch.equal(back, data)
        assert h.write(data, tmp_path / "w.bin") == data.numel()
        assert h.read(back, tmp_path / "w.bin") == data.numel()
        # validation compares the buffer with a plain read of the file range
        request = h.submit_read(torch.empty(10, dtype=torch.uint8), tmp_path / "w.bin", 5)
        request.wait()
        other = data[5:15].clone()
        other[3] += 1
        with pytest.raises(AsyncIOError, match=r"validation of .*w.bin failed: .* at offset 8"):
            _validate(request, other)
        _validate(request, data[5:15])
    finally:
        h.close()


@pytest.mark.parametrize("kwargs, match", [
    ({"block_size": 1000}, "block_size must be an int >= 4096"),
    ({"block_size": 5000}, "block_size must be a multiple of 4096"),
    ({"queue_depth": 0}, "queue_depth must be an int >= 1"),
    ({"intra_op_parallelism": 0}, "intra_op_parallelism must be an int >= 1"),
    ({"backend": "uring"}, "backend must be one of auto, aio, threads"),
])
def test_bad_parameters_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AsyncIOHandle(**kwargs)


def test_bad_requests_name_the_argument(tmp_path):
    with AsyncIOHandle() as h:
        with pytest.raises(ValueError, match="buffer must be contiguous"):
            h.sync_pwrite(torch.zeros(4, 4).t(), tmp_path / "x")
        with pytest.raises(ValueError, match="file_offset must be an int >= 0"):
            h.sync_pread(torch.zeros(4), tmp_path / "x", -1)
        with pytest.raises(ValueError, match="pass in_place=True"):
            h.submit_write(torch.zeros(4), tmp_path / "x", 8, in_place=False)
    with pytest.raises(ValueError, match="closed"):
        h.sync_pwrite(torch.zeros(4), tmp_path / "x")


@pytest.mark.parametrize("backend", ["aio", "threads"])
def test_a_lane_that_breaks_fails_its_request_and_serves_the_next(tmp_path, monkeypatch, backend):
    from dslab.io import lanes

    real = lanes.Lane._submit
    calls = []

    def broken_once(self, batch, in_flight):
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("lane bug")
        return real(self, batch, in_flight)

    monkeypatch.setattr(lanes.Lane, "_submit", broken_once)
    with AsyncIOHandle(block_size=4096, queue_depth=2, backend=backend) as h:
        with pytest.raises(RuntimeError, match="lane bug"):
            h.sync_pwrite(_bytes(20_000), tmp_path / "a.bin")
        assert not (tmp_path / "a.bin").exists() and list(tmp_path.iterdir()) == []
        h.sync_pwrite(_bytes(20_000), tmp_path / "b.bin")
        assert (tmp_path / "b.bin").stat().st_size == 20_000
