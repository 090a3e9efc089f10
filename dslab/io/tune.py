"""``dslab nvme-tune``: which :class:`~dslab.io.handle.AsyncIOHandle` parameters read and write a
directory's storage fastest, beside fio's best-practice job on the same file in the same run.

DeepSpeed's ``ds_nvme_tune`` times each of its 64 configurations once. Here each configuration
of the sweep space (:data:`DEFAULT_SPACE`: block size, queue depth, intra-op parallelism,
single_submit, overlap_events) is timed in rounds of successive halving, separately for reads
and writes, on one test file of ``size`` bytes:

1. every configuration moves the first quarter of the file once;
2. the best quarter of them (at least :data:`FINALISTS`) moves half of it twice;
3. the best :data:`FINALISTS` move the whole file ``trials`` times.

After each round a configuration is dropped when it is not among the kept or when its median
is below :data:`CLEARLY_WORSE` of the round's best (clearly worse; noise does not save it).
A sweep of at most :data:`FINALISTS` configurations goes straight to round 3. GB/s are 1e9
bytes per second of a blocking transfer of the whole range (submission to the last
completion), the median over trials, with the spread as half the range in % of the median.

The winners: the best read and the best write; each is then timed in the other direction too,
and the ``aio`` block printed is the one of them with the higher harmonic mean of read and write
(the engine's swaps do both). When Debian's ``fio`` is installed, :data:`dslab.io.fio.FIO_JOB`
(bs 1M, iodepth 32) runs on the same file once per trial of round 3, between the finalists'
trials; after the sweep fio jobs *matched* to each direction's best configuration (its block
size and requests in flight, as one job or one job per lane, through libaio and io_uring:
:meth:`_Fio.matched_jobs`) run ``trials`` times each, interleaved with that configuration, and
the best of them is kept with the others listed. fio's best job is what the tuner's best is
compared with; a shared or throttled disk drifts over a run, so fio is only
ever compared with what ran beside it.

Before timing, the file is written once and read once (the first read after a write is slower
on some virtual disks: the host's cache warms). The file is removed at the end, also on errors.
"""

from __future__ import annotations

import math
import secrets
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

import torch

from dslab.io import fio as fio_runner
from dslab.io.buffers import DIRECT_IO_ALIGNMENT
from dslab.io.config import AioConfig
from dslab.io.handle import AsyncIOHandle

DEFAULT_SPACE = {
    "block_size": [256 << 10, 1 << 20, 4 << 20],
    "queue_depth": [4, 16, 64],
    "intra_op_parallelism": [1, 2, 4],
    "single_submit": [False, True],
    "overlap_events": [True, False],
}
FINALISTS = 4
CLEARLY_WORSE = 0.8
OPS = ("read", "write")

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str, name: str = "--size") -> int:
    """``"1G"``, ``"64M"``, ``"512KiB"``, ``"4096"`` -> bytes (binary units, as fio reads them).
    Raises ValueError naming ``name``."""
    raw = str(text).strip().upper().removesuffix("B").removesuffix("I")
    unit = raw[-1:] if raw[-1:] in _SIZE_UNITS and raw[-1:] else ""
    number = raw[:-1] if unit else raw
    try:
        value = float(number) * _SIZE_UNITS[unit]
    except ValueError:
        raise ValueError(f"{name} must be a size like 1G, 256M or 4096, got {text!r}") from None
    if value <= 0 or value != int(value):
        raise ValueError(f"{name} must be a positive whole number of bytes, got {text!r}")
    return int(value)


@dataclass(frozen=True)
class TuneConfig:
    """One point of the sweep: the handle's five parameters."""

    block_size: int
    queue_depth: int
    intra_op_parallelism: int
    single_submit: bool
    overlap_events: bool

    def label(self) -> str:
        return (f"bs={_human(self.block_size)} qd={self.queue_depth} "
                f"p={self.intra_op_parallelism} ss={int(self.single_submit)} "
                f"oe={int(self.overlap_events)}")

    def aio(self) -> dict:
        """The config's ``aio`` section for these parameters."""
        return {"block_size": self.block_size, "queue_depth": self.queue_depth,
                "intra_op_parallelism": self.intra_op_parallelism,
                "single_submit": self.single_submit, "overlap_events": self.overlap_events}


def _human(nbytes: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)


