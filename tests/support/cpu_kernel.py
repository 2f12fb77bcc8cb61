"""The GPU hash kernel's CUDA C source built for the CPU with a harness of a test's own (the
source is plain C++ apart from its CUDA qualifiers, which the harness defines away)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest


def build_with_harness(where: Path, harness: str) -> ctypes.CDLL:
    """``harness`` (which includes ``kernel.cu``) and the kernel's source, compiled into a shared
    library in ``where`` and loaded; the test is skipped where no C++ compiler is installed."""
    from gdskit.engine.gpu_hash_kernel import SOURCE

    compiler = shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler to run the kernel's source on the CPU")
    (where / "kernel.cu").write_text(SOURCE)
    (where / "harness.cpp").write_text(harness)
    lib = where / "libkernel.so"
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-Wno-unknown-pragmas", "-o", str(lib),
                    str(where / "harness.cpp")], check=True, cwd=where)
    return ctypes.CDLL(str(lib))
