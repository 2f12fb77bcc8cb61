"""Reader processes: a loader's host reads made in other interpreters, into memory shared with this one.

A batch of small reads (64 token windows of 4 KiB) is mostly interpreter time: planning,
submission, the hand-off. Reader threads of one process share one interpreter lock, so they
cannot add to it. With ``gdskit.data.Loader(..., workers=N)`` the staged batches are read by ``N``
reader processes (:mod:`gdskit.engine.reader_main` in a fresh interpreter each: nothing is forked
from a process that runs CUDA and threads). They read into the slots of one shared mapping (a
``memfd``, page-locked in this process for the copy to the GPU) through their own engine, with
this process's settings, and answer with each read's byte count and their ledger records, which
this process adds to its own ledger. The caller's thread plans each batch, sends it, and takes
the answers in order; there is no reader thread in this process.

The wire between the two is one Unix stream socket per process, messages framed as
``<u32 length><u8 kind><payload>``:

* ``I`` (to the reader, once): JSON ``{"paths": [...], "settings": {...}, "host_reason": ...}``: the
  reader sees no GPU (``CUDA_VISIBLE_DEVICES`` is empty there), so its reads into host memory
  are recorded with this process's reason for such reads.
* ``R`` (to the reader): ``<u64 base><u32 groups>`` and per group ``<u32 path><u32 size><u32 n>``
  then ``n`` file offsets and ``n`` places (int64, places from ``base`` in the mapping).
* ``D`` (from it): ``<u32 groups>``, per group ``<u32 n>`` and ``n`` counts (int64), then the
  ledger records as JSON.
* ``E`` (from it): JSON ``{"type", "errno", "message", "path"}``, the error of that batch.

Torch-free, like the rest of the engine; the dataset loader (:mod:`gdskit.data.loader`) uses it.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import socket
import struct
import subprocess
import sys
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from gdskit.engine import framing
from gdskit.engine.framing import send_message
from gdskit.errors import ReaderProcessError, call_each, from_os_error
from gdskit.shutdown import STOP_WORK, ClosedAtExit

__all__ = ["ReaderProcessError", "ReaderProcesses", "SharedSlot", "recv_message", "send_message"]

KIND_INIT, KIND_READ, KIND_DONE, KIND_ERROR = b"I", b"R", b"D", b"E"
_READ_HEAD = struct.Struct("<QI")
_GROUP_HEAD = struct.Struct("<III")
_U32 = struct.Struct("<I")
#: Largest message either side accepts (a batch of 64 MiB in 4 KiB reads is 256 KiB of offsets).
MAX_MESSAGE = 64 << 20
#: How long closing waits for a reader process to end by itself before it is killed.
CLOSE_WAIT_S = 5.0
_GRAIN = 64 << 10


# -- framing (both sides): gdskit.engine.framing -----------------------------------------------
def recv_message(sock: socket.socket) -> tuple[bytes, bytearray]:
    """The next message's kind and payload; EOFError where the other side has closed."""
    return framing.recv_message(sock, MAX_MESSAGE)


def pack_read(base: int, groups: Sequence[tuple[int, int, Sequence[int], Sequence[int]]]) -> bytes:
    """``groups``: ``(path index, size, file offsets, places)`` each."""
    parts = [_READ_HEAD.pack(base, len(groups))]
    for path, size, offsets, places in groups:
        parts.append(_GROUP_HEAD.pack(path, size, len(offsets)))
        parts.append(np.asarray(offsets, dtype="<i8").tobytes())
        parts.append(np.asarray(places, dtype="<i8").tobytes())
    return b"".join(parts)


def unpack_read(payload: bytes | bytearray) -> tuple[int, list[tuple[int, int, list[int], list[int]]]]:
    """The inverse of :func:`pack_read`; ValueError for anything it did not make."""
    try:
        return _unpack_read(payload)
    except struct.error as exc:
        raise ValueError(f"a damaged read message ({exc})") from None


def _unpack_read(payload: bytes | bytearray) -> tuple[int, list[tuple[int, int, list[int], list[int]]]]:
    base, count = _READ_HEAD.unpack_from(payload, 0)
    at = _READ_HEAD.size
    groups = []
    for _ in range(count):
        path, size, n = _GROUP_HEAD.unpack_from(payload, at)
        at += _GROUP_HEAD.size
        offsets = np.frombuffer(payload, dtype="<i8", count=n, offset=at).tolist()
        places = np.frombuffer(payload, dtype="<i8", count=n, offset=at + 8 * n).tolist()
        at += 16 * n
        groups.append((path, size, offsets, places))
    if at != len(payload):
        raise ValueError("a read message longer than its groups")
    return base, groups


def pack_done(counts: Sequence[Sequence[int]], ledger_rows: list[list[Any]]) -> bytes:
    parts = [_U32.pack(len(counts))]
    for c in counts:
        parts.append(_U32.pack(len(c)))
        parts.append(np.asarray(c, dtype="<i8").tobytes())
    parts.append(json.dumps(ledger_rows, separators=(",", ":")).encode())
    return b"".join(parts)