def load_sweep_config(path) -> dict:
    """A sweep space from a JSON file: an object with some of :data:`DEFAULT_SPACE`'s keys, each
    a list (checked by :func:`sweep_configs`). Raises ValueError / FileNotFoundError naming
    the file."""
    import json

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--sweep-config {path} does not exist")
    try:
        space = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"--sweep-config {path} is not valid JSON: {err}") from None
    if not isinstance(space, dict):
        raise ValueError(f"--sweep-config {path} must hold a JSON object of lists")
    try:
        sweep_configs(space)
    except ValueError as err:
        raise ValueError(f"--sweep-config {path}: {err}") from None
    return space


def sweep_configs(space: dict | None = None) -> list[TuneConfig]:
    """Every combination of ``space`` (keys of :data:`DEFAULT_SPACE`, each a list; missing keys
    take the default lists). Each value is checked as the ``aio`` section checks it."""
    space = dict(space or {})
    unknown = sorted(set(space) - set(DEFAULT_SPACE))
    if unknown:
        import difflib

        hint = difflib.get_close_matches(unknown[0], list(DEFAULT_SPACE), n=1)
        raise ValueError(f"unknown sweep key '{unknown[0]}'"
                         + (f"; did you mean '{hint[0]}'?" if hint else "")
                         + f" (keys: {', '.join(DEFAULT_SPACE)})")
    lists = {}
    for key, default in DEFAULT_SPACE.items():
        values = space.get(key, default)
        if not isinstance(values, list) or not values:
            raise ValueError(f"sweep key '{key}' must be a non-empty list, got {values!r}")
        lists[key] = values
    configs = []
    for bs in lists["block_size"]:
        for qd in lists["queue_depth"]:
            for p in lists["intra_op_parallelism"]:
                for ss in lists["single_submit"]:
                    for oe in lists["overlap_events"]:
                        checked = AioConfig(block_size=bs, queue_depth=qd, intra_op_parallelism=p,
                                            single_submit=ss, overlap_events=oe)
                        configs.append(TuneConfig(**checked.handle_kwargs()))
    return list(dict.fromkeys(configs))


@dataclass
class Measured:
    """One configuration's trials in one direction: ``trials`` GB/s at ``sample_bytes``, the
    last round it ran in and, when it was dropped, after which round."""

    config: TuneConfig
    op: str
    sample_bytes: int = 0
    round: int = 0
    trials: list[float] = field(default_factory=list)
    dropped_after: int | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.trials) if self.trials else 0.0

    @property
    def spread_pct(self) -> float:
        if len(self.trials) < 2 or self.median <= 0:
            return 0.0
        return (max(self.trials) - min(self.trials)) / 2 / self.median * 100


@dataclass
class TuneResult:
    """What :func:`tune` found (module docstring)."""

    path: str
    file_bytes: int
    trials: int
    device: str
    direct_io: bool
    backend: str
    rows: list[Measured]
    best: dict[str, Measured]
    recommended: TuneConfig
    cross: dict[str, float]
    fio: dict | None
    seconds: float
    notes: list[str] = field(default_factory=list)

    def record(self) -> dict:
        """The run report's ``profilers["io"]["tune"]`` record."""
        def row(m: Measured) -> dict:
            return {"op": m.op, **m.config.aio(), "label": m.config.label(),
                    "GBps": m.median, "spread_pct": m.spread_pct, "trials": m.trials,
                    "sample_bytes": m.sample_bytes, "round": m.round,
                    "dropped_after_round": m.dropped_after}
        return {
            "kind": "tune", "path": self.path, "file_bytes": self.file_bytes,
            "trials": self.trials, "device": self.device, "direct_io": self.direct_io,
            "backend": self.backend, "seconds": self.seconds,
            "configs": [row(m) for m in self.rows],
            "best": {op: row(m) for op, m in self.best.items()},
            "recommended_aio": self.recommended.aio(), "cross_GBps": self.cross,
            "fio": self.fio, "notes": self.notes,
        }


