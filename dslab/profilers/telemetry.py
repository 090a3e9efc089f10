"""GPU telemetry: a daemon thread samples NVML at a fixed interval while the run trains.

Per sample and GPU: utilisation (GPU and memory, percent over NVML's last sample period), the SM
clock (MHz), device memory used (bytes), power draw (W; NVML reports mW), temperature (C) and the
current clock throttle reasons, decoded from NVML's bitmask into names. The thread only talks to
NVML (no CUDA call, no device synchronisation), so it costs the training loop a few microseconds
of GIL every ``interval_ms``.

Which GPUs: the ones this process sees. torch's device ``i`` is matched to its NVML handle by
UUID (``torch.cuda.get_device_properties(i).uuid`` against ``nvmlDeviceGetUUID``); NVML's own
indices are physical and ignore ``CUDA_VISIBLE_DEVICES``. Where torch has no CUDA or the UUIDs do
not match, ``CUDA_VISIBLE_DEVICES`` is parsed the way CUDA does (integers and ``GPU-`` UUID
prefixes, up to the first invalid entry); an integer there is taken as an NVML index, which is
exact under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``. Unset, every GPU NVML lists is sampled.

Bounded memory: each GPU keeps at most ``max_samples`` samples. When the buffer fills, every
second sample is dropped and from then on only every second offered sample is kept (the stride
doubles), so a long run keeps an evenly spaced series covering all of it at a coarser spacing.
The summary (mean, max, throttle counts) is accumulated over every sample taken, kept or not.

Without NVML (``pynvml`` does not import, ``nvmlInit`` fails, no GPU visible) the sampler logs one
warning and :meth:`TelemetrySampler.records` says why; nothing raises.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from pydantic import Field

from dslab.config_base import ConfigSection
from dslab.profilers.base import Profiler

logger = logging.getLogger(__name__)

#: (name in the report, bit, pynvml constant names: the current name first, the deprecated one
#: second). The bits are NVML's documented values, used when the module lacks both constants.
THROTTLE_REASONS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    ("gpu_idle", 0x1, ("nvmlClocksEventReasonGpuIdle", "nvmlClocksThrottleReasonGpuIdle")),
    ("applications_clocks_setting", 0x2, ("nvmlClocksEventReasonApplicationsClocksSetting",
                                          "nvmlClocksThrottleReasonApplicationsClocksSetting")),
    ("sw_power_cap", 0x4, ("nvmlClocksEventReasonSwPowerCap",
                           "nvmlClocksThrottleReasonSwPowerCap")),
    ("hw_slowdown", 0x8, ("nvmlClocksEventReasonHwSlowdown", "nvmlClocksThrottleReasonHwSlowdown")),
    ("sync_boost", 0x10, ("nvmlClocksEventReasonSyncBoost", "nvmlClocksThrottleReasonSyncBoost")),
    ("sw_thermal_slowdown", 0x20, ("nvmlClocksEventReasonSwThermalSlowdown",
                                   "nvmlClocksThrottleReasonSwThermalSlowdown")),
    ("hw_thermal_slowdown", 0x40, ("nvmlClocksEventReasonHwThermalSlowdown",
                                   "nvmlClocksThrottleReasonHwThermalSlowdown")),
    ("hw_power_brake_slowdown", 0x80, ("nvmlClocksEventReasonHwPowerBrakeSlowdown",
                                       "nvmlClocksThrottleReasonHwPowerBrakeSlowdown")),
    ("display_clock_setting", 0x100, ("nvmlClocksEventReasonDisplayClockSetting",
                                      "nvmlClocksThrottleReasonDisplayClockSetting")),
)

#: The numeric fields of a sample, summarised as mean and max.
SAMPLE_FIELDS = ("util_gpu", "util_mem", "sm_clock_mhz", "mem_used_bytes", "power_w", "temp_c")

#: the reasons for no telemetry already logged in this process (:meth:`TelemetrySampler._unavailable`)
_WARNED: set[str] = set()
_NVML_CLOCK_SM = 1  # nvmlClockType_t NVML_CLOCK_SM
_NVML_TEMPERATURE_GPU = 0  # nvmlTemperatureSensors_t NVML_TEMPERATURE_GPU


class TelemetryConfig(ConfigSection):
    """dslab's ``telemetry`` section."""

    enabled: bool = False
    interval_ms: int = Field(500, ge=10, description="sampling period of the NVML thread")
    max_samples: int = Field(4096, ge=16, description="samples kept per GPU before downsampling")


