"""Page-cache control shared by the benchmarks: make a run cold, or hot."""

from __future__ import annotations

import os


def drop_caches(paths: list[str]) -> str:
    """Evict the files' pages: the whole page cache where permitted (root), else fadvise per file.

    Returns which of the two was used.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return "drop_caches"
    except OSError:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def warm(paths: list[str]) -> None:
    """Read the files once so that their pages are in the page cache."""
    buf = bytearray(64 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
