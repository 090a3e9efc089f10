"""The Perfetto trace of a run report, parsed back with the perfetto package's protobufs: a
process track per rank and case, collectives with bytes and bandwidth, nested step phases and
module spans, memory and telemetry counters; ``dslab trace`` writes it once."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dashboards"))

from report_factory import STRAGGLER_RANK, WORLD, make_report, write_run  # noqa: E402

from dslab import cli  # noqa: E402
from dslab.profilers.comms_analysis import bandwidth  # noqa: E402
from dslab.profilers.trace import TRACE_FILE, build_trace, write_trace  # noqa: E402
from dslab.report import report_from_dict  # noqa: E402

trace_pb2 = pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2")

RUN_ID = "20261120T100000Z-aaaa00"


def parse(data: bytes) -> dict:
    """``{process name: {track name: [events]}}``; a slice event is ``(ts, "B"|"E", name, args)``,
    a counter ``(ts, "C", value)``."""
    trace = trace_pb2.Trace.FromString(data)
    names, parents, processes = {}, {}, {}
    events = defaultdict(list)
    last_ts = 0
    for packet in trace.packet:
        if packet.HasField("track_descriptor"):
            d = packet.track_descriptor
            if d.HasField("process"):
                processes[d.uuid] = d.process.process_name
            else:
                names[d.uuid], parents[d.uuid] = d.name, d.parent_uuid
        elif packet.HasField("track_event"):
            e = packet.track_event
            assert packet.timestamp >= last_ts, "events are in time order"
            last_ts = packet.timestamp
            if e.type == e.TYPE_SLICE_BEGIN:
                args = {}
                for a in e.debug_annotations:
                    args[a.name] = getattr(a, a.WhichOneof("value"))
                events[e.track_uuid].append((packet.timestamp, "B", e.name, args))
            elif e.type == e.TYPE_SLICE_END:
                events[e.track_uuid].append((packet.timestamp, "E"))
            else:
                events[e.track_uuid].append((packet.timestamp, "C", e.double_counter_value))
    out = defaultdict(dict)
    for uuid, name in names.items():
        out[processes[parents[uuid]]][name] = events.get(uuid, [])
    for name in processes.values():
        out.setdefault(name, {})
    return out


def slices(events: list) -> list[tuple[str, int, int, dict, int]]:
    """``(name, begin, end, args, depth)`` of properly nested slices (asserts the nesting)."""
    stack, out = [], []
    for event in events:
        if event[1] == "B":
            stack.append(event)
        elif event[1] == "E":
            begin = stack.pop()
            out.append((begin[2], begin[0], event[0], begin[3], len(stack)))
    assert not stack, "every slice ends"
    return out


@pytest.fixture(scope="module")
def report_data():
    return make_report(RUN_ID)


@pytest.fixture(scope="module")
def tracks(report_data):
    return parse(build_trace(report_from_dict(report_data)))


def test_a_process_per_rank_and_case(tracks):
    for case in ("seq128", "seq512"):
        for rank in range(WORLD):
            assert f"{case} rank {rank}" in tracks
        assert {"profiled step", "measured steps", "collectives", "activations saved", "memory peak allocated",
                "memory peak reserved"} <= set(tracks[f"{case} rank 0"])
        assert set(tracks[f"{case} rank 1"]) == {"collectives"}
        assert f"{case} GPUs" in tracks


def test_collectives_carry_bytes_bandwidth_and_wait(report_data, tracks):
    for rank in range(WORLD):
        records = report_data["profilers"]["comms"]["seq128"]["per_rank"][str(rank)]
        calls = slices(tracks[f"seq128 rank {rank}"]["collectives"])
        assert len(calls) == len(records)
        first = min(records, key=lambda r: r["arrival_ns"])
        name, begin, end, args, _ = calls[0]
        assert (name, begin, args["bytes"]) == (first["op"], first["arrival_ns"], first["bytes"])
        assert end - begin == pytest.approx(first["latency_ms"] * 1e6, abs=1)
        algbw, busbw = bandwidth(first["op"], first["bytes"], first["latency_ms"], first["group_size"])
        assert args["algbw_GBps"] == pytest.approx(algbw) and args["busbw_GBps"] == pytest.approx(busbw)
        waits = [c[3]["wait_ms"] for c in calls]
        if rank == STRAGGLER_RANK:
            assert all(w == 0.0 for w in waits)
        else:
            assert all(w > 3.5 for w in waits)


def test_profiled_step_nests_modules_in_phases(report_data, tracks):
    spans = slices(tracks["seq128 rank 0"]["profiled step"])
    phases = {s[0]: s for s in spans if s[4] == 0}
    assert list(phases) == ["forward", "backward", "optimizer"]
    flops = report_data["profilers"]["flops"]["seq128"]
    assert phases["forward"][2] - phases["forward"][1] == pytest.approx(flops["forward_latency_ms"] * 1e6, abs=1)
    assert phases["forward"][2] <= phases["backward"][1]
    qkv = [s for s in spans if s[0] == "layers.0.attention.qkv"]
    assert len(qkv) == 2  # once in forward, once in backward
    for span in qkv:
        phase = phases["forward"] if span[1] < phases["forward"][2] else phases["backward"]
        assert phase[1] <= span[1] and span[2] <= phase[2]
        assert span[4] == 5  # phase > model > layers > layers.0 > attention > qkv
    assert qkv[0][3]["type"] == "Linear" and qkv[0][3]["flops"] == next(
        m["forward_flops"] for m in flops["modules"] if m["name"] == "layers.0.attention.qkv")
    steps = slices(tracks["seq128 rank 0"]["measured steps"])
    dslab = next(r for r in report_data["results"] if r["case"] == "seq128" and r["arm"] == "dslab")
    assert len(steps) == sum(len(t["step_times_ms"]) for t in dslab["trials"])


def test_memory_and_telemetry_counters(report_data, tracks):
    memory = report_data["profilers"]["memory"]["seq128"]
    allocated = [e[2] for e in tracks["seq128 rank 0"]["memory peak allocated"]]
    assert allocated == [s["peak_allocated"] for s in memory["steps"]]
    activations = [e[2] for e in tracks["seq128 rank 0"]["activations saved"]]
    assert activations == sorted(activations) and activations[-1] == memory["activation_bytes"]
    gpus = tracks["seq128 GPUs"]
    power = [e[2] for e in gpus["GPU 0 power (W)"]]
    samples = next(iter(report_data["profilers"]["telemetry"]["seq128"]["gpus"].values()))["samples"]
    assert power == [s["power_w"] for s in samples]
    assert {"GPU 1 GPU utilisation (%)", "GPU 1 memory used (bytes)", "GPU 1 SM clock (MHz)"} <= set(gpus)


def test_a_malformed_report_still_gives_a_trace():
    data = make_report(RUN_ID)
    data["profilers"] = {"flops": {"seq128": {"modules": "x"}}, "comms": {"seq128": {"per_rank": {"a": [], "1": [3]}}},
                         "memory": "garbage", "telemetry": {"seq128": {"gpus": {"u": {"samples": [{"t": "x"}]}}}}}
    tracks = parse(build_trace(report_from_dict(data)))
    assert "seq128 rank 0" in tracks and "seq128 rank 1" in tracks


def test_write_trace_once_and_the_cli(tmp_path, report_data, capsys):
    run = write_run(tmp_path, report_data)
    path = write_trace(run)
    assert path == run / TRACE_FILE and parse(path.read_bytes())
    path.write_bytes(b"kept")
    assert write_trace(run).read_bytes() == b"kept"
    assert cli.main(["trace", RUN_ID, "--reports", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(path) and path.read_bytes() == b"kept"
    assert cli.main(["trace", f"gpt2_medium/{RUN_ID}", "--reports", str(tmp_path), "--force"]) == 0
    assert "seq128 rank 3" in parse(path.read_bytes())
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]
    assert cli.main(["trace", "nosuchrun", "--reports", str(tmp_path)]) == 1


def test_a_track_per_pipeline_stage():
    data = make_report(RUN_ID)
    timeline0 = [["forward", 0, 0.0, 2.0], ["forward", 1, 2.5, 4.5], ["backward", 0, 9.0, 13.0],
                 ["backward", 1, 13.5, 17.5]]
    timeline1 = [["forward", 0, 3.0, 5.0], ["backward", 0, 5.0, 9.0], ["forward", 1, 9.2, 11.2],
                 ["backward", 1, 11.2, 15.2]]
    data["profilers"]["pipeline"] = {"seq128": {"stages": 2, "micro_batches": 2, "per_stage": [
        {"stage": 0, "batches": [{"step": 0, "timeline": []}, {"step": 1, "timeline": timeline0}]},
        {"stage": 1, "batches": [{"step": 1, "timeline": timeline1}]}]}}
    tracks = parse(build_trace(report_from_dict(data)))
    stages = tracks["seq128 pipeline"]
    assert set(stages) == {"stage 0", "stage 1"}
    got = slices(stages["stage 1"])
    assert [name for name, *_ in got] == ["F0", "B0", "F1", "B1"]
    origin = got[0][1] - 3 * 1_000_000  # stage 1's first forward began 3 ms into the batch
    assert [(b - origin, e - origin) for _, b, e, _, _ in got] == [
        (int(s * 1e6), int(e * 1e6)) for _, _, s, e in timeline1]
    assert [name for name, *_ in slices(stages["stage 0"])] == ["F0", "F1", "B0", "B1"]
