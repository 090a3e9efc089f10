"""Draw one dashboard page in a headless Chromium and save it as a PNG (the README's picture).

    python docs/screenshot.py --reports tests/dashboards/fixtures/gpu_reports \\
        --page /run/gpt2/20261123T200744Z-0aa422/flops --out docs/dashboard.png

Run from the repository root (the defaults are relative to it). Serves the dashboard over ``--reports`` on a free local port, loads ``--page``, waits until the
page's heading and every graph are drawn, and writes the page's viewport (``--width`` x ``--height``) to
``--out`` through a temporary file renamed into place. Needs Debian's chromium and
chromium-driver and selenium, as the dashboard's browser tests do.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
DRAWN = ("const gs = document.querySelectorAll('#page .dash-graph');"
         "return document.querySelector('#page h2') !== null && document.querySelector('._dash-loading') === null"
         " && Array.from(gs).every(g => g.querySelector('.main-svg'))")


def _serve(reports: Path) -> str:
    from werkzeug.serving import make_server

    sys.path.insert(0, str(REPO))
    from dashboards.app import create_app

    server = make_server("127.0.0.1", 0, create_app(reports).server, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}"


def screenshot(reports: Path, page: str, out: Path, width: int = 1400, height: int = 1000,
               timeout_s: float = 60.0) -> Path:
    """Save ``page`` of the dashboard over ``reports`` to ``out``; the PNG's path."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    if not reports.is_dir():
        raise FileNotFoundError(f"--reports {reports}: no such directory")
    chromium = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    driver_path = CHROMEDRIVER if Path(CHROMEDRIVER).exists() else shutil.which("chromedriver")
    if not chromium or not driver_path:
        raise FileNotFoundError("chromium and chromedriver are needed (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--hide-scrollbars"):
        options.add_argument(arg)
    base = _serve(reports)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        driver.get(base + page)
        # the window's size includes the browser's own bars: grow it so the page gets width x height
        extra_w, extra_h = driver.execute_script(
            "return [window.outerWidth - window.innerWidth, window.outerHeight - window.innerHeight]")
        driver.set_window_size(width + extra_w, height + extra_h)
        WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(lambda d: d.execute_script(DRAWN))
        time.sleep(0.5)  # plotly's transitions settle
        problems = driver.execute_script(
            "return Array.from(document.querySelectorAll('#page .warning')).map(e => e.textContent)")
        if problems:
            raise RuntimeError(f"{page} drew with warnings: {problems}")
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".png", dir=out.parent)
        os.close(fd)
        try:
            if not driver.save_screenshot(tmp):
                raise RuntimeError(f"chromium could not save a screenshot of {page}")
            os.chmod(tmp, 0o644)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    finally:
        driver.quit()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reports", type=Path, default=Path("tests/dashboards/fixtures/gpu_reports"))
    parser.add_argument("--page", default="/run/gpt2/20261123T200744Z-0aa422/flops")
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1000)
    args = parser.parse_args(argv)
    print(screenshot(args.reports, args.page, args.out, args.width, args.height))
    return 0


if __name__ == "__main__":
    sys.exit(main())
