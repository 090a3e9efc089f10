"""DispatchRecorder: the ops a block of code runs at the dispatcher, for tests that assert which
ops ran (a fused kernel taken, a fallback not) or which tensors they made (no full-size fp32 copy,
no op writing a tensor of some weight's shape).

Imported by bare name, as the other shared test helpers are: from tests/kernels directly, from
elsewhere after ``sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))``.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class DispatchRecorder(TorchDispatchMode):
    """(name, outputs) of every op run at the dispatcher inside the block.

    ``ops`` holds one ``(name, outputs)`` per op, in the order they ran, forward and backward
    alike (autograd's backward ops run under the mode too when ``backward()`` is called inside the
    block). ``name`` is the op's name without its overload (``"aten::add"``, not
    ``"aten::add.Tensor"``; custom ops as ``"dslab::embedding_backward"``). ``outputs`` has one
    ``(shape, dtype)`` per tensor the op returned (nested tuples and lists flattened, non-tensors
    left out), ``shape`` a plain tuple.

    Use it as a context manager::

        with DispatchRecorder() as recorder:
            loss.backward()
        assert "aten::embedding_dense_backward" not in recorder.names()
    """

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = [(tuple(t.shape), t.dtype) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.ops.append((func.name().split(".", 1)[0], outputs))
        return out

    def names(self):
        """The name of every op run, in order (an op run twice stands twice)."""
        return [name for name, _ in self.ops]

    def shaped(self, shape):
        """The names of the ops that returned a tensor of ``shape`` (any dtype), in order."""
        shape = tuple(shape)
        return [name for name, outputs in self.ops if any(s == shape for s, _ in outputs)]

    @property
    def outputs(self):
        """``(shape, dtype)`` of every tensor any op returned, in order, all ops' together."""
        return [output for _, outputs in self.ops for output in outputs]
