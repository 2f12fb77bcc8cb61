"""``gdskit.open`` and :class:`File`: the public face of the engine."""

from __future__ import annotations

import os
import sys
import operator
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import gdskit.engine.cuda as cuda
from gdskit.engine.backends.base import Backend, OpenFile, Request
from gdskit.engine.buffers import BufferView, adapt
from gdskit.durable import (create_locked_temp, fsync_dir, open_file_fd, remove_if_present, remove_stale_temps,
                            replacement_target)
from gdskit.errors import (
    BufferTooSmallError,
    ClosedFileError,
    InvalidArgumentError,
    NothingToVerifyError,
    ReadOnlyBufferError,
    TruncatedFileError,
    UnsupportedOperationError,
    UnverifiableRangeError,
    from_os_error,
)
from gdskit.engine.plan import nonnegative_int
from gdskit.engine.pool import request_executor
from gdskit.engine.via_gpu import read_routed
from gdskit.engine.gpu_routing import RouteDecision
from gdskit.engine.objects.url import is_object_url
from gdskit.engine.read_route import BackendKind, host_reason, route_read
from gdskit.engine.residency import Residency
from gdskit.settings import settings
from gdskit.vocabulary import Reason

_MODES = {
    "r": os.O_RDONLY,
    "w": os.O_RDWR | os.O_CREAT | os.O_TRUNC,
    "r+": os.O_RDWR,
    "a": os.O_RDWR | os.O_CREAT,
}

def _host() -> type[Backend]:
    from gdskit.engine.backends.host import HostBackend  # noqa: PLC0415 - import time

    return HostBackend


def _bounce() -> type[Backend]:
    from gdskit.engine.backends.bounce import BounceBackend  # noqa: PLC0415 - import time

    return BounceBackend


def _cufile() -> type[Backend]:
    from gdskit.engine.backends.cufile import CufileBackend  # noqa: PLC0415 - import time

    return CufileBackend


#: Each backend's class by the name routes use, imported on first use (a process that never
#: reads into GPU memory never imports the GPU backends).
BACKEND_CLASSES: dict[BackendKind, Callable[[], type[Backend]]] = {
    BackendKind.HOST: _host, BackendKind.BOUNCE: _bounce, BackendKind.CUFILE: _cufile}

_backends: dict[BackendKind, Backend] = {}
_backends_lock = threading.Lock()


def backend(name: BackendKind) -> Backend:
    """The process-wide instance of a backend."""
    found = _backends.get(name)
    if found is not None:
        return found
    if name not in BACKEND_CLASSES:
        raise InvalidArgumentError(f"unknown backend {name!r}")
    with _backends_lock:
        if name not in _backends:
            _backends[name] = BACKEND_CLASSES[name]()()
        return _backends[name]


def _check_ints(name: str, values: Iterable[int]) -> list[int]:
    """Non-negative integers as a list (numpy integer arrays welcome), checked in one pass."""
    items = values.tolist() if hasattr(values, "tolist") else list(values)  # numpy: plain ints at C speed
    kinds = set(map(type, items))  # at C speed: this runs for every batch of small reads
    if bool in kinds:
        raise InvalidArgumentError(f"{name} must be integers, not booleans")
    if kinds <= {int}:
        out = items
    else:
        try:
            out = list(map(operator.index, items))
        except TypeError:
            raise InvalidArgumentError(f"{name} must be integers") from None
    if out and min(out) < 0:
        raise InvalidArgumentError(f"{name} must be >= 0, got {min(out)}")
    return out


#: The files whose ``on_bytes`` callback this thread is running (a close from there would
#: wait for the read that calls it).
_in_callback = threading.local()