def unpack_done(payload: bytes | bytearray) -> tuple[list[list[int]], list[list[Any]]]:
    (count,) = _U32.unpack_from(payload, 0)
    at = _U32.size
    counts = []
    for _ in range(count):
        (n,) = _U32.unpack_from(payload, at)
        at += _U32.size
        counts.append(np.frombuffer(payload, dtype="<i8", count=n, offset=at).tolist())
        at += 8 * n
    return counts, json.loads(bytes(payload[at:]))


def _cuda() -> Any:
    import gdskit.engine.cuda as cuda  # noqa: PLC0415 - import time
    return cuda


# -- the shared slots --------------------------------------------------------------------------------
class SharedSlot:
    """One batch's place in the shared mapping: what the dataset loader's own staging slots offer
    it (``ptr``, ``copy_to``, ``reusable``), at ``offset`` in the mapping."""

    def __init__(self, mapping: _SharedMapping, offset: int, pinned: bool) -> None:
        self.offset = offset
        self.ptr = mapping.ptr + offset
        self.copied = _cuda().Event() if pinned else None

    def reusable(self) -> None:
        """Wait until the last copy out of this slot has finished (at once where none is queued)."""
        if self.copied is not None:
            self.copied.wait()

    def copy_to(self, dst: int, nbytes: int, stream: int) -> None:
        """Queue the copy of the first ``nbytes`` to device memory ``dst`` on ``stream``."""
        assert self.copied is not None
        _cuda().copy_h2d_on(stream, dst, self.ptr, nbytes)
        self.copied.record_on(stream)

    def free(self) -> None:
        if self.copied is not None:
            try:
                self.copied.wait()
            finally:
                self.copied.destroy()
                self.copied = None


