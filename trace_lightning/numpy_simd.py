"""numpy's SIMD paths, held to the AVX2 ones on x86-64 so that every CPU gets the same results.

numpy chooses its sort, partition and arithmetic loops by CPU when it loads (AVX-512 where
the CPU has it, AVX2 where it does not), and the paths break ties in their own order:
``np.argpartition`` over BM25 scores with equal values (namesakes' documents) returns another
document on an AVX-512 CPU than on an AVX2 one. An agent that reads other observations
follows another trajectory, so a demo world built or an RL run trained on an AVX-512 CPU
differed from the same command on an AVX2 one (the demo's warm start stopped at step 684
instead of 916). Turning numpy's AVX-512 paths off before numpy loads gives every x86-64 CPU
the AVX2 paths, and the same figures. The package does it on import (``trace_lightning/
__init__.py``), which is first in ``trace-lightning`` and in the processes it starts; a
program that loaded numpy before (``import torch`` does) keeps the CPU's own paths and is
warned. Only the standard library is imported here: this runs before numpy loads.
"""

from __future__ import annotations

import os
import platform
import sys
import warnings

# numpy's AVX-512 dispatch targets (numpy 1.26 to 2.3); a name the CPU lacks is ignored.
NUMPY_AVX512 = ("AVX512F AVX512CD AVX512_KNL AVX512_KNM AVX512_SKX AVX512_CLX AVX512_CNL "
                "AVX512_ICL AVX512_SPR")
VARIABLE = "NPY_DISABLE_CPU_FEATURES"


def x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def numpy_avx512() -> bool:
    """Whether the loaded numpy runs any AVX-512 path (it loads numpy)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:  # numpy 1.x
        from numpy.core._multiarray_umath import __cpu_features__ as features
    return any(features.get(name, False) for name in NUMPY_AVX512.split())


def pin_numpy_simd() -> None:
    """Turn numpy's AVX-512 paths off for this process and those it starts (x86-64 only).

    A ``NPY_DISABLE_CPU_FEATURES`` the caller set is kept as it is. If numpy is already
    loaded with an AVX-512 path on, it is too late here: a warning says what to do.
    """
    if not x86_64():
        return
    os.environ.setdefault(VARIABLE, NUMPY_AVX512)
    if "numpy" in sys.modules and numpy_avx512():
        warnings.warn(
            "numpy was loaded before trace_lightning and runs its AVX-512 paths, which break "
            "ties (BM25's top-k) in another order than on other CPUs, so results will differ "
            "from the same run elsewhere; import trace_lightning before torch and numpy, or "
            f"start Python with {VARIABLE}=\"{NUMPY_AVX512}\"", stacklevel=2)
