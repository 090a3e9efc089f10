"""Parameter offload and ``zero.Init`` on a CUDA device: the side-stream fetches from pinned
host memory and from files give the losses of stage 3 with the parameters on the GPU."""

import pytest
import torch

import dslab
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny

pytestmark = pytest.mark.gpu

STEPS = 4


def _config(**zero):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "gradient_clipping": 1.0, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                  "stage3_prefetch_bucket_size": 100_000, **zero}}


def _losses(zero, partitioned=False):
    torch.manual_seed(0)
    with dslab.zero.Init(enabled=partitioned), torch.device("cuda"):
        model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0, layers=4), kernels="dslab")
    engine, _, _, _ = dslab.initialize(model=model, config=_config(**zero))
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS * 2):
        ids = torch.randint(0, 1000, (2, 64), generator=g).cuda()
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    home = engine.zero.param_home
    stats = home.stats() if home is not None else None
    if stats is not None and engine.zero.offload is not None:
        stats.update(engine.zero.offload.stats())
    engine.destroy()
    return losses, stats


@pytest.fixture(scope="module")
def reference():
    return _losses({"stage3_param_persistence_threshold": 0})[0]


@pytest.mark.parametrize("offload", ["cpu", "nvme", "cpu-ratio", "cpu-ratio-host-add"])
def test_offloaded_parameters_train_like_device_resident_ones(reference, offload, tmp_path):
    """``cpu-ratio``: half the units step on the GPU (fused AdamW over CUDA and CPU masters at
    once) and keep their parameters there; ``host-add``: the second micro-step's gradient shards
    copied from the GPU into two pinned staging buffers and added on the CPU."""
    device = offload.split("-")[0]
    zero = {"stage3_param_persistence_threshold": 0,
            "offload_param": {"device": device, "pin_memory": True, "nvme_path": str(tmp_path)}}
    if offload == "nvme":  # no CPU cache (DeepSpeed's default max_in_cpu keeps a tiny model in memory)
        zero["offload_param"]["max_in_cpu"] = 0
    if "ratio" in offload:
        zero["offload_optimizer"] = {"device": "cpu", "ratio": 0.5}
    if offload.endswith("host-add"):
        zero["offload_optimizer"].update(accumulate_on="cpu", staging_buffers=2)
    losses, stats = _losses(zero)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-5)
    assert stats["fetches"] > 0 and stats["h2d_bytes"] > 0 and stats["copy_stall_ms"] >= 0
    if offload == "nvme":
        assert stats["disk_read_bytes"] >= stats["h2d_bytes"]
    assert stats["grad_d2h_bytes"] > 0
    if offload.endswith("host-add"):  # the second micro-step's shards added on the host: none went back
        assert stats["grad_h2d_bytes"] == 0 and stats["host_adds"] > 0
    else:
        assert stats["grad_h2d_bytes"] > 0 and stats["host_adds"] == 0


def test_parameters_fetched_as_bf16_copies_move_half_the_bytes(reference):
    """offload_param.fetch_dtype bf16: the copies cross PCIe on the side stream and are widened on
    the GPU; the run ends within the weights' bf16 rounding of the fp32 one."""
    zero = {"stage3_param_persistence_threshold": 0, "offload_param": {"device": "cpu", "pin_memory": True}}
    _, fp32 = _losses(zero)
    zero["offload_param"]["fetch_dtype"] = "bf16"
    losses, stats = _losses(zero)
    assert stats["fetches"] == fp32["fetches"] > 0 and 2 * stats["h2d_bytes"] == fp32["h2d_bytes"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-2, atol=1e-2)


def test_a_model_built_partitioned_on_the_gpu_trains_like_a_plain_one(reference):
    losses, _ = _losses({"stage3_param_persistence_threshold": 0}, partitioned=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-5)


def test_gradients_staged_in_bf16_cross_pcie_at_half_the_bytes(reference):
    """offload_optimizer.staging_dtype bf16: the later micro-step's shards are converted on the
    GPU's copy stream and cross in half the bytes (the first of each window stays fp32); the run
    ends within bf16 rounding of the fp32 one."""
    zero = {"stage3_param_persistence_threshold": 0, "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "accumulate_on": "cpu", "staging_buffers": 2}}
    _, fp32 = _losses(zero)
    zero["offload_optimizer"]["staging_dtype"] = "bf16"
    losses, stats = _losses(zero)
    assert stats["host_adds"] == fp32["host_adds"] > 0 and stats["grad_h2d_bytes"] == 0
    # accumulation 2: half the shards are a window's first (fp32), half staged (bf16)
    assert stats["grad_d2h_bytes"] == pytest.approx(0.75 * fp32["grad_d2h_bytes"])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-2, atol=1e-2)


def test_a_resident_gradient_sum_crosses_pcie_once_a_step(reference):
    """``accumulate_on: gpu_resident``: the micro-steps' shards summed on the GPU, the sum copied
    to the host once per optimizer step (half the gradient bytes of the default's two micro-steps,
    none back), the same losses."""
    zero = {"stage3_param_persistence_threshold": 0, "offload_param": {"device": "cpu", "pin_memory": True}}
    _, plain = _losses(zero)
    zero["offload_optimizer"] = {"device": "cpu", "accumulate_on": "gpu_resident"}
    losses, stats = _losses(zero)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-5)
    assert stats["grad_h2d_bytes"] == 0 and stats["host_adds"] == 0
    assert 2 * stats["grad_d2h_bytes"] == plain["grad_d2h_bytes"] > 0


@pytest.mark.parametrize("fetch_dtype", [None, "bf16"])
def test_a_background_step_trains_as_the_serial_one_on_the_gpu(fetch_dtype):
    """``offload_optimizer.overlap_step``: the offloaded units' CPU step on a worker thread while
    the next forward fetches them from pinned memory on the side stream, with resident units
    stepped first: the serial step's losses (to the run-to-run tolerance of the GPU kernels, as
    the other tests here), and the worker did the stepping."""
    zero = {"stage3_param_persistence_threshold": 2_000, "sub_group_size": 50_000,
            "offload_param": {"device": "cpu", "pin_memory": True, "fetch_dtype": fetch_dtype}}
    serial, _ = _losses(zero)
    zero["offload_optimizer"] = {"device": "cpu", "overlap_step": True}
    overlapped, stats = _losses(zero)
    torch.testing.assert_close(torch.tensor(overlapped), torch.tensor(serial), rtol=1e-5, atol=1e-5)
    assert stats["overlap_step_s"] > 0 and stats["update_wait_s"] >= 0