class _Bench:
    """Times transfers of the test file with one handle per configuration."""

    def __init__(self, path: Path, size: int, device: str):
        self.path, self.size, self.device = path, size, device
        if device == "cuda":
            self.buffer = torch.empty(size, dtype=torch.uint8, device="cuda")
        else:
            from dslab.io.buffers import aligned_empty

            self.buffer = aligned_empty(size, torch.uint8)
        # Random bytes, not the zeros a fresh buffer holds: a virtual disk may store zero blocks
        # as holes (QEMU's detect-zeroes, thin provisioning) and serve their reads without
        # touching the drive, which measured 3x fio's reads on a virtio disk. fio writes
        # pseudo-random buffers too.
        generator = torch.Generator(device=self.buffer.device).manual_seed(0)
        self.buffer.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, device=self.buffer.device,
                                        generator=generator))

    def time(self, handle: AsyncIOHandle, op: str, nbytes: int) -> float:
        data = self.buffer[:nbytes]
        if self.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        if op == "read":
            handle.sync_pread(data, self.path)
        else:
            handle.sync_pwrite(data, self.path, in_place=True)
        return nbytes / (time.perf_counter() - start) / 1e9


def _rounds(count: int, trials: int) -> list[tuple[float, int]]:
    if count <= FINALISTS:
        return [(1.0, trials)]
    return [(0.25, 1), (0.5, 2), (1.0, trials)]


