import torch

import dslab
from dslab.engine.checkpoint_io import CheckpointError

import pytest

from helpers import TinyNet, base_config, make_data

CFG = base_config(
    gradient_accumulation_steps=2,
    fp16={"enabled": False},
    scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 20, "warmup_num_steps": 4,
                                                   "warmup_max_lr": 0.02}},
)


def build(seed=0):
    torch.manual_seed(seed)
    engine, _, _, _ = dslab.initialize(model=TinyNet(dropout=0.2), config=CFG)
    return engine


def train(engine, steps, start):
    x, y = make_data(64 * 8, seed=5)
    losses = []
    for i in range(start, start + steps):
        xb, yb = x[(i % 64) * 8:(i % 64 + 1) * 8], y[(i % 64) * 8:(i % 64 + 1) * 8]
        loss = engine(xb, yb)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    return losses


def test_resume_is_bit_exact(tmp_path):
    straight = build()
    expected = train(straight, 12, 0)

    first = build()
    head = train(first, 6, 0)
    first.save_checkpoint(tmp_path, client_state={"epoch": 3, "note": "x"})
    assert (tmp_path / "latest").read_text().strip() == "global_step3"

    torch.manual_seed(1234)  # a different RNG stream that the checkpoint must override
    resumed = build(seed=99)
    path, client = resumed.load_checkpoint(tmp_path)
    assert path == tmp_path / "global_step3"
    assert client == {"epoch": 3, "note": "x"}
    assert resumed.global_steps == 3 and resumed.global_samples == 48 and resumed.micro_steps == 6
    tail = train(resumed, 6, 6)
    for a, b in zip(expected, head + tail):
        assert torch.equal(a, b)
    for p, q in zip(straight.module.parameters(), resumed.module.parameters()):
        assert torch.equal(p, q)
    assert resumed.get_lr() == straight.get_lr()


def test_load_without_latest_returns_none(tmp_path):
    engine = build()
    assert engine.load_checkpoint(tmp_path) == (None, None)


def test_truncated_checkpoint_names_file(tmp_path):
    engine = build()
    train(engine, 2, 0)
    path = engine.save_checkpoint(tmp_path, tag="t1")
    model_file = path / "model.pt"
    data = model_file.read_bytes()
    model_file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.pt"):
        build().load_checkpoint(tmp_path, tag="t1")


def test_mismatched_model_names_file_and_key(tmp_path):
    engine = build()
    path = engine.save_checkpoint(tmp_path, tag="t1")
    assert path.is_dir()
    other, _, _, _ = dslab.initialize(model=TinyNet(hidden=48), config=CFG)
    with pytest.raises(CheckpointError, match=r"model.pt does not match the model: 'fc1.weight'"):
        other.load_checkpoint(tmp_path, tag="t1")


def test_client_state_must_be_plain_data(tmp_path):
    engine = build()
    with pytest.raises(ValueError, match="client_state"):
        engine.save_checkpoint(tmp_path, tag="bad", client_state={"obj": object()})
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                              (None, torch.float32)])
def test_save_16bit_model_writes_the_weights_in_the_training_precision(tmp_path, precision, dtype):
    overrides = {precision: {"enabled": True}} if precision else {}
    torch.manual_seed(0)
    model = TinyNet(dropout=0.0)
    model.fc1.bias.requires_grad_(False)
    engine, _, _, _ = dslab.initialize(model=model, config=base_config(**overrides))
    train(engine, 2, 0)
    assert engine.save_16bit_model(tmp_path / "out") is True
    saved = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    expected = engine.module.state_dict()
    assert saved.keys() == expected.keys()
    for key, value in expected.items():
        assert saved[key].dtype == dtype and saved[key].device.type == "cpu"
        assert torch.equal(saved[key], value.detach().cpu().to(dtype)), key
    assert engine.save_16bit_model(tmp_path / "out", "weights.pt", exclude_frozen_parameters=True)
    lean = torch.load(tmp_path / "out" / "weights.pt", weights_only=True)
    assert set(lean) == set(expected) - {"fc1.bias"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["pytorch_model.bin", "weights.pt"]


def test_save_16bit_model_under_stage3_needs_the_gather_key(tmp_path, caplog):
    cfg = base_config(bf16={"enabled": True},
                      zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    engine, _, _, _ = dslab.initialize(model=TinyNet(dropout=0.0), config=cfg)
    train(engine, 1, 0)
    assert engine.save_16bit_model(tmp_path) is False
    assert not any(tmp_path.iterdir())
    assert "stage3_gather_16bit_weights_on_model_save" in caplog.text
    engine.destroy()
    for key in ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"):
        cfg["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0, key: True}
        torch.manual_seed(0)
        engine, _, _, _ = dslab.initialize(model=TinyNet(dropout=0.0), config=cfg)
        train(engine, 1, 0)
        assert engine.save_16bit_model(tmp_path, key)
        saved = torch.load(tmp_path / key, weights_only=True)
        full = engine.module_state_dict()
        assert all(torch.equal(saved[k], v.cpu().to(torch.bfloat16)) for k, v in full.items())
        assert saved["fc1.weight"].shape == (32, 16)
        engine.destroy()


def test_save_16bit_model_refuses_a_path_as_file_name(tmp_path):
    engine = build()
    with pytest.raises(ValueError, match="save_filename"):
        engine.save_16bit_model(tmp_path, "sub/model.bin")
    assert not any(tmp_path.iterdir())


def test_save_16bit_model_failure_leaves_no_file(tmp_path, monkeypatch):
    engine = build()

    def broken(obj, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(CheckpointError, match="disk full"):
        engine.save_16bit_model(tmp_path)
    assert list(tmp_path.iterdir()) == []