class BoundedSeries:
    """At most ``capacity`` items of a stream, evenly spaced over all of it.

    Items are offered in order; every ``stride``-th is kept. When ``capacity`` are kept, every
    second one is dropped and the stride doubles, so the kept items are always those whose offer
    index is a multiple of ``stride`` (``capacity`` is even so that stays true).
    """

    def __init__(self, capacity: int):
        if capacity < 2:
            raise ValueError(f"capacity must be at least 2, got {capacity}")
        self.capacity = capacity + capacity % 2
        self.stride = 1
        self.offered = 0
        self.items: list = []

    def offer(self, item) -> None:
        if self.offered % self.stride == 0:
            self.items.append(item)
            if len(self.items) >= self.capacity:
                self.items = self.items[::2]
                self.stride *= 2
        self.offered += 1


def throttle_bits(nvml) -> tuple[tuple[str, int], ...]:
    """(name, bit) of each known throttle reason, the bit read from ``nvml`` when it has it."""
    table = []
    for name, default_bit, constants in THROTTLE_REASONS:
        bit = default_bit
        for constant in constants:
            value = getattr(nvml, constant, None)
            if isinstance(value, int):
                bit = value
                break
        table.append((name, bit))
    return tuple(table)


def decode_throttle_reasons(mask: int,
                            table: tuple[tuple[str, int], ...] | None = None) -> list[str]:
    """Names of the reasons set in NVML's clock-event bitmask; a bit no name covers reads
    ``unknown_0x...``. ``table`` defaults to NVML's documented bits."""
    table = table if table is not None else tuple((n, b) for n, b, _ in THROTTLE_REASONS)
    names = [name for name, bit in table if mask & bit]
    rest = mask
    for _, bit in table:
        rest &= ~bit
    if rest:
        names.append(f"unknown_{rest:#x}")
    return names


def _copy_sample(sample: dict) -> dict:
    throttle = sample["throttle"]
    return dict(sample, throttle=None if throttle is None else list(throttle))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _uuid_key(uuid: str) -> str:
    """UUIDs compared without NVML's ``GPU-`` prefix and case (torch prints them bare)."""
    uuid = uuid.strip().lower()
    return uuid[4:] if uuid.startswith("gpu-") else uuid


def select_visible_gpus(nvml_uuids: list[str], torch_uuids: list[str] | None,
                        cuda_visible_devices: str | None) -> list[tuple[int, int]]:
    """``(visible index, NVML index)`` of each GPU this process sees.

    ``nvml_uuids[i]`` is the UUID of NVML device ``i``; ``torch_uuids[j]`` that of torch's device
    ``j`` (None or empty without CUDA). See the module docstring for the rules.
    """
    keys = [_uuid_key(u) for u in nvml_uuids]
    if torch_uuids:
        matched = [keys.index(_uuid_key(u)) if _uuid_key(u) in keys else None for u in torch_uuids]
        if all(m is not None for m in matched):
            return list(enumerate(matched))
    if cuda_visible_devices is None:
        return [(i, i) for i in range(len(nvml_uuids))]
    chosen: list[int] = []
    for token in cuda_visible_devices.split(","):
        token = token.strip()
        if token.lstrip("-").isdigit():
            index = int(token)
            if index < 0 or index >= len(keys) or index in chosen:
                break
            chosen.append(index)
            continue
        if token.lower().startswith("gpu-"):
            prefix = _uuid_key(token)
            found = [i for i, key in enumerate(keys) if key.startswith(prefix)]
            if len(found) != 1 or found[0] in chosen:
                break
            chosen.append(found[0])
            continue
        break
    return list(enumerate(chosen))


def _torch_uuids() -> list[str] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        return [str(torch.cuda.get_device_properties(i).uuid)
                for i in range(torch.cuda.device_count())]
    except (RuntimeError, AttributeError):  # an old torch without ``uuid``, a broken driver
        return None


