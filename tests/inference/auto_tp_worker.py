"""One rank of the automatic tensor-parallelism test, started by torchrun (see test_auto_tp.py).

Every rank builds the same tiny transformers Llama (grouped-query: 4 heads over 2 key/value
heads), OPT and GPT-2 (``Conv1D``) from one seed, keeps an unsplit copy, and splits the other with
``init_inference(replace_with_kernel_inject=False, tensor_parallel={"tp_size": world})``. It records,
per model: the largest logit difference from the unsplit model and the largest logit (fp32, a
left-padded batch), whether greedy generation gives the unsplit model's tokens (and the tokens),
the weights and biases of the layers' linear layers before and after, the engine's note, the
collectives of one forward, and a few split attributes. A Llama with 3 key/value heads, a model
without decoder layers and int8 without a policy must be refused. Results are pickled to
``argv[1]/rank{r}.pkl``.
"""

import copy
import pickle
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import dslab  # noqa: E402
from dslab import comm  # noqa: E402
from tiny_models import hf_gpt2, prompts  # noqa: E402

NEW_TOKENS = 8


class _Recorder:
    def __init__(self):
        self.calls = []

    def before(self, call):
        self.calls.append({"op": call.op, "numel": call.numel, "group_size": call.group_size})

    def after(self, call, work):
        pass


def llama(kv_heads: int = 2, heads: int = 4, seed: int = 0):
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32 * heads, intermediate_size=160,
                                      num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
                                      initializer_range=0.15)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def opt(seed: int = 0):
    import transformers

    config = transformers.OPTConfig(vocab_size=256, hidden_size=128, ffn_dim=192, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=128,
                                    init_std=0.15, dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(seed)
    model = transformers.OPTForCausalLM(config).eval()
    with torch.no_grad():  # random biases, so that adding the row-parallel ones once shows
        for name, param in model.named_parameters():
            if name.endswith("bias") and "layer_norm" not in name:
                param.normal_(0.0, 0.1)
    return model


def _linear_sizes(model) -> dict[str, int]:
    """Weights and biases of the linear layers (nn.Linear, Conv1D, RowParallelLinear) in the layers."""
    weights = biases = 0
    for name, module in model.named_modules():
        if (".layers." not in name and ".h." not in name) or not hasattr(module, "weight"):
            continue
        if module.weight.dim() == 2 and type(module).__name__ in ("Linear", "Conv1D", "RowParallelLinear"):
            weights += module.weight.numel()
            biases += module.bias.numel() if getattr(module, "bias", None) is not None else 0
    return {"weights": weights, "biases": biases}


def _record(model, ids, mask) -> dict:
    reference = copy.deepcopy(model)
    before = _linear_sizes(reference)
    engine = dslab.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=False,
                                  tensor_parallel={"tp_size": comm.get_world_size()})
    recorder = _Recorder()
    comm.add_observer(recorder)
    logits = engine(ids, attention_mask=mask).logits
    comm.remove_observer(recorder)
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).logits
    real = mask[..., None].bool()
    greedy = dict(max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0, do_sample=False)
    tokens = engine.generate(ids, attention_mask=mask, **greedy)
    with torch.no_grad():
        expected_tokens = reference.generate(ids, attention_mask=mask, **greedy)
    return {
        "logit_error": (logits - expected).masked_fill(~real, 0).abs().max().item(),
        "logit_scale": expected.masked_fill(~real, 0).abs().max().item(),
        "tokens_equal": torch.equal(tokens, expected_tokens),
        "tokens": tokens[:, ids.shape[1]:].tolist(),
        "varied": len(set(expected_tokens[0, ids.shape[1]:].tolist())) > 2,
        "before": before, "after": _linear_sizes(engine.module),
        "notes": list(engine.notes), "calls": recorder.calls, "injected": engine.injected,
        "tp": (engine.tp_rank, engine.tp_size), "module_is_model": engine.module is model,
    }


def main(out_dir: Path) -> None:
    torch.set_num_threads(1)
    comm.init_distributed()
    rank = comm.get_rank()
    result = {"rank": rank, "world": comm.get_world_size()}
    ids, mask = prompts(3, 10, pads=[0, 4, 1])

    model = llama()
    attention = model.model.layers[0].self_attn
    result["llama"] = _record(model, ids, mask)
    result["llama"]["shapes"] = {name: tuple(getattr(attention, name).weight.shape)
                                 for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    mlp = model.model.layers[0].mlp
    result["llama"]["shapes"].update({name: tuple(getattr(mlp, name).weight.shape)
                                      for name in ("gate_proj", "up_proj", "down_proj")})
    result["llama"]["o_proj_class"] = type(attention.o_proj).__name__

    model = opt()
    attention = model.model.decoder.layers[0].self_attn
    result["opt"] = _record(model, ids, mask)
    result["opt"]["attention"] = {"num_heads": attention.num_heads, "embed_dim": attention.embed_dim,
                                  "head_dim": attention.head_dim}
    result["opt"]["row_bias"] = tuple(attention.out_proj.bias.shape)

    model = hf_gpt2()
    attention = model.transformer.h[0].attn
    result["gpt2"] = _record(model, ids, mask)
    result["gpt2"]["attention"] = {"num_heads": attention.num_heads, "split_size": attention.split_size,
                                   "c_attn": tuple(attention.c_attn.weight.shape)}

    for label, build, dtype in (("kv_error", lambda: llama(kv_heads=3, heads=6), torch.float32),
                                ("layers_error", lambda: torch.nn.Sequential(torch.nn.Linear(8, 8)), torch.float32),
                                ("int8_error", llama, torch.int8)):
        try:
            dslab.init_inference(build(), dtype=dtype, replace_with_kernel_inject=False,
                                 tensor_parallel={"tp_size": comm.get_world_size()})
            result[label] = None
        except ValueError as err:
            result[label] = str(err)

    with open(out_dir / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
