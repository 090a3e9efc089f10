"""Measuring: the device's ceilings, the flops of one training step, and timed trials.

Device work is timed with CUDA events recorded around each step on the current stream and read
after one synchronisation at the end of the trial; on CPU, where work is synchronous, with the
host clock.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from dslab.profilers import peaks as allocator_peaks
from dslab.profilers.flops_causal import causal_aware_formulas


def measure_peaks(device: torch.device) -> dict:
    """bf16 matmul TFLOP/s (8192^3, random data, median of 10) and device-to-device copy GB/s
    (1 GiB, bytes read + written, median of 10). Empty on CPU."""
    if device.type != "cuda":
        return {}
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm = _median_ms(lambda: a @ b, 10)
    src = torch.randn(1 << 28, device=device)  # 1 GiB of fp32
    dst = torch.empty_like(src)
    cp = _median_ms(lambda: dst.copy_(src), 10)
    peaks = {
        "bf16_matmul_tflops": 2 * n**3 / (mm * 1e-3) / 1e12,
        "copy_gbps": 2 * src.numel() * src.element_size() / (cp * 1e-3) / 1e9,
        "method": "bf16 8192^3 matmul and a 1 GiB device copy (read+write), medians of 10 after warm-up",
    }
    del a, b, src, dst
    torch.cuda.empty_cache()
    return peaks


def _median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def count_step_flops(model: torch.nn.Module, loss_fn, batch: dict, dtype: torch.dtype | None,
                     device: torch.device) -> int:
    """Floating-point operations of one forward + backward, counted from the aten ops that run
    (``torch.utils.flop_counter``): matrix products and attention, as that counter defines them,
    except that a fused attention kernel called causal counts half of the score square, the part
    it computes (:func:`dslab.profilers.flops_formulas.causal_aware_formulas`, the flops
    profiler's convention)."""
    counter = FlopCounterMode(display=False, custom_mapping=causal_aware_formulas())
    with counter:
        if dtype is not None:
            with torch.autocast(device.type, dtype=dtype):
                loss = loss_fn(model, batch)
        else:
            loss = loss_fn(model, batch)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_pools(device: torch.device) -> dict[tuple[int, int], tuple[int, int]]:
    """``{pool id: (reserved bytes, allocated bytes)}`` of the CUDA caching allocator's private pools
    on ``device`` (the pools CUDA graphs are captured into); empty on a CPU."""
    if device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    pools: dict[tuple[int, int], tuple[int, int]] = {}
    for segment in torch.cuda.memory_snapshot():
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        if segment.get("device", index) != index or pool == (0, 0):
            continue
        reserved, allocated = pools.get(pool, (0, 0))
        pools[pool] = (reserved + segment["total_size"], allocated + segment["allocated_size"])
    return pools


def run_trial(step, device: torch.device, warmup: int, steps: int,
              pools: set[tuple[int, int]] | None = None) -> dict:
    """Warm up, then time ``steps`` calls of ``step`` one by one.

    Returns ``{"step_times_ms": [...], "peak_memory_bytes": int or None, "final_loss": float}``,
    on CUDA ``"host_times_ms"`` (how long each ``step()`` took to return on the host: close to the
    step time when the host, or a synchronisation inside the step, is what the device waits for;
    well below it when the device is busy) and, when ``pools`` is given, ``"graph_pool_bytes"``.

    ``pools`` is the arm's set of CUDA-graph pool ids, kept by the caller across the arm's trials:
    the private pools that appear while this arm warms up or runs are added to it (only one arm
    runs at a time). A replay allocates nothing, so the allocator's peak misses the activations a
    graph writes into its pool; ``peak_memory_bytes`` therefore adds the bytes the arm's pools
    hold beyond their allocated blocks (those already count in the peak) to the allocator's peak
    over the trial. ``graph_pool_bytes`` is what those pools reserve in all.
    """
    cuda = device.type == "cuda"
    before = set(graph_pools(device)) if cuda and pools is not None else set()
    loss = None
    for _ in range(warmup):
        loss = step()
    sync(device)
    cuda = device.type == "cuda"
    if cuda:
        allocator_peaks.reset_peak(device)  # the trial's peak over every step, whatever the memory tracer resets
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        host = []
        for s, e in zip(starts, ends):
            s.record()
            t0 = time.perf_counter()
            loss = step()
            host.append((time.perf_counter() - t0) * 1e3)
            e.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        peak = allocator_peaks.peak_allocated(device)
        if pools is not None:
            usage = graph_pools(device)
            pools |= set(usage) - before
            owned = [usage[pool] for pool in pools if pool in usage]
            peak += sum(reserved - allocated for reserved, allocated in owned)
            pool_bytes = sum(reserved for reserved, _ in owned)
    else:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = step()
            times.append((time.perf_counter() - t0) * 1e3)
        peak = None
    trial = {
        "step_times_ms": times,
        "peak_memory_bytes": peak,
        "final_loss": float(loss.detach().float()) if loss is not None else float("nan"),
    }
    if cuda:
        trial["host_times_ms"] = host
    if cuda and pools is not None:
        trial["graph_pool_bytes"] = pool_bytes
    return trial


def trial_metrics(trial: dict, samples: int, tokens: int, flops: int | None, peaks: dict,
                  datasheet_bf16_tflops: float | None) -> dict:
    times = trial["step_times_ms"]
    step_ms = statistics.median(times)
    metrics = {
        "step_time_ms": step_ms,
        "step_time_min_ms": min(times),
        "step_time_max_ms": max(times),
        "samples_per_s": samples / (step_ms / 1e3),
        "tokens_per_s": tokens / (step_ms / 1e3),
        "final_loss": trial["final_loss"],
    }
    if len(times) >= 4:
        q = statistics.quantiles(times, n=10)
        metrics["step_time_p10_ms"], metrics["step_time_p90_ms"] = q[0], q[-1]
    if trial.get("host_times_ms"):
        metrics["host_step_ms"] = statistics.median(trial["host_times_ms"])
    if trial["peak_memory_bytes"] is not None:
        metrics["peak_memory_bytes"] = float(trial["peak_memory_bytes"])
    if trial.get("graph_pool_bytes") is not None:
        metrics["graph_pool_bytes"] = float(trial["graph_pool_bytes"])
    if flops:
        tflops = flops / (step_ms / 1e3) / 1e12
        metrics["model_tflops"] = tflops
        if peaks.get("bf16_matmul_tflops"):
            metrics["mfu_measured"] = tflops / peaks["bf16_matmul_tflops"]
        if datasheet_bf16_tflops:
            metrics["mfu_datasheet"] = tflops / datasheet_bf16_tflops
    return metrics


class TimedWindow:
    """The optimizer steps after ``from_step`` of a training loop, timed on the host clock with
    the device synchronised at both ends (the examples' ``--timed_from``): call :meth:`mark` at
    the top of every micro-step with the engine's global step, and :meth:`line` after the loop."""

    def __init__(self, device: torch.device, from_step: int | None):
        self.device = device
        self.from_step = from_step
        self.start: tuple[float, int] | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def mark(self, global_steps: int) -> None:
        """The first micro-step seen at ``from_step`` opens the window (the top of that window)."""
        if self.start is None and global_steps == self.from_step:
            self._sync()
            self.start = (time.perf_counter(), global_steps)

    def line(self, global_steps: int, tokens_per_step: int) -> str | None:
        """``timed: <tokens/s> tokens/s over steps a..b``, None when the window never opened."""
        self._sync()
        if self.start is None:
            return None
        seconds = time.perf_counter() - self.start[0]
        steps = global_steps - self.start[1]
        return f"timed: {steps * tokens_per_step / seconds:.1f} tokens/s over steps {self.start[1] + 1}..{global_steps}"
