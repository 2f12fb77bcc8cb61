"""Device nodes of a test's own, for the tests that write into a device and must never replace one."""

from __future__ import annotations

import os
import stat

import pytest


def private_device(path, major, minor):
    """A character device node of the test's own (``mknod``: root only), or the test is skipped."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    return path
