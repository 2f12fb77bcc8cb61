"""Small pieces of crash-safe file handling shared by the engine and the checkpoint writers."""

from __future__ import annotations

import errno
import os
import uuid

#: Files being written carry this ending (and a leading dot) until they are complete.
TEMP_SUFFIX = ".gdskit-tmp"


def temp_name(name: str, token: str | None = None) -> str:
    """The hidden name a file called ``name`` has while it is being written (``token``
    tells writers apart; a random one by default)."""
    return f".{name}.{token or uuid.uuid4().hex[:12]}{TEMP_SUFFIX}"


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is one of :func:`temp_name`'s (left behind by a writer that died)."""
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


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
