"""One rank of the tensor-parallel inference test, started by torchrun (see test_tensor_parallel.py).

Every rank builds the same dslab GPT-2 (pre-LN, causal) and BERT (post-LN) from one seed, injects
each at tp_size 1 and at tp_size = world size, and records: the largest logit difference and the largest logit, whether
greedy generation (a left-padded batch) gives the same tokens, the shapes of its weight slices,
and the collectives the comm layer saw during one tp forward. A tp_size that does not divide the
heads must be refused. Results are pickled to ``argv[1]/rank{r}.pkl``.
"""

import pickle
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import dslab  # noqa: E402
from dslab import comm  # noqa: E402
from tiny_models import dslab_bert, dslab_gpt2  # noqa: E402


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

    gpt2 = dslab_gpt2()
    gen = torch.Generator().manual_seed(21)
    ids = torch.randint(2, gpt2.config.vocab_size, (3, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    single = dslab.init_inference(gpt2, dtype=torch.float32)
    sliced = dslab.init_inference(gpt2, dtype=torch.float32, tensor_parallel={"tp_size": world})
    result["tp_rank"], result["tp_size"] = sliced.tp_rank, sliced.tp_size
    layer = sliced.module.layers[0]
    result["shapes"] = {name: tuple(getattr(layer, name).weight.shape) for name in ("qkv", "out_proj", "fc_in", "fc_out")}
    result["row_bias"] = layer.out_proj.bias is not None
    recorder = _Recorder()
    comm.add_observer(recorder)
    logits = sliced(ids, attention_mask=mask)
    comm.remove_observer(recorder)
    result["calls"] = recorder.calls
    real = mask[..., None].bool()
    reference = single(ids, attention_mask=mask).masked_fill(~real, 0)
    result["gpt2_logit_error"] = (logits.masked_fill(~real, 0) - reference).abs().max().item()
    result["gpt2_logit_scale"] = reference.abs().max().item()
    result["gpt2_tokens_equal"] = torch.equal(sliced.generate(ids, attention_mask=mask, max_new_tokens=16),
                                              single.generate(ids, attention_mask=mask, max_new_tokens=16))
    result["gpt2_tokens"] = sliced.generate(ids, attention_mask=mask, max_new_tokens=16)[:, 10:].tolist()

    bert = dslab_bert()
    ids = torch.randint(0, bert.config.vocab_size, (2, 12), generator=gen)
    ours = dslab.init_inference(bert, dtype=torch.float32, mp_size=world)(ids)
    reference = dslab.init_inference(bert, dtype=torch.float32)(ids)
    result["bert_logit_error"] = max((a - b).abs().max().item() for a, b in zip(ours, reference))
    result["bert_logit_scale"] = max(b.abs().max().item() for b in reference)

    try:
        dslab.init_inference(dslab_gpt2(hidden=96, heads=3), dtype=torch.float32, tensor_parallel={"tp_size": world})
        result["indivisible_error"] = None
    except ValueError as err:
        result["indivisible_error"] = str(err)

    with open(out_dir / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
