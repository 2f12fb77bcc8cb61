"""What a test compares before and after a call to see that nothing leaked."""

from __future__ import annotations

import os


def fd_count() -> int:
    """File descriptors this process has open."""
    return len(os.listdir("/proc/self/fd"))


def file_fd_count() -> int:
    """File descriptors this process has open on files (not io_uring rings, which a thread keeps
    for its next batch, nor sockets, pipes and the like)."""
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/"):
                n += 1
        except OSError:
            pass  # the directory's own descriptor, closed by now
    return n
