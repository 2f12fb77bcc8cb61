"""``gdskit serve``'s side of the resident loader: keep the engine warm for one GPU and read
checkpoints into other processes' memory on request (docs/resident.md).

Each connection is one request, handled on its own thread; requests run one at a time (the
ledger rows of each are its own). The loader never lets go of a client's memory while its
copies are in flight: a client that goes away mid-load is answered by nobody, but the reads run
to their end before the mappings are closed.
"""

from __future__ import annotations

import functools
import itertools
import mmap
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait as futures_wait
from contextlib import nullcontext
from typing import Any

import gdskit.engine.cuda as cuda
import gdskit.engine.pool as pool
from gdskit.engine.buffers import ScatterList, adapt, scattered_device_view, synchronized_device_views
from gdskit.engine.file import open as open_file
from gdskit.engine.many_files import FileReads, read_files as many_files_read
from gdskit.engine.framing import recv_with_fds, send_message
from gdskit.engine.ledger import ledger
from gdskit.engine.ledger_inbox import as_row
from gdskit.engine.resident import HOST, SMALL_READ, ipc, socket_dir, socket_path
from gdskit.engine.resident.wire import (KIND_DONE, KIND_ERROR, KIND_PROGRESS, KIND_REQUEST, MAX_FILES,
                                         MAX_REQUEST, MAX_SOCKET_PATH, PROGRESS_S, Request, make_private_dir,
                                         pack_json, pack_progress, peer_uid, unpack_request)
from gdskit.settings import settings
from gdskit.threads import start_thread
from gdskit.errors import (CudaError, FormatError, GdskitPermissionError, InvalidArgumentError, ResidentLoaderError,
                           TruncatedFileError)

#: Requests waiting for the one under way, beyond which clients are refused at connect.
BACKLOG = 64
#: Small reads (resident.SMALL_READ) that touch are grouped up to this many bytes.
GROUP_BYTES = 16 << 20
#: The share of a request's bytes read first, while the client's other allocations are mapped
#: (mapping 256 of them took 11-15 ms on an H100 machine; an eighth of 8 GiB reads in about 25).
HEAD_SHARE = 1 / 8


class Refused(Exception):
    """A request turned down before anything was written (the client reads itself)."""


class ServedTotals:
    """What a loader has done since it started (``gdskit serve`` prints it)."""

    __slots__ = ("requests", "bytes", "refused", "failed", "seconds")

    def __init__(self) -> None:
        self.requests = self.bytes = self.refused = self.failed = 0
        self.seconds = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


