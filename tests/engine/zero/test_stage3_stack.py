"""ZeRO stage 3 over a model's layer stack (dslab/engine/zero/stage3_stack.py) on 2 gloo
processes (on a machine with 2 GPUs, 2 nccl processes replaying the captured graphs): GPT-2 tiny and BERT tiny (padding mask) give stage 0's losses and parameters, in fp32
exactly and under bf16 autocast within bf16's rounding of the sharded biases, with gradient
accumulation too; the stack's gathers move the autocast dtype. On a CPU the stack runs its
layer-by-layer passes eagerly: the same code the CUDA graphs capture on a GPU
(tests/engine/zero/test_zero_gpu.py replays them)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dslab.models.graphs import WARMUP_RUNS

HERE = Path(__file__).parent
pytestmark = pytest.mark.world_size(2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("stack") / "runs.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "stack_worker.py"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def _stack_stats(run, calls):
    """What the stack's counters read after ``calls`` training forwards: replays of one capture
    on a GPU, eager passes on a CPU."""
    if run["device"] == "cuda":
        return {"captures": 1, "replays": calls}
    return {"eager_not_cuda": calls}


def _max_param_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_fp32_stack_gives_stage0_exactly(runs, family):
    zero0, zero3 = runs[(family, 0, False, 1)], runs[(family, 3, False, 1)]
    assert zero3["stack"] and not zero0["stack"]
    assert zero3["stats"] == _stack_stats(zero3, 3)  # every training forward went through the stack
    assert zero3["losses"] == pytest.approx(zero0["losses"], rel=1e-6, abs=1e-6)
    assert _max_param_diff(zero0["state"], zero3["state"]) < 1e-5
    assert zero0["losses"][0] != zero0["losses"][-1]  # it trained


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_bf16_stack_gives_stage0_within_bf16_rounding(runs, family):
    zero0, zero3 = runs[(family, 0, True, 1)], runs[(family, 3, True, 1)]
    assert zero3["stack"]
    assert zero3["losses"] == pytest.approx(zero0["losses"], rel=1e-3)
    # AdamW moves each parameter by up to lr = 1e-3 a step; three steps of equal updates apart
    # from signs flipped on gradients within bf16 rounding of zero stay within 5e-3
    assert _max_param_diff(zero0["state"], zero3["state"]) < 5e-3


def test_accumulation_over_two_micro_steps(runs):
    zero0, zero3 = runs[("gpt2", 0, False, 2)], runs[("gpt2", 3, False, 2)]
    assert zero3["stats"] == _stack_stats(zero3, 6)
    assert zero3["losses"] == pytest.approx(zero0["losses"], rel=1e-6, abs=1e-6)
    assert _max_param_diff(zero0["state"], zero3["state"]) < 1e-5


def test_stack_gathers_in_the_autocast_dtype(runs):
    # GPT-2 tiny: 2 layers, each with 4 sharded units (qkv, out_proj, fc_in, fc_out; the norms
    # and biases are under the persistence threshold), gathered in forward and again in backward
    # per pass through the stack; on a GPU each capture's warm-up runs gather too
    per_step = 2 * 4 * 2
    run = runs[("gpt2", 3, True, 1)]
    passes = 3 + WARMUP_RUNS * run["stats"].get("captures", 0)
    bf16 = [c for c in run["calls"] if c[0] == "all_gather" and c[2] == "torch.bfloat16"]
    assert len(bf16) == passes * per_step
    assert not [c for c in runs[("gpt2", 3, False, 1)]["calls"] if c[2] == "torch.bfloat16"]
    # fp32 run: the same gathers in fp32, twice the bytes
    fp32_bytes = sorted(nb for op, nb, dt in runs[("gpt2", 3, False, 1)]["calls"] if op == "all_gather")
    assert {nb * 2 for _, nb, _ in bf16} <= set(fp32_bytes)


@pytest.mark.parametrize("linear_saves_weights", [True, False])
def test_the_forward_keeps_no_gathered_buffer_for_the_backward(monkeypatch, linear_saves_weights):
    """In one process: what the stack's forward saves for its backward holds no gathered buffer,
    except through the parameters themselves (rebound by the backward's gathers). With
    ``F.linear``'s saved views instead, every layer's buffers would stay alive."""
    import contextlib

    import dslab
    from dslab.engine.zero import stage3_stack
    from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny

    if torch.cuda.is_available():
        pytest.skip("checks the eager layer-by-layer passes in one process (a CPU's); on a GPU the "
                    "stack captures them into graphs, checked by the 2-process tests above")
    if not linear_saves_weights:
        monkeypatch.setattr(stage3_stack, "linear_saves_weights", contextlib.nullcontext)
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000},
              "cuda_graphs": {"enabled": True}, "steps_per_print": 10**6}
    engine, _, _, _ = dslab.initialize(model=GPT2LMHeadModel(gpt2_tiny(dropout=0.0)), config=config)
    stack = engine.module._layer_graphs
    assert isinstance(stack, stage3_stack.Stage3LayerStack)
    # the storages of the gathered buffers alive now, by layer (a freed buffer's address may
    # come back as an activation's)
    live, start, release, forward = {}, stack._gather_start, stack._release, [True]

    def recording(i):
        pending = start(i)
        if forward[0]:
            live[i] = {b.untyped_storage().data_ptr() for b in pending.buffers}
        return pending

    def releasing(i):
        release(i)
        live.pop(i, None)

    monkeypatch.setattr(stack, "_gather_start", recording)
    monkeypatch.setattr(stack, "_release", releasing)
    gathered, held = set(), set()

    def pack(t):
        alive = set().union(*live.values()) if live else set()
        gathered.update(alive)
        ptr = t.untyped_storage().data_ptr()
        if ptr in alive and not isinstance(t, torch.nn.Parameter):
            held.add(ptr)
        return t

    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine(input_ids=ids, labels=ids)
    forward[0] = False
    engine.backward(loss)
    engine.step()
    assert len(gathered) >= 2 * 4  # 2 layers x 4 sharded units, each gathered in the forward
    if linear_saves_weights:
        assert not held
    else:  # F.linear's saved weight views: every layer's 4 projections
        assert len(held) == 2 * 4
    engine.destroy()
