"""numpy held to its AVX2 paths: a process that imports trace_lightning first runs no AVX-512
path of numpy's (whose ties break in another order, so BM25's top-k differed by CPU), and one
that loaded numpy before is told."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from trace_lightning import numpy_simd

PROBE = ("import os, trace_lightning; from trace_lightning.numpy_simd import numpy_avx512; "
         "print(numpy_avx512(), os.environ.get('NPY_DISABLE_CPU_FEATURES'))")


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != numpy_simd.VARIABLE}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True)


@pytest.mark.skipif(not numpy_simd.x86_64(), reason="numpy's AVX paths are x86-64's")
def test_a_process_importing_trace_lightning_first_runs_no_avx512_path_of_numpys():
    # On an AVX-512 CPU numpy would run those paths unpinned; with the package first it does
    # not, here and in the processes it starts (the variable is set for them).
    out = _run(PROBE)
    assert out.stdout.split(maxsplit=1) == ["False", numpy_simd.NUMPY_AVX512 + "\n"]
    assert "numpy was loaded before" not in out.stderr


def test_a_variable_the_caller_set_is_kept(monkeypatch):
    monkeypatch.setattr(numpy_simd, "x86_64", lambda: True)  # on any CPU, the x86-64 branch
    monkeypatch.setenv(numpy_simd.VARIABLE, "AVX512_SKX")
    numpy_simd.pin_numpy_simd()
    assert os.environ[numpy_simd.VARIABLE] == "AVX512_SKX"


def test_numpy_loaded_before_with_avx512_paths_on_is_warned_with_the_fix(monkeypatch):
    import numpy  # noqa: F401 - loaded (as torch loads it in a program that imports it first)

    monkeypatch.setattr(numpy_simd, "x86_64", lambda: True)
    monkeypatch.setattr(numpy_simd, "numpy_avx512", lambda: True)
    with pytest.warns(UserWarning, match="import trace_lightning before torch and numpy, or "
                                         "start Python with NPY_DISABLE_CPU_FEATURES="):
        numpy_simd.pin_numpy_simd()
    # Not loaded with them on (an AVX2 CPU, or the package first): nothing to say.
    monkeypatch.setattr(numpy_simd, "numpy_avx512", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        numpy_simd.pin_numpy_simd()
