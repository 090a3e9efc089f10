"""One rank of the model-parallel checkpoint tests, started by torchrun: tiny GPT-2 (fp32, dropout
0, torch kernels, AdamW under WarmupLR) on several (pipe, data, model) grids in one launch, saved
and resumed through ``engine.save_checkpoint``/``load_checkpoint`` (see
test_model_parallel_checkpoint.py).

    mp_checkpoint_worker.py OUT_DIR PHASE

- ``save`` (4 ranks): per case of ``CASES``, train ``STEPS`` steps, save into
  ``OUT_DIR/<case>``, train ``STEPS`` more, recording those losses.
- ``resume`` (4 ranks): per case, a fresh engine from other initial weights and another RNG stream
  loads ``OUT_DIR/<case>`` and trains the same ``STEPS`` steps; then the PP2 x DP2 checkpoint is
  loaded at PP4 (refused), at PP2 x DP2 with ZeRO 0 with and without its optimizer states (the
  first refused, the second loads the weights), and the TP2 x DP2 one into a ZeRO-1 engine
  without its optimizer states.
- ``refuse`` (2 ranks): the PP2 x DP2 checkpoint loaded at PP2 x DP1; a data-parallel
  checkpoint (saved into ``OUT_DIR/dp2``) loaded at TP2.

Every rank writes ``OUT_DIR/<phase>_rank<r>.pt``: ``{case: {...}}``.
"""

import sys
from pathlib import Path

import torch

import dslab
from dslab import comm
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny
from dslab.models.gpt2_pipe import gpt2_pipeline_module
from dslab.parallel.topology import PipelineParallelGrid, PipeModelDataParallelTopology

VOCAB, SEQ, MICRO, ACCUM, STEPS = 64, 16, 2, 2, 2

# name -> (tp, pp, dp, zero stage, pipeline engine)
CASES = {
    "tp2_dp2_zero1": (2, 1, 2, 1, False),
    "tp2_dp2_zero2": (2, 1, 2, 2, False),
    "pp2_dp2_zero1": (1, 2, 2, 1, True),
    "tp2_pp2": (2, 2, 1, 0, True),
}


def micro_batches(step, dp, dp_rank):
    for a in range(ACCUM):
        g = torch.Generator().manual_seed(1000 * step + a)
        ids = torch.randint(0, VOCAB, (dp * MICRO, SEQ), generator=g)
        rows = ids[dp_rank * MICRO:(dp_rank + 1) * MICRO]
        yield rows, rows


class Run:
    """One engine of a case: its grid, and one optimizer step at a time."""

    def __init__(self, tp, pp, dp, zero, pipeline, seed):
        self.grid = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp))
        self.dp, self.pipeline = dp, pipeline
        config = gpt2_tiny(dropout=0.0, layers=4, vocab_size=VOCAB, n_positions=SEQ, tp_size=tp)
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
               "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                            "warmup_num_steps": 10}},
               "zero_optimization": {"stage": zero}, "gradient_clipping": 1.0, "steps_per_print": 1000}
        torch.manual_seed(seed)
        if pipeline:
            model = gpt2_pipeline_module(config, "torch", grid=self.grid, seed_layers=True, base_seed=seed)
            self.engine, _, _, _ = dslab.initialize(model=model, config=cfg)
        else:
            model = GPT2LMHeadModel(config, "torch", tp_group=self.grid.get_model_parallel_group())
            self.engine, _, _, _ = dslab.initialize(model=model, config=cfg, mpu=self.grid)

    def train(self, steps) -> list[float]:
        engine, losses = self.engine, []
        for step in steps:
            batches = micro_batches(step, self.dp, self.grid.get_data_parallel_rank())
            if self.pipeline:
                losses.append(float(engine.train_batch(batches)))
                continue
            total = 0.0
            for ids, labels in batches:
                loss = engine(ids, labels=labels)
                engine.backward(loss)
                engine.step()
                total += loss.item()
            mean = torch.tensor(total / ACCUM)
            if self.dp > 1:
                comm.all_reduce(mean, group=self.grid.get_data_parallel_group())
                mean /= self.dp
            losses.append(float(mean))
        return losses


def refusal(run: Run, path: Path, **kwargs) -> dict:
    try:
        run.engine.load_checkpoint(path, **kwargs)
    except Exception as err:  # recorded for the test to judge
        return {"type": type(err).__name__, "is_value_error": isinstance(err, ValueError),
                "message": str(err)}
    return {"type": None, "message": ""}


def save_phase(out: Path) -> dict:
    results = {}
    for name, case in CASES.items():
        run = Run(*case, seed=0)
        before = run.train(range(STEPS))
        path = run.engine.save_checkpoint(out / name, client_state={"case": name, "steps": STEPS})
        after = run.train(range(STEPS, 2 * STEPS))
        results[name] = {"before": before, "after": after, "path": str(path)}
        run.engine.destroy()
    return results


def resume_phase(out: Path) -> dict:
    results = {}
    for name, case in CASES.items():
        run = Run(*case, seed=5)  # other weights, which the checkpoint must replace
        torch.manual_seed(1234 + comm.get_rank())  # another RNG stream, which it must restore
        path, client = run.engine.load_checkpoint(out / name)
        results[name] = {"path": str(path), "client": client, "global_steps": run.engine.global_steps,
                         "after": run.train(range(STEPS, 2 * STEPS))}
        run.engine.destroy()
    pipe_ckpt = out / "pp2_dp2_zero1"
    run = Run(1, 4, 1, 1, True, seed=0)
    results["at_pp4"] = refusal(run, pipe_ckpt)
    run.engine.destroy()
    run = Run(1, 2, 2, 0, True, seed=5)
    results["at_zero0"] = refusal(run, pipe_ckpt)
    run.engine.load_checkpoint(pipe_ckpt, load_optimizer_states=False)
    results["weights_at_zero0"] = {"after": run.train(range(STEPS, STEPS + 1))}
    run.engine.destroy()
    run = Run(2, 1, 2, 1, False, seed=5)
    run.engine.load_checkpoint(out / "tp2_dp2_zero1", load_optimizer_states=False)
    results["weights_tp2_dp2_zero1"] = {"after": run.train(range(STEPS, STEPS + 1))}
    run.engine.destroy()
    return results


def refuse_phase(out: Path) -> dict:
    run = Run(1, 2, 1, 1, True, seed=0)
    results = {"at_pp2_dp1": refusal(run, out / "pp2_dp2_zero1")}
    run.engine.destroy()
    # a data-parallel checkpoint (no mpu) is refused by a tensor-parallel engine
    config = gpt2_tiny(dropout=0.0, layers=4, vocab_size=VOCAB, n_positions=SEQ)
    plain, _, _, _ = dslab.initialize(model=GPT2LMHeadModel(config, "torch"), config={
        "train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    plain.save_checkpoint(out / "dp2")
    plain.destroy()
    run = Run(2, 1, 1, 0, False, seed=0)
    results["dp_checkpoint_at_tp2"] = refusal(run, out / "dp2")
    run.engine.destroy()
    return results


def main(out_dir: str, phase: str) -> None:
    comm.init_distributed(dist_backend="gloo")
    out = Path(out_dir)
    results = {"save": save_phase, "resume": resume_phase, "refuse": refuse_phase}[phase](out)
    torch.save(results, out / f"{phase}_rank{comm.get_rank()}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:3])
