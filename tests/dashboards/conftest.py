"""Fixtures of the dashboard tests: a reports directory of generated runs (full, partial and
malformed), the app served on 127.0.0.1 in a thread, and a headless Chromium driven by selenium."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import report_factory as factory  # noqa: E402
from report_factory import NOT_JSON, NOT_OBJECT, RUN_IDS, SUITE, partial_report  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture(scope="session")
def reports_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reports")
    for i, run_id in enumerate(RUN_IDS):
        factory.write_run(root, factory.make_report(run_id, SUITE, created=f"2026-11-2{i}T10:00:00+00:00",
                                                    commit=f"c0ffee{i}abc", throughput=400 - 60 * (i == 4), seed=i))
    factory.write_gate_files(root, SUITE, RUN_IDS, 400)
    factory.write_run(root, partial_report())
    factory.write_run(root, '{"run_id": "cut', suite=SUITE, run_id=NOT_JSON)
    factory.write_run(root, json.dumps([1, 2, 3]), suite=SUITE, run_id=NOT_OBJECT)
    return root


@pytest.fixture(scope="session")
def server(reports_root):
    """The dashboard over ``reports_root``; yields its base URL."""
    yield from factory.serve_dashboard(reports_root)


@pytest.fixture(scope="session")
def browser():
    """A headless Chromium (Debian's chromium and chromium-driver) that records console logs."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists() and not shutil.which(Path(p).name)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (apt-get install chromium chromium-driver); "
                    ".ci/run installs them when it runs as root")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000", "--disable-extensions"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver_path = CHROMEDRIVER if Path(CHROMEDRIVER).exists() else shutil.which("chromedriver")
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()
