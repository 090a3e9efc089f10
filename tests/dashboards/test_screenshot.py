"""docs/screenshot.py (the README's picture): a real Chromium draws a run's Flops tab from a
committed fixture and the PNG has the window's size; a page that is not there is an error, and no
file is left behind."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests/dashboards/fixtures/gpu_reports"


def _module():
    spec = importlib.util.spec_from_file_location("screenshot", REPO / "docs/screenshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_the_flops_tab_is_saved_at_the_window_size(browser, tmp_path):
    run = next(FIXTURE.glob("gpt2/*/run.json")).parent.name
    out = _module().screenshot(FIXTURE, f"/run/gpt2/{run}/flops", tmp_path / "shot.png", width=900, height=700)
    assert _png_size(out) == (900, 700)
    assert out.stat().st_size > 20_000  # a drawn page, not a blank one
    assert [p.name for p in tmp_path.iterdir()] == ["shot.png"]


def test_a_missing_reports_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="--reports"):
        _module().screenshot(tmp_path / "nope", "/", tmp_path / "shot.png")
    assert not (tmp_path / "shot.png").exists()