class _Gpu:
    """One sampled GPU: its handle, its kept samples and running aggregates over all samples."""

    def __init__(self, index: int, nvml_index: int, handle, uuid: str, name: str, capacity: int):
        self.index, self.nvml_index, self.handle = index, nvml_index, handle
        self.uuid, self.name = uuid, name
        self.series = BoundedSeries(capacity)
        self.sums = {field: 0.0 for field in SAMPLE_FIELDS}
        self.counts = {field: 0 for field in SAMPLE_FIELDS}
        self.maxima: dict[str, float | None] = {field: None for field in SAMPLE_FIELDS}
        self.throttle_counts: dict[str, int] = {}
        self.errors: dict[str, str] = {}

    def add(self, sample: dict) -> None:
        for field in SAMPLE_FIELDS:
            value = sample[field]
            if value is None:
                continue
            self.sums[field] += value
            self.counts[field] += 1
            best = self.maxima[field]
            self.maxima[field] = value if best is None else max(best, value)
        for name in sample["throttle"] or ():
            self.throttle_counts[name] = self.throttle_counts.get(name, 0) + 1
        self.series.offer(sample)

    def summary(self) -> dict:
        out = {}
        for field in SAMPLE_FIELDS:
            n = self.counts[field]
            out[field] = {"mean": self.sums[field] / n if n else None, "max": self.maxima[field]}
        out["samples_taken"] = self.series.offered
        out["throttle_counts"] = dict(self.throttle_counts)
        return out


