"""Where a benchmark's figures come from, and where its JSON line goes.

Every published line carries the commit it ran on (``-dirty``: with uncommitted changes),
the UTC date, the machine (its CPU model, CPUs, load average before and after the run, so
a ratio measured beside another job can be told from one measured alone) and, for benchmarks
on the demo, a fingerprint of the demo world: two clones give the same figures only on the
same world, and a world's warm start is its own run (its policy's weights are hashed, not
assumed). The warm start stops at a loss threshold, so another CPU's floating-point sums can
stop it at another step and build another policy from the same settings; the CPU model and
that step are recorded for this reason.

The line goes to ``docs/results/<benchmark>.json``; the README's headline table and
docs/results.md quote those files (``scripts/results_table.py`` writes the README's).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"


def commit() -> str:
    """``git describe --always --dirty`` of the checkout ("unknown" without git)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                              capture_output=True, text=True, check=True,
                              cwd=REPO).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` ("unknown" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def command() -> str:
    """How this benchmark was started, as one would type it in the checkout's root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(REPO)
    except ValueError:
        pass
    return " ".join(["python", shlex.quote(str(script)), *map(shlex.quote, sys.argv[1:])])


class Stamp:
    """Taken when a benchmark starts: the load the machine had before it."""

    def __init__(self):
        self.load_before = os.getloadavg()
        self.started = time.time()
        self.commit = commit()  # the code that runs, whatever the checkout holds at the end

    def fields(self) -> dict:
        """The command, commit, date and machine, the load before and after (1, 5, 15-minute
        averages)."""
        return {"command": command(),
                "commit": self.commit,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.started)),
                "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(),
                            "load_before": [round(x, 2) for x in self.load_before],
                            "load_after": [round(x, 2) for x in os.getloadavg()],
                            "wall_s": round(time.time() - self.started, 1)}}


def world(demo_dir: str | Path) -> dict | None:
    """The demo world a run used: its settings' and policy weights' SHA-256 (12 hex digits)
    and the warm start's final loss and last step (None where no demo is prepared there)."""
    root = Path(demo_dir)
    if not root.is_absolute():
        root = REPO / root
    manifest = root / "manifest.json"
    if not manifest.exists():
        return None
    m = json.loads(manifest.read_text())
    digest = hashlib.sha256()
    for f in sorted((root / "model").glob("*.safetensors")):
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    settings = json.dumps(m.get("settings"), sort_keys=True).encode()
    warm = m.get("warm_start", {})
    return {"dir": str(demo_dir),
            "settings_sha256": hashlib.sha256(settings).hexdigest()[:12],
            "policy_sha256": digest.hexdigest()[:12],
            "warm_start_loss": warm.get("final_loss"),
            "warm_start_steps": warm.get("steps")}


def publish(result: dict, stamp: Stamp, out: str | Path | None,
            demo_dir: str | Path | None = None) -> str:
    """``result`` with its provenance as one JSON line: printed, and written to ``out``
    (None: printed only). Returns the line."""
    result = {**result, **stamp.fields()}
    if demo_dir is not None:
        result["world"] = world(demo_dir)
    line = json.dumps(result)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(line + "\n")
    print(line)
    return line
