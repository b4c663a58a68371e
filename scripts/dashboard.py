"""The README's picture of the TensorBoard dashboard, taken from a finished run.

    python scripts/dashboard.py runs/demo/tensorboard/version_0

Starts TensorBoard on the run's folder (127.0.0.1, a free port), waits until it serves the
run's scalars, and photographs its Time Series page, filtered to the figures a TRACE run is
judged by (``--tags``), in headless Chromium driven by ChromeDriver over the WebDriver HTTP
protocol (Debian's packages: ``apt-get install chromium chromium-driver``; no Python
package beyond the standard library). The page draws its charts in a worker after the data
arrive, so the picture is taken after ``--wait`` seconds of real time. Writes ``docs/dashboard.png`` and ``docs/dashboard.json``: the run,
the commit, the date and the SHA-256 of ``callbacks/METRICS.md``, the list of what the
callbacks draw. When that list changes, a test says to take the picture again.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from provenance import commit  # noqa: E402  (the commit a benchmark's JSON names, likewise)

METRICS = REPO / "callbacks" / "METRICS.md"
# held-out accuracy, the step's reward and contrast, how the budget was spread, the
# predictor's calibration, the update's loss and the step's cost
TAGS = ("^(val/em|rollout/reward_mean|rollout/effective_ratio|alloc/leaves_per_prompt_gini"
        "|alloc/branched_prefixes|predictor/brier_skill|train/loss|perf/step_s)$")

TENSORBOARD_SETTINGS = {"scalarSmoothing": 0, "timeSeriesSettingsPaneOpened": False,
                        "stepSelectorEnabled": False, "ignoreOutliers": False}


def metrics_digest() -> str:
    """SHA-256 of ``callbacks/METRICS.md`` (every key the callbacks draw)."""
    return hashlib.sha256(METRICS.read_bytes()).hexdigest()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromedriver() -> str:
    path = shutil.which("chromedriver")
    if path is None or not any(shutil.which(n) for n in ("chromium", "chromium-browser")):
        raise SystemExit("scripts/dashboard.py needs headless Chromium and ChromeDriver: "
                         "`apt-get install chromium chromium-driver` (Debian), then run it again")
    return path


def webdriver(base: str, method: str, path: str, body: dict | None = None) -> dict:
    """One WebDriver command (W3C protocol, JSON over HTTP); its ``value``."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{base}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())["value"]


def wait_for(url: str, timeout_s: float, failure: str,
             ready: Callable[[bytes], bool] = lambda body: True) -> None:
    """Until ``url`` answers with a body ``ready`` accepts; else exit with ``failure``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if ready(r.read()):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{failure} (waited {timeout_s:.0f} s for {url})")


def photograph(url: str, out: Path, size: tuple[int, int], wait_s: float) -> None:
    """``url`` in headless Chromium, ``wait_s`` seconds after it loads, as a PNG."""
    port = free_port()
    driver = subprocess.Popen([chromedriver(), f"--port={port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(f"{base}/status", 30, "chromedriver did not start")
        options = {"args": ["--headless=new", "--no-sandbox", "--hide-scrollbars",
                            "--use-angle=swiftshader", "--enable-unsafe-swiftshader",
                            f"--window-size={size[0]},{size[1]}"]}
        session = webdriver(base, "POST", "/session", {"capabilities": {"alwaysMatch": {
            "browserName": "chrome", "goog:chromeOptions": options}}})["sessionId"]
        try:
            # TensorBoard's own settings, as its settings pane stores them: no smoothing (the
            # values as logged, outliers drawn), the pane closed, no step selector
            webdriver(base, "POST", f"/session/{session}/url", {"url": url})
            webdriver(base, "POST", f"/session/{session}/execute/sync", {
                "script": "localStorage.setItem('_tb_global_settings', arguments[0]);",
                "args": [json.dumps(TENSORBOARD_SETTINGS)]})
            webdriver(base, "POST", f"/session/{session}/refresh", {})
            time.sleep(wait_s)
            png = base64.b64decode(webdriver(base, "GET", f"/session/{session}/screenshot"))
        finally:
            webdriver(base, "DELETE", f"/session/{session}")
    finally:
        driver.terminate()
        driver.wait(timeout=30)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(png)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a run's folder: <save_dir>/<name>/version_<N>")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "dashboard.png")
    p.add_argument("--tags", default=TAGS, help="the Time Series tag filter (a regex)")
    p.add_argument("--size", default="1500,1300", help="window width,height in pixels")
    p.add_argument("--wait", type=float, default=10.0,
                   help="seconds between the page's load and the picture")
    args = p.parse_args(argv)
    if not any(args.run.glob("events.out.tfevents.*")):
        raise SystemExit(f"{args.run} holds no TensorBoard event files; pass a run's folder, "
                         f"e.g. runs/demo/tensorboard/version_0")
    chromedriver()  # installed, before TensorBoard starts
    code = commit()  # before the picture is written, which would make the tree dirty
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    board = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir",
                              str(args.run), "--host", "127.0.0.1", "--port", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # TensorBoard reads the event files lazily: wait until it lists the run's scalars
        wait_for(f"{base}/data/plugin/scalars/tags", 120,
                 f"TensorBoard served no scalars of {args.run}; is it a run's folder?",
                 ready=lambda body: bool(json.loads(body)))
        url = f"{base}/?tagFilter={urllib.parse.quote(args.tags)}#timeseries"
        width, height = (int(x) for x in args.size.split(","))
        photograph(url, args.out, (width, height), args.wait)
    finally:
        board.terminate()
        board.wait(timeout=30)
    meta = {"run": str(args.run), "commit": code,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "tags": args.tags, "metrics_md_sha256": metrics_digest()}
    args.out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB) from {args.run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
