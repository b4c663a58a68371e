"""``call_pinned``: a build runs in a process with pinned CPU kernels, and its errors come
back as one error here."""

from __future__ import annotations

import ast
import os
import platform
import statistics
import subprocess
import sys

import numpy
import pytest
import torch

from trace_lightning.tasks.build import PINNED_KERNELS, call_pinned, cpu_vendor, kernels

X86_AVX2 = (platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def _capability_under(env: dict[str, str]) -> str:
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not X86_AVX2, reason="needs an x86-64 CPU with AVX2")
def test_the_build_runs_avx2_kernels_on_one_thread_whatever_the_caller_set(monkeypatch):
    # What a CPU without AVX2 (or a caller's environment) would choose: the scalar kernels.
    # Unpinned, the variable decides; the build process runs AVX2 all the same.
    assert _capability_under({"ATEN_CPU_CAPABILITY": "default"}) == "DEFAULT"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("MKL_CBWR", raising=False)
    monkeypatch.setenv("NPY_DISABLE_CPU_FEATURES", "")  # numpy's own choice, AVX-512 included
    got = call_pinned(kernels)
    assert got == {"cpu_capability": "AVX2", "mkl_cbwr": PINNED_KERNELS["MKL_CBWR"],
                   "threads": 1, "torch": torch.__version__, "numpy": numpy.__version__,
                   "numpy_avx512": False, "cpu_vendor": _vendor()}


def _vendor() -> str | None:
    """The vendor_id line of /proc/cpuinfo, read here by hand."""
    try:
        lines = open("/proc/cpuinfo").read().splitlines()
    except OSError:
        return None
    found = [line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")]
    return found[0] if found else None


def test_the_cpu_vendor_is_what_linux_says():
    assert cpu_vendor() == _vendor()
    if platform.system() == "Linux" and platform.machine() == "x86_64":
        assert cpu_vendor() in ("GenuineIntel", "AuthenticAMD", "HygonGenuine")


def test_an_error_in_the_build_process_is_raised_here_with_its_message():
    # A built-in type comes back as itself...
    with pytest.raises(ValueError, match="malformed node or string"):
        call_pinned(ast.literal_eval, node_or_string="x")
    # ...any other as RuntimeError, with the same message.
    with pytest.raises(RuntimeError, match="mean requires at least one data point"):
        call_pinned(statistics.mean, data=[])
    assert call_pinned(statistics.mean, data=[1, 2, 6]) == 3
