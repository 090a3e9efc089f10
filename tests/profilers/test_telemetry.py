"""GPU telemetry sampler (dslab.profilers.telemetry) against a scripted fake NVML module."""

import json
import logging
import random
import statistics
import sys
import threading
import time
import types

import pytest

from dslab.config_base import parse_section
from dslab.profilers import telemetry
from dslab.profilers.telemetry import (THROTTLE_REASONS, BoundedSeries, TelemetryConfig,
                                       TelemetrySampler, decode_throttle_reasons,
                                       select_visible_gpus)

UNKNOWN_BIT = 0x10000


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """The pynvml calls the sampler makes, returning seeded random values and logging each one.

    ``event_names`` picks the current (``nvmlClocksEventReason*``) or the deprecated
    (``nvmlClocksThrottleReason*``) constants and reasons query, as pynvml versions differ.
    """

    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, n_gpus=2, seed=0, init_error=None, unsupported=(), event_names=True):
        self.uuids = [f"GPU-{i:08x}-1111-2222-3333-{seed:012d}" for i in range(n_gpus)]
        self.names = [f"NVIDIA H100 80GB HBM3 #{i}" for i in range(n_gpus)]
        self.rng = random.Random(seed)
        self.init_error = init_error
        self.unsupported = set(unsupported)
        self.log = {u: {k: [] for k in ("util", "clock", "mem", "power", "temp", "mask")}
                    for u in self.uuids}
        self.lock = threading.Lock()
        self.init_calls = self.shutdown_calls = 0
        for _, bit, (event, throttle) in THROTTLE_REASONS:
            setattr(self, event if event_names else throttle, bit)
        query = self._reasons
        if event_names:
            self.nvmlDeviceGetCurrentClocksEventReasons = query
        else:
            self.nvmlDeviceGetCurrentClocksThrottleReasons = query

    def _value(self, handle, kind, make):
        if kind in self.unsupported:
            raise FakeNVMLError(f"{kind}: Not Supported")
        with self.lock:
            value = make()
            self.log[self.uuids[handle]][kind].append(value)
        return value

    def nvmlInit(self):
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self):
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self):
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetUUID(self, handle):
        return self.uuids[handle].encode() if handle % 2 else self.uuids[handle]

    def nvmlDeviceGetName(self, handle):
        return self.names[handle]

    def nvmlDeviceGetUtilizationRates(self, handle):
        return self._value(handle, "util", lambda: types.SimpleNamespace(
            gpu=self.rng.randint(0, 100), memory=self.rng.randint(0, 100)))

    def nvmlDeviceGetClockInfo(self, handle, clock):
        assert clock == self.NVML_CLOCK_SM
        return self._value(handle, "clock", lambda: self.rng.randint(200, 1980))

    def nvmlDeviceGetMemoryInfo(self, handle):
        return self._value(handle, "mem", lambda: types.SimpleNamespace(
            used=self.rng.randint(0, 80 * 2**30), total=80 * 2**30, free=0))

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._value(handle, "power", lambda: self.rng.randint(50_000, 700_000))

    def nvmlDeviceGetTemperature(self, handle, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._value(handle, "temp", lambda: self.rng.randint(25, 90))

    def _reasons(self, handle):
        def mask():
            bits = [bit for _, bit, _ in THROTTLE_REASONS if self.rng.random() < 0.3]
            if self.rng.random() < 0.1:
                bits.append(UNKNOWN_BIT)
            return sum(bits)
        return self._value(handle, "mask", mask)


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture(autouse=True)
def all_gpus_visible(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(telemetry, "_torch_uuids", lambda: None)


def expected_names(mask):
    names = [name for name, bit, _ in THROTTLE_REASONS if mask & bit]
    return names + (["unknown_0x10000"] if mask & UNKNOWN_BIT else [])


# --- config and pieces ------------------------------------------------------------------------

def test_config_defaults_validation_and_from_config():
    cfg = TelemetryConfig()
    assert (cfg.enabled, cfg.interval_ms) == (False, 500)
    assert TelemetrySampler.from_config(cfg) is None
    sampler = TelemetrySampler.from_config(
        parse_section(TelemetryConfig, {"enabled": True, "interval_ms": 10}, "telemetry"))
    assert sampler.interval_ms == 10 and sampler.section == "telemetry"
    with pytest.raises(ValueError, match="telemetry.interval_ms"):
        parse_section(TelemetryConfig, {"interval_ms": 9}, "telemetry")
    with pytest.raises(ValueError, match="telemetry.interval_ms"):
        TelemetrySampler(interval_ms=5)


@pytest.mark.parametrize("event_names", [True, False])
def test_decode_throttle_reasons(event_names):
    rng = random.Random(1)
    table = telemetry.throttle_bits(FakeNVML(event_names=event_names))
    for _ in range(50):
        mask = sum(bit for _, bit, _ in THROTTLE_REASONS if rng.random() < 0.5)
        mask |= UNKNOWN_BIT if rng.random() < 0.3 else 0
        assert decode_throttle_reasons(mask, table) == expected_names(mask)
    assert decode_throttle_reasons(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert decode_throttle_reasons(0) == []


def test_bounded_series_keeps_an_even_grid():
    for total in (5, 16, 17, 1000, 4097):
        series = BoundedSeries(16)
        for i in range(total):
            series.offer(i)
        assert len(series.items) < 16
        assert series.items == list(range(0, total, series.stride))
        assert series.offered == total


def test_select_visible_gpus():
    nvml = ["GPU-aaaa-0", "GPU-bbbb-1", "GPU-cccc-2"]
    assert select_visible_gpus(nvml, None, None) == [(0, 0), (1, 1), (2, 2)]
    # torch's UUIDs are bare and lower case: matched by UUID, whatever the env says
    assert select_visible_gpus(nvml, ["CCCC-2", "aaaa-0"], "0,1") == [(0, 2), (1, 0)]
    assert select_visible_gpus(nvml, None, "2,0") == [(0, 2), (1, 0)]
    assert select_visible_gpus(nvml, None, "GPU-bbbb,1") == [(0, 1)]  # a repeat stops the list
    assert select_visible_gpus(nvml, None, "1,7,0") == [(0, 1)]  # as CUDA: stop at invalid
    assert select_visible_gpus(nvml, None, "") == []
    assert select_visible_gpus(nvml, ["dddd-9"], "2") == [(0, 2)]  # no UUID match: env rules


# --- sampling ---------------------------------------------------------------------------------

def test_samples_values_summary_and_uuid_keys():
    fake = FakeNVML(n_gpus=2, seed=3)
    sampler = TelemetrySampler(interval_ms=60_000, nvml=fake)
    sampler.attach(model=None)
    wait_for(lambda: all(len(fake.log[u]["mask"]) == 1 for u in fake.uuids))
    for _ in range(29):
        sampler.sample_now()
    sampler.close()
    rec = sampler.records()
    json.dumps(rec)
    assert rec["available"] is True and rec["reason"] is None and rec["interval_ms"] == 60_000
    assert sorted(rec["gpus"]) == sorted(fake.uuids)
    for index, uuid in enumerate(fake.uuids):
        gpu, log = rec["gpus"][uuid], fake.log[uuid]
        assert (gpu["index"], gpu["nvml_index"], gpu["name"]) == (index, index, fake.names[index])
        samples = gpu["samples"]
        assert len(samples) == 30 and gpu["stride"] == 1
        assert [s["util_gpu"] for s in samples] == [u.gpu for u in log["util"]]
        assert [s["util_mem"] for s in samples] == [u.memory for u in log["util"]]
        assert [s["sm_clock_mhz"] for s in samples] == log["clock"]
        assert [s["mem_used_bytes"] for s in samples] == [m.used for m in log["mem"]]
        assert [s["power_w"] for s in samples] == pytest.approx([p / 1e3 for p in log["power"]])
        assert [s["temp_c"] for s in samples] == log["temp"]
        assert [s["throttle"] for s in samples] == [expected_names(m) for m in log["mask"]]
        assert all(b["t"] >= a["t"] for a, b in zip(samples, samples[1:]))
        summary = rec["summary"][uuid]
        assert summary["samples_taken"] == 30
        assert summary["power_w"]["mean"] == pytest.approx(statistics.mean(log["power"]) / 1e3)
        assert summary["power_w"]["max"] == pytest.approx(max(log["power"]) / 1e3)
        assert summary["temp_c"]["mean"] == pytest.approx(statistics.mean(log["temp"]))
        assert summary["util_gpu"]["max"] == max(u.gpu for u in log["util"])
        assert summary["mem_used_bytes"]["max"] == max(m.used for m in log["mem"])
        counts = {}
        for mask in log["mask"]:
            for name in expected_names(mask):
                counts[name] = counts.get(name, 0) + 1
        assert summary["throttle_counts"] == counts
    assert fake.shutdown_calls == 1


def test_downsampling_keeps_memory_bounded_and_summary_exact():
    fake = FakeNVML(n_gpus=1, seed=4)
    sampler = TelemetrySampler(interval_ms=60_000, max_samples=16, nvml=fake)
    sampler.on_step_begin(0)
    wait_for(lambda: len(fake.log[fake.uuids[0]]["temp"]) == 1)
    for _ in range(99):
        sampler.sample_now()
    sampler.close()
    rec = sampler.records()
    gpu, temps = rec["gpus"][fake.uuids[0]], fake.log[fake.uuids[0]]["temp"]
    assert len(gpu["samples"]) < 16 and gpu["stride"] == 8
    assert [s["temp_c"] for s in gpu["samples"]] == temps[::8]
    assert rec["summary"][fake.uuids[0]]["temp_c"]["mean"] == pytest.approx(statistics.mean(temps))
    assert rec["summary"][fake.uuids[0]]["samples_taken"] == 100


@pytest.mark.serial  # counts samples of a timed thread
def test_samples_arrive_at_about_the_interval_and_stop_at_close():
    fake = FakeNVML(n_gpus=1, seed=5)
    interval_ms = 40
    sampler = TelemetrySampler(interval_ms=interval_ms, nvml=fake)
    began = time.monotonic()
    sampler.attach(model=None)
    assert sampler.running
    time.sleep(0.6)
    sampler.close()
    elapsed = time.monotonic() - began
    assert not sampler.running and fake.shutdown_calls == 1
    taken = len(fake.log[fake.uuids[0]]["temp"])
    time.sleep(0.15)
    assert len(fake.log[fake.uuids[0]]["temp"]) == taken  # nothing sampled after close
    times = [s["t"] for s in sampler.records()["gpus"][fake.uuids[0]]["samples"]]
    expected = elapsed / (interval_ms / 1e3) + 1  # the first sample is taken at start
    assert 0.5 * expected <= len(times) <= expected + 1
    spacing = statistics.median(b - a for a, b in zip(times, times[1:]))
    assert 0.7 * interval_ms / 1e3 <= spacing <= 1.6 * interval_ms / 1e3
    sampler.on_step_begin(3)  # a closed sampler does not start again
    assert not sampler.running


def test_cuda_visible_devices_is_respected(monkeypatch):
    fake = FakeNVML(n_gpus=3, seed=6)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    sampler = TelemetrySampler(interval_ms=60_000, nvml=fake)
    sampler.attach(model=None)
    sampler.close()
    gpus = sampler.records()["gpus"]
    assert {u: (g["index"], g["nvml_index"]) for u, g in gpus.items()} == {
        fake.uuids[2]: (0, 2), fake.uuids[0]: (1, 0)}


def test_unsupported_field_is_none_and_noted():
    fake = FakeNVML(n_gpus=1, seed=7, unsupported={"power"})
    sampler = TelemetrySampler(interval_ms=60_000, nvml=fake)
    sampler.attach(model=None)
    wait_for(lambda: len(fake.log[fake.uuids[0]]["temp"]) == 1)
    sampler.sample_now()
    sampler.close()
    rec = sampler.records()
    gpu = rec["gpus"][fake.uuids[0]]
    assert [s["power_w"] for s in gpu["samples"]] == [None, None]
    assert "Not Supported" in gpu["errors"]["power"]
    assert rec["summary"][fake.uuids[0]]["power_w"] == {"mean": None, "max": None}
    assert rec["summary"][fake.uuids[0]]["temp_c"]["max"] is not None


# --- without NVML -----------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def no_reason_logged_yet(monkeypatch):
    monkeypatch.setattr(telemetry, "_WARNED", set())


def check_unavailable(sampler, caplog, reason_part):
    with caplog.at_level(logging.WARNING, logger="dslab.profilers.telemetry"):
        sampler.attach(model=None)
        sampler.on_step_begin(0)
        sampler.on_step_begin(1)
        sampler.close()
    warnings = [r for r in caplog.records if r.name == "dslab.profilers.telemetry"]
    assert len(warnings) == 1 and reason_part in warnings[0].getMessage()
    rec = sampler.records()
    assert rec["available"] is False and reason_part in rec["reason"] and rec["gpus"] == {}
    assert not sampler.running
    json.dumps(rec)


def test_pynvml_missing(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes ``import pynvml`` raise ImportError
    check_unavailable(TelemetrySampler(interval_ms=10), caplog, "pynvml does not import")


def test_nvml_init_failure(caplog):
    fake = FakeNVML(init_error=FakeNVMLError("Driver Not Loaded"))
    check_unavailable(TelemetrySampler(interval_ms=10, nvml=fake), caplog, "Driver Not Loaded")
    assert fake.shutdown_calls == 0


def test_no_gpu_visible(monkeypatch, caplog):
    fake = FakeNVML(n_gpus=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    check_unavailable(TelemetrySampler(interval_ms=10, nvml=fake), caplog, "no GPU visible")
    assert fake.shutdown_calls == 1


def test_each_reason_is_logged_once_per_process_and_recorded_every_time(caplog):
    """A benchmark builds an engine, and a sampler, per arm and case: one line per reason."""
    samplers = [TelemetrySampler(interval_ms=10, nvml=FakeNVML(init_error=FakeNVMLError(error)))
                for error in ("Driver Not Loaded", "Driver Not Loaded", "Insufficient Permissions")]
    with caplog.at_level(logging.WARNING, logger="dslab.profilers.telemetry"):
        for sampler in samplers:
            sampler.attach(model=None)
            sampler.close()
    logged = [r.getMessage() for r in caplog.records if r.name == "dslab.profilers.telemetry"]
    assert logged == ["telemetry: no GPU telemetry recorded: nvmlInit failed: Driver Not Loaded",
                      "telemetry: no GPU telemetry recorded: nvmlInit failed: Insufficient Permissions"]
    assert [s.records()["reason"] for s in samplers] == [
        "nvmlInit failed: Driver Not Loaded", "nvmlInit failed: Driver Not Loaded",
        "nvmlInit failed: Insufficient Permissions"]


def test_records_before_start():
    rec = TelemetrySampler(nvml=FakeNVML()).records()
    assert rec["available"] is False and "not started" in rec["reason"]
