"""One rank of the Llama-layout tensor-parallel test, started by torchrun (see
test_llama_injection.py).

Every rank builds the same tiny transformers Llama (grouped-query attention, 4 query heads over 2
key/value heads, with attention and MLP biases so that column- and row-parallel biases are both
sliced) from one seed, injects it at tp_size 1 and at tp_size = world size, and records: the
largest logit difference on a left-padded batch and the largest logit, whether greedy generation
gives the same tokens, the shapes of its weight slices and KV cache, the collectives the comm layer
saw during one tp forward, and int8's error against fp32 at tp_size 1 and at this tp_size. A model
whose key/value heads tp_size does not divide must be refused. Results are pickled to
``argv[1]/rank{r}.pkl``.
"""

import pickle
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import dslab  # noqa: E402
from dslab import comm  # noqa: E402
from tiny_models import LLAMA_VOCAB, hf_llama, prompts  # noqa: E402


class _Recorder:
    def __init__(self):
        self.calls = []

    def before(self, call):
        self.calls.append({"op": call.op, "numel": call.numel, "group_size": call.group_size})

    def after(self, call, work):
        pass


def main(out_dir: Path) -> None:
    comm.init_distributed()
    world, rank = comm.get_world_size(), comm.get_rank()
    result = {"rank": rank, "world": world}

    model = hf_llama("llama", attention_bias=True, mlp_bias=True)
    ids, mask = prompts(3, 10, vocab=LLAMA_VOCAB, pads=[0, 4, 1], seed=21)
    single = dslab.init_inference(model, dtype=torch.float32, max_out_tokens=24)
    sliced = dslab.init_inference(model, dtype=torch.float32, max_out_tokens=24, tensor_parallel={"tp_size": world})
    result["tp_rank"], result["tp_size"] = sliced.tp_rank, sliced.tp_size
    layer = sliced.module.layers[0]
    result["shapes"] = {name: tuple(getattr(layer, name).weight.shape)
                        for name in ("qkv", "out_proj", "gate_up", "down")}
    result["row_bias"] = layer.out_proj.bias is not None and layer.down.bias is not None
    recorder = _Recorder()
    comm.add_observer(recorder)
    logits = sliced(ids, attention_mask=mask)
    comm.remove_observer(recorder)
    result["calls"] = recorder.calls
    real = mask[..., None].bool()
    reference = single(ids, attention_mask=mask).masked_fill(~real, 0)
    result["logit_error"] = (logits.masked_fill(~real, 0) - reference).abs().max().item()
    result["logit_scale"] = reference.abs().max().item()
    tokens = sliced.generate(ids, attention_mask=mask, max_new_tokens=8)
    result["tokens_equal"] = torch.equal(tokens, single.generate(ids, attention_mask=mask, max_new_tokens=8))
    result["tokens"] = tokens[:, 10:].tolist()
    result["cache_heads"] = next(iter(sliced._runner.slots.values())).cache.heads

    for name, tp_size in (("int8_tp1_error", 1), ("int8_error", world)):
        int8 = dslab.init_inference(model, dtype=torch.int8, quant={"compute_dtype": "fp32"},
                                    tensor_parallel={"tp_size": tp_size})(ids, attention_mask=mask)
        result[name] = ((int8.masked_fill(~real, 0) - reference).norm() / reference.norm()).item()

    try:
        dslab.init_inference(hf_llama("llama", num_key_value_heads=1), dtype=torch.float32,
                             tensor_parallel={"tp_size": world})
        result["indivisible_error"] = None
    except ValueError as err:
        result["indivisible_error"] = str(err)

    with open(out_dir / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