class TelemetrySampler(Profiler):
    """Samples NVML on a daemon thread from :meth:`attach` (or the first step) to :meth:`close`.

    ``nvml`` is the NVML module (``pynvml``, imported when None); tests pass a fake.
    """

    section = "telemetry"

    def __init__(self, interval_ms: int = 500, max_samples: int = 4096, nvml=None):
        if interval_ms < 10:
            raise ValueError(f"telemetry.interval_ms must be at least 10, got {interval_ms}")
        if max_samples < 16:
            raise ValueError(f"telemetry.max_samples must be at least 16, got {max_samples}")
        self.interval_ms = int(interval_ms)
        self.max_samples = int(max_samples)
        self._nvml = nvml
        self._gpus: list[_Gpu] = []
        self._reason: str | None = "not started: neither attach() nor a step ran"
        self._started = False
        self._initialised = False
        self._t0 = 0.0
        self._started_unix: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._throttle_table: tuple[tuple[str, int], ...] = ()
        self._throttle_query = None
        self._closed = False

    @classmethod
    def from_config(cls, cfg: TelemetryConfig, nvml=None) -> TelemetrySampler | None:
        if not cfg.enabled:
            return None
        return cls(interval_ms=cfg.interval_ms, max_samples=cfg.max_samples, nvml=nvml)

    # --- engine hooks ------------------------------------------------------------------------

    def attach(self, model=None, optimizer=None) -> None:
        self.start()

    def on_step_begin(self, step: int) -> None:
        if not self._started:
            self.start()

    # --- life cycle --------------------------------------------------------------------------

    def _unavailable(self, reason: str) -> None:
        """No samples: ``reason`` goes into the records, and into the log once per process (a
        benchmark builds an engine per arm and case, each with its own telemetry)."""
        self._reason = reason
        if reason not in _WARNED:
            _WARNED.add(reason)
            logger.warning("telemetry: no GPU telemetry recorded: %s", reason)

    def start(self) -> None:
        """Initialise NVML, pick the visible GPUs and start the thread (once; later calls no-op)."""
        if self._started or self._closed:
            return
        self._started = True
        nvml = self._nvml
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as exc:
                self._unavailable(f"pynvml does not import (pip install nvidia-ml-py): {exc}")
                return
            self._nvml = nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError and its subclasses: no driver, no library
            self._unavailable(f"nvmlInit failed: {exc}")
            return
        self._initialised = True
        try:
            count = nvml.nvmlDeviceGetCount()
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
            visible = select_visible_gpus(uuids, _torch_uuids(),
                                          os.environ.get("CUDA_VISIBLE_DEVICES"))
            for index, nvml_index in visible:
                handle = handles[nvml_index]
                name = _text(nvml.nvmlDeviceGetName(handle))
                self._gpus.append(_Gpu(index, nvml_index, handle, uuids[nvml_index], name,
                                       self.max_samples))
        except Exception as exc:  # a query failing right after init
            self._gpus = []
            self._shutdown_nvml()
            self._unavailable(f"NVML query failed: {exc}")
            return
        if not self._gpus:
            self._shutdown_nvml()
            self._unavailable("no GPU visible to NVML in this process")
            return
        self._throttle_table = throttle_bits(nvml)
        self._throttle_query = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                                or getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
        self._reason = None
        self._t0 = time.monotonic()
        self._started_unix = time.time()
        self._thread = threading.Thread(target=self._run, name="dslab-telemetry", daemon=True)
        self._thread.start()

    def _shutdown_nvml(self) -> None:
        if not self._initialised:
            return
        self._initialised = False
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # best effort: the samples are already read
            pass

    def close(self) -> None:
        """Stop the thread (waits at most one interval plus 5 s) and shut NVML down."""
        self._closed = True
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=self.interval_ms / 1e3 + 5.0)
            if thread.is_alive():
                logger.warning("telemetry: sampler thread still in an NVML call; left running")
                return
        self._shutdown_nvml()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- sampling ----------------------------------------------------------------------------

    def _run(self) -> None:
        period = self.interval_ms / 1e3
        next_time = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample_now()
            except Exception:  # never let a sampling bug kill training; say so once and stop
                logger.exception("telemetry: sampling failed; sampler stopped")
                return
            next_time += period
            delay = next_time - time.monotonic()
            if delay < 0:  # fell behind (a slow NVML call): restart the grid rather than burst
                next_time, delay = time.monotonic(), 0.0
            self._stop.wait(delay)

    def _read(self, gpu: _Gpu, field: str, query):
        try:
            return query()
        except Exception as exc:  # NVMLError_NotSupported on some boards, a GPU gone away
            gpu.errors[field] = str(exc) or type(exc).__name__
            return None

    def _sample(self, gpu: _Gpu, t: float) -> dict:
        nvml, handle = self._nvml, gpu.handle
        clock_sm = getattr(nvml, "NVML_CLOCK_SM", _NVML_CLOCK_SM)
        sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", _NVML_TEMPERATURE_GPU)
        reasons = self._throttle_query
        util = self._read(gpu, "utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        memory = self._read(gpu, "memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        power_mw = self._read(gpu, "power", lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        mask = None if reasons is None else self._read(gpu, "throttle", lambda: reasons(handle))
        return {
            "t": t,
            "util_gpu": None if util is None else float(util.gpu),
            "util_mem": None if util is None else float(util.memory),
            "sm_clock_mhz": self._read(
                gpu, "sm_clock", lambda: float(nvml.nvmlDeviceGetClockInfo(handle, clock_sm))),
            "mem_used_bytes": None if memory is None else int(memory.used),
            "power_w": None if power_mw is None else power_mw / 1e3,
            "temp_c": self._read(gpu, "temperature",
                                 lambda: float(nvml.nvmlDeviceGetTemperature(handle, sensor))),
            "throttle": None if mask is None else decode_throttle_reasons(int(mask),
                                                                          self._throttle_table),
        }

    def sample_now(self) -> None:
        """Take one sample of every GPU (the thread calls this each interval)."""
        t = time.monotonic() - self._t0
        samples = [(gpu, self._sample(gpu, t)) for gpu in self._gpus]
        with self._lock:
            for gpu, sample in samples:
                gpu.add(sample)

    # --- report ------------------------------------------------------------------------------

    def records(self) -> dict:
        """``{"available", "reason", "interval_ms", "started_at_unix", "gpus": {uuid: {"index",
        "nvml_index", "name", "stride", "samples": [...], "errors"}}, "summary": {uuid: {field:
        {"mean", "max"}, "samples_taken", "throttle_counts"}}}``; ``t`` is seconds since the start,
        ``stride`` how many samples taken per sample kept."""
        out = {"available": self._reason is None and bool(self._gpus), "reason": self._reason,
               "interval_ms": self.interval_ms, "max_samples": self.max_samples,
               "started_at_unix": self._started_unix, "gpus": {}, "summary": {}}
        with self._lock:
            for gpu in self._gpus:
                out["gpus"][gpu.uuid] = {
                    "index": gpu.index,
                    "nvml_index": gpu.nvml_index,
                    "name": gpu.name,
                    "stride": gpu.series.stride,
                    "samples": [_copy_sample(s) for s in gpu.series.items],
                    "errors": dict(gpu.errors),
                }
                out["summary"][gpu.uuid] = gpu.summary()
        return out
