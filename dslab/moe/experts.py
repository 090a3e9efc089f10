"""The local experts of an MoE layer.

DeepSpeed deep-copies the user's ``expert`` once per local expert, so every local expert starts
from the same weights. dslab does the same, and when the expert is a plain MLP
(``Linear(H, F) -> activation -> Linear(F, H)``, or :class:`MLPExpert`) it stores the copies
*stacked*, one parameter per weight with a leading expert dimension:

    w1 [E_local, F, H]   b1 [E_local, F]   w2 [E_local, H, F]   b2 [E_local, H]

and runs all experts as two grouped GEMMs over the expert-ordered token buffer (rows of expert j
are ``group_offsets[j]:group_offsets[j+1]``), with the activation between: for M rows,
``4 * M * H * F`` flops forward, reading the buffer [M, H] and the weights once and writing the
hidden [M, F] and the output [M, H]. Any other expert module
is kept as a ``ModuleList`` of copies (``deepspeed_experts``, DeepSpeed's attribute name) and run
in a per-expert loop: the slow path, which also needs the group sizes on the host (one host sync
per call when the sizes are data-dependent, i.e. dropless).

Every expert parameter is marked as DeepSpeed marks it: ``param.allreduce = False`` and
``param.group_name = "ep_size_{ep_size}"``. The engine reduces such parameters over the
expert-data-parallel group of that name instead of the whole data-parallel world.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from dslab.kernels.activation.bias_gelu import bias_gelu
from dslab.kernels.moe.grouped_gemm import grouped_gemm
from dslab.kernels.moe.grouped_mlp import grouped_mlp

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
_REFERENCE_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"), "relu": F.relu,
                          "silu": F.silu}


def _activation_module(name: str) -> nn.Module:
    return {"gelu": lambda: nn.GELU(), "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
            "relu": nn.ReLU, "silu": nn.SiLU}[name]()


def _activation_name(module: nn.Module) -> str | None:
    """The name of a supported activation module, else None."""
    if isinstance(module, nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(module.approximate)
    if isinstance(module, nn.ReLU):
        return "relu"
    if isinstance(module, nn.SiLU):
        return "silu"
    return None


class MLPExpert(nn.Module):
    """``fc2(activation(fc1(x)))``: x [..., hidden] -> [..., hidden], ``ffn`` inner width.

    ``activation`` is one of ``gelu``, ``gelu_tanh``, ``relu``, ``silu``.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str = "gelu", bias: bool = True):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.fc1 = nn.Linear(hidden_size, ffn_hidden_size, bias=bias)
        self.act = _activation_module(activation)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def mlp_parts(expert: nn.Module, hidden_size: int):
    """``(fc1, activation_name, fc2)`` when ``expert`` is an MLP that can be stacked, else None."""
    if isinstance(expert, MLPExpert):
        parts = (expert.fc1, expert.act, expert.fc2)
    elif isinstance(expert, nn.Sequential) and len(expert) == 3:
        parts = tuple(expert)
    else:
        return None
    fc1, act, fc2 = parts
    if not (type(fc1) is nn.Linear and type(fc2) is nn.Linear):
        return None
    name = _activation_name(act)
    if name is None or fc1.in_features != hidden_size or fc2.out_features != hidden_size:
        return None
    if fc2.in_features != fc1.out_features or (fc1.bias is None) != (fc2.bias is None):
        return None
    return fc1, name, fc2


def mark_expert_params(module: nn.Module, group_name: str) -> None:
    """DeepSpeed's marks: the engine reduces these over the expert-data-parallel group ``group_name``."""
    for param in module.parameters():
        param.allreduce = False
        param.group_name = group_name


class Experts(nn.Module):
    """``num_local_experts`` copies of ``expert`` applied to an expert-ordered token buffer."""

    def __init__(self, expert: nn.Module, num_local_experts: int, expert_group_name: str, hidden_size: int):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.expert_group_name = expert_group_name
        parts = mlp_parts(expert, hidden_size)
        self.stacked = parts is not None
        # the stacked experts' activation in the grouped GEMMs' epilogues (dslab.kernels.moe.grouped_mlp)
        # rather than a separate kernel between them
        self.fused_activation = False
        if self.stacked:
            fc1, self.activation, fc2 = parts

            def stack(t):
                return None if t is None else nn.Parameter(t.detach().unsqueeze(0).repeat(
                    num_local_experts, *([1] * t.dim())).contiguous())

            self.w1, self.b1 = stack(fc1.weight), stack(fc1.bias)
            self.w2, self.b2 = stack(fc2.weight), stack(fc2.bias)
        else:
            self.deepspeed_experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_local_experts))
        mark_expert_params(self, expert_group_name)

    def forward(self, x: torch.Tensor, group_offsets: torch.Tensor, group_sizes: list[int] | None = None):
        """Expert j on rows ``group_offsets[j]:group_offsets[j+1]`` of ``x`` [M, H] -> [M, H].

        ``group_offsets`` [E_local + 1] int on x's device, from 0 to M; ``group_sizes`` (the same
        boundaries as host ints) spares the loop path a host sync.
        """
        if self.stacked:
            return self._stacked_forward(x, group_offsets)
        if group_sizes is None:
            group_sizes = torch.diff(group_offsets).tolist()  # host sync: the loop needs the sizes
        chunks = x.split(list(group_sizes))
        return torch.cat([_first(expert(chunk)) for expert, chunk in zip(self.deepspeed_experts, chunks)])

    def _stacked_forward(self, x, group_offsets):
        w1, b1, w2, b2 = self.w1, self.b1, self.w2, self.b2
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            # fp32 parameters stay fp32: the grouped GEMM casts them for the products and returns
            # their gradients in fp32 straight from its accumulators
            dtype = torch.get_autocast_dtype(device_type)
            x = x.to(dtype)
            if w1.dtype not in (dtype, torch.float32):
                w1, w2 = w1.to(dtype), w2.to(dtype)
                b1, b2 = (None if b is None else b.to(dtype) for b in (b1, b2))
        if self.fused_activation:
            return grouped_mlp(x, w1, b1, w2, b2, group_offsets, self.activation)
        h = grouped_gemm(x, w1, group_offsets, b1)
        h = self._activate(h)
        return grouped_gemm(h, w2, group_offsets, b2)

    def _activate(self, h):
        if self.activation == "gelu":
            return bias_gelu(h, None, "none")
        if self.activation == "gelu_tanh":
            return bias_gelu(h, None, "tanh")
        if self.activation == "relu":
            return F.relu(h)
        return F.silu(h)

    def reference_forward(self, x: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
        """The plain-PyTorch loop over experts (F.linear per expert), the reference of
        :meth:`forward`: expert j on the next ``group_sizes[j]`` rows of ``x`` [M, H]."""
        if not self.stacked:
            return self.forward(x, None, group_sizes)
        outputs = []
        for j, chunk in enumerate(x.split(list(group_sizes))):
            h = F.linear(chunk, self.w1[j], None if self.b1 is None else self.b1[j])
            h = _REFERENCE_ACTIVATIONS[self.activation](h)
            outputs.append(F.linear(h, self.w2[j], None if self.b2 is None else self.b2[j]))
        return torch.cat(outputs)


def _first(output):
    """An expert may return a tuple (Megatron's MLP returns (output, bias)): keep the output."""
    return output[0] if isinstance(output, tuple) else output
