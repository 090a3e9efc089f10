"""Where the engine's flops profile text goes: standard output in a training script (DeepSpeed's
behaviour), ``flops_profiler.output_file`` when the config names one, and the profile output
directory a benchmark sets (printed as well only with ``echo_text``)."""

import pytest
import torch
import torch.nn as nn

import dslab

HEADER = "dslab Flops Profiler"


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


def train(flops_profiler: dict, steps: int = 2, output_dir=None, echo_text: bool = False):
    """A tiny engine with the flops profiler on step 0, trained for ``steps`` steps and destroyed;
    returns its flops records."""
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "flops_profiler": {"enabled": True, "profile_step": 0, "device_time": False, **flops_profiler}}
    engine, _, _, _ = dslab.initialize(model=Regression(), config=config)
    if output_dir is not None:
        engine.set_profile_output_dir(output_dir, echo_text=echo_text)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    for _ in range(steps):
        engine.backward(engine(x, y))
        engine.step()
    records = engine.profiler_records()["flops"]
    engine.destroy()
    return records


def test_engine_without_output_dir_prints_the_profile(capsys):
    records = train({})
    out = capsys.readouterr().out
    assert out.count(HEADER) == 1 and "Profile Summary at step 0" in out
    assert records["profiled"] and records["text_file"] is None


def test_output_file_of_the_config_gets_the_profile(capsys, tmp_path):
    path = tmp_path / "flops.txt"
    records = train({"output_file": str(path)})
    assert HEADER not in capsys.readouterr().out
    assert path.read_text().count(HEADER) == 1
    assert records["text_file"] == str(path)


@pytest.mark.parametrize("echo_text", [False, True])
def test_profile_output_dir_gets_the_profile_and_echo_prints_it(capsys, tmp_path, echo_text):
    records = train({}, output_dir=tmp_path / "profiles", echo_text=echo_text)
    path = tmp_path / "profiles" / "flops_profile.txt"
    assert path.read_text().count(HEADER) == 1
    assert records["text_file"] == str(path)
    assert (HEADER in capsys.readouterr().out) == echo_text


def test_profile_written_at_destroy_when_the_run_stops_early(capsys, tmp_path):
    """With device_time on, the text waits for the two steps after the counted one; a run that
    stops before them gets it when the engine is destroyed, in the file its records named."""
    records = train({"device_time": True}, steps=1, output_dir=tmp_path)
    assert records["text_file"] == str(tmp_path / "flops_profile.txt")
    assert HEADER in (tmp_path / "flops_profile.txt").read_text()
    assert HEADER not in capsys.readouterr().out
