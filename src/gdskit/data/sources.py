"""Which files a dataset or a preload means: a list of paths, a directory or a glob."""

from __future__ import annotations

import errno
import glob
import operator
import os
import stat
from collections.abc import Iterable
from stat import S_ISREG
from typing import NamedTuple, Union

from gdskit.engine import is_object_url, list_objects, open_file
from gdskit.errors import GdskitFileNotFoundError, InvalidArgumentError, from_os_error

PathLike = Union[str, "os.PathLike[str]"]
#: What a dataset or ``preload`` takes: one path (a file, a directory, a glob) or a list of them.
Files = Union[PathLike, Iterable[PathLike]]


class Source(NamedTuple):
    """One file: ``key`` is its name as the caller gave it (relative to a directory given),
    ``path`` where to open it, ``size`` its size when it was found. A named tuple: a list of
    100,000 files makes 100,000 of them, at a third of a frozen dataclass's cost."""

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
    out: list[Source] = []
    seen: set[str] = set()
    for item in items:
        # A list of 100,000 file names is the common case: each is one stat and one Source
        # here, the rest (directories, globs, errors) goes the long way (_one).
        name = item if type(item) is str else _name_of(item)
        try:
            st: os.stat_result | None = os.stat(name)
        except OSError:
            st = None
        if st is not None and S_ISREG(st.st_mode):
            if name in seen:
                raise InvalidArgumentError(f"{name!r} is named twice")
            seen.add(name)
            out.append(Source(name, name, st.st_size))
            continue
        for src in _one(name, st):
            if src.key in seen:
                raise InvalidArgumentError(f"{src.key!r} is named twice")
            seen.add(src.key)
            out.append(src)
    return out


def _name_of(item: object) -> str:
    if not isinstance(item, (str, os.PathLike)):
        raise InvalidArgumentError(f"not a path: {item!r:.60}")
    name = os.fspath(item)
    if not isinstance(name, str):
        raise InvalidArgumentError("file names must be str or os.PathLike, not bytes")
    return name


def _one(name: str, st: os.stat_result | None = None) -> list[Source]:
    """What one item names; ``st`` is its ``stat`` where the caller has made it."""
    if is_object_url(name):
        return _objects(name)
    try:
        if st is None:
            st = os.stat(name)
    except FileNotFoundError:
        if glob.has_magic(name):
            return _glob(name)
        raise GdskitFileNotFoundError(errno.ENOENT, "No such file or directory", name) from None
    except OSError as exc:
        raise from_os_error(exc, name) from exc
    if stat.S_ISDIR(st.st_mode):
        return _walk(name)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgumentError(f"{name} is not a regular file")
    return [Source(name, name, st.st_size)]


def _objects(url: str) -> list[Source]:
    """An object (``s3://bucket/key``), or every object under a prefix (a URL ending in ``/``),
    keyed as a directory's files are: by their key below the prefix."""
    if not url.endswith("/"):
        with open_file(url) as obj:
            return [Source(url, url, obj.size)]
    found = [Source(u[len(url):], u, size) for u, size in list_objects(url)
             if not u.endswith("/")]  # "directory" markers some tools write hold no data
    if not found:
        raise GdskitFileNotFoundError(errno.ENOENT, "No object under this prefix", url)
    return found


def _glob(pattern: str) -> list[Source]:
    found = []
    for match in sorted(glob.glob(pattern, recursive=True)):
        try:
            st = os.stat(match)
        except OSError:
            continue  # gone since the listing
        if stat.S_ISREG(st.st_mode):
            found.append(Source(match, match, st.st_size))
    if not found:
        raise GdskitFileNotFoundError(errno.ENOENT, "No file matches the pattern", pattern)
    return found


def _walk(top: str) -> list[Source]:
    """The directory's regular files, as ``os.walk`` (top down, links to directories not
    followed) would list them, keyed by their path below ``top``. Keys are built as the walk
    goes down rather than by ``os.path.relpath``, which took most of the time of listing
    100,000 files (benchmarks/RESULTS.md, "Listing a directory of many files")."""
    found: list[Source] = []
    errors: list[OSError] = []
    todo = [(top, "")]  # (directory, its key prefix), taken depth first in sorted order
    while todo:
        directory, prefix = todo.pop()
        try:
            with os.scandir(directory) as it:
                entries = sorted(it, key=_name)
        except OSError as exc:
            errors.append(exc)
            continue
        below = []
        for e in entries:
            name = e.name
            if name.startswith("."):
                continue
            try:
                is_dir = e.is_dir()  # a link to a directory counts as one (and is not walked)
            except OSError:
                is_dir = False
            if is_dir:
                if not e.is_symlink():
                    below.append((e.path, f"{prefix}{name}/"))
                continue
            try:
                st = e.stat()
            except OSError as exc:
                raise from_os_error(exc, e.path) from exc
            if stat.S_ISREG(st.st_mode):
                found.append(Source(prefix + name, e.path, st.st_size))
        todo.extend(reversed(below))
    if errors:
        raise from_os_error(errors[0], errors[0].filename)
    if not found:
        raise GdskitFileNotFoundError(errno.ENOENT, "No file in the directory", top)
    found.sort(key=_key)
    return found


_name = operator.attrgetter("name")
_key = operator.attrgetter("key")

