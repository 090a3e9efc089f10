"""``communication_data_type`` (DeepSpeed's key): the dtype data-parallel gradients are reduced
in at ZeRO stages 0-2, checked on two gloo ranks against reducing in the gradients' own dtype."""

from pathlib import Path

import pytest
import torch

from dslab.engine.config import load_config

HERE = Path(__file__).parent


def test_the_key_loads_and_is_refused_where_it_cannot_apply():
    assert load_config({"train_batch_size": 8}).communication_dtype is None
    for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        assert load_config({"train_batch_size": 8, "communication_data_type": name}).communication_dtype == dtype
    with pytest.raises(ValueError, match="communication_data_type"):
        load_config({"train_batch_size": 8, "communication_data_type": "int8"})
    with pytest.raises(ValueError, match="'communication_data_type' with 'zero_optimization.stage' = 3"):
        load_config({"train_batch_size": 8, "communication_data_type": "bf16", "zero_optimization": {"stage": 3}})


@pytest.mark.world_size(2)
def test_gradients_are_reduced_in_the_named_dtype(tmp_path, torchrun):
    out = tmp_path / "dtypes.pt"
    torchrun(HERE / "comm_dtype_worker.py", out)
    results = torch.load(out, weights_only=True)
    for stage, op in ((0, "all_reduce"), (1, "reduce_scatter"), (2, "reduce_scatter")):
        plain, fp32, bf16 = (results[f"{stage}-{d}"] for d in (None, "fp32", "bf16"))
        assert plain["dtypes"] == fp32["dtypes"] == [(op, "float32")], stage
        assert bf16["dtypes"] == [(op, "bfloat16")], stage
        # fp32 on an fp32 model is what it did anyway: bit for bit
        assert fp32["losses"] == plain["losses"]
        assert all(torch.equal(fp32["params"][k], v) for k, v in plain["params"].items())
        # bf16 rounds the gradients on the way: the same first loss, close later, not equal
        assert bf16["losses"][0] == plain["losses"][0]
        assert bf16["losses"][-1] == pytest.approx(plain["losses"][-1], rel=2e-3)
        assert not all(torch.equal(bf16["params"][k], v) for k, v in plain["params"].items())
        assert bf16["losses"][-1] < bf16["losses"][0]
    # bf16 weight copies reduce their bf16 gradients in bf16; "fp32" reduces them in fp32
    copies, copies_fp32 = results["0-bf16copies-None"], results["0-bf16copies-fp32"]
    assert ("all_reduce", "bfloat16") in copies["dtypes"]
    assert copies_fp32["dtypes"] == [("all_reduce", "float32")]
    assert copies_fp32["losses"][0] == copies["losses"][0]
    assert copies_fp32["losses"][-1] == pytest.approx(copies["losses"][-1], rel=5e-3)
