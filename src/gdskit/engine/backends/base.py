"""What every backend shares: the open-file state and the small backend interface."""

from __future__ import annotations

import errno
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from gdskit.engine.buffers import BufferView
from gdskit.errors import call_each, from_os_error
from gdskit.engine.residency import FileMapping
from gdskit.vocabulary import Reason

# Linux: O_DIRECT is 0o40000 on x86 and most others; os exposes it where it exists.
O_DIRECT = getattr(os, "O_DIRECT", 0)
RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)

T = TypeVar("T")


class Unknown:
    """The state of a :class:`Once` not worked out yet (``None`` can be a value)."""

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN = Unknown()


_ONCE_LOCKS = threading.Lock()  # makes each Once's own lock, once


class Once(Generic[T]):
    """A per-file fact worked out once, on first use, under its own lock: :data:`UNKNOWN`
    until then, whatever the value (``None`` included) after."""

    __slots__ = ("_lock", "_value")

    def __init__(self) -> None:
        self._value: T | Unknown = UNKNOWN
        self._lock: threading.Lock | None = None  # made by the first get(): most facts of a file are never asked


    @property
    def value(self) -> T | Unknown:
        """The value, or :data:`UNKNOWN` when it has not been worked out."""
        return self._value

    def get(self, make: Callable[[], T]) -> T:
        """The value; ``make()`` works it out the first time (one caller at a time)."""
        value = self._value
        if value is UNKNOWN:
            lock = self._lock
            if lock is None:
                with _ONCE_LOCKS:
                    lock = self._lock
                    if lock is None:
                        lock = self._lock = threading.Lock()
            with lock:
                value = self._value
                if value is UNKNOWN:
                    value = self._value = make()
        return value  # type: ignore[return-value]


@dataclass(frozen=True)
class FileRegistration:
    """A cuFile handle for one open file, or why there is none (``reason``, ``detail``)."""

    handle: int | None
    reason: Reason | None
    detail: str = ""


