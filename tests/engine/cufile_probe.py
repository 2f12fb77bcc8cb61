"""Whether cuFile can serve files in a directory here: the GPU tests that need the cufile
route skip with the reason where it cannot (no usable libcufile, or files it cannot register:
run them through ``scripts/gpu_test.sh``)."""

from __future__ import annotations

import os
from pathlib import Path


def cufile_unusable_reason(directory: str | os.PathLike[str]) -> str | None:
    """Why cuFile cannot serve a file in ``directory`` (None: it can), asked by registering a
    small probe file there."""
    from gdskit.engine.backends.base import OpenFile
    from gdskit.engine.backends.cufile import cufile_library, register

    lib = cufile_library()
    if not lib.available():
        return f"libcufile not usable: {lib.error}"
    probe = Path(directory) / "cufile-probe.bin"
    probe.write_bytes(b"x" * 4096)
    of = OpenFile(str(probe), os.open(probe, os.O_RDWR), os.O_RDWR)
    try:
        reg = register(of)
    finally:
        of.close()
    if reg.handle is None:
        return f"cuFile cannot register files here: {reg.reason} ({reg.detail}); run scripts/gpu_test.sh"
    return None
