"""Pipeline parallelism: the 1F1B schedule, partitioning, topologies, and real gloo runs where 2 and
4 stages (and 2 stages x 2 data-parallel replicas with ZeRO-1) give one stage's losses and
weights (pipe_worker.py: the one-stage references in one process, the split runs in one launch
per world size)."""

import os
import subprocess
import sys
from collections import defaultdict, deque
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from dslab.parallel.pipe.module import LayerSpec, PipelineModule, partition_balanced, partition_uniform
from dslab.parallel.pipe.p2p import decode_header, encode_header
from dslab.parallel.pipe.schedule import bubble_fraction, inference_schedule, train_schedule
from dslab.parallel.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

from shared_launch import shared_directory

HERE = Path(__file__).parent


# -- the schedule -------------------------------------------------------------------------------


def simulate(schedules: list[list]) -> dict:
    """Run every stage's schedule with blocking p2p steps (a step completes when each of its
    transfers met its counterpart on the neighbour, in posting order per direction); fails on a
    deadlock. Returns what each stage received, in order, and the peak live activations."""
    stages = len(schedules)
    pos = [0] * stages
    posted = [False] * stages
    queues = defaultdict(deque)  # (src, dst, kind, "send"|"recv") -> posted transfers, in order
    received = defaultdict(list)
    live = [0] * stages
    peak = [0] * stages
    matched = defaultdict(int)  # id of a posted op -> matched

    def ops_of(stage, step):
        out = []
        for kind, i in step.sends:
            dst = stage + 1 if kind == "activation" else stage - 1
            out.append(("send", stage, dst, kind, i))
        for kind, i in step.recvs:
            src = stage - 1 if kind == "activation" else stage + 1
            out.append(("recv", src, stage, kind, i))
        return out

    pending = [[] for _ in range(stages)]
    while any(pos[s] < len(schedules[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if pos[s] >= len(schedules[s]):
                continue
            step = schedules[s][pos[s]]
            if step.kind != "p2p":
                if step.kind == "forward":
                    live[s] += 1
                    peak[s] = max(peak[s], live[s])
                elif step.kind == "backward":
                    live[s] -= 1
                pos[s] += 1
                progressed = True
                continue
            if not posted[s]:
                posted[s] = True
                pending[s] = ops_of(s, step)
                for op in pending[s]:
                    side, src, dst, kind, i = op
                    other = "recv" if side == "send" else "send"
                    partner = queues[(src, dst, kind, other)]
                    if partner:
                        peer = partner.popleft()
                        assert peer[4] == i, f"stage {s}: {side} of {kind} {i} met {kind} {peer[4]}"
                        matched[id(op)] = matched[id(peer)] = 1
                        if side == "recv":
                            received[s].append((kind, i))
                        else:
                            received[dst].append((kind, i))
                    else:
                        queues[(src, dst, kind, side)].append(op)
                progressed = True
            if all(matched[id(op)] for op in pending[s]):
                posted[s] = False
                pos[s] += 1
                progressed = True
        assert progressed, f"deadlock at steps {[schedules[s][pos[s]] if pos[s] < len(schedules[s]) else None for s in range(stages)]}"
    return {"received": received, "peak": peak}


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 3, 5, 8])
def test_1f1b_runs_without_deadlock_in_order_with_bounded_activations(stages, micro):
    schedules = [train_schedule(s, stages, micro) for s in range(stages)]
    result = simulate(schedules)
    for s, steps in enumerate(schedules):
        forwards = [st.micro_batch for st in steps if st.kind == "forward"]
        backwards = [st.micro_batch for st in steps if st.kind == "backward"]
        assert forwards == list(range(micro)) and backwards == list(range(micro))
        loads = [st.micro_batch for st in steps if st.kind == "load"]
        assert loads == (list(range(micro)) if s in (0, stages - 1) else [])
        # 1F1B keeps at most (stages - s) micro-batches alive on stage s (GPipe would keep all)
        assert result["peak"][s] == min(stages - s, micro)
        got = result["received"][s]
        if s > 0:
            assert [i for k, i in got if k == "activation"] == list(range(micro))
        if s < stages - 1:
            assert [i for k, i in got if k == "grad"] == list(range(micro))


def test_inference_schedule_is_forward_only_and_runs():
    schedules = [inference_schedule(s, 3, 4) for s in range(3)]
    simulate(schedules)
    assert all(st.kind != "backward" for steps in schedules for st in steps)


def test_schedule_refuses_bad_arguments():
    with pytest.raises(ValueError, match="stage 2 is not a stage"):
        train_schedule(2, 2, 4)
    with pytest.raises(ValueError, match="micro-batch"):
        train_schedule(0, 2, 0)
    assert bubble_fraction(4, 16) == pytest.approx(3 / 19)


# -- partitioning and topologies ----------------------------------------------------------------


def test_partitions():
    assert partition_uniform(7, 3) == [0, 3, 5, 7]
    assert partition_balanced([1, 1, 1, 1], 2) == [0, 2, 4]
    assert partition_balanced([10, 1, 1, 1, 1, 10], 4) == [0, 1, 4, 5, 6]
    # zero-weight layers (embeddings, norms) ride along; every stage gets at least one layer
    assert partition_balanced([0, 1, 1, 1, 1, 0, 0], 2) == [0, 3, 7]
    assert partition_balanced([5, 0, 0, 0], 4) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="cannot fill 4 pipeline stages"):
        partition_balanced([1, 1, 1], 4)