def _sample(size: int, fraction: float) -> int:
    return max(DIRECT_IO_ALIGNMENT, int(size * fraction) // DIRECT_IO_ALIGNMENT * DIRECT_IO_ALIGNMENT)


def _survivors(measured: list[Measured], keep: int, round_index: int) -> list[Measured]:
    ranked = sorted(measured, key=lambda m: m.median, reverse=True)
    best = ranked[0].median if ranked else 0.0
    kept = [m for m in ranked[:keep] if m.median >= CLEARLY_WORSE * best]
    for m in ranked:
        if m not in kept:
            m.dropped_after = round_index
    return kept


def tune(path, size: int = 1 << 30, trials: int = 3, device: str = "cpu",
         space: dict | None = None, use_fio: bool = True,
         progress: Callable[[str], None] | None = None) -> TuneResult:
    """Sweep ``space`` on a ``size``-byte file in directory ``path`` (module docstring)."""
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"--path {directory} is not a directory")
    if size % DIRECT_IO_ALIGNMENT or size <= 0:
        raise ValueError(f"--size must be a positive multiple of {DIRECT_IO_ALIGNMENT} bytes, "
                         f"got {size}")
    if trials < 1:
        raise ValueError(f"--trials must be >= 1, got {trials}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a CUDA GPU, and torch sees none")
    configs = sweep_configs(space)
    say = progress or (lambda line: None)
    started = time.perf_counter()
    test_file = directory / f".dslab-nvme-tune-{secrets.token_hex(6)}.bin"
    notes: list[str] = []
    try:
        bench = _Bench(test_file, size, device)
        with AsyncIOHandle(queue_depth=32, overlap_events=True, intra_op_parallelism=2) as first:
            say(f"writing the {_human(size)} test file {test_file} and reading it once")
            pattern = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(0))
            filled = pattern.repeat(-(-size // pattern.numel()))[:size]
            bench.buffer.copy_(filled)
            del filled
            first.sync_pwrite(bench.buffer, test_file)
            first.sync_pread(bench.buffer, test_file)
            direct_io = not first.buffered_dirs
            backend = first.backend
        if not direct_io:
            notes.append(f"the file system of {directory} refuses O_DIRECT: every number is "
                         "page-cache I/O, not the device's")
        fio = _Fio(test_file, size, say, notes) if use_fio else None
        if not use_fio:
            notes.append("fio comparison skipped (--no-fio)")
        rows, best = _sweep(bench, configs, trials, size, say, fio)
        recommended, cross = _recommend(bench, best, trials, size, say)
        if fio is not None:
            fio.matched_phase(bench, best, trials)
        fio_record = fio.record() if fio is not None else None
    finally:
        test_file.unlink(missing_ok=True)
    return TuneResult(str(directory), size, trials, device, direct_io, backend, rows, best,
                      recommended, cross, fio_record, time.perf_counter() - started, notes)


def _sweep(bench: _Bench, configs: list[TuneConfig], trials: int, size: int, say,
           fio: "_Fio | None") -> tuple[list[Measured], dict[str, Measured]]:
    """The rounds of the module docstring. The last round runs trial by trial (every finalist
    once, then fio's job once, then the next trial), so that the finalists and fio see the same
    device: a shared or throttled disk drifts over a run."""
    rows = {op: [Measured(c, op) for c in configs] for op in OPS}
    alive = {op: list(rows[op]) for op in OPS}
    plan = _rounds(len(configs), trials)
    for index, (fraction, repeats) in enumerate(plan, start=1):
        sample = _sample(size, fraction)
        todo = sorted({m.config for op in OPS for m in alive[op]}, key=configs.index)
        say(f"round {index}/{len(plan)}: {len(todo)} configurations, {_human(sample)} x "
            f"{repeats} trial(s) each")
        by_config = {op: {m.config: m for m in alive[op]} for op in OPS}
        if index == len(plan):
            _final_round(bench, todo, by_config, repeats, sample, index, say, fio)
            break
        for n, config in enumerate(todo, start=1):
            with AsyncIOHandle(**config.aio()) as handle:
                parts = []
                for op in OPS:
                    m = by_config[op].get(config)
                    if m is None:
                        continue
                    m.trials = [bench.time(handle, op, sample) for _ in range(repeats)]
                    m.sample_bytes, m.round = sample, index
                    parts.append(f"{op} {m.median:.2f} GB/s")
            say(f"  [{n}/{len(todo)}] {config.label():<34} " + "  ".join(parts))
        keep = FINALISTS if index == len(plan) - 1 else max(FINALISTS, math.ceil(len(configs) / 4))
        for op in OPS:
            alive[op] = _survivors(alive[op], keep, index)
    best = {op: max(alive[op], key=lambda m: m.median) for op in OPS}
    ordered = [m for op in OPS for m in sorted(rows[op], key=lambda m: (-m.round, -m.median))]
    return ordered, best


def _final_round(bench: _Bench, todo: list[TuneConfig], by_config: dict, repeats: int,
                 sample: int, index: int, say, fio: "_Fio | None") -> None:
    handles = {config: AsyncIOHandle(**config.aio()) for config in todo}
    try:
        for config in todo:
            for op in OPS:
                if config in by_config[op]:
                    m = by_config[op][config]
                    m.trials, m.sample_bytes, m.round = [], sample, index
        for trial in range(repeats):
            for config in todo:
                for op in OPS:
                    if config in by_config[op]:
                        by_config[op][config].trials.append(bench.time(handles[config], op, sample))
            if fio is not None:
                fio.plain_trial()
            say(f"  trial {trial + 1}/{repeats}: " + "  ".join(
                f"{op} best so far {max(m.trials[-1] for m in by_config[op].values()):.2f} GB/s"
                for op in OPS))
    finally:
        for handle in handles.values():
            handle.close()
    for config in todo:
        say("  " + f"{config.label():<34} " + "  ".join(
            f"{op} {by_config[op][config].median:.2f} GB/s" for op in OPS if config in by_config[op]))


def _recommend(bench: _Bench, best: dict[str, Measured], trials: int, size: int, say
               ) -> tuple[TuneConfig, dict[str, float]]:
    """Time the best read configuration's writes and the best write configuration's reads (at
    the final size); the recommendation has the higher harmonic mean of the two directions."""
    cross = {}
    scores = {}
    for op, other in (("read", "write"), ("write", "read")):
        config = best[op].config
        if best[other].config == config:
            value = best[other].median
        else:
            with AsyncIOHandle(**config.aio()) as handle:
                value = statistics.median(bench.time(handle, other, size) for _ in range(trials))
            say(f"best {op} configuration {config.label()}: {other} {value:.2f} GB/s")
        cross[f"best_{op}_config_{other}_GBps"] = value
        pair = (best[op].median, value)
        scores[config] = 2 / (1 / pair[0] + 1 / pair[1]) if min(pair) > 0 else 0.0
    return max(scores, key=scores.get), cross


def _stats(values: list[float]) -> dict:
    median = statistics.median(values)
    spread = (max(values) - min(values)) / 2 / median * 100 if median > 0 and len(values) > 1 else 0.0
    return {"GBps": median, "spread_pct": spread, "trials": values}


class _Fio:
    """fio on the tuner's file: its best-practice job once per final-round trial, and, after
    the sweep, the job matched to each direction's best configuration (its block size, and its
    requests in flight ``queue_depth x intra_op_parallelism`` as iodepth) interleaved trial by
    trial with that configuration. A failure drops fio from the run with a note."""

    def __init__(self, test_file: Path, size: int, say, notes: list[str]):
        self.test_file, self.size, self.say, self.notes = str(test_file), size, say, notes
        self.fio = fio_runner.find_fio()
        self.plain: dict[str, list[float]] = {op: [] for op in OPS}
        self.matched: dict[str, dict] = {}
        if self.fio is None:
            notes.append("fio is not installed (Debian's fio package): no comparison")

    def _run(self, op: str, **job) -> float | None:
        if self.fio is None:
            return None
        try:
            return fio_runner.run_fio(self.fio, self.test_file, self.size, op, **job)
        except (RuntimeError, ValueError, OSError) as err:
            self.notes.append(f"fio failed, no comparison: {err}")
            self.fio = None
            return None

    def plain_trial(self) -> None:
        for op in OPS:
            value = self._run(op)
            if value is not None:
                self.plain[op].append(value)
        if self.fio is not None:
            self.say("  fio (bs 1M, iodepth 32): " + "  ".join(
                f"{op} {self.plain[op][-1]:.2f} GB/s" for op in OPS))

    def matched_jobs(self, config) -> list[dict]:
        """fio jobs shaped like ``config``: its block size and requests in flight, as one job of
        iodepth ``queue_depth x intra_op_parallelism`` and, with parallelism, as
        ``intra_op_parallelism`` jobs of iodepth ``queue_depth`` each over its share of the file
        (the tuner's lanes); each through libaio and io_uring. On a virtio disk served from the
        host's cache fio's reads ranged 1.1 to 2.9 GB/s over these (one libaio job to four
        io_uring jobs) on one file, so one job shape says little about the device."""
        shapes = [(config.queue_depth * config.intra_op_parallelism, 1)]
        if config.intra_op_parallelism > 1:
            shapes.append((config.queue_depth, config.intra_op_parallelism))
        return [{"ioengine": engine, "bs": config.block_size, "iodepth": depth, "numjobs": jobs}
                for engine in ("libaio", "io_uring") for depth, jobs in shapes]

    def _run_variant(self, op: str, job: dict) -> float | None:
        """One run of a matched job; a job this fio or kernel refuses (io_uring) is noted and
        skipped, not the whole comparison."""
        try:
            return fio_runner.run_fio(self.fio, self.test_file, self.size, op, **job)
        except (RuntimeError, ValueError, OSError) as err:
            self.notes.append(f"fio {op} job {job} failed, left out: {str(err)[:200]}")
            return None

    def matched_phase(self, bench: _Bench, best: dict[str, Measured], trials: int) -> None:
        if self.fio is None:
            return
        for op in OPS:
            config = best[op].config
            jobs = self.matched_jobs(config)
            mine: list[float] = []
            theirs: list[list[float]] = [[] for _ in jobs]
            refused: set[int] = set()
            with AsyncIOHandle(**config.aio()) as handle:
                for _ in range(trials):  # each trial: dslab, then every fio job, interleaved
                    mine.append(bench.time(handle, op, self.size))
                    for index, (job, values) in enumerate(zip(jobs, theirs)):
                        if index in refused:
                            continue
                        value = self._run_variant(op, job)
                        if value is None:
                            refused.add(index)
                        else:
                            values.append(value)
            variants = [{**job, **_stats(values)} for index, (job, values) in enumerate(zip(jobs, theirs))
                        if values and index not in refused]
            if not variants:
                continue
            top = max(variants, key=lambda v: v["GBps"])
            self.matched[op] = {**top, "dslab": _stats(mine), "variants": variants}
            self.say(f"{op}: {config.label()} {_stats(mine)['GBps']:.2f} GB/s beside fio's best "
                     f"matched job ({top['ioengine']}, bs {_human(top['bs'])}, iodepth {top['iodepth']}, "
                     f"{top['numjobs']} job(s)): {top['GBps']:.2f} GB/s")

    def record(self) -> dict | None:
        if not all(self.plain[op] for op in OPS):
            return None
        out = {"job": dict(fio_runner.FIO_JOB), "matched": self.matched,
               "command": fio_runner.fio_command(self.fio or "fio", self.test_file, self.size,
                                                 "read")}
        out.update({op: _stats(self.plain[op]) for op in OPS})
        return out


def fio_best(fio: dict | None, op: str) -> float | None:
    """The higher of fio's best-practice job and its best matched job in direction ``op`` (None
    without fio)."""
    if not fio or op not in fio:
        return None
    return max(fio[op]["GBps"], fio.get("matched", {}).get(op, {}).get("GBps", 0.0))


def format_result(result: TuneResult) -> str:
    """The summary printed by ``dslab nvme-tune``: the finalists, dslab beside fio, and the
    ``aio`` block to paste."""
    import json

    lines = [f"dslab nvme-tune: {result.path} ({_human(result.file_bytes)} file, {result.device} "
             f"tensors, {result.trials} trials, {result.backend} backend, "
             f"{'O_DIRECT' if result.direct_io else 'page cache: O_DIRECT refused'}) in "
             f"{result.seconds:.0f} s", ""]
    lines.append(f"{'op':<6} {'configuration':<34} {'GB/s':>7} {'spread':>7}  trials")
    for m in result.rows:
        if m.dropped_after is None:
            lines.append(f"{m.op:<6} {m.config.label():<34} {m.median:>7.2f} "
                         f"{m.spread_pct:>6.1f}%  {len(m.trials)}")
    fio = result.fio or {}
    lines += ["", "beside fio (O_DIRECT) on the same file, trials interleaved (GB/s):",
              f"{'op':<6} {'dslab best':>10} {'fio 1M/32':>10} {'dslab':>10} {'fio matched':>12} "
              f"{'dslab/fio best':>15}"]
    for op in OPS:
        mine = result.best[op].median
        matched = fio.get("matched", {}).get(op, {})
        best = fio_best(result.fio, op)
        lines.append(f"{op:<6} {mine:>10.2f} {_num(fio.get(op, {}).get('GBps')):>10} "
                     f"{_num(matched.get('dslab', {}).get('GBps')):>10} "
                     f"{_num(matched.get('GBps')):>12} {_num(mine / best if best else None, 3):>15}")
    if fio:
        lines.append("(dslab best and fio 1M/32 (libaio): the final round; dslab and fio matched: the best "
                     "configuration beside fio's best job of its block size and requests in flight: " + ", ".join(
                         f"{op} {m.get('ioengine', 'libaio')} bs {_human(m['bs'])} iodepth {m['iodepth']}"
                         f" x {m.get('numjobs', 1)} job(s)"
                         for op, m in fio.get("matched", {}).items()) + ")")
        for op, m in fio.get("matched", {}).items():
            for v in m.get("variants", []):
                lines.append(f"  fio {op} {v['ioengine']:<8} bs {_human(v['bs'])} iodepth {v['iodepth']:>3} "
                             f"x {v['numjobs']} job(s): {v['GBps']:.2f} GB/s")
    for op in OPS:
        lines.append(f"best {op}: {result.best[op].median:.2f} GB/s with {result.best[op].config.label()}")
    lines += ["", "paste into the config:", json.dumps({"aio": result.recommended.aio()}, indent=2)]
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines) + "\n"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def write_tune_report(result: TuneResult, out, space: dict | None = None):
    """Write the run report (suite ``nvme_tune``) with ``profilers["io"]["tune"]``; returns its
    path. The best configuration's and fio's trials are results of cases ``read`` and
    ``write`` (arms ``dslab``, ``fio`` and ``fio-matched``, metric ``GBps``)."""
    from dslab.report import Result, RunReport, Trial, new_run_id, write_report
    from dslab.report.environment import collect_environment
    from dslab.report.store import utc_now

    report = RunReport(run_id=new_run_id(), suite="nvme_tune", status="complete",
                       created=utc_now(), finished=utc_now())
    report.environment = collect_environment()
    report.config = {"path": result.path, "size": result.file_bytes, "trials": result.trials,
                     "device": result.device, "space": space or DEFAULT_SPACE,
                     "finalists": FINALISTS, "clearly_worse": CLEARLY_WORSE}
    report.data = {"kind": "file", "description": "one test file, written once and read once "
                                                  "before timing; removed after the run"}
    for op in OPS:
        mine = Result(case=op, arm="dslab", trials=[Trial(trial=i, metrics={"GBps": v})
                                                    for i, v in enumerate(result.best[op].trials)])
        mine.summarize()
        report.results.append(mine)
        runs = {"fio": (result.fio or {}).get(op),
                "fio-matched": (result.fio or {}).get("matched", {}).get(op)}
        for arm, run in runs.items():
            if run:
                theirs = Result(case=op, arm=arm, trials=[Trial(trial=i, metrics={"GBps": v})
                                                          for i, v in enumerate(run["trials"])])
                theirs.summarize()
                report.results.append(theirs)
    report.profilers["io"] = {"tune": result.record()}
    report.notes = list(result.notes)
    return write_report(report, out)


def stderr_progress(stream: TextIO | None = None) -> Callable[[str], None]:
    """Progress lines on ``stream`` (default: the current ``sys.stderr``)."""
    def say(line: str) -> None:
        print(f"[nvme-tune] {line}", file=stream or sys.stderr, flush=True)
    return say

