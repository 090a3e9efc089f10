"""Test-wide set-up.

On a machine without CUDA, Triton kernels run under its interpreter: TRITON_INTERPRET must be set
before triton is first imported, so it is set here, before any test module loads.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
