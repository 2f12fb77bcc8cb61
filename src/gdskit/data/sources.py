"""Which files a dataset or a preload means: a list of paths, a directory or a glob."""

from __future__ import annotations

import errno
import glob
import os
import stat
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Union

from gdskit.errors import GdskitFileNotFoundError, InvalidArgumentError, from_os_error

PathLike = Union[str, "os.PathLike[str]"]
#: What a dataset or ``preload`` takes: one path (a file, a directory, a glob) or a list of them.
Files = Union[PathLike, Iterable[PathLike]]


@dataclass(frozen=True)
class Source:
    """One file: ``key`` is its name as the caller gave it (relative to a directory given),
    ``path`` where to open it, ``size`` its size when it was found."""

    key: str
    path: str
    size: int


def resolve(files: Files) -> list[Source]:
    """The regular files ``files`` names, in a stable order.

    A path is taken as it is; a directory is walked (recursively, in sorted order, hidden
    names and symbolic links to directories left out) and its files keyed by their path
    relative to it; a pattern with ``*``, ``?`` or ``[`` that names no file itself is a glob
    (``**`` recursive), its matches sorted. A list is resolved item by item, in its order.

    Raises
    ------
    gdskit.errors.GdskitFileNotFoundError
        A path does not exist, or a glob or directory holds no file (named).
    gdskit.errors.InvalidArgumentError
        Nothing was given, or two items name the same key.
    """
    if isinstance(files, (str, os.PathLike)):
        items: list[PathLike] = [files]
    elif isinstance(files, (bytes, bytearray)):
        raise InvalidArgumentError("file names must be str or os.PathLike, not bytes")
    else:
        try:
            items = list(files)
        except TypeError:
            raise InvalidArgumentError(f"files must be a path, a directory, a glob or a list of paths; "
                                       f"got {type(files).__name__}") from None
    if not items:
        raise InvalidArgumentError("no files given")
    names = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            raise InvalidArgumentError(f"not a path: {item!r:.60}")
        names.append(os.fspath(item))
    out: list[Source] = []
    seen: set[str] = set()
    for name, st in zip(names, stat_all(names)):
        for src in _one(name, st):
            if src.key in seen:
                raise InvalidArgumentError(f"{src.key!r} is named twice")
            seen.add(src.key)
            out.append(src)
    return out


#: Paths stat'ed one after another before deciding how to stat the rest: where they took more
#: than STAT_COLD_NS each, their inodes came from the disk, and the rest are stat'ed on
#: STAT_THREADS threads, so that the disk has many inode reads at once (100,000 cold files took
#: 10 µs each one after another on the H200 machine, a sixth of a cold preload); from the inode
#: cache a stat takes a microsecond or two, and threads would only take turns at the interpreter.
STAT_PROBE = 64
STAT_COLD_NS = 5_000
STAT_THREADS = 16


def stat_all(paths: list[str]) -> list[os.stat_result | OSError]:
    """``os.stat`` of each path, in order: its result or the ``OSError`` it raised."""
    head = paths[:STAT_PROBE]
    t0 = time.perf_counter_ns()
    out = [_stat(p) for p in head]
    rest = paths[len(head):]
    if not rest:
        return out
    if (time.perf_counter_ns() - t0) > STAT_COLD_NS * len(head):
        with ThreadPoolExecutor(STAT_THREADS, thread_name_prefix="gdskit-stat") as pool:
            out.extend(pool.map(_stat, rest, chunksize=max(1, len(rest) // (4 * STAT_THREADS))))
    else:
        out.extend(_stat(p) for p in rest)
    return out


def _stat(path: str) -> os.stat_result | OSError:
    try:
        return os.stat(path)
    except OSError as exc:
        return exc


def _one(name: str, st: os.stat_result | OSError) -> list[Source]:
    if isinstance(st, FileNotFoundError):
        if glob.has_magic(name):
            return _glob(name)
        raise GdskitFileNotFoundError(errno.ENOENT, "No such file or directory", name) from None
    if isinstance(st, OSError):
        raise from_os_error(st, name) from st
    if stat.S_ISDIR(st.st_mode):
        return _walk(name)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgumentError(f"{name} is not a regular file")
    return [Source(name, name, st.st_size)]


def _glob(pattern: str) -> list[Source]:
    matches = sorted(glob.glob(pattern, recursive=True))
    found = [Source(m, m, st.st_size) for m, st in zip(matches, stat_all(matches))
             if not isinstance(st, OSError) and stat.S_ISREG(st.st_mode)]  # an error: gone since the listing
    if not found:
        raise GdskitFileNotFoundError(errno.ENOENT, "No file matches the pattern", pattern)
    return found


def _walk(top: str) -> list[Source]:
    paths = []
    errors: list[OSError] = []
    for root, dirs, names in os.walk(top, onerror=errors.append):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        paths.extend(os.path.join(root, n) for n in sorted(names) if not n.startswith("."))
    found = []
    for path, st in zip(paths, stat_all(paths)):
        if isinstance(st, OSError):
            raise from_os_error(st, path) from st
        if stat.S_ISREG(st.st_mode):
            key = os.path.relpath(path, top).replace(os.sep, "/")
            found.append(Source(key, path, st.st_size))
    if errors:
        raise from_os_error(errors[0], errors[0].filename)
    if not found:
        raise GdskitFileNotFoundError(errno.ENOENT, "No file in the directory", top)
    found.sort(key=lambda s: s.key)
    return found

