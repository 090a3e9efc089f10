"""pytest set-up of the kernel benchmarks (``test_kernels_bench.py``): the cases each test runs,
how many rounds it times, and the GPU and software stack recorded in the JSON's ``machine_info``.

Options (each has a default, so that the folder also runs when its conftest is not an initial one)::

    --kernel-rounds N          timed rounds per benchmark (default 30): the samples the gate compares
    --kernel-iterations N      calls per round (default 10); a round's value is their mean
    --kernel-warmup-rounds N   untimed rounds first (default 3): Triton's autotuning and compilation
    --kernel-warmup-s S        and untimed calls for at least S seconds of device time before them
                               (default 0): a matmul-bound case near the GPU's power limit runs a
                               clock transient about a second into sustained load (on an H200 the
                               fused linear cross-entropy's rounds went 6.8 -> 8.4 -> 6.8 ms);
                               warming past it keeps the transient out of the timed rounds
    --kernel-round-ms MS       make each round at least MS of device time (default 0: exactly
                               --kernel-iterations calls): the calls per round become MS over the
                               case's median call, at least --kernel-iterations; near the power
                               limit the clock swings by several percent over about a second, and
                               rounds of a second average the swing that 70 ms rounds sample
    --kernel-pins FILE         replay the kernel choices recorded in FILE before anything runs: a
                               pytest-benchmark JSON of these benchmarks, or a kernel-choices JSON
    --kernel-inject-slowdown F each dslab arm followed by a device-side spin of F times its median
                               call time (``common.slowed``): a known slowdown for checking the gate,
                               recorded in ``machine_info["dslab_inject_slowdown"]``
    --kernel-timing MODE       ``graph`` (default): each timed call is one replay of the case captured
                               in a CUDA graph, so a round times the device's work alone; ``eager``:
                               the case's own calls, the host's issuing included when the host is the
                               slower side (``test_kernels_bench.py``)

Kernel choices (:mod:`dslab.kernels.pinning`): each process picks its kernels afresh (Triton's
autotuner times its configs per process, and two configs within its noise go either way), so two
runs of the same code can differ by what their choices differ. The JSON's ``machine_info`` records
the session's choices, read at the end of the session (``kernel_choices``: every autotuner's chosen
configs, the cuDNN/cuBLAS flags, the device and versions they hold for, and ``replay``, the replay's
summary with the keys the session autotuned itself, or None). ``--kernel-pins`` replays a file's
choices in ``pytest_configure``, before collection builds any case: the autotuners take the
recorded configs without benchmarking them and the flags are the recorded ones. A file recorded
on another GPU or another torch, Triton, CUDA or cuDNN is refused (a usage error naming the field).

Test ids come from the cases themselves: on a GPU, every ``bench_<op>.py`` builds its cases once
at collection to name them (``<op> <shape>`` as an id) and drops them; at run time the cases of one
module at a time are built again (:class:`CaseStore`), so that only one module's inputs are on the
device. Without CUDA nothing is built, and each module's tests are collected as one skipped test.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench_ops, op_cases  # noqa: E402

if importlib.util.find_spec("pytest_benchmark") is None:
    raise ImportError("the kernel benchmarks are pytest-benchmark tests: pip install -e '.[dev]' "
                      "(or pip install pytest-benchmark)")

ARMS = ("dslab", "torch")
TIMING_MODES = ("graph", "eager")
NO_CUDA = "needs a CUDA GPU: the kernel benchmarks time device work with CUDA events"
PEAKS_KEY = pytest.StashKey[dict]()
PINS_KEY = pytest.StashKey[dict]()


@dataclass(frozen=True)
class Timing:
    """How :func:`test_kernels_bench.test_kernel` drives ``benchmark.pedantic``."""

    rounds: int
    iterations: int
    warmup_rounds: int
    warmup_s: float = 0.0
    round_ms: float = 0.0


class CaseRef(NamedTuple):
    """One case as collected: its module's ``op``, its index in ``cases()``, and its ``slug``.
    ``error`` holds why the module's cases could not be built (the test then fails with it)."""

    op: str
    index: int | None
    slug: str
    error: str | None = None