class Wide(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.fc = nn.Linear(n, n)

    def forward(self, x):
        return self.fc(x)


def test_pipeline_module_partition_methods_and_seeded_layers():
    specs = [LayerSpec(Wide, 8), LayerSpec(Wide, 2), LayerSpec(Wide, 2), LayerSpec(Wide, 8)]
    one = PipelineModule(specs, num_stages=1, partition_method="parameters", seed_layers=True, base_seed=5)
    assert one.parts == [0, 4]
    # each layer's weights depend only on its index
    torch.manual_seed(5 + 3)
    assert torch.equal(one.get_submodule("3").fc.weight, Wide(8).fc.weight)
    with pytest.raises(ValueError, match="matches none of the layers"):
        PipelineModule(specs, num_stages=1, partition_method="type:Attention")
    with pytest.raises(ValueError, match="partition_method='best'"):
        PipelineModule(specs, num_stages=1, partition_method="best")
    with pytest.raises(ValueError, match="num_stages=3 must divide the world size 1"):
        PipelineModule(specs, num_stages=3)
    with pytest.raises(ValueError, match="LayerSpec needs an nn.Module subclass"):
        LayerSpec(len)


def test_topologies_keep_deepspeeds_rank_order():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    for pipe in range(2):
        for data in range(2):
            for model in range(2):
                rank = topo.get_rank(pipe=pipe, data=data, model=model)
                assert rank == pipe * 4 + data * 2 + model
                assert tuple(topo.get_coord(rank)) == (pipe, data, model)
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_axis_comm_lists("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.filter_match(pipe=1, model=0) == [4, 6]
    assert topo.get_rank_repr(5) == "model_01"
    pd = PipeDataParallelTopology(num_pp=4, num_dp=2)
    assert pd.get_axis_list("pipe", 0) == [0, 1] and pd.get_dim("data") == 2 and pd.get_dim("model") == 0
    with pytest.raises(ValueError, match="axis 'b' has size 0"):
        ProcessTopology(["a", "b"], [2, 0])
    with pytest.raises(ValueError, match="outside the grid"):
        pd.get_rank(pipe=4, data=0)


def test_activation_header_round_trip():
    a = torch.randn(2, 3, 4, requires_grad=True) * 1.0
    b = torch.zeros(5, dtype=torch.int64)
    assert decode_header(encode_header((a, b))) == [(torch.float32, True, (2, 3, 4)), (torch.int64, False, (5,))]
    with pytest.raises(ValueError, match="header of"):
        encode_header(tuple(torch.zeros([1] * 8) for _ in range(20)))


# -- gloo runs ----------------------------------------------------------------------------------
#
# Every run below, by name: (stages, dp, options, steps, micro, accum). The one-stage references
# train in one process, the split runs in one launch per world size (pipe_worker.py runs a
# launch's runs one after another); each launch runs once per session (shared_launch.py) and the
# tests read its runs' results.

REFERENCES = {
    "one": (1, 1, ("clip=0.5",), 3, 2, 4),
    "one_micro4": (1, 1, ("clip=0.5",), 3, 4, 4),
    # SGD: the key bias's gradient is zero up to rounding, which Adam would blow up to full steps
    # that differ with the recomputation's rounding; SGD keeps them at rounding size
    "gpt2": (1, 1, ("model=gpt2", "clip=1.0", "opt=SGD", "lr=0.5"), 3, 2, 4),
    "fp16": (1, 1, ("fp16=1", "clip=0.5"), 6, 2, 4),
}
ON_TWO = {  # the comms=1 run first: the comms logger counts its process's transfers
    "pp2": (2, 1, ("clip=0.5", "comms=1"), 3, 2, 4),
    "fp16_pp2": (2, 1, ("fp16=1", "clip=0.5", "short=1"), 6, 2, 4),
}
ON_FOUR = {
    "pp4": (4, 1, ("clip=0.5",), 3, 2, 4),
    "pp2_dp2": (2, 2, ("clip=0.5", "zero=1"), 3, 2, 4),
    "gpt2_pp4": (4, 1, ("model=gpt2", "partition=type:GPT2Block", "clip=1.0", "ckpt=1", "opt=SGD", "lr=0.5"), 3, 2,
                 4),
}


def launch(out: Path, runs: dict[str, tuple], world: int) -> None:
    """Train ``runs`` in one launch of ``world`` processes (one plain process when 1), each into
    ``out/<name>``."""
    args = []
    for name, (stages, dp, options, steps, micro, accum) in runs.items():
        assert stages * dp == world, name
        (out / name).mkdir()
        if args:
            args.append("+")
        args += [str(out / name), str(stages), str(dp), str(steps), str(micro), str(accum), *options]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if world == 1:
        cmd = [sys.executable, str(HERE / "pipe_worker.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
               str(HERE / "pipe_worker.py"), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]


def results(tmp_path_factory, label: str, runs: dict[str, tuple], world: int) -> dict[str, list[dict]]:
    """Each run's rank results (one dict per rank), from the session's launch of ``runs``."""
    out = shared_directory(tmp_path_factory, f"pipeline-{label}", lambda out: launch(out, runs, world))
    return {name: [torch.load(out / name / f"rank{r}.pt", weights_only=True) for r in range(world)]
            for name in runs}


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, dict]:
    return {name: ranks[0] for name, ranks in results(tmp_path_factory, "one", REFERENCES, 1).items()}


@pytest.fixture(scope="module")
def on_two(tmp_path_factory) -> dict[str, list[dict]]:
    return results(tmp_path_factory, "two", ON_TWO, 2)


@pytest.fixture(scope="module")
def on_four(tmp_path_factory) -> dict[str, list[dict]]:
    return results(tmp_path_factory, "four", ON_FOUR, 4)


def assert_same_training(reference: dict, ranks: list[dict], rtol=1e-5, atol=1e-6):
    """Every rank reports the reference's losses, and together the stages hold the reference's
    parameters (each tied copy equal to it)."""
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=rtol, atol=atol)
        torch.testing.assert_close(torch.tensor(r["eval_loss"]), torch.tensor(reference["eval_loss"]),
                                   rtol=rtol, atol=atol)
    seen = set()
    for r in ranks:
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=rtol, atol=atol, msg=name)
            seen.add(name)
    assert seen == set(reference["params"])


