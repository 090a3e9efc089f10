"""Hostfiles and --include/--exclude/--num_nodes/--num_gpus."""

from __future__ import annotations

import pytest

from dslab.engine.launch.hostfile import parse_hostfile, parse_hostfile_text
from dslab.engine.launch.resources import parse_host_filter, select_resources
from dslab.engine.launch.runner import discover_hosts

HOSTS = {"worker-0": 4, "worker-1": 4, "worker-2": 2}


def test_hostfile_good_with_comments_and_blank_lines(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("# cluster\n\nworker-0 slots=4\n  worker-1   slots = 8  # big one\n10.0.0.7 slots=1\n")
    hosts = parse_hostfile(path)
    assert hosts == {"worker-0": 4, "worker-1": 8, "10.0.0.7": 1}
    assert list(hosts) == ["worker-0", "worker-1", "10.0.0.7"]  # file order = node order


@pytest.mark.parametrize("text, match", [
    ("worker-0 slots=4\nworker-1\n", r"hf:2: expected 'hostname slots=N', got 'worker-1'"),
    ("worker-0 gpus=4\n", r"hf:1: expected 'hostname slots=N'"),
    ("worker-0 slots=4 extra\n", r"hf:1: expected"),
    ("worker-0 slots=0\n", r"hf:1: slots must be an integer >= 1, got '0' for host 'worker-0'"),
    ("worker-0 slots=two\n", r"hf:1: slots must be an integer >= 1, got 'two'"),
    ("a slots=1\n# c\nb slots=1\na slots=2\n", r"hf:4: host 'a' is listed twice \(first on line 1\)"),
    ("# only a comment\n\n", r"hf: no hosts"),
])
def test_hostfile_bad_lines_name_the_line(text, match):
    with pytest.raises(ValueError, match=match):
        parse_hostfile_text(text, "hf")


def test_missing_hostfile_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="hostfile .*nope does not exist"):
        parse_hostfile(tmp_path / "nope")


def test_host_sources_in_order(tmp_path):
    job = tmp_path / "job_hostfile"
    job.write_text("node-a slots=2\n")
    given = tmp_path / "given"
    given.write_text("node-b slots=3\n")
    assert discover_hosts(str(given), default_hostfile=str(job), gpu_count=lambda: 8) == {"node-b": 3}
    assert discover_hosts(None, default_hostfile=str(job), gpu_count=lambda: 8) == {"node-a": 2}
    absent = str(tmp_path / "absent")
    assert discover_hosts(None, default_hostfile=absent, gpu_count=lambda: 8) == {"localhost": 8}
    assert discover_hosts(None, default_hostfile=absent, gpu_count=lambda: 0) == {"localhost": 1}
    assert discover_hosts(None, 3, default_hostfile=absent, gpu_count=lambda: 0) == {"localhost": 3}
    with pytest.raises(ValueError, match="--num_gpus must be >= 1"):
        discover_hosts(None, 0, default_hostfile=absent, gpu_count=lambda: 0)


def test_filter_syntax():
    assert parse_host_filter("worker-1:0,2@worker-2", HOSTS) == {"worker-1": [0, 2], "worker-2": None}
    assert parse_host_filter("worker-0:3,1@worker-0:1", HOSTS) == {"worker-0": [1, 3]}


@pytest.mark.parametrize("spec, match", [
    ("worker-9", r"--include 'worker-9': unknown host 'worker-9' \(hosts: worker-0, worker-1, worker-2\)"),
    ("worker-2:2", r"host 'worker-2' has no slot 2 \(it has slots 0-1\)"),
    ("worker-0:a", r"slot 'a' of host 'worker-0' is not a non-negative integer"),
    ("worker-0:", r"slot '' of host 'worker-0'"),
    ("worker-0@@worker-1", r"empty host name"),
    ("", r"--include is empty"),
])
def test_filter_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_host_filter(spec, HOSTS, "--include")


def test_include_exclude_and_counts():
    everything = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}
    assert select_resources(HOSTS) == everything
    assert select_resources(HOSTS, include="worker-2@worker-0:1,3") == {"worker-0": [1, 3], "worker-2": [0, 1]}
    assert select_resources(HOSTS, exclude="worker-0@worker-1:0,3") == {"worker-1": [1, 2], "worker-2": [0, 1]}
    assert select_resources(HOSTS, exclude="worker-2:0,1") == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    assert select_resources(HOSTS, num_nodes=2, num_gpus=1) == {"worker-0": [0], "worker-1": [0]}


@pytest.mark.parametrize("kwargs, match", [
    ({"include": "worker-0", "exclude": "worker-1"}, "--include and --exclude are mutually exclusive"),
    ({"include": "worker-0", "num_gpus": 1}, "cannot be combined with --include/--exclude"),
    ({"num_nodes": 4}, r"--num_nodes 4: the hostfile has 3 host\(s\)"),
    ({"num_nodes": 0}, r"--num_nodes 0"),
    ({"num_gpus": 3}, r"--num_gpus 3: host 'worker-2' has 2 slot\(s\)"),
    ({"exclude": "worker-0@worker-1@worker-2"}, "no hosts or slots left"),
    ({"exclude": "worker-5"}, "--exclude 'worker-5': unknown host 'worker-5'"),
])
def test_selection_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        select_resources(HOSTS, **kwargs)