DEFAULT_TIMING = Timing(rounds=30, iterations=10, warmup_rounds=3)
OPTION_HELP = {"rounds": "timed rounds per benchmark", "iterations": "calls per round; a round's value is their mean",
               "warmup_rounds": "untimed rounds before the timed ones"}


def pytest_addoption(parser):
    group = parser.getgroup("dslab kernel benchmarks")
    for name, text in OPTION_HELP.items():
        default = getattr(DEFAULT_TIMING, name)
        group.addoption(f"--kernel-{name.replace('_', '-')}", type=int, default=default,
                        help=f"{text} (default {default})")
    group.addoption("--kernel-round-ms", type=float, default=0.0, metavar="MS",
                    help="make each timed round at least this much device time: more calls per round for a short "
                         "case, so that rounds average the clock's swing near the power limit (default 0: exactly "
                         "--kernel-iterations calls)")
    group.addoption("--kernel-warmup-s", type=float, default=0.0, metavar="SECONDS",
                    help="untimed calls for at least this much device time before each benchmark's warm-up "
                         "rounds: past the clock transient of sustained load near the power limit (default 0)")
    group.addoption("--kernel-inject-slowdown", type=float, default=0.0, metavar="FRACTION",
                    help="slow every dslab arm by this fraction of its median call time with a device-side spin "
                         "(common.slowed), to check the kernel gate; recorded in machine_info (default 0: off)")
    group.addoption("--kernel-timing", choices=TIMING_MODES, default="graph",
                    help="graph: time replays of each case captured in a CUDA graph (device work only; a case "
                         "that cannot be captured runs eagerly and says so); eager: time the calls as issued "
                         "(default graph)")
    group.addoption("--kernel-pins", default=None, metavar="FILE",
                    help="replay the kernel choices recorded in FILE (a pytest-benchmark JSON of these benchmarks, "
                         "or a kernel-choices JSON) before anything runs")


def pytest_configure(config):
    """Replay ``--kernel-pins`` before collection builds any case (module docstring)."""
    path = config.getoption("kernel_pins", None)
    if not path:
        return
    from dslab.kernels.pinning import load_kernel_choices, replay_kernel_choices

    try:
        config.stash[PINS_KEY] = replay_kernel_choices(load_kernel_choices(path), source=str(path))
    except (ValueError, FileNotFoundError) as err:
        raise pytest.UsageError(f"--kernel-pins: {err}") from None


def _free_device_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _op_params(op: str) -> list:
    if not torch.cuda.is_available():
        return [pytest.param(CaseRef(op, None, op), None, id=op, marks=pytest.mark.skip(reason=NO_CUDA))]
    try:
        slugs = [case.slug for case in op_cases(op, torch.device("cuda"))]
    except Exception as err:  # reported by the module's one test, as run.py reports it in its table
        return [pytest.param(CaseRef(op, None, f"{op}-error", f"{type(err).__name__}: {err}"), None,
                             id=f"{op}-error")]
    finally:
        _free_device_memory()
    return [pytest.param(CaseRef(op, index, slug), arm, id=f"{slug}-{arm}")
            for index, slug in enumerate(slugs) for arm in ARMS]


def pytest_generate_tests(metafunc):
    if {"case_ref", "arm"} <= set(metafunc.fixturenames):
        metafunc.parametrize(("case_ref", "arm"), [param for op in bench_ops() for param in _op_params(op)])


def pytest_collection_modifyitems(items):
    """Give every case its module's op as a keyword, so that ``-k fused_adam`` or ``-k llama_ops``
    selects that module's cases on a GPU too, where the ids name the case (``adamw_step_...``)."""
    for item in items:
        ref = getattr(getattr(item, "callspec", None), "params", {}).get("case_ref")
        if isinstance(ref, CaseRef):
            item.extra_keyword_matches.add(ref.op)