class File:
    """A file opened for reads and writes to and from GPU or host memory.

    Use :func:`gdskit.open` to make one. All methods are thread-safe; many
    threads may read and write one ``File`` at once. :meth:`close` (or
    :meth:`abort`) from one thread waits for the calls other threads have under
    way; calls that start after it raise :class:`~gdskit.errors.ClosedFileError`.
    """

    def __init__(self, path: str | os.PathLike[str], mode: str = "r", *, atomic: bool = False) -> None:
        self._closed = False
        self._released = threading.Event()   # set once close/abort has released everything
        if mode not in _MODES:
            raise InvalidArgumentError(f"mode must be one of {', '.join(_MODES)}; got {mode!r}")
        if atomic and mode != "w":
            raise InvalidArgumentError("atomic=True needs mode 'w' (a whole new file)")
        self.path = os.fspath(path)
        self.mode = mode
        self.atomic = atomic
        self._lock = threading.Lock()
        self._pending: set[Future[Any]] = set()
        self._failed_write: BaseException | None = None  # atomic files: never published after one
        self._target = self.path
        open_path = self.path
        if atomic:
            # Links followed, a directory or device refused: the rename at close replaces a file only.
            self._target = replacement_target(self.path)
            d, name = os.path.split(self._target)
        flags = _MODES[mode] | getattr(os, "O_CLOEXEC", 0)
        try:
            if atomic:
                # The temporary stays locked while it is written, so that another writer's sweep
                # (this one's, below) removes only what writers that died left behind.
                remove_stale_temps(d, name)
                owned = create_locked_temp(d, name)
                open_path, fd = owned.path, owned.fd
                st = os.fstat(fd)
            else:  # never waits on a FIFO; refuses directories and other non-files
                fd, st = open_file_fd(open_path, flags)
        except OSError as exc:
            raise from_os_error(exc, self.path) from exc
        self._open_path = open_path
        self._of = OpenFile(open_path, fd, flags)
        self._append_pos = st.st_size if mode == "a" else 0

    # -- context manager --------------------------------------------------
    def __enter__(self) -> File:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and self.atomic:
            self.abort()
        else:
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<gdskit.File {self.path!r} mode={self.mode!r} {state}>"

    # -- properties -------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True from the moment :meth:`close` or :meth:`abort` starts."""
        return self._closed

    @property
    def size(self) -> int:
        """The file's current size in bytes."""
        self._enter()
        try:
            return self._size()
        finally:
            self._of.leave()

    def fileno(self) -> int:
        """The file's (buffered) descriptor. It stays valid until :meth:`close`, which does not
        wait for uses of the number made outside gdskit: finish those before closing."""
        self._enter()
        try:
            return self._of.fd
        finally:
            self._of.leave()

    # -- I/O --------------------------------------------------------------
    def read(self, buf: Any, size: int | None = None, file_offset: int = 0, buf_offset: int = 0, *,
             verify: Any = False) -> int:
        """Read ``size`` bytes at ``file_offset`` into ``buf`` at ``buf_offset``; blocking.

        Returns the number of bytes read, which is short only at end of file.
        ``size=None`` fills the buffer from ``buf_offset`` to its end.

        ``verify`` (True, or a manifest's path) checks the bytes where they landed against the
        chunk digests of the file's manifest (``gdskit digest``; docs/verify.md): the range must
        start on a chunk boundary and end on one or at the end of the file, else
        :class:`~gdskit.errors.UnverifiableRangeError` before anything is read. A chunk that
        differs raises :class:`~gdskit.errors.ChecksumMismatchError` naming its byte range.
        """
        self._enter()
        try:
            args = self._validate("read", buf, size, file_offset, buf_offset)
            check = _chunk_check(self, verify, *args) if verify is not False and verify is not None else None
            n = self._execute("read", *args)
            if check is not None:
                check(n)
            return n
        finally:
            self._of.leave()

    def write(self, buf: Any, size: int | None = None, file_offset: int | None = None, buf_offset: int = 0) -> int:
        """Write ``size`` bytes from ``buf`` at ``buf_offset`` to the file at ``file_offset``; blocking.

        ``file_offset=None`` means 0, or the end of the file in mode ``"a"``.
        Returns ``size``: a write either completes or raises.
        """
        self._enter()
        try:
            return self._execute("write", *self._validate("write", buf, size, file_offset, buf_offset))
        finally:
            self._of.leave()

    def read_batch(self, buf: Any, file_offsets: Iterable[int], size: int, buf_offsets: Iterable[int] | None = None,
                   *, latencies_ns: list[int] | None = None) -> list[int]:
        """Many reads of ``size`` bytes in one call, one after another: ``file_offsets[i]`` into
        ``buf`` at ``buf_offsets[i]`` (default ``i * size``); blocking.

        For many small reads (random access to records, samples, embeddings): the
        buffer and the arguments are checked once, and into host memory each read that
        can be one system call is made in a tight loop, so a 4 KiB read costs little more
        than the system call. Into device memory, reads cuFile serves whose destinations do
        not overlap go to the engine as one job where ``settings.cufile_batch`` picks cuFile's
        batch API for them (docs/engine.md, "Batched submission"). Returns each read's byte
        count (short only at end of file). ``latencies_ns``, when given, receives each read's
        duration in nanoseconds (the reads then run one after another).
        """
        self._enter()
        try:
            return self._read_batch(buf, file_offsets, size, buf_offsets, latencies_ns)
        finally:
            self._of.leave()

    def _read_batch(self, buf: Any, file_offsets: Iterable[int], size: int, buf_offsets: Iterable[int] | None,
                    latencies_ns: list[int] | None) -> list[int]:
        if self.mode in ("w", "a"):
            raise UnsupportedOperationError(9, f"file opened with mode {self.mode!r} is not readable", self.path)
        view = adapt(buf)
        if view.readonly:
            raise ReadOnlyBufferError("cannot read into a read-only buffer")
        size = nonnegative_int("size", size)
        offsets = _check_ints("file_offsets", file_offsets)
        if buf_offsets is None:
            places = list(range(0, len(offsets) * size, size)) if size else [0] * len(offsets)
        else:
            places = _check_ints("buf_offsets", buf_offsets)
            if len(places) != len(offsets):
                raise InvalidArgumentError(f"{len(offsets)} file offsets but {len(places)} buffer offsets")
        if places and max(places) + size > view.nbytes:
            raise BufferTooSmallError(f"buffer of {view.nbytes} bytes cannot hold {size} bytes at offset {max(places)}")
        if size == 0 or not offsets:
            return [0] * len(offsets)
        if not view.on_device:
            return backend(BackendKind.HOST).read_batch(self._of, view, offsets, places, size, host_reason(), latencies_ns)
        if latencies_ns is None and self._batch_job(view, size, offsets, places):
            return self._execute_many([(view, size, off, bo) for off, bo in zip(offsets, places)])
        bounce_reason = self._batch_bounce_reason(view, size, offsets[0], places[0])
        if bounce_reason is not None:
            _wait_for_producer(view)
            return backend(BackendKind.BOUNCE).read_batch(self._of, view, offsets, places, size, bounce_reason, latencies_ns)
        counts = []
        synced: set[Any] = set()  # one wait for the producer's stream, not one per read
        for off, bo in zip(offsets, places):
            t0 = time.perf_counter_ns()
            counts.append(self._execute_many([(view, size, off, bo)], synced)[0])
            if latencies_ns is not None:
                latencies_ns.append(time.perf_counter_ns() - t0)
        return counts

    def _batch_job(self, view: BufferView, size: int, offsets: list[int], places: list[int]) -> bool:
        """Whether a batch of device reads runs as one job, so that cuFile's batch API can take
        it (gdskit.engine.backends.cufile_batch decides; the first read's route says cuFile serves)."""
        from gdskit.engine.backends.cufile_batch import read_batch_as_one_job  # noqa: PLC0415 - import time

        cfg = settings.snapshot()
        if not read_batch_as_one_job(cfg.cufile_batch, size, places):
            return False
        return route_read(self._of, view, size, offsets[0], places[0], cfg, other_gpu=False).uses_cufile

    def _batch_bounce_reason(self, view: BufferView, size: int, file_offset: int, buf_offset: int) -> Reason | None:
        """The reason every read of a batch into device memory takes the bounce ring, where the
        route of its first read says so for all of them (every reason but ``unaligned`` is the
        same for reads of one size into one buffer); else None (each read is routed alone)."""
        reason = route_read(self._of, view, size, file_offset, buf_offset, settings.snapshot()).bounce_reason
        return None if reason is Reason.UNALIGNED else reason

    def read_many(self, reads: Iterable[tuple[Any, ...]], *,
                  on_bytes: Callable[[int], None] | None = None) -> list[int]:
        """Many reads as one job, blocking; each item is ``(buf, size, file_offset)`` or
        ``(buf, size, file_offset, buf_offset)``. Returns each read's byte count (short only
        at end of file).

        For loading the many tensors of a checkpoint: the pieces of all items share the
        worker threads on every path, and reads into device memory that take the CPU path
        also share their pinned staging buffers; the same reads made one by one pay a
        hand-over of those buffers per read (docs/engine.md has the figures). Every item is
        checked before anything is read.

        ``on_bytes``, if given, is called with the byte count of each piece as it is read
        (from the I/O threads: keep it quick), for progress reporting. An exception it raises
        abandons the job: no further piece starts, those under way finish, and the exception
        is raised here. It must not close this file (that close would wait for this read):
        such a close raises :class:`~gdskit.errors.InvalidArgumentError`.
        """
        self._enter()
        try:
            return self._execute_many(self._validate_many(reads), None, self._own_callback(on_bytes))
        finally:
            self._of.leave()

    def pread_many(self, reads: Iterable[tuple[Any, ...]], *,
                   on_bytes: Callable[[int], None] | None = None) -> Future[list[int]]:
        """Like :meth:`read_many`, in the background: returns a ``Future`` of the byte counts."""
        self._enter()
        try:
            fut = request_executor(settings.threads).submit(self._execute_many, self._validate_many(reads), None,
                                                            self._own_callback(on_bytes))
        except BaseException:
            self._of.leave()
            raise
        return self._track(fut)

    def pread(self, buf: Any, size: int | None = None, file_offset: int = 0, buf_offset: int = 0, *,
              stream: Any = None) -> Future[int]:
        """Like :meth:`read`, in the background: returns a ``Future`` of the byte count.

        ``stream``: a CUDA stream (torch, CuPy, ``__cuda_stream__``, or a raw handle). The read
        is then queued on it, after the work already queued there, and work queued on it
        afterwards sees the bytes; the call never waits for the stream, and every error,
        argument errors included, arrives on the future (docs/engine.md, "Stream-ordered I/O").
        """
        if stream is not None:
            return self._submit_on_stream("read", buf, size, file_offset, buf_offset, stream)
        return self._submit("read", buf, size, file_offset, buf_offset)

    def pwrite(self, buf: Any, size: int | None = None, file_offset: int | None = None,
               buf_offset: int = 0, *, stream: Any = None) -> Future[int]:
        """Like :meth:`write`, in the background: returns a ``Future`` of the byte count.

        ``stream``: as for :meth:`pread`: the write takes the bytes the work queued before it
        on the stream left, without a host-side wait.
        """
        if stream is not None:
            return self._submit_on_stream("write", buf, size, file_offset, buf_offset, stream)
        return self._submit("write", buf, size, file_offset, buf_offset)

    def cached(self, file_offset: int = 0, size: int | None = None) -> bool:
        """Whether the page cache holds every byte of ``[file_offset, file_offset + size)``
        (default: to the end of the file), asked without causing any I/O. Bytes past the end
        of the file are not held; False also where the kernel cannot say (neither
        ``cachestat`` nor ``mincore`` works)."""
        self._enter()
        try:
            file_offset = nonnegative_int("file_offset", file_offset)
            size = self._size() - file_offset if size is None else nonnegative_int("size", size)
            from gdskit.engine.backends.staged import file_residency  # noqa: PLC0415 - test seam

            return file_residency(self._of, file_offset, max(size, 0)) is Residency.ALL
        finally:
            self._of.leave()

    def fsync(self) -> None:
        """Make written data durable."""
        self._enter()
        try:
            os.fsync(self._of.fd)
        except OSError as exc:
            raise from_os_error(exc, self.path) from exc
        finally:
            self._of.leave()

    # -- lifecycle --------------------------------------------------------
    def close(self) -> None:
        """Wait for the calls under way (background ones included), release everything; for
        ``atomic`` files publish the data, unless a write failed: then the temporary file is
        removed and that error raised. A second ``close`` waits for the first to finish."""
        pending = self._start_closing()
        if pending is None:
            return
        try:
            _wait_on_streams(pending)
            self._of.shut()
            errors = [fut.exception() for fut in pending if not fut.cancelled() and fut.exception() is not None]
            if self.atomic and self._failed_write is not None and self._failed_write not in errors:
                errors.insert(0, self._failed_write)
            if self.atomic and errors:
                self._discard()
                raise errors[0]
            try:
                if self.atomic:
                    self._publish()
                else:
                    self._of.close()
            except BaseException:
                if self.atomic:
                    self._discard()
                raise
            if errors:
                raise errors[0]
        finally:
            self._released.set()

    def abort(self) -> None:
        """Close without publishing: for ``atomic`` files the temporary file is removed, the target untouched."""
        pending = self._start_closing()
        if pending is None:
            return
        try:
            _wait_on_streams(pending)
            self._of.shut()
            self._discard() if self.atomic else self._of.close()
        finally:
            self._released.set()

    def _start_closing(self) -> list[Future[Any]] | None:
        """Mark the file closed; the background requests to collect errors from, or None where
        another close came first (after waiting for it to finish)."""
        if self in getattr(_in_callback, "files", ()):
            raise InvalidArgumentError("close() from this file's own on_bytes callback would wait for the read "
                                       "that calls it")
        with self._lock:
            first = not self._closed
            self._closed = True
            pending = list(self._pending)
        if not first:
            self._released.wait()
            return None
        return pending

    def _publish(self) -> None:
        try:
            os.fsync(self._of.fd)
        except OSError as exc:
            raise from_os_error(exc, self.path) from exc
        try:
            os.replace(self._open_path, self._target)  # still locked: no sweep can take it first
        except OSError as exc:
            raise from_os_error(exc, self.path) from exc
        self._of.close()
        try:
            fsync_dir(os.path.dirname(os.path.abspath(self._target)))
        except OSError as exc:
            raise from_os_error(exc, self.path) from exc

    def _discard(self) -> None:
        try:
            remove_if_present(self._open_path)  # before the descriptor (and its lock) goes
        finally:
            if self._of.fd >= 0:
                self._of.close()

    def __del__(self) -> None:
        try:
            if not self._closed and getattr(self, "_of", None) is not None:
                self.abort() if self.atomic else self.close()
        except Exception:
            pass

    # -- internals --------------------------------------------------------
    def _enter(self) -> None:
        """Start a call that uses the descriptors (end it with ``self._of.leave()``)."""
        if not self._of.enter():
            raise ClosedFileError(f"I/O on closed file {self.path!r}")

    def _size(self) -> int:
        try:
            return os.fstat(self._of.fd).st_size
        except OSError as exc:
            raise from_os_error(exc, self.path) from exc

    def _own_callback(self, on_bytes: Callable[[int], None] | None) -> Callable[[int], None] | None:
        """``on_bytes``, run with this file marked as inside its callback (see :meth:`close`)."""
        if on_bytes is None:
            return None

        def call(n: int) -> None:
            inside = getattr(_in_callback, "files", None)
            if inside is None:
                inside = _in_callback.files = []
            inside.append(self)
            try:
                on_bytes(n)
            finally:
                inside.pop()

        return call

    def _validate(self, op: str, buf: Any, size: int | None, file_offset: int | None,
                  buf_offset: int) -> tuple[BufferView, int, int, int]:
        if op == "read" and self.mode in ("w", "a"):
            raise UnsupportedOperationError(9, f"file opened with mode {self.mode!r} is not readable", self.path)
        if op == "write" and self.mode == "r":
            raise UnsupportedOperationError(9, "file opened with mode 'r' is not writable", self.path)
        view = adapt(buf)
        if op == "write" and view.scatter is not None:
            raise InvalidArgumentError("a scattered view is a read's destination; write from one buffer")
        if op == "read" and view.readonly:
            raise ReadOnlyBufferError("cannot read into a read-only buffer")
        buf_offset = nonnegative_int("buf_offset", buf_offset)
        if buf_offset > view.nbytes:
            raise BufferTooSmallError(f"buf_offset {buf_offset} is past the end of the {view.nbytes}-byte buffer")
        size = view.nbytes - buf_offset if size is None else nonnegative_int("size", size)
        if buf_offset + size > view.nbytes:
            raise BufferTooSmallError(f"buffer of {view.nbytes} bytes cannot hold {size} bytes at offset {buf_offset}")
        if file_offset is None:
            if op == "write" and self.mode == "a":
                with self._lock:
                    file_offset = self._append_pos
                    self._append_pos += size
            else:
                file_offset = 0
        else:
            file_offset = nonnegative_int("file_offset", file_offset)
            if op == "write" and self.mode == "a":
                raise InvalidArgumentError("in mode 'a' writes go to the end of the file; leave file_offset unset")
        return view, size, file_offset, buf_offset

    def _execute(self, op: str, view: BufferView, size: int, file_offset: int, buf_offset: int) -> int:
        if op == "write" and self.atomic:
            try:
                return self._move(op, view, size, file_offset, buf_offset)
            except BaseException as exc:
                with self._lock:  # the file now has a hole or stale bytes: close() must not publish it
                    self._failed_write = self._failed_write or exc
                raise
        return self._move(op, view, size, file_offset, buf_offset)

    def _move(self, op: str, view: BufferView, size: int, file_offset: int, buf_offset: int) -> int:
        if size == 0:
            return 0
        if not view.on_device:  # host memory: one route, no planning needed
            req = Request(op, view, size, file_offset, buf_offset, host_reason())
            host = backend(BackendKind.HOST)
            return host.read(self._of, req) if op == "read" else host.write(self._of, req)
        if op == "read":
            return self._execute_many([(view, size, file_offset, buf_offset)])[0]
        _wait_for_producer(view)
        cfg = settings.snapshot()
        total = 0
        for piece in route_read(self._of, view, size, file_offset, buf_offset, cfg, other_gpu=False).pieces:
            total += backend(piece.backend).write(self._of, Request(op, view, piece.size, piece.file_offset,
                                                                    piece.buf_offset, piece.reason))
        return total

    def _validate_many(self, reads: Iterable[tuple[Any, ...]]) -> list[tuple[BufferView, int, int, int]]:
        items = []
        for i, item in enumerate(reads):
            if not isinstance(item, tuple) or len(item) not in (3, 4):
                raise InvalidArgumentError(
                    f"read {i}: expected (buf, size, file_offset[, buf_offset]), got {item!r:.80}")
            buf, size, file_offset = item[:3]
            if size is None or file_offset is None:
                raise InvalidArgumentError(f"read {i}: size and file_offset must be given")
            items.append(self._validate("read", buf, size, file_offset, item[3] if len(item) == 4 else 0))
        return items

    def _execute_many(self, items: list[tuple[BufferView, int, int, int]],
                      synced: set[Any] | None = None,
                      on_bytes: Callable[[int], None] | None = None, route: bool = True) -> list[int]:
        """``synced``: producer streams already waited for (a batch's later calls skip the wait).
        ``on_bytes``: called with the byte count of each piece as it lands. ``route``: False for
        the staged part of a routed read, which goes straight into the GPU it names."""
        cfg = settings.snapshot()
        pieces: list[list[int]] = [[] for _ in items]   # per item: indexes into ``reqs``
        reqs: list[tuple[str, Request]] = []
        routed: dict[RouteDecision, list[int]] = {}     # items read through another GPU (gdskit.engine.gpu_routing)
        synced = set() if synced is None else synced
        for i, (view, size, file_offset, buf_offset) in enumerate(items):
            if size == 0:
                continue
            if not view.on_device:
                reqs.append((BackendKind.HOST, Request("read", view, size, file_offset, buf_offset, host_reason())))
                pieces[i].append(len(reqs) - 1)
                continue
            _wait_for_producer(view, synced)
            found = route_read(self._of, view, size, file_offset, buf_offset, cfg, other_gpu=route)
            if found.via is not None:
                routed.setdefault(found.via, []).append(i)
                continue
            for p in found.pieces:
                reqs.append((p.backend, Request("read", view, p.size, p.file_offset, p.buf_offset, p.reason)))
                pieces[i].append(len(reqs) - 1)
        if len(items) == 1 and len(reqs) == 1 and not routed:  # one piece (most reads): no jobs to gather
            name, req = reqs[0]
            return backend(name).read_many(self._of, [req], on_bytes)
        counts = [0] * len(reqs)
        # One job per backend (and per device for the bounce ring, whose lanes belong to one):
        # the pieces of all items share the workers instead of being read one after another.
        jobs: dict[tuple[str, Any], list[int]] = {}
        for k, (name, req) in enumerate(reqs):
            jobs.setdefault((name, req.buf.device if name is BackendKind.BOUNCE else None), []).append(k)
        for (name, _device), ks in jobs.items():
            for k, n in zip(ks, backend(name).read_many(self._of, [reqs[k][1] for k in ks], on_bytes)):
                counts[k] = n
        out = []
        for ks in pieces:
            total = 0
            for k in ks:
                total += counts[k]
                if counts[k] < reqs[k][1].size:  # end of file: later pieces would leave a gap
                    break
            out.append(total)
        for decision, idx in routed.items():
            got = read_routed([items[i] for i in idx], decision,
                              lambda staged: self._execute_many(staged, synced, None, route=False),
                              cfg.threads, cfg.chunk_size, cfg.alignment, on_bytes)
            for i, n in zip(idx, got):
                out[i] = n
        return out

    def _submit(self, op: str, buf: Any, size: int | None, file_offset: int | None, buf_offset: int) -> Future[int]:
        self._enter()
        try:
            view, size, file_offset, buf_offset = self._validate(op, buf, size, file_offset, buf_offset)
            fut = request_executor(settings.threads).submit(self._execute, op, view, size, file_offset, buf_offset)
        except BaseException:
            self._of.leave()
            raise
        return self._track(fut)

    def _submit_on_stream(self, op: str, buf: Any, size: int | None, file_offset: int | None, buf_offset: int,
                          stream: Any) -> Future[int]:
        """Queue a request on a caller's CUDA stream (:mod:`gdskit.engine.stream_ordered`); every error goes
        to the future, so that a caller's stream code has one place to look."""
        import gdskit.engine.stream_ordered as stream_ordered  # noqa: PLC0415 - import time

        try:
            self._enter()
        except ClosedFileError as exc:
            return stream_ordered.failed(exc)
        try:
            handle = cuda.stream_handle(stream)
            view, size, file_offset, buf_offset = self._validate(op, buf, size, file_offset, buf_offset)
            fut = stream_ordered.submit(self._of, op, view, size, file_offset, buf_offset, handle, settings.snapshot(),
                                  self._write_failed if op == "write" and self.atomic else None)
        except Exception as exc:  # noqa: BLE001 - nothing was queued: the error is the future's
            self._of.leave()
            return stream_ordered.failed(exc)
        return self._track(fut)

    def _write_failed(self, exc: BaseException) -> None:
        with self._lock:  # the file now has a hole or stale bytes: close() must not publish it
            self._failed_write = self._failed_write or exc

    def _track(self, fut: Future[Any]) -> Future[Any]:
        """Remember a background request, which holds the file open (entered by the caller),
        until it is done or cancelled: ``close`` waits for it and collects its error."""
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._finished)
        return fut

    def _finished(self, fut: Future[Any]) -> None:
        self._of.leave()
        with self._lock:
            self._pending.discard(fut)


