"""dslab's ``GatheredParameters`` on parameters DeepSpeed partitioned: a dslab model built under
``deepspeed.zero.Init`` (the size ladder's and the suites' DeepSpeed arms) is initialised as a plain
build is. Without the hand-over its init pass wrote into DeepSpeed's empty placeholders, and the
model kept its constructors' defaults (word embeddings ~ N(0, 1): a first loss of 1,372 for GPT-2
2.7B where the dslab arm's was 11.3)."""

import os
import socket
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from torch import nn

from dslab.models.ops import init_normal_
from dslab.parallel.partitioned import GatheredParameters, is_deepspeed_partitioned


class StandInDeepSpeed:
    """A stand-in for ``deepspeed.zero.GatheredParameters`` over parameters whose whole values sit
    in ``store`` while they are partitioned (``p.data`` empty): whole inside the block, written
    back on exit when ``modifier_rank`` is given."""

    def __init__(self):
        self.store: dict[int, torch.Tensor] = {}
        self.calls: list[tuple[list[int], int | None]] = []

    def partition(self, p: nn.Parameter) -> None:
        self.store[id(p)] = p.data.clone()
        p.data = torch.empty(0, dtype=p.dtype)
        p.ds_status, p.ds_id = "NOT_AVAILABLE", len(self.store)

    def gathered(self, params, modifier_rank=None):
        stand_in = self

        class Block:
            def __enter__(self):
                stand_in.calls.append(([id(p) for p in params], modifier_rank))
                for p in params:
                    p.data = stand_in.store[id(p)].clone()

            def __exit__(self, *exc):
                for p in params:
                    if modifier_rank is not None:
                        stand_in.store[id(p)] = p.data.clone()
                    p.data = torch.empty(0, dtype=p.dtype)
                return False

        return Block()


@pytest.fixture
def stand_in(monkeypatch):
    deepspeed = StandInDeepSpeed()
    module = types.ModuleType("deepspeed")
    module.zero = types.SimpleNamespace(GatheredParameters=deepspeed.gathered)
    monkeypatch.setitem(sys.modules, "deepspeed", module)
    return deepspeed


def test_an_init_pass_reaches_parameters_deepspeed_partitioned(stand_in):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(300, 64), nn.Linear(64, 96), nn.LayerNorm(96))
    for p in model.parameters():
        stand_in.partition(p)
    assert all(is_deepspeed_partitioned(p) for p in model.parameters())
    init_normal_(model, 0.02)
    embedding, weight, bias = (stand_in.store[id(p)] for p in
                               (model[0].weight, model[1].weight, model[1].bias))
    assert embedding.shape == (300, 64) and weight.shape == (96, 64)
    assert embedding.std().item() == pytest.approx(0.02, rel=0.05)  # N(0, 1) before the pass
    assert weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(bias, torch.zeros(96))
    assert torch.equal(stand_in.store[id(model[2].weight)], torch.ones(96))  # LayerNorm: as built
    assert all(rank == 0 for _, rank in stand_in.calls)
    assert all(p.numel() == 0 for p in model.parameters())  # partitioned again after each block


def test_read_only_gathers_write_nothing_back_and_plain_parameters_are_left_alone(stand_in):
    linear = nn.Linear(8, 4)
    plain = nn.Parameter(torch.ones(3))
    stand_in.partition(linear.weight)
    before = stand_in.store[id(linear.weight)].clone()
    with GatheredParameters([linear.weight, plain]):
        assert linear.weight.shape == (4, 8)
        linear.weight.data.fill_(5.0)
        plain.data.fill_(2.0)
    assert torch.equal(stand_in.store[id(linear.weight)], before)  # modifier_rank None
    assert stand_in.calls == [([id(linear.weight)], None)]  # only DeepSpeed's parameter handed over
    assert torch.equal(plain, torch.full((3,), 2.0))
    assert not is_deepspeed_partitioned(plain)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_gpt2_built_under_deepspeeds_init_starts_from_a_plain_builds_weights(tmp_path):
    """The real thing where DeepSpeed imports (one gloo process on the CPU): the same seed gives
    the same weights as a plain build, each gathered whole by DeepSpeed."""
    pytest.importorskip("deepspeed")
    script = tmp_path / "build.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=0, world_size=1)
        import deepspeed
        from dslab.models.gpt2 import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(vocab_size=512, n_positions=64, hidden=64, layers=2, heads=4, dropout=0.0)
        torch.manual_seed(3)
        plain = {n: p.detach().clone() for n, p in GPT2LMHeadModel(cfg, kernels="torch").named_parameters()}
        torch.manual_seed(3)
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = GPT2LMHeadModel(cfg, kernels="torch")
        built = {}
        for n, p in model.named_parameters():
            with deepspeed.zero.GatheredParameters([p]):
                built[n] = p.detach().clone()
        torch.save({"plain": plain, "built": built}, sys.argv[1])
    """))
    out = tmp_path / "weights.pt"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    weights = torch.load(out)
    assert weights["built"].keys() == weights["plain"].keys()
    for name, want in weights["plain"].items():
        assert torch.equal(weights["built"][name], want), name
    assert weights["built"]["wte.weight"].std().item() == pytest.approx(0.02, rel=0.05)