class ResidentLoader:
    """The resident loader of GPU ``device`` (None: host memory only, for a machine without one).

    ``start()`` warms the engine and listens; ``serve_forever()`` answers until ``close()`` from
    another thread, or until :meth:`request_stop` (a signal handler's) and then ``close()``.
    ``on_event(kind, detail)`` hears of each request's end (``"served"``, ``"refused"``,
    ``"failed"``)."""

    def __init__(self, device: int | None, *, on_event: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
            raise InvalidArgumentError(f"device must be a GPU number, got {device!r}")
        self.device = device
        self.gpu = HOST
        self.path = ""
        self.totals = ServedTotals()
        self._on_event = on_event or (lambda _kind, _detail: None)
        self._listener: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._one_at_a_time = threading.Lock()
        self._closed = threading.Event()
        self._live = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._idle: set[socket.socket] = set()  # connections whose request has not come yet

    # -- life -------------------------------------------------------------------------------------
    def start(self) -> str:
        """Warm the engine (pinned lanes, streams, worker threads, direct-route facts), then listen;
        the socket's path. ResidentLoaderError where a loader already listens there."""
        if self.device is not None:
            if not cuda.available() or self.device >= cuda.device_count():
                raise ResidentLoaderError(f"GPU {self.device} is not available here "
                                          f"({cuda.device_count()} GPU(s) seen)", "no such GPU")
            try:  # named as its clients name it
                self.gpu = ipc.ordinal_uuid(self.device)
            except ipc.IpcUnavailable as exc:
                raise ResidentLoaderError(f"GPU {self.device}'s UUID: {exc}", "no such GPU") from None
        pool.set_up(self.device, None)
        make_private_dir(socket_dir())
        self.path = socket_path(self.gpu)
        if len(self.path.encode()) > MAX_SOCKET_PATH:
            raise InvalidArgumentError(f"the socket path {self.path} is longer than a Unix socket's "
                                       f"{MAX_SOCKET_PATH} bytes (set XDG_RUNTIME_DIR to a shorter directory)")
        self._listener = self._listen(self.path)
        return self.path

    def _listen(self, path: str) -> socket.socket:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
                raise GdskitPermissionError(f"{path} exists and is not this user's socket; not replaced")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                probe.connect(path)
            except ConnectionRefusedError:
                os.unlink(path)  # a loader that ended without cleaning up
            else:
                raise ResidentLoaderError(f"a resident loader already listens at {path}", "already serving")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(path)  # in a directory only this user can enter; the socket's own mode too:
            os.chmod(path, 0o600)
            sock.listen(BACKLOG)
            st = os.stat(path)
            self._inode = (st.st_dev, st.st_ino)
        except BaseException:
            sock.close()
            raise
        return sock

    def serve_forever(self) -> None:
        listener = self._listener
        if listener is None:
            raise ResidentLoaderError("start() the loader before serving", "not started")
        listener.settimeout(0.2)  # so that close() from another thread is seen
        while not self._closed.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                raise
            with self._live:
                if self._closed.is_set():
                    conn.close()
                    return
                self._idle.add(conn)
                self._threads.add(start_thread(functools.partial(self._connection, conn), "gdskit-resident"))

    def request_stop(self) -> None:
        """Make :meth:`serve_forever` return within a fifth of a second (safe in a signal handler:
        it only sets a flag); then :meth:`close`."""
        self._closed.set()

    def close(self) -> None:
        """Stop listening and remove the socket (if it is still the one this loader made); a request
        under way runs to its end."""
        self._closed.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        if self._inode is not None and self.path:
            try:
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == self._inode:
                    os.unlink(self.path)
            except OSError:
                pass
            self._inode = None
        with self._live:  # connections still waiting for their request get none now
            for conn in self._idle:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            threads = list(self._threads)
        for t in threads:  # and the request under way, if any, runs to its end
            if t is not threading.current_thread():
                t.join()

    def __enter__(self) -> ResidentLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one request -----------------------------------------------------------------------------
    def _connection(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            if peer_uid(conn) != os.getuid():
                self._event("refused", {"why": "a client of another user"})
                return
            conn.settimeout(30)  # a request arrives at once after connect
            try:
                kind, payload, fds = recv_with_fds(conn, MAX_REQUEST, max_fds=MAX_FILES + 1)
            except (EOFError, ValueError, OSError) as exc:
                if not self._closed.is_set():
                    self._event("refused", {"why": f"no request ({exc})"})
                return
            finally:
                with self._live:
                    self._idle.discard(conn)
            conn.settimeout(None)
            with self._one_at_a_time:
                self._request(conn, kind, payload, fds)
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()
            with self._live:
                self._idle.discard(conn)
                self._threads.discard(threading.current_thread())

    def _request(self, conn: socket.socket, kind: bytes, payload: bytearray, fds: list[int]) -> None:
        t0 = time.monotonic()
        dest: _Destinations | None = None
        try:
            dest = self._answer(conn, kind, payload, fds, t0)
        finally:
            # After the answer: the client goes on while the mappings are closed (its copies
            # have all completed by then).
            if dest is not None:
                dest.close()

    def _answer(self, conn: socket.socket, kind: bytes, payload: bytearray, fds: list[int],
                t0: float) -> _Destinations | None:
        dest: _Destinations | None = None
        req: Request | None = None
        try:
            if kind != KIND_REQUEST:
                raise Refused(f"a message of kind {kind!r}, not a request")
            try:
                req = unpack_request(payload)
            except ValueError as exc:
                raise Refused(str(exc)) from None
            dest = self._destinations(req, fds)
            nbytes, rows = self._read(conn, req, fds[:len(req.files)], dest)
        except Refused as exc:
            self.totals.refused += 1
            self._event("refused", {"why": str(exc)})
            _reply(conn, KIND_ERROR, {"type": "Refused", "message": str(exc), "refused": True, "errno": None})
            return dest
        except Exception as exc:  # noqa: BLE001 - the client raises it in its own place
            self.totals.failed += 1
            code = getattr(exc, "errno", None)
            self._event("failed", {"error": f"{type(exc).__name__}: {exc}"})
            at_fault = getattr(exc, "path", None) or getattr(exc, "filename", None)
            message = exc.args[0] if isinstance(exc, FormatError) and exc.path and exc.args else str(exc)
            _reply(conn, KIND_ERROR, {"type": type(exc).__name__, "refused": False,
                                      "errno": code if isinstance(code, int) else None,
                                      "message": (getattr(exc, "strerror", None) or message)
                                      if isinstance(code, int) else message,
                                      "file": _file_at_fault(req, fds, at_fault)})
            return dest
        seconds = time.monotonic() - t0
        self.totals.requests += 1
        self.totals.bytes += nbytes
        self.totals.seconds += seconds
        _reply(conn, KIND_DONE, {"bytes": nbytes, "rows": rows})
        # Said after the answer, so that printing it costs the client nothing.
        self._event("served", {"path": req.files[0][0], "files": len(req.files), "bytes": nbytes, "seconds": seconds,
                               "map_seconds": dest.map_seconds, "wait_seconds": dest.wait_seconds,
                               "segments": len(req.segments)})
        return dest

    def _destinations(self, req: Request, fds: list[int]) -> _Destinations:
        """The request checked against its files and this loader; its memory, mapped as its reads
        come to it (:meth:`_Destinations.items`)."""
        host = self.device is None
        if (req.device or HOST) != self.gpu:
            raise Refused(f"this loader serves {'host memory' if host else 'GPU ' + self.gpu}, "
                          f"not {req.device or 'host memory'}")
        if len(fds) != len(req.files) + host or not req.segments:
            raise Refused("a request without its files (and, for host memory, its shared mapping)")
        for fd, (_path, size) in zip(fds, req.files):
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Refused("a descriptor sent is not a regular file")
            if st.st_size != size:
                raise Refused(f"a file has {st.st_size} bytes, not the {size} its header said")
        for k, seg, at, offset, n in req.reads:
            if not (0 <= k < len(req.files) and 0 <= seg < len(req.segments) and at >= 0 and n > 0 and offset >= 0
                    and offset + n <= req.files[k][1]):
                raise Refused(f"a read ({k}, {seg}, {at}, {offset}, {n}) outside the file or its segments")
        return _Destinations(self.device, req, fds)

    def _read(self, conn: socket.socket, req: Request, fds: list[int],
              dest: _Destinations) -> tuple[int, list[list[Any]]]:
        """Read every read of ``req`` from its files (``fds``, one a file, in order) into ``dest``;
        the bytes and the ledger rows. One file's reads go as that file's job
        (``File.pread_many``); several files' as the many-file job (``gdskit.engine.many_files``,
        as a preload in the process reads them: their chunks share the workers)."""
        ledger.reset()
        reads = sorted(req.reads, key=lambda r: (r[0], r[3]))
        cut = _head_reads(reads)
        landed = [0]

        def count(n: int) -> None:
            landed[0] += n

        # Per part: each file's (index, items), and the job's byte counts (per file, per item).
        jobs: list[tuple[list[tuple[int, list[tuple[Any, int, int]]]], Future[Any]]] = []
        # Each file's size was checked against its header's in _destinations; a file that shrinks
        # since gives short reads, refused below.
        with open_file(f"/proc/self/fd/{fds[0]}", "r") if len(req.files) == 1 else nullcontext() as one:
            try:
                # The first reads start as soon as their memory is mapped; the rest of the
                # client's allocations are mapped while they run (a worker moves on to the
                # second job as it runs out of the first's chunks).
                for part in (reads[:cut], reads[cut:]):
                    by_file = [(k, dest.items([r[1:] for r in of_file]))
                               for k, of_file in itertools.groupby(part, key=lambda r: r[0])]
                    if not by_file:
                        continue
                    if one is not None:
                        jobs.append((by_file, one.pread_many(by_file[0][1], on_bytes=count)))
                    else:
                        jobs.append((by_file, pool.request_executor(settings.threads).submit(
                            many_files_read, [FileReads(f"/proc/self/fd/{fds[k]}", items) for k, items in by_file],
                            on_bytes=count)))
                t_read = time.monotonic()
                self._wait(conn, [job for _by_file, job in jobs], landed)
                dest.wait_seconds = time.monotonic() - t_read
            except BaseException:
                # No mapping is closed under a copy in flight (a request's thread hears no signals).
                futures_wait([job for _by_file, job in jobs])
                raise
        for by_file, job in jobs:
            counts = [job.result()] if one is not None else job.result()
            for (k, items), got_each in zip(by_file, counts):
                for (_v, n, offset), got in zip(items, got_each):
                    if got != n:
                        raise TruncatedFileError(f"{n} bytes at offset {offset} asked, {got} read (the file shrank)",
                                                 path=req.files[k][0])
        rows = [as_row(e) for e in ledger.snapshot().entries]
        return sum(r[4] for r in req.reads), rows

    @staticmethod
    def _wait(conn: socket.socket, jobs: list[Future[list[int]]], landed: list[int]) -> None:
        """Wait for ``jobs``, telling the client how many bytes have landed every PROGRESS_S."""
        talking = True
        for job in jobs:
            while True:
                try:
                    job.result(timeout=PROGRESS_S)
                    break
                except TimeoutError:
                    if talking:
                        try:
                            send_message(conn, KIND_PROGRESS, pack_progress(landed[0]))
                        except OSError:
                            talking = False  # the client went away: the reads still run to their end

    def _event(self, kind: str, detail: dict[str, Any]) -> None:
        try:
            self._on_event(kind, detail)
        except Exception:  # noqa: BLE001 - a printer's failure is not the client's
            pass


def _file_at_fault(req: Request | None, fds: list[int], named: Any) -> int | None:
    """Which of the request's files an error names (by the client's path, or by the descriptor's
    path as this process opened it); None where it names none."""
    if req is None or not isinstance(named, str):
        return None
    for k, (path, _size) in enumerate(req.files):
        if named in (path, f"/proc/self/fd/{fds[k] if k < len(fds) else -1}"):
            return k
    return None


def _head_reads(reads: list[tuple[int, int, int, int, int]]) -> int:
    """How many of ``reads`` (``(file, segment, at, file offset, bytes)``, in file order) are read
    while the memory of the rest is mapped: the first to hold HEAD_SHARE of the bytes (all of
    them for a request of one allocation)."""
    total = sum(r[4] for r in reads)
    if len({r[1] for r in reads}) < 2:
        return len(reads)
    head = 0
    for i, r in enumerate(reads):
        head += r[4]
        if head >= total * HEAD_SHARE:
            return i + 1
    return len(reads)


class _Destinations:
    """A request's memory, mapped for the time of the request: the client's GPU allocations (CUDA
    IPC), or its shared host mapping. Every byte a read may touch is checked to lie inside."""

    def __init__(self, device: int | None, req: Request, fds: list[int]) -> None:
        self.device = device
        self._opened: list[int] = []
        self._map: mmap.mmap | None = None
        self.bases: list[int] = []
        self.sizes: list[int] = []   # 0: not mapped yet
        self._handles: list[bytes] = []
        self.map_seconds = 0.0
        self.wait_seconds = 0.0  # from the last job's start to every job's end
        if device is None:
            if req.segments != ["memfd"]:
                raise Refused("host memory comes as one shared mapping")
            size = os.fstat(fds[-1]).st_size
            if size <= 0:
                raise Refused("an empty shared mapping")
            self._map = mmap.mmap(fds[-1], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.bases, self.sizes = [0], [size]
            return
        for hx in req.segments:
            try:
                handle = bytes.fromhex(hx)
            except ValueError:
                raise Refused("a segment that is not an IPC handle") from None
            if len(handle) != 64:
                raise Refused("a segment that is not an IPC handle")
            self._handles.append(handle)
        self.bases = [0] * len(self._handles)
        self.sizes = [0] * len(self._handles)

    def _map_segments(self, reads: list[tuple[int, int, int, int]]) -> None:
        """Map the client's allocations that ``reads`` land in, those not mapped yet (a request's
        later reads have theirs mapped while its first ones run)."""
        t = time.monotonic()
        try:
            for seg, _at, _offset, _n in reads:
                if self.sizes[seg]:
                    continue
                try:
                    ptr, size = cuda.open_ipc_memory(self.device, self._handles[seg])  # type: ignore[arg-type]
                except CudaError as exc:
                    raise Refused(f"a client allocation could not be opened here ({exc})") from None
                self._opened.append(ptr)
                self.bases[seg], self.sizes[seg] = ptr, size
        finally:
            self.map_seconds += time.monotonic() - t

    def items(self, reads: list[tuple[int, int, int, int]]) -> list[tuple[Any, int, int]]:
        """The engine's ``(destination, bytes, file offset)`` of each read. On a GPU, small reads
        that follow one another in the file go as one read whose bytes the engine scatters into
        their tensors (as a load in the process groups them): one bounce copy, not one each."""
        if self._map is None:
            self._map_segments(reads)
        for seg, at, _offset, n in reads:
            if at + n > self.sizes[seg]:
                raise Refused(f"a read of {n} bytes at {at} past the end of segment {seg} ({self.sizes[seg]} bytes)")
        if self._map is not None:
            whole = memoryview(self._map)
            return [(adapt(whole[at:at + n]), n, offset) for _seg, at, offset, n in reads]
        out: list[tuple[Any, int, int]] = []
        direct: list[tuple[int, int, Any]] = []
        direct_at: list[int] = []
        group: list[tuple[int, int, int]] = []  # (place in the group's bytes, pointer, bytes)
        start = end = 0

        def close_group() -> None:
            if group:
                out.append((scattered_device_view(ScatterList(group), end - start, self.device, self,
                                                  caller_busy=False), end - start, start))
                group.clear()

        for seg, at, offset, n in sorted(reads, key=lambda r: r[2]):
            ptr = self.bases[seg] + at
            if n >= SMALL_READ:
                close_group()
                direct_at.append(len(out))
                out.append((None, n, offset))
                direct.append((ptr, n, self))
                continue
            if not group or offset != end or end - start + n > GROUP_BYTES:
                close_group()
                start = end = offset
            group.append((offset - start, ptr, n))
            end = offset + n
        close_group()
        for i, view in zip(direct_at, synchronized_device_views(direct) if direct else []):
            out[i] = (view, out[i][1], out[i][2])
        return out

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still held: it goes with the collector
                pass
            self._map = None
        if self.device is not None:
            for ptr in self._opened:
                cuda.close_ipc_memory(self.device, ptr)
            self._opened = []



def _reply(conn: socket.socket, kind: bytes, value: dict[str, Any]) -> None:
    try:
        send_message(conn, kind, pack_json(value))
    except OSError:
        pass  # the client went away; nothing waits for this answer