class OpenFile:
    """The file descriptors and the per-file state behind one :class:`gdskit.File`.

    ``fd`` is an ordinary buffered descriptor. ``direct_fd()`` opens a second,
    O_DIRECT descriptor on first use (``None`` where the filesystem refuses
    O_DIRECT, e.g. tmpfs). What the engine learns about the file lives in typed fields:

    ``direct_refused``
        O_DIRECT I/O failed with EINVAL (the filesystem or device wants another
        alignment): the CPU paths read and write this file buffered from then on.
    ``nowait_supported``
        Whether buffered ``RWF_NOWAIT`` reads work here (False once refused).
    ``compat_seen``
        cuFile's own counters showed its POSIX compat mode serving a request of this
        file that was routed direct: ``auto`` sends the file's later requests to the ring.
        Set by the cuFile backend, read by the router.
    ``registration``
        The file's cuFile handle (:class:`FileRegistration`), registered on first use.
    ``page_map``
        The mapping ``mincore`` asks the page cache through, made on first use.
    ``threshold``
        The measured direct-path cut-off of the file's mount (``None``: no profile).
    ``routing``
        Where the file's storage sits relative to each GPU and the routes decided for it
        (``gdskit.engine.gpu_routing``), made on first use.

    Every operation that uses a descriptor runs between :meth:`enter` and :meth:`leave`;
    :meth:`shut` refuses new ones and waits for those under way, so no descriptor is
    released while a thread still uses its number (which the next ``open`` may reuse).
    """

    def __init__(self, path: str, fd: int, flags: int) -> None:
        self.path = path
        self.fd = fd
        self._flags = flags
        self._direct_fd: int | None = None
        self._direct_tried = False
        self._lock = threading.Lock()
        self.direct_refused = False
        self.nowait_supported = bool(RWF_NOWAIT)
        self.compat_seen = False
        self.registration: Once[FileRegistration] = Once()
        self.page_map: Once[FileMapping] = Once()
        self.threshold: Once[int | None] = Once()
        self.routing: Once[Any] = Once()  # gdskit.engine.gpu_routing's per-file state (it imports this module)
        self._closers: list[Callable[[], None]] = []
        self._users = 0             # operations under way
        self._shut = False          # no new operation may start
        # Operations take the lock itself, not the condition: a Condition's ``with`` runs in
        # Python, and every read enters and leaves once.
        self._users_lock = threading.Lock()
        self._idle = threading.Condition(self._users_lock)

    def enter(self) -> bool:
        """Start an operation; False (and nothing started) once :meth:`shut` has begun."""
        with self._users_lock:
            if self._shut:
                return False
            self._users += 1
            return True

    def leave(self) -> None:
        """End an operation started by a successful :meth:`enter`."""
        with self._users_lock:
            self._users -= 1
            if self._users == 0 and self._shut:
                self._idle.notify_all()

    def shut(self) -> bool:
        """Refuse new operations and wait until none is under way; False if already shut."""
        with self._idle:
            if self._shut:
                return False
            self._shut = True
            while self._users:
                self._idle.wait()
            return True

    @property
    def direct_missing(self) -> bool:
        """Whether an O_DIRECT descriptor was asked for and could not be had (no open is made here)."""
        return self._direct_tried and self._direct_fd is None

    def direct_fd(self) -> int | None:
        if self._direct_tried:
            return self._direct_fd
        if not O_DIRECT:
            return None
        with self._lock:
            if not self._direct_tried:
                self._direct_tried = True
                flags = (self._flags & (os.O_RDONLY | os.O_WRONLY | os.O_RDWR)) | O_DIRECT
                try:
                    self._direct_fd = os.open(f"/proc/self/fd/{self.fd}", flags)
                except OSError:
                    try:
                        self._direct_fd = os.open(self.path, flags)
                    except OSError:
                        self._direct_fd = None
            return self._direct_fd

    def close(self) -> None:
        """Wait for the operations under way (:meth:`shut`), then release every descriptor."""
        self.shut()
        closers, self._closers = self._closers, []
        try:
            call_each(lambda close: close(), closers)
        finally:
            with self._lock:
                if self._direct_fd is not None:
                    os.close(self._direct_fd)
                    self._direct_fd = None
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when the file closes (before its descriptors go)."""
        with self._lock:
            self._closers.append(fn)


@dataclass(slots=True)
class Request:
    """One validated request handed to a backend."""

    op: str            # "read" or "write"
    buf: BufferView
    size: int
    file_offset: int
    buf_offset: int
    reason: Reason


class Backend(ABC):
    """Moves bytes for one request. Implementations record what they did in the ledger.

    Which backend serves which memory is the router's decision (:func:`gdskit.engine.read_route.route_read`):
    host memory goes to ``host``, device memory to ``bounce`` or ``cufile``.
    """

    name: str = "backend"

    @abstractmethod
    def read(self, f: OpenFile, req: Request) -> int:
        """Read up to ``req.size`` bytes; return how many (short only at end of file)."""

    @abstractmethod
    def write(self, f: OpenFile, req: Request) -> int:
        """Write exactly ``req.size`` bytes or raise."""

    @abstractmethod
    def read_many(self, f: OpenFile, reqs: Sequence[Request],
                  on_bytes: Callable[[int], None] | None = None) -> list[int]:
        """Several reads as one job, their chunks shared among the worker threads; the byte count
        of each. ``on_bytes`` is called with the count of each piece as it lands (from worker
        threads); an exception it raises stops the job from starting further pieces."""


def pwrite_all(fd: int, view: memoryview, offset: int, path: str | None = None) -> int:
    """``os.pwrite`` until everything is written; OS errors become gdskit errors."""
    done = 0
    total = len(view)
    while done < total:
        try:
            n = os.pwrite(fd, view[done:], offset + done)
        except InterruptedError:
            continue
        except OSError as exc:
            raise from_os_error(exc, path) from exc
        if n == 0:
            raise from_os_error(OSError(errno.EIO, "write returned 0 bytes"), path)
        done += n
    return done


def pread_full(fd: int, view: memoryview, offset: int, path: str | None = None, flags: int = 0,
               alignment: int = 1) -> int:
    """Read into ``view`` until it is full or end of file; return the count. The one ``preadv``
    loop of every chunk read.

    With ``flags=RWF_NOWAIT`` stop early (without error) at the first byte that is not in
    the page cache; a refusal of the flag itself (EOPNOTSUPP, EINVAL) is raised as it came.
    ``alignment``: an O_DIRECT descriptor's, where a count that is not a multiple of it means
    end of file (the next aligned read would be refused).
    """
    done = 0
    total = len(view)
    while done < total:
        try:
            n = os.preadv(fd, [view[done:]], offset + done, flags) if flags else os.preadv(fd, [view[done:]], offset + done)
        except InterruptedError:
            continue
        except BlockingIOError:
            break
        except OSError as exc:
            if flags and exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            raise from_os_error(exc, path) from exc
        done += n
        if n == 0 or n % alignment:
            break
    return done
