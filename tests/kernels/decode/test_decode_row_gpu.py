"""On a GPU: the persistent one-row kernel launched with as many programs as the SMs hold
(``programs per SM`` :data:`dslab.kernels.decode.decode_row_triton.RESIDENT`) gives the reference's
outputs at Llama-shaped projections (the norm in front, SwiGLU pairs, a K of 8192), with the grid
its compiled registers allow."""

from __future__ import annotations

import pytest
import torch

from dslab.kernels import kernel_backend
from dslab.kernels.decode import decode_row_triton as row
from dslab.kernels.decode.decode_linear import decode_linear, decode_linear_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("config", [(8, 0, 8, 0), (2, 0, 8, 0), (1, 0, 4, 0), (2, 2048, 8, 0)])
@pytest.mark.parametrize("shape", ["norm swiglu", "wide k"])
def test_resident_launches_give_the_reference(config, shape):
    torch.manual_seed(hash((config, shape)) % 1000)
    device = torch.device("cuda")
    bf16 = dict(device=device, dtype=torch.bfloat16)
    if shape == "norm swiglu":
        n, k = 4096, 2048
        kwargs = dict(residual=torch.randn(1, k, **bf16), rms_norm=(1 + 0.1 * torch.randn(k, **bf16), 1e-5),
                      activation="swiglu")
    else:
        n, k, kwargs = 1536, 8192, {}
    x = torch.randn(1, k, **bf16)
    weight = torch.randn(n, k, **bf16) / k ** 0.5
    row._resident_cache.clear()
    launched = []
    kernel = row._decode_row_kernel

    class Recording:
        warmup = kernel.warmup

        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    with kernel_backend("triton"), row.forced_row_config(config), pytest.MonkeyPatch.context() as patch:
        patch.setattr(row, "_decode_row_kernel", Recording())
        got = decode_linear(x, weight, **kwargs)
    want = decode_linear_reference(x, weight, **kwargs)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
    (per_sm,) = row._resident_cache.values()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = -(-(n // 2 if shape == "norm swiglu" else n) // (max(1, config[0] // 2) if shape == "norm swiglu"
                                                               else config[0]))
    assert launched == [(min(tiles, per_sm * sms),)] and 1 <= per_sm <= 32
