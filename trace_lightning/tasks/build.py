"""What building a task's files shares: one builder at a time, the same files everywhere.

Two runs started on one output folder (or one per node on a shared disk) would both build
it; ``exclusive`` makes the others wait, after which they find it built (each task's
manifest says so). ``call_pinned`` runs the build in a process whose CPU kernels are pinned,
so the same settings build the same policy on any x86-64 CPU.
"""

from __future__ import annotations

import builtins
import fcntl
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trace_lightning.numpy_simd import NUMPY_AVX512, VARIABLE, numpy_avx512, x86_64

log = logging.getLogger(__name__)


@contextmanager
def exclusive(lock: Path, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock`` (created), waiting for another holder; where
    the filesystem has no ``flock`` (some network filesystems), go on without it. ``what``
    names the build in the messages ("the demo")."""
    with open(lock, "a") as f:
        locked = True
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building %s in %s: waiting for it", what, lock.parent)
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as e:
            log.warning("cannot lock %s (%s): building %s without a lock; do not start two "
                        "runs on one folder at once", lock, e, what)
            locked = False
        try:
            yield
        finally:
            if locked:
                fcntl.flock(f, fcntl.LOCK_UN)


# The CPU kernels a task's build runs. ATen's vectorised kernels, MKL's BLAS and oneDNN
# each pick a code path for the CPU they find (AVX2, AVX-512, ...), and each path adds
# floating-point numbers in its own order; numpy's paths also break ties in their own order
# (``numpy_simd``). A build trains a policy for hundreds of steps up to a loss threshold, so
# another order is another policy. Pinned to the AVX2 paths (every x86-64 CPU since 2013 has
# them) on one thread, one config builds the same files on CPUs of one vendor. MKL honours
# MKL_CBWR on Intel CPUs only and runs a path of its own on AMD ones, so the two vendors
# still build different policies (docs/results.md, "One world on every CPU"); the manifest
# records the vendor.
PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2",
                  "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                  VARIABLE: NUMPY_AVX512}


def pinned_env() -> dict[str, str]:
    """This process's environment with the kernels pinned (``PINNED_KERNELS``) on x86-64;
    elsewhere (an ARM CPU has neither these paths nor MKL) unchanged."""
    env = dict(os.environ)
    if x86_64():
        env.update(PINNED_KERNELS)
    return env


def cpu_vendor() -> str | None:
    """The CPU's vendor as Linux names it (``GenuineIntel``, ``AuthenticAMD``), else None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id":
                    return value.strip()
    except OSError:
        pass
    return None


def kernels() -> dict[str, Any]:
    """What this process's torch and numpy run on: torch's CPU kernels, threads and version,
    numpy's version and whether it runs AVX-512 paths (a build's manifest records them; the
    release matters too, as its sort paths break ties), and the CPU's vendor (MKL takes a
    path of its own on a CPU that is not Intel's, whatever ``MKL_CBWR`` asks)."""
    import numpy
    import torch

    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkl_cbwr": os.environ.get("MKL_CBWR"), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "numpy": numpy.__version__,
            "numpy_avx512": numpy_avx512(), "cpu_vendor": cpu_vendor()}


def call_pinned(fn: Callable[..., Any], /, **kwargs: Any) -> Any:
    """``fn(**kwargs)`` in a new Python process with pinned kernels (``pinned_env``).

    Environment variables choose the kernels once per process, when torch first uses them,
    hence the new process. ``fn`` is a module-level function; ``kwargs`` and its result
    are JSON (paths as strings). The child's log lines reach this process's stderr at the
    level the ``trace_lightning`` logger has here. An exception in the child is raised here
    again with its message (a built-in type as itself, others as RuntimeError); a child
    that dies (killed, out of memory) raises RuntimeError with its exit status.
    """
    target = f"{fn.__module__}:{fn.__qualname__}"
    level = logging.getLogger("trace_lightning").getEffectiveLevel()
    with tempfile.TemporaryDirectory(prefix="trace-build-") as tmp:
        call, out = Path(tmp) / "call.json", Path(tmp) / "result.json"
        call.write_text(json.dumps({"target": target, "kwargs": kwargs, "level": level,
                                    "result": str(out)}))
        proc = subprocess.run([sys.executable, "-m", __name__, str(call)], env=pinned_env())
        answer = json.loads(out.read_text()) if out.is_file() else None
    if answer is None:
        raise RuntimeError(f"the build process for {target} ended with exit status "
                           f"{proc.returncode} before it finished (killed, or out of memory?); "
                           f"nothing it built was installed: run again")
    if "error" in answer:
        kind = getattr(builtins, answer["error"]["type"], None)
        if not (isinstance(kind, type) and issubclass(kind, Exception)):
            kind = RuntimeError
        raise kind(answer["error"]["message"])
    return answer["result"]


def _child(call_file: str) -> int:
    """The child's side of ``call_pinned``: run the call, write its result or its error."""
    call = json.loads(Path(call_file).read_text())
    from trace_lightning.console import setup_console
    setup_console(call["level"])
    parent = os.getppid()

    def orphaned() -> None:  # the caller was killed: stop building for no one
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    module, name = call["target"].split(":")
    fn = getattr(importlib.import_module(module), name)
    try:
        answer = {"result": fn(**call["kwargs"])}
    except Exception as e:  # noqa: BLE001 - handed to the caller, which raises it again
        answer = {"error": {"type": type(e).__name__, "message": str(e)}}
    Path(call["result"]).write_text(json.dumps(answer))
    return 1 if "error" in answer else 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