class CaseStore:
    """The cases of the bench module in use, built on first use and freed when the tests move on
    to another module (tests run module by module, in collection order)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.op: str | None = None
        self.cases: list = []

    def get(self, ref: CaseRef):
        if ref.error is not None:
            pytest.fail(f"bench_{ref.op}.py could not build its cases: {ref.error}", pytrace=False)
        if ref.op != self.op:
            self.op, self.cases = None, []
            _free_device_memory()
            self.cases, self.op = op_cases(ref.op, self.device), ref.op
        case = self.cases[ref.index]
        if case.slug != ref.slug:
            pytest.fail(f"bench_{ref.op}.py case {ref.index} is {case.slug!r} now, {ref.slug!r} at collection",
                        pytrace=False)
        return case


@pytest.fixture(scope="session")
def case_store():
    store = CaseStore(torch.device("cuda"))
    yield store
    store.cases = []
    _free_device_memory()


@pytest.fixture(scope="session")
def timing(pytestconfig) -> Timing:
    values = {name: pytestconfig.getoption(f"kernel_{name}", getattr(DEFAULT_TIMING, name)) for name in OPTION_HELP}
    for name, value in values.items():
        least = 0 if name == "warmup_rounds" else 1
        if value < least:
            raise ValueError(f"--kernel-{name.replace('_', '-')} must be at least {least}, got {value}")
    warmup_s = pytestconfig.getoption("kernel_warmup_s", 0.0) or 0.0
    if not 0.0 <= warmup_s <= 600.0:
        raise ValueError(f"--kernel-warmup-s must lie in [0, 600] seconds, got {warmup_s}")
    round_ms = pytestconfig.getoption("kernel_round_ms", 0.0) or 0.0
    if not 0.0 <= round_ms <= 60_000.0:
        raise ValueError(f"--kernel-round-ms must lie in [0, 60000] ms, got {round_ms}")
    return Timing(**values, warmup_s=warmup_s, round_ms=round_ms)


@pytest.fixture(scope="session")
def timing_mode(pytestconfig) -> str:
    """``--kernel-timing``: ``graph`` or ``eager`` (module docstring)."""
    return pytestconfig.getoption("kernel_timing", "graph") or "graph"


@pytest.fixture(scope="session")
def inject_slowdown(pytestconfig) -> float:
    """``--kernel-inject-slowdown``: the fraction each dslab arm is slowed by (0: not at all)."""
    value = pytestconfig.getoption("kernel_inject_slowdown", 0.0) or 0.0
    if not 0.0 <= value < 1.0:
        raise ValueError(f"--kernel-inject-slowdown must lie in [0, 1), got {value}")
    return value


@pytest.fixture(scope="session")
def device_peaks(pytestconfig) -> dict:
    """The measured bf16 matmul and copy ceilings (``dslab.bench.measure.measure_peaks``), once per
    session; also written to the JSON's ``machine_info.gpu.measured_peaks``."""
    from dslab.bench.measure import measure_peaks

    peaks = measure_peaks(torch.device("cuda"))
    pytestconfig.stash[PEAKS_KEY] = peaks
    return peaks


def pytest_benchmark_update_machine_info(config, machine_info):
    """What ``dslab gate --pytest-benchmark`` must find equal besides pytest-benchmark's own host
    fields: the GPU's name, torch and CUDA (major.minor), and ``DSLAB_KERNELS`` (which forces the
    reference kernels). Triton's version, the measured ceilings, the GPU's UUID (the gate notes a
    baseline from another unit) and the session's kernel choices (module docstring; what
    ``--kernel-pins`` reads back) are recorded, not compared."""
    from dslab.kernels.pinning import pinning_misses, record_kernel_choices

    triton_spec = importlib.util.find_spec("triton")
    machine_info["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                             "triton": __import__("triton").__version__ if triton_spec else None}
    machine_info["dslab_kernels"] = os.environ.get("DSLAB_KERNELS")
    if torch.cuda.is_available():
        uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
        machine_info["gpu"] = {"name": torch.cuda.get_device_name(), "count": torch.cuda.device_count(),
                               "uuid": str(uuid) if uuid is not None else None,
                               "measured_peaks": config.stash.get(PEAKS_KEY, None)}
    machine_info["dslab_inject_slowdown"] = config.getoption("kernel_inject_slowdown", 0.0) or 0.0
    replay = config.stash.get(PINS_KEY, None)
    machine_info["kernel_choices"] = {**record_kernel_choices(),
                                      "replay": None if replay is None else {**replay, "misses": pinning_misses()}}