@pytest.mark.world_size(4)
def test_two_and_four_stages_train_as_one(references, on_two, on_four):
    one, two, four = references["one"], on_two["pp2"], on_four["pp4"]
    assert [r["parts"] for r in four][0] == [0, 2, 4, 6, 7]
    assert_same_training(one, two)
    assert_same_training(one, four)
    # the losses moved: the check compares training, not three copies of the first loss
    assert len(set(one["losses"])) == 3
    # the comms logger saw the transfers: 3 batches x 4 micro-batches x 2 tensors (a tuple
    # crosses the boundary) forward and back, the evaluation's 4 x 2 forward, one header per batch
    stage0 = next(r for r in two if r["stage"] == 0)
    assert stage0["p2p_counts"] == {"send": 3 * 4 * 2 + 4 * 2 + 4, "recv": 3 * 4 * 2}
    # every stage measured its busy and idle time for each batch
    stats = stage0["pipeline"]["per_stage"]
    assert [s["stage"] for s in stats] == [0, 1]
    assert all(len(s["batches"]) == 3 and 0.0 < s["busy_ms"] < s["wall_ms"] for s in stats)
    # the latest batch's timeline: stage 0 of 2 warms up with one forward before alternating
    order = [(kind[0].upper(), i) for kind, i, _, _ in stats[0]["batches"][-1]["timeline"]]
    assert order == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert stage0["pipeline"]["bubble_fraction"] == pytest.approx(1 / 5)


@pytest.mark.world_size(4)
def test_pipeline_times_data_parallel_with_zero1_trains_as_one(references, on_four):
    grid = on_four["pp2_dp2"]
    assert sorted((r["stage"], r["dp_rank"]) for r in grid) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert_same_training(references["one_micro4"], grid)


@pytest.mark.world_size(4)
def test_gpt2_in_four_stages_with_checkpointing_trains_as_one(references, on_four):
    four = on_four["gpt2_pp4"]
    assert four[0]["parts"] == [0, 2, 3, 4, 7]
    assert_same_training(references["gpt2"], four)


@pytest.mark.world_size(2)
def test_fp16_pipeline_scales_skips_and_steps_as_one_stage(references, on_two):
    # a loss scale of 2^19 that doubles every 2 steps: fp16 activations' gradients overflow at
    # 2^21, so some steps are skipped (on every stage together) and the others applied
    one, two = references["fp16"], on_two["fp16_pp2"]
    assert 0 < one["skipped"] < 6
    # a data iterator one micro-batch short: both stages stopped with the error, neither hung
    assert [r["short_error"] for r in two] == ["data_iter gave 3 of the batch's 4 micro-batches "
                                               "(gradient_accumulation_steps) on a stage that reads data; "
                                               "the pipeline stopped on every stage"] * 2
    assert [r["skipped"] for r in two] == [one["skipped"]] * 2
    assert [r["loss_scale"] for r in two] == [one["loss_scale"]] * 2
    assert_same_training(one, two)
