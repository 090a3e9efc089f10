"""One rank of test_communication_data_type.py, started by torchrun: GPT-2 tiny on two gloo ranks
at ZeRO stages 0-2, its gradients reduced in the gradients' dtype and in each
``communication_data_type``; records the losses, the parameters and the dtypes of the gradient
collectives."""

import sys

import torch

import dslab
from dslab import comm
from dslab.models.gpt2 import GPT2LMHeadModel, gpt2_tiny


class Dtypes:
    """The dtype of every gradient-bucket collective issued while attached."""

    def __init__(self):
        self.seen = set()

    def before(self, call):
        if call.bucket is not None:
            self.seen.add((call.op, str(call.dtype).replace("torch.", "")))

    def after(self, call, work):
        pass


def train(stage: int, comm_dtype: str | None, bf16: bool = False) -> dict:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_tiny(dropout=0.0, layers=2), kernels="torch")
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "gradient_clipping": 1.0, "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000}}
    if comm_dtype is not None:
        config["communication_data_type"] = comm_dtype
    if bf16:
        config["bf16"] = {"enabled": True, "weight_copies": True}
    engine, *_ = dslab.initialize(model=model, config=config)
    ids = torch.randint(0, 1000, (4, 24), generator=torch.Generator().manual_seed(5))[2 * engine.rank: 2 * engine.rank + 2]
    dtypes = Dtypes()
    comm.add_observer(dtypes)
    losses = []
    try:
        for _ in range(3):
            loss = engine(ids, labels=ids)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    finally:
        comm.remove_observer(dtypes)
    params = {k: v.detach().float().clone() for k, v in engine.module_state_dict().items()}
    engine.destroy()
    return {"losses": losses, "params": params, "dtypes": sorted(dtypes.seen)}


def main(out: str) -> None:
    results = {}
    for stage in (0, 1, 2):
        for comm_dtype in (None, "fp32", "bf16"):
            results[f"{stage}-{comm_dtype}"] = train(stage, comm_dtype)
    results["0-bf16copies-None"] = train(0, None, bf16=True)
    results["0-bf16copies-fp32"] = train(0, "fp32", bf16=True)
    if torch.distributed.get_rank() == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1])
