"""A Triton kernel's register use, spills and shared memory on a GPU this machine may not have.

:func:`assemble` compiles a ``@triton.jit`` kernel for a CUDA target (an H200's sm_90 by default)
with Triton's own CUDA backend and assembles the PTX with Triton's ptxas ``-v``: no GPU and no
driver are needed, only Triton's NVIDIA backend (shipped in its wheel). What ptxas reports is
what the GPU would run: a configuration that spills registers to local memory, or that needs more
shared memory than an SM has, shows here before any device time is spent on it.

    from dslab.kernels.register_audit import assemble
    report = assemble(kernel, {"X": "*bf16", "eps": "fp32"}, {"BLOCK": 128}, num_warps=4, num_stages=3)
    report.registers, report.spill_bytes, report.shared_bytes

The figures are this machine's Triton's: another Triton version (a lent GPU machine's may be
older) can allocate registers and pipeline loads differently, so a spill found here is a strong
hint about the GPU, and its timing is the proof.

Arguments not named in ``types`` are ``i32`` (sizes and strides); pointers are taken as 16-byte
aligned, as Triton specialises aligned tensors. Under ``TRITON_INTERPRET=1`` ``triton.jit`` makes
interpreted functions, which do not compile: run it in a process without the interpreter
(``benchmarks/register_audit.py``, and the tests run it in a child process).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Assembly:
    """What ptxas reported for one compiled configuration."""

    registers: int
    spill_bytes: int  # spill stores and spill loads, bytes a thread
    shared_bytes: int  # static shared memory ptxas reports (Triton adds its dynamic share at launch)
    dynamic_shared_bytes: int  # the shared memory Triton's compiled kernel asks for at launch
    log: str


def assemble(kernel, types: dict[str, str], constexprs: dict[str, object], num_warps: int = 4,
             num_stages: int = 3, arch: int = 90) -> Assembly:
    """Compile ``kernel`` with ``constexprs`` (every constexpr parameter without a default) for
    ``sm_<arch>`` and assemble it; ``types`` maps argument names to Triton's type strings
    (``"*bf16"``, ``"fp32"``, ``"i64"``...). ValueError for an interpreted kernel or a missing
    constexpr; RuntimeError with ptxas's message when it fails."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    params = getattr(kernel, "params", None)
    if params is None:
        raise ValueError(f"{getattr(kernel, '__name__', kernel)!r} is not a compilable @triton.jit kernel (under "
                         f"TRITON_INTERPRET=1 triton.jit makes interpreted functions: run without it)")
    signature, values, attrs = {}, {}, {}
    for param in params:
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            if param.name in constexprs:
                values[(param.num,)] = constexprs[param.name]
            elif param.has_default:
                values[(param.num,)] = param.default
            else:
                raise ValueError(f"{kernel.__name__}: constexpr {param.name} has no value and no default")
        else:
            kind = types.get(param.name, "i32")
            signature[param.name] = kind
            if kind.startswith("*"):
                attrs[(param.num,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=values, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        proc = subprocess.run([get_ptxas(arch).path, "-v", "--gpu-name", f"sm_{arch}a", str(ptx), "-o",
                               str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed on {kernel.__name__}: {proc.stderr.strip()[-2000:]}")
    return parse_ptxas_log(proc.stderr, int(getattr(compiled.metadata, "shared", 0) or 0))


def parse_ptxas_log(log: str, dynamic_shared_bytes: int = 0) -> Assembly:
    """The figures of ptxas ``-v``'s report (``Used 168 registers, used 1 barriers, 8 bytes smem``,
    ``0 bytes stack frame, 16 bytes spill stores, 16 bytes spill loads``)."""
    registers = re.search(r"Used (\d+) registers", log)
    if registers is None:
        raise ValueError(f"no register count in ptxas's report: {log.strip()[-500:]!r}")
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    shared = re.search(r"(\d+) bytes smem", log)
    return Assembly(registers=int(registers.group(1)), spill_bytes=spills,
                    shared_bytes=int(shared.group(1)) if shared else 0, dynamic_shared_bytes=dynamic_shared_bytes,
                    log=log)