class _SharedMapping:
    """A ``memfd`` of ``nbytes``, mapped here (and page-locked for the GPU where ``pinned``)."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.nbytes = nbytes
        self.fd = -1
        self.pinned = False
        try:
            self.fd = os.memfd_create("gdskit-reader-staging", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, nbytes)
            self._map = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._anchor = ctypes.c_char.from_buffer(self._map)  # the address; released before unmapping
            self.ptr = ctypes.addressof(self._anchor)
            if pinned:
                _cuda().register_host(self.ptr, nbytes)
                self.pinned = True
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.pinned:
            self.pinned = False
            _cuda().unregister_host(self.ptr)
        anchor = self.__dict__.pop("_anchor", None)
        del anchor
        m = self.__dict__.pop("_map", None)
        if m is not None:
            m.close()
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


# -- the processes ---------------------------------------------------------------------------------
def _package_root() -> str:
    # src/gdskit/engine/reader_processes.py -> src: where a fresh interpreter finds gdskit
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ReaderProcesses:
    """``count`` reader processes and ``slots`` slots of ``slot_bytes`` in one shared mapping
    (page-locked where ``pinned``), for the files ``paths``.

    :meth:`send` gives reader ``k`` a batch's reads into a slot; :meth:`receive` takes reader
    ``k``'s next answer (each reader answers in the order it was asked). One thread at a time
    (the loader's caller). :meth:`close` ends the processes and frees the memory; so does the
    exit. A reader that dies or answers nonsense makes the set ``broken``: every later call
    raises :class:`ReaderProcessError`.
    """

    def __init__(self, count: int, paths: Sequence[str], slots: int, slot_bytes: int, *, pinned: bool,
                 settings_values: dict[str, Any]) -> None:
        self.count = count
        self.slot_bytes = self.slot_size(slot_bytes)
        self.broken: str | None = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self._socks: list[socket.socket] = []
        # Per reader: the bytes each unanswered request and its answer take in the sockets, and
        # answers taken early (see send()).
        self._owed: list[deque[int]] = [deque() for _ in range(count)]
        self._early: list[deque[tuple[bytes, bytearray]]] = [deque() for _ in range(count)]
        self._socket_room = 0
        self._slots: list[SharedSlot] = []
        self._mapping: _SharedMapping | None = None
        self._closed = False
        try:
            mapping = self._mapping = _SharedMapping(slots * self.slot_bytes, pinned)
            self._slots = [SharedSlot(mapping, k * self.slot_bytes, pinned)
                           for k in range(slots)]
            from gdskit.engine.read_route import host_reason  # noqa: PLC0415 - import time
            init = json.dumps({"paths": list(paths), "settings": settings_values,
                               "host_reason": host_reason().value}).encode()
            env = dict(os.environ)
            # No GPU there: the reader never starts a CUDA driver of its own (its reads go to host memory).
            env["CUDA_VISIBLE_DEVICES"] = ""
            # The reader imports gdskit from where this process has it, never from its working
            # directory (``python -m`` or ``-c`` would look there first, and a directory another
            # user can write, such as /tmp, could hold a "gdskit" of theirs).
            start = (f"import sys; sys.path[0] = {_package_root()!r}; "
                     "from gdskit.engine.reader_main import main; sys.exit(main(sys.argv))")
            for _ in range(count):
                mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                self._socks.append(mine)
                try:
                    proc = subprocess.Popen(
                        [sys.executable, "-c", start, str(theirs.fileno()), str(mapping.fd), str(mapping.nbytes)],
                        pass_fds=(theirs.fileno(), mapping.fd), env=env, stdin=subprocess.DEVNULL,
                        close_fds=True)
                finally:
                    theirs.close()
                self._procs.append(proc)
                send_message(mine, KIND_INIT, init)
            if self._socks:
                sock = self._socks[0]
                self._socket_room = min(sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
                                        sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)) // 4
        except (OSError, AttributeError) as exc:  # AttributeError: no memfd_create (not Linux)
            self.close()
            raise ReaderProcessError(f"could not start the reader processes: {exc}") from exc
        except BaseException:
            self.close()
            raise
        _live.add(self)

    @staticmethod
    def slot_size(nbytes: int) -> int:
        """The bytes a slot for batches of ``nbytes`` takes (rounded up to 64 KiB)."""
        return -(-max(nbytes, 1) // _GRAIN) * _GRAIN

    def slot(self, position: int) -> SharedSlot:
        """The slot of a pass's ``position``-th batch, its last copy out finished."""
        s = self._slots[position % len(self._slots)]
        s.reusable()
        return s

    def send(self, k: int, slot: SharedSlot, groups: Sequence[tuple[int, int, Sequence[int], Sequence[int]]]) -> None:
        """Ask reader ``k`` for ``groups`` (path index, size, file offsets, places in the slot).

        A request and its answer wait in the two sockets' buffers until they are read. Were this
        side blocked sending while the reader is blocked answering (both buffers full), neither
        would move: so before a request that would take more than a quarter of a socket's room
        with those still owed, the reader's oldest answers are taken now and kept for
        :meth:`receive`. Batches of a few hundred reads never wait for that."""
        self._check()
        message = pack_read(slot.offset, groups)
        size = len(message) + 4 + sum(4 + 8 * len(g[2]) for g in groups) + 1024  # with its answer, JSON
        owed = self._owed[k]
        while owed and sum(owed) + size > self._socket_room:
            self._early[k].append(self._take_answer(k))
        try:
            send_message(self._socks[k], KIND_READ, message)
        except OSError as exc:
            self._break(self._died(k, exc))
        owed.append(size)

    def _take_answer(self, k: int) -> tuple[bytes, bytearray]:
        """Reader ``k``'s next message, whatever it says."""
        try:
            message = recv_message(self._socks[k])
        except (EOFError, OSError, ValueError) as exc:
            self._break(self._died(k, exc))
        if self._owed[k]:
            self._owed[k].popleft()
        return message

    def receive(self, k: int) -> tuple[list[list[int]], list[list[Any]]]:
        """Reader ``k``'s next answer: each group's counts and its ledger records. Raises the
        error of the batch where the reader had one (as the same class where it is an OS error)."""
        self._check()
        early = self._early[k]
        kind, payload = early.popleft() if early else self._take_answer(k)
        try:
            if kind == KIND_DONE:
                return unpack_done(payload)
            if kind == KIND_ERROR:
                err = json.loads(bytes(payload))
                raise_remote(err)
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            self._break(f"reader process {k} sent a damaged answer ({exc})")
        self._break(f"reader process {k} sent a message of kind {kind!r}")

    def _died(self, k: int, exc: BaseException) -> str:
        proc = self._procs[k]
        try:
            code = proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return f"reader process {k} (pid {proc.pid}) stopped answering ({exc})"
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return f"reader process {k} (pid {proc.pid}) {how}; its own error, if any, is on stderr"

    def _check(self) -> None:
        if self._closed:
            raise ReaderProcessError("the reader processes are closed")
        if self.broken is not None:
            raise ReaderProcessError(self.broken)

    def _break(self, why: str) -> Any:
        self.broken = why
        raise ReaderProcessError(why)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """End the processes (their sockets closed: each leaves after the batch it reads; killed
        after ``wait_s``) and free the mapping once every copy out of it has finished."""
        if self._closed:
            return
        self._closed = True
        call_each(lambda s: s.close(), self._socks)
        for proc in self._procs:
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        call_each(SharedSlot.free, self._slots)
        if self._mapping is not None:
            self._mapping.close()

    def __del__(self) -> None:
        try:
            self.close(0.5)
        except Exception:  # noqa: BLE001 - nothing to tell at collection time
            pass


def raise_remote(err: dict[str, Any]) -> None:
    """Raise, here, the error a reader process had: an OS error as the engine's class for its
    errno (as an in-process read raises it), anything else as :class:`ReaderProcessError`."""
    code = err.get("errno")
    message, path = str(err.get("message", "")), err.get("path")
    if isinstance(code, int) and code > 0:
        raise from_os_error(OSError(code, message), str(path) if path is not None else None)
    raise ReaderProcessError(f"a reader process failed: {err.get('type', 'error')}: {message}")


# At exit, while CUDA still runs (the pinned mapping): every set ended, its processes waited for briefly.
_live = ClosedAtExit(STOP_WORK, lambda procs: procs.close(1.0))
