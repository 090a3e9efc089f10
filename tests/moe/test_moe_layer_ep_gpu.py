"""Expert parallelism over NCCL on two GPUs: the gloo test's cases (test_moe_layer_ep.py) with the
layers, tokens and all_to_all exchanges on CUDA and the Triton kernels in the hot path.

    python3 -m pytest -q -m gpu tests/moe/test_moe_layer_ep_gpu.py
"""

import pytest
import torch

from test_moe_layer_ep import _check_calls, _check_equal_to_ep1, _launch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ep2_over_nccl_equals_ep1(tmp_path):
    results = _launch(2, tmp_path, backend="nccl")
    _check_equal_to_ep1(results, device_type="cuda")
    _check_calls(results)
