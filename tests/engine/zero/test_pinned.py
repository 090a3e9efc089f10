"""Page-locked host buffers of the size asked for (dslab/engine/zero/pinned.py): on CPU with a
stand-in for the CUDA runtime's registration calls, and on a GPU with the real ones."""

import gc

import pytest
import torch

from dslab.engine.zero import pinned


class FakeCudart:
    """Records cudaHostRegister/cudaHostUnregister; refuses a range overlapping a registered one
    (as CUDA does) or any registration once ``fail`` is set."""

    def __init__(self):
        self.ranges: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.fail = False

    def cudaHostRegister(self, pointer, size, flags):
        overlaps = any(p < pointer + size and pointer < p + s for p, s in self.ranges.items())
        if self.fail or overlaps:
            return 2
        self.ranges[pointer] = size
        return 0

    def cudaHostUnregister(self, pointer):
        self.ranges.pop(pointer)
        self.unregistered.append(pointer)
        return 0

    def cudaGetErrorString(self, error):
        return "out of memory"


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    return fake


def test_buffers_are_registered_whole_pages_of_their_own_size(cudart):
    buffers = pinned.HostBuffers("offload_param")
    sizes = [(78_643_200 // 64, torch.float32), (3 * 2**20 + 5, torch.bfloat16), (300_001, torch.float32)]
    tensors = [buffers.empty(numel, dtype, pin=True) for numel, dtype in sizes]
    for t, (numel, dtype) in zip(tensors, sizes):
        assert t.numel() == numel and t.dtype == dtype
        t.fill_(1.5)  # the memory is this tensor's to write
    assert len(cudart.ranges) == 3  # disjoint: every range lies inside its own allocation
    for (pointer, size), t in zip(cudart.ranges.items(), tensors):
        assert pointer % pinned.PAGE == 0 and pointer == t.data_ptr()
        assert size == -(-t.numel() * t.element_size() // pinned.PAGE) * pinned.PAGE  # pages, not a power of two
    assert buffers.registered_bytes == sum(cudart.ranges.values())
    assert all(torch.equal(t, torch.full_like(t, 1.5)) for t in tensors)
    plain = buffers.zeros(5, torch.float32, pin=False)  # not pinned: ordinary memory, nothing registered
    assert torch.equal(plain, torch.zeros(5)) and len(cudart.ranges) == 3
    buffers.close()
    assert not cudart.ranges and len(cudart.unregistered) == 3
    buffers.close()  # once only
    assert len(cudart.unregistered) == 3 and torch.equal(tensors[0], torch.full_like(tensors[0], 1.5))


def test_an_owner_collected_unregisters_its_buffers(cudart):
    buffers = pinned.HostBuffers("offload_optimizer")
    buffers.empty(2**20, torch.float32, pin=True)
    assert len(cudart.ranges) == 1
    del buffers
    gc.collect()
    assert not cudart.ranges and len(cudart.unregistered) == 1


def test_a_failed_registration_names_the_owner_and_the_way_out(cudart):
    cudart.fail = True
    with pytest.raises(RuntimeError, match=r"page-locking 4194304 bytes .*out of memory.*offload_param needs pinned "
                                           r"memory.*pin_memory to false"):
        pinned.HostBuffers("offload_param").empty(2**20, torch.float32, pin=True)


@pytest.mark.gpu
def test_registered_memory_copies_asynchronously():
    """A copy into pageable memory waits for the stream; into registered memory it is queued
    behind a long-running kernel and returns while the stream is still busy."""
    buffers = pinned.HostBuffers("offload_param")
    host = buffers.empty(3_000_001, torch.float32, pin=True)
    assert buffers.registered_bytes == -(-3_000_001 * 4 // 4096) * 4096
    values = torch.randn(3_000_001)
    host.copy_(values)
    device = torch.empty(3_000_001, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        device.copy_(host, non_blocking=True)
        doubled = device * 2
        back = buffers.zeros(3_000_001, torch.float32, pin=True)
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock cycles
        back.copy_(doubled, non_blocking=True)  # device to registered host memory
        queued = not stream.query()
    stream.synchronize()
    assert queued, "the copy to registered host memory waited for the stream"
    torch.testing.assert_close(back, values * 2)
    pageable = torch.empty(3_000_001)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000_000)
        pageable.copy_(doubled, non_blocking=True)
        assert stream.query(), "the control: a copy to pageable memory returns once the stream is done"
    buffers.close()
    assert not buffers._registered
