"""FusedAdam (AdamW mode, writing bf16 copies of the parameters in the same pass) against
``torch.optim.AdamW(fused=True)`` (no copies) on BERT-large-like fp32 parameters: 24 layers of
width 1024 and FFN 4096, 30522-word embeddings and an untied MLM decoder, 367M parameters in
397 tensors.

Fewest bytes moved per parameter: read p, g, m, v (16 B), write p, m, v (12 B) and the bf16 copy
(2 B): 30 B, 11.0 GB per step (~2.6 ms at 4.2 TB/s). PyTorch's step moves 28 B per parameter and
would need a separate pass (+6 B) to produce the bf16 copy.
"""

from __future__ import annotations

import torch

from common import Case  # benchmarks/kernels/ is on sys.path (run.py and conftest.py put it there)
from dslab.kernels import kernel_backend
from dslab.kernels.optim.fused_adam import FusedAdam


def bert_large_like_shapes(layers: int = 24, hidden: int = 1024, ffn: int = 4096, vocab: int = 30522):
    """Parameter shapes of a BERT-large-like MLM model with an untied decoder (367M at the defaults)."""
    shapes = [(vocab, hidden), (512, hidden), (2, hidden), (hidden,), (hidden,)]  # embeddings + LN
    for _ in range(layers):
        shapes += [(hidden, hidden), (hidden,)] * 4  # q, k, v, attention output
        shapes += [(hidden,), (hidden,)]  # attention LN
        shapes += [(ffn, hidden), (ffn,), (hidden, ffn), (hidden,)]  # FFN
        shapes += [(hidden,), (hidden,)]  # output LN
    shapes += [(hidden, hidden), (hidden,)]  # pooler
    shapes += [(hidden, hidden), (hidden,), (hidden,), (hidden,), (vocab, hidden), (vocab,)]  # MLM head
    return shapes


def _params_with_grads(shapes, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(0.02 * torch.randn(shape, device=device, generator=gen))
        param.grad = 1e-3 * torch.randn(shape, device=device, generator=gen)
        params.append(param)
    return params


def cases(device) -> list[Case]:
    device = torch.device(device)
    shapes = bert_large_like_shapes()
    n_params = sum(torch.Size(s).numel() for s in shapes)
    hyper = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    dslab_params = _params_with_grads(shapes, device, seed=0)
    dslab_opt = FusedAdam(dslab_params, adam_w_mode=True, **hyper)
    dslab_opt.set_param_copies([torch.empty_like(p, dtype=torch.bfloat16) for p in dslab_params])
    torch_opt = torch.optim.AdamW(_params_with_grads(shapes, device, seed=0), fused=True, **hyper)

    def dslab_step():
        with kernel_backend("triton"):
            dslab_opt.step()

    return [
        Case(
            op="adamw step",
            shape=f"{n_params / 1e6:.0f}M fp32, {len(shapes)} tensors",
            dslab=dslab_step,
            torch=torch_opt.step,
            bytes_moved=30 * n_params,
            target=1.0,
            notes="dslab writes bf16 param copies in the same pass; PyTorch: AdamW(fused=True), no copies",
            extra={"n_params": n_params, "n_tensors": len(shapes)},
        )
    ]
