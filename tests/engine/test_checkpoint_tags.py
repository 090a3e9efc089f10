"""``checkpoint.tag_validation``: ranks that save under different tags are logged (Warn) or
refused before anything is written (Fail); the section's keys are validated by name."""

import json
from pathlib import Path

import pytest

from dslab.engine.config import load_config

HERE = Path(__file__).parent
BASE = {"train_micro_batch_size_per_gpu": 2}


def test_the_section_and_zero_allow_untested_optimizer_load():
    assert load_config(BASE).checkpoint.tag_validation == "Warn"
    for given, mode in (("warn", "Warn"), ("FAIL", "Fail"), ("Ignore", "Ignore")):
        assert load_config({**BASE, "checkpoint": {"tag_validation": given}}).checkpoint.tag_validation == mode
    config = load_config({**BASE, "checkpoint": {"use_node_local_storage": False, "load_universal": False},
                          "zero_allow_untested_optimizer": True})
    assert config.zero_allow_untested_optimizer is True


@pytest.mark.parametrize("section, words", [
    ({"tag_validation": "sometimes"}, "'checkpoint.tag_validation' must be one of Ignore, Warn, Fail"),
    ({"load_universal": True}, "'checkpoint.load_universal': a DeepSpeed feature"),
    ({"use_node_local_storage": True}, "'checkpoint.use_node_local_storage': a DeepSpeed feature"),
    ({"parallel_writes": {}}, "checkpoint.parallel_writes"),
])
def test_bad_checkpoint_sections_name_the_key(section, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        load_config({**BASE, "checkpoint": section})


@pytest.mark.world_size(2)
def test_tags_that_differ_across_ranks_warn_or_fail(tmp_path, torchrun):
    out = tmp_path / "result.json"
    torchrun(HERE / "checkpoint_tags_worker.py", tmp_path, out, timeout=240)
    result = json.loads(out.read_text())
    # one tag on every rank: no warning, one checkpoint directory
    assert result["same"] == {"warnings": [], "dirs": ["agreed"]}
    # Warn: logged (on every rank), naming both tags and their ranks; the save goes on under rank
    # 0's tag
    warn = result["warn"]
    assert len(warn["warnings"]) == 1 and "'step-r0' on rank(s) 0; 'step-r1' on rank(s) 1" in warn["warnings"][0]
    assert "tag_validation' is Warn" in warn["warnings"][0] and "step-r0" in warn["dirs"]
    # Fail: every rank raises before writing; Ignore: no check, no message
    assert "'step-r0' on rank(s) 0; 'step-r1' on rank(s) 1" in result["fail"]["error"]
    assert "tag_validation' is Fail" in result["fail"]["error"] and result["fail"]["dirs"] == []
    assert result["ignore"]["warnings"] == []