def _wait_on_streams(pending: list[Future[Any]]) -> None:
    """Let stream-ordered requests among ``pending`` run on their streams (a closing file waits
    for them as for its other background requests)."""
    if pending and "gdskit.engine.stream_ordered" in sys.modules:
        sys.modules["gdskit.engine.stream_ordered"].wait_for(pending)


def _wait_for_producer(view: BufferView, done: set[Any] | None = None) -> None:
    """Let kernels still queued on a device buffer (a fill before a read, a compute before a
    write) finish first: gdskit's copies run on their own streams. ``done``: streams already
    waited for by this call, skipped."""
    if not view.producer_sync or (done is not None and view.producer_stream in done):
        return
    cuda.synchronize_producer(view.producer_stream)
    if done is not None:
        done.add(view.producer_stream)


def open(path: str | os.PathLike[str], mode: str = "r", *, atomic: bool = False) -> File:  # noqa: A001
    """Open ``path`` for reads and writes to and from GPU or host memory.

    Parameters
    ----------
    path : str or PathLike
        A local file, or an object URL (``s3://bucket/key``): then an
        :class:`~gdskit.engine.objects.source.ObjectFile` with the same read methods, opened with
        ``"r"`` or ``"w"`` (written whole, as a multipart upload completed at close;
        docs/object-storage.md).
    mode : {"r", "w", "r+", "a"}
        As for Python's ``open``, but always binary and always positional:
        ``"w"`` truncates, ``"a"`` appends when ``file_offset`` is left unset.
    atomic : bool
        Only with ``"w"``: write to a temporary file beside ``path`` and, on
        :meth:`File.close`, fsync it, rename it over ``path`` and fsync the
        directory. On error (or :meth:`File.abort`) ``path`` is left untouched.
    """
    if is_object_url(path):
        from gdskit.engine.objects.source import open_object  # noqa: PLC0415 - import time

        return open_object(os.fspath(path), mode, atomic=atomic)  # type: ignore[return-value]
    return File(path, mode, atomic=atomic)


