"""The kernel tests live in one folder per op family (``tests/kernels/<family>/``, as
``dslab/kernels/<family>/``); the helpers they share stay here: :mod:`dispatch_recorder` (which
ops ran) and :mod:`philox_reference` (Philox-4x32-10 from its definition)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
