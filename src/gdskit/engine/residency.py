"""How much of a file range sits in the page cache, without causing any I/O.

The bounce and host paths read cached ranges through the page cache and the
rest with O_DIRECT. Asking must not itself start readahead (a buffered
``RWF_NOWAIT`` read does: it still triggers readahead, and then the O_DIRECT
read races a second, buffered read of the same bytes). So: ``cachestat(2)``
where the kernel has it (Linux 6.5+), else ``mincore(2)`` on a mapping of the
file; ``None`` when neither works.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import mmap
import os
import platform
import threading
from collections.abc import Callable

from gdskit.durable import open_file_fd
from gdskit.engine.plan import spread

_SYS_CACHESTAT = {"x86_64": 451, "aarch64": 451}.get(platform.machine())
_PAGE = mmap.PAGESIZE

# The C library calls gdskit makes through ctypes (also the pinned staging memory in gdskit.engine.cuda).
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MAP_FAILED = ctypes.c_void_p(-1).value

# The same C library, called without letting go of the interpreter lock: for cachestat(2) of a
# small range, which never waits for I/O and takes about a microsecond. Letting go of the lock
# costs more where other threads want it: the caller then queues behind them to get it back.
_libc_holding = ctypes.PyDLL(None, use_errno=True)
_libc_holding.syscall.restype = ctypes.c_long
_SMALL_RANGE = 1 << 20  # ranges up to this many bytes are asked holding the lock


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64), ("nr_writeback", ctypes.c_uint64),
                ("nr_evicted", ctypes.c_uint64), ("nr_recently_evicted", ctypes.c_uint64)]


class Residency(enum.Enum):
    ALL = "all"
    NONE = "none"
    SOME = "some"  # more than an eighth of the range's pages, not all
    FEW = "few"    # some pages, at most an eighth of them (a header read's readahead, say)


_cachestat_works: bool | None = None if _SYS_CACHESTAT else False


class _CachestatArgs(threading.local):
    """Each thread's argument structures for cachestat(2), made once (this runs for every read)."""

    def __init__(self) -> None:
        self.rng = _Range()
        self.cs = _Cachestat()
        self.rng_ref = ctypes.byref(self.rng)
        self.cs_ref = ctypes.byref(self.cs)


_args = _CachestatArgs()


def cachestat_answers() -> bool:
    """Whether cachestat(2) has answered here (then no mincore mapping is needed)."""
    return _cachestat_works is True


def _cachestat(fd: int, offset: int, length: int) -> tuple[int, int] | None:
    """(cached pages, pages) in the range, or None if the syscall is unavailable."""
    global _cachestat_works
    if _cachestat_works is False:
        return None
    a = _args
    rng, cs = a.rng, a.cs
    rng.off, rng.len = offset, length
    call = _libc_holding.syscall if length <= _SMALL_RANGE else libc.syscall
    rc = call(_SYS_CACHESTAT, fd, a.rng_ref, a.cs_ref, 0)
    if rc != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP):
            _cachestat_works = False
        return None
    _cachestat_works = True
    first = offset // _PAGE
    last = (offset + length + _PAGE - 1) // _PAGE
    return int(cs.nr_cache), last - first


class FileMapping:
    """A read-only mapping of a file for mincore(2); remapped when the file grows."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.addr: int | None = None
        self.length = 0

    def ensure(self, fd: int, end: int) -> int | None:
        with self._lock:
            if self.addr is not None and end <= self.length:
                return self.addr
            self.close_locked()
            size = os.fstat(fd).st_size
            if size == 0:
                return None
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, MAP_FAILED):
                return None
            self.addr, self.length = addr, size
            return addr

    def close_locked(self) -> None:
        if self.addr is not None:
            libc.munmap(self.addr, self.length)
            self.addr, self.length = None, 0

    def close(self) -> None:
        with self._lock:
            self.close_locked()


def _mincore(mapping: FileMapping, fd: int, offset: int, length: int) -> tuple[int, int] | None:
    addr = mapping.ensure(fd, offset + length)
    if addr is None:
        return None
    end = min(offset + length, mapping.length)
    first = offset - offset % _PAGE
    if end <= first:
        return 0, 0
    pages = (end - first + _PAGE - 1) // _PAGE
    vec = ctypes.create_string_buffer(pages)
    if libc.mincore(addr + first, end - first, vec) != 0:
        return None
    return sum(b & 1 for b in vec.raw), pages


def residency(fd: int, offset: int, length: int, mapping: FileMapping | None = None) -> Residency | None:
    """Whether ``[offset, offset + length)`` of the file is all, none or partly in the page cache."""
    if length <= 0:
        return Residency.ALL
    counts = _cachestat(fd, offset, length)
    if counts is None and mapping is not None:
        counts = _mincore(mapping, fd, offset, length)
    if counts is None:
        return None
    cached, pages = counts
    if cached >= pages:
        return Residency.ALL
    if cached == 0:
        return Residency.NONE
    return Residency.FEW if cached * 8 <= pages else Residency.SOME


def new_mapping() -> FileMapping:
    return FileMapping()


def path_residency(path: str, offset: int, length: int) -> Residency | None:
    """:func:`residency` of ``[offset, offset + length)`` of the file at ``path`` (cut at its end),
    opened for the question alone; None where the kernel cannot say or the file cannot be opened
    (the read that follows reports that)."""
    try:
        fd, st = open_file_fd(path, os.O_RDONLY)
    except OSError:
        return None
    mapping = new_mapping()
    try:
        return residency(fd, offset, max(0, min(length, st.st_size - offset)), mapping)
    finally:
        mapping.close()
        os.close(fd)


#: Files, spread evenly over a job, whose page-cache residency says whether the job is cached:
#: a job judged cached is read by fewer workers, so a partly cached one must not pass for it
#: (with half the files cached at random, sixteen all are one time in 65,536).
CACHED_SAMPLES = 16


def job_cached(n: int, range_of: Callable[[int], tuple[str, int, int] | None]) -> bool:
    """Whether the page cache holds a job of ``n`` files, judged by :data:`CACHED_SAMPLES` of them
    spread over it (asking about each would cost an open and a system call a file).
    ``range_of(i)`` is file ``i``'s ``(path, offset, length)``, or None where it reads nothing. A
    file the kernel cannot say about, or that cannot be opened, counts as not cached."""
    for i in spread(n, CACHED_SAMPLES):
        rng = range_of(i)
        if rng is not None and path_residency(*rng) is not Residency.ALL:
            return False
    return True