def _chunk_check(f: File, verify: Any, view: BufferView, size: int, file_offset: int,
                 buf_offset: int) -> Callable[[int], None]:
    """What checks a read of ``size`` bytes at ``file_offset`` against the manifest's chunk
    digests once it has landed; refuses, before the read, a range no chunk digests cover."""
    from gdskit.engine.digests import digest_buffers  # noqa: PLC0415 - import time
    from gdskit.verify import find_expectation, mismatch, verify_mode  # noqa: PLC0415 - import time

    mode = verify_mode(verify)
    if mode.whole_file:
        raise InvalidArgumentError("File.read checks chunk digests (verify=True or a manifest), not a sha256")
    expectation = find_expectation(f.path, mode)
    entry, chunk = expectation.file, expectation.chunk_bytes
    if entry is None:
        raise NothingToVerifyError(f"{f.path}: {expectation.source} holds tensor digests, not the chunk digests "
                                   "File.read checks: make a manifest with `gdskit digest`", path=f.path)
    end = min(file_offset + size, entry.size)
    if file_offset % chunk or (end % chunk and end != entry.size) or file_offset > entry.size:
        raise UnverifiableRangeError(f"{f.path}: bytes {file_offset}-{file_offset + size} do not start and end on "
                                     f"the manifest's {chunk}-byte chunks (or the end of the file): they cannot "
                                     "be checked; read whole chunks, or read without verify")
    if view.scatter is not None or not view.ptr:
        raise UnverifiableRangeError("a scattered destination cannot be checked chunk by chunk; read into one buffer")

    def check(n: int) -> None:
        stop = file_offset + n
        if stop != end:  # short: the file is shorter than its manifest says (no digest was compared)
            raise TruncatedFileError(f"read {n} bytes at {file_offset}, but {expectation.source} records "
                                     f"{entry.size} bytes: the file shrank", path=f.path)
        pieces = [(start, min(start + chunk, stop)) for start in range(file_offset, stop, chunk)]
        base = view.ptr + buf_offset - file_offset
        got = digest_buffers([(base + a, b - a) for a, b in pieces])
        for (a, b), digest in zip(pieces, got):
            want = entry.chunks[a // chunk]
            if digest != want:
                raise mismatch(expectation, None, (a, b), want, digest)

    return check
