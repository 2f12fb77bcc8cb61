"""Is there a direct storage-to-GPU route on this machine at all? (cached, cheap after the first call)

The engine's ``auto`` mode asks this before it tries cuFile: without nvidia-fs
and without upstream PCI P2PDMA, cuFile can only run its POSIX compat mode,
which gdskit's own bounce path beats. ``gdskit check`` explains the same facts
at length.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from gdskit.vocabulary import Path, Reason


@dataclass(frozen=True)
class DirectRoute:
    """``route`` is the direct path available (``None``: none), ``reason`` why not."""

    route: Path | None
    reason: Reason | None
    nvidia_fs: bool
    p2pdma: bool
    udev: bool


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def nvidia_fs_loaded(root: str = "/") -> bool:
    if os.path.exists(os.path.join(root, "proc/driver/nvidia-fs")):
        return True
    return any(line.split(" ", 1)[0] == "nvidia_fs" for line in _read(os.path.join(root, "proc/modules")).splitlines())


def kernel_has_p2pdma(root: str = "/") -> bool:
    """Upstream PCI P2PDMA for GPU memory: the kernel exports ``p2pdma_pgmap_ops``."""
    path = os.path.join(root, "proc/kallsyms")
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return any(line.rstrip().endswith(" p2pdma_pgmap_ops") for line in fh)
    except OSError:
        return False


def udev_database_present(root: str = "/") -> bool:
    return os.path.isdir(os.path.join(root, "run/udev/data"))


@functools.lru_cache(maxsize=1)
def direct_route() -> DirectRoute:
    nvfs = nvidia_fs_loaded()
    p2p = kernel_has_p2pdma()
    udev = udev_database_present()
    if nvfs:
        return DirectRoute(Path.CUFILE_NVFS, None if udev else Reason.UDEV_MISSING, nvfs, p2p, udev)
    if p2p:
        return DirectRoute(Path.CUFILE_P2PDMA, None if udev else Reason.UDEV_MISSING, nvfs, p2p, udev)
    return DirectRoute(None, Reason.NVIDIA_FS_MISSING, nvfs, p2p, udev)
