"""Small pieces of crash-safe file handling shared by the engine and the checkpoint writers."""

from __future__ import annotations

import errno
import os


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename or a new name in ``directory`` durable.

    Filesystems that cannot fsync a directory (they answer EINVAL) are skipped; any
    other failure is raised, because the caller's data would not be durable.
    """
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def remove_if_present(path: str | os.PathLike[str]) -> bool:
    """Delete ``path``; False when it was not there."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
