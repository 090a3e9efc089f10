"""One rank of the stage 3 layer-stack tests, started by torchrun (see test_stage3_stack.py).

``OUT``: GPT-2 tiny and BERT tiny (dslab kernels; on a CPU their PyTorch references) trained by
the engine at stage 0 and at stage 3 with ``cuda_graphs`` on, in fp32 and under bf16 autocast,
with and without gradient accumulation. With graphs on, stage 3 runs the layer stack through
:mod:`dslab.engine.zero.stage3_stack` (eagerly on a CPU: the same layer-by-layer passes the
graphs capture on a GPU; ``STACK_WORKER_FAMILIES=gpt2`` runs GPT-2 alone). Rank 0 saves each run's losses, final full parameters, the stack's
call counts and the bytes of the collectives each run issued. Each run's start and losses go to
stderr; ``STACK_WORKER_DUMP_S=<s>`` dumps every thread's stack and exits after that many seconds
(for a run that hangs on GPUs).
"""

import faulthandler
import os
import sys

import torch

import dslab
from dslab import comm
from dslab.engine.zero.stage3_stack import Stage3LayerStack
from dslab.models.bert import BertForPreTraining, bert_tiny
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny

STEPS = 3


class Observed:
    """The collectives that ran: those issued eagerly (the capture's warm-up runs included) and
    those a replayed graph announced, not those recorded into a capture (run at its replays)."""

    def __init__(self):
        self.calls = []

    def before(self, call):
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            self.calls.append((call.op, call.nbytes, str(call.dtype)))

    def after(self, call, work):
        pass

    def replayed(self, call):
        self.calls.append((call.op, call.nbytes, str(call.dtype)))


def batch(family, rank, seed):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    ids = torch.randint(0, 1000, (2, 24), generator=g)
    if family == "gpt2":
        return {"input_ids": ids, "labels": ids}
    mlm = torch.full_like(ids, -100)
    mlm[:, ::5] = ids[:, ::5]
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0  # padding on one sequence: the stack reads the key padding mask
    return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask,
            "masked_lm_labels": mlm, "next_sentence_label": torch.tensor([0, 1])}


def build(family, stage, bf16, accum):
    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0), kernels="dslab")
    else:
        model = BertForPreTraining(bert_tiny(hidden_dropout=0.0, attention_dropout=0.0), kernels="dslab")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accum,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "gradient_clipping": 1.0, "steps_per_print": 10**6,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1000,
                                    "stage3_max_reuse_distance": 0},
              "cuda_graphs": {"enabled": True}}
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = dslab.initialize(model=model, config=config)
    return engine


def run(family, stage, bf16, accum):
    what = f"{family} stage {stage}{' bf16' if bf16 else ''} accumulation {accum}"
    print(f"stack_worker rank {comm.get_rank()}: {what}", file=sys.stderr, flush=True)
    engine = build(family, stage, bf16, accum)
    observed = Observed()
    comm.add_observer(observed)
    losses = []
    try:
        for step in range(STEPS):
            for micro in range(accum):
                inputs = {k: v.to(engine.device) for k, v in batch(family, comm.get_rank(), step * accum + micro).items()}
                loss = engine(**inputs)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss))
    finally:
        comm.remove_observer(observed)
    graphs = getattr(engine.module, "_layer_graphs", None)
    out = {"losses": losses, "state": {k: v.detach().float().cpu().clone()
                                       for k, v in engine.module_state_dict().items()},
           "stack": isinstance(graphs, Stage3LayerStack),
           "stats": dict(graphs.stats) if graphs is not None else {},
           "device": engine.device.type,
           "calls": observed.calls}
    engine.destroy()
    print(f"stack_worker rank {comm.get_rank()}: {what}: losses {losses}", file=sys.stderr, flush=True)
    return out


def main(path):
    if os.environ.get("STACK_WORKER_DUMP_S"):
        faulthandler.dump_traceback_later(float(os.environ["STACK_WORKER_DUMP_S"]), exit=True)
    comm.init_distributed()
    results = {}
    families = os.environ.get("STACK_WORKER_FAMILIES", "gpt2,bert").split(",")
    for family in families:
        for bf16 in (False, True):
            for stage in (0, 3):
                results[(family, stage, bf16, 1)] = run(family, stage, bf16, 1)
    for stage in (0, 3):
        results[("gpt2", stage, False, 2)] = run("gpt2", stage, False, 2)
    if comm.get_rank() == 0:
        torch.save(results, path)


if __name__ == "__main__":
    main(sys.argv[1])
