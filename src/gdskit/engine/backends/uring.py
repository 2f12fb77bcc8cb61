"""Many small reads in one system call: a minimal io_uring reader (Linux 5.6 and later).

A batch of reads becomes submission queue entries (SQEs) written with a few vectorised
numpy stores, one ``io_uring_enter`` submits them all and waits for them (the interpreter
lock is let go for the whole wait, and the kernel copies the bytes or runs the O_DIRECT
reads side by side), and the completion entries (CQEs) are read back with numpy.

Each thread has its own ring (:func:`ring_for_thread`), made on first use; a forked child
never touches its parent's rings and makes its own; rings close when their thread's ring is
dropped and at the process's ordered exit (:mod:`gdskit.shutdown`). Whether io_uring works
here is asked once per process (:func:`availability`): where ``io_uring_setup`` is refused
(no such system call, a seccomp filter or ``kernel.io_uring_disabled``, no memory) or the
kernel has no ``IORING_OP_READ``, that is remembered and callers read another way.

Memory safety comes first: :meth:`Ring.read` never returns or raises while a read it
submitted may still write into the caller's memory. It waits for the completion of every
read the kernel took, through interrupted waits and through exceptions raised while waiting
(``KeyboardInterrupt``), and raises only then. The addresses it hands the kernel come only
from the memory view it is given, checked against its length.

The layout of every structure is the kernel's documented ABI (``linux/io_uring.h``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

import gdskit.shutdown as shutdown

# -- the kernel's ABI ---------------------------------------------------------------------------------
#: System call numbers (the same in the generic table of aarch64 and on x86_64).
_SYSCALLS = {"x86_64": (425, 426, 427), "aarch64": (425, 426, 427)}
_SETUP_SUBMIT_ALL = 1 << 7       # keep submitting after an entry fails (5.18)
_SETUP_COOP_TASKRUN = 1 << 8     # no interrupting IPIs for completions (5.19)
_SETUP_SINGLE_ISSUER = 1 << 12   # only one task submits: each ring belongs to one thread (6.0)
_FEAT_SINGLE_MMAP = 1 << 0       # both rings in one mapping (5.4)
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_ENTER_GETEVENTS = 1 << 0
_REGISTER_PROBE = 8
_OP_READ = 22
_OP_SUPPORTED = 1 << 0
_PROBE_OPS = 256

#: Flags tried in turn: the newest first, then what every kernel with IORING_OP_READ takes.
_SETUP_FLAGS = (_SETUP_SUBMIT_ALL | _SETUP_COOP_TASKRUN | _SETUP_SINGLE_ISSUER, 0)

#: Entries per ring; a larger batch goes in rounds of this many.
RING_ENTRIES = 128


class _SqOffsets(ctypes.Structure):
    _fields_ = [("head", ctypes.c_uint32), ("tail", ctypes.c_uint32), ("ring_mask", ctypes.c_uint32),
                ("ring_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("dropped", ctypes.c_uint32),
                ("array", ctypes.c_uint32), ("resv1", ctypes.c_uint32), ("user_addr", ctypes.c_uint64)]


class _CqOffsets(ctypes.Structure):
    _fields_ = [("head", ctypes.c_uint32), ("tail", ctypes.c_uint32), ("ring_mask", ctypes.c_uint32),
                ("ring_entries", ctypes.c_uint32), ("overflow", ctypes.c_uint32), ("cqes", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("resv1", ctypes.c_uint32), ("user_addr", ctypes.c_uint64)]


class Params(ctypes.Structure):
    """``struct io_uring_params``: what ``io_uring_setup`` is asked for and answers."""

    _fields_ = [("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("sq_thread_cpu", ctypes.c_uint32), ("sq_thread_idle", ctypes.c_uint32),
                ("features", ctypes.c_uint32), ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
                ("sq_off", _SqOffsets), ("cq_off", _CqOffsets)]


# ``struct io_uring_sqe`` (64 bytes) and ``struct io_uring_cqe`` (16 bytes) as rows of plain integers
# (x86_64 and aarch64 are little-endian): the 64-bit words of an SQE hold opcode|fd, off, addr,
# len|rw_flags, user_data; its 32-bit words 1 and 6 are fd and len; a CQE's 32-bit words 0 and 2
# are user_data (low half) and res.
_SQE_WORDS, _SQE_OFF, _SQE_ADDR, _SQE_USER_DATA = 8, 1, 2, 4
_SQE_FD32, _SQE_LEN32 = 1, 6
_CQE_WORDS32, _CQE_USER_DATA32, _CQE_RES32 = 4, 0, 2
assert ctypes.sizeof(Params) == 120


# -- the system calls, behind one seam ----------------------------------------------------------------
class Kernel:
    """The three io_uring system calls; each returns its result or ``-errno``.

    The default is the running kernel through libc's ``syscall`` (ctypes lets go of the
    interpreter lock for each call). Tests pass a subclass to :func:`use_kernel` (one that
    refuses ``setup``, one that counts ``enter`` calls); a stand-in must keep the kernel's
    rules, since real memory is read into.
    """

    def __init__(self) -> None:
        numbers = _SYSCALLS.get(platform.machine())
        self.numbers = numbers
        if numbers is None:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        self._setup = libc["syscall"]
        self._setup.argtypes = [ctypes.c_long, ctypes.c_uint, ctypes.c_void_p]
        self._setup.restype = ctypes.c_long
        self._enter = libc["syscall"]
        self._enter.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                ctypes.c_void_p, ctypes.c_size_t]
        self._enter.restype = ctypes.c_long
        self._register = libc["syscall"]
        self._register.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint]
        self._register.restype = ctypes.c_long

    def setup(self, entries: int, params: Params) -> int:
        """``io_uring_setup(entries, &params)``: the ring's descriptor."""
        if self.numbers is None:
            return -errno.ENOSYS
        r = self._setup(self.numbers[0], entries, ctypes.addressof(params))
        return r if r >= 0 else -ctypes.get_errno()

    def enter(self, fd: int, to_submit: int, min_complete: int, flags: int) -> int:
        """``io_uring_enter(fd, to_submit, min_complete, flags, NULL, 0)``: how many were submitted."""
        r = self._enter(self.numbers[1], fd, to_submit, min_complete, flags, None, 0)  # type: ignore[index]
        return r if r >= 0 else -ctypes.get_errno()

    def register(self, fd: int, opcode: int, arg: int, nr_args: int) -> int:
        """``io_uring_register(fd, opcode, arg, nr_args)``."""
        r = self._register(self.numbers[2], fd, opcode, arg, nr_args)  # type: ignore[index]
        return r if r >= 0 else -ctypes.get_errno()


_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_mmap.restype = ctypes.c_void_p
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value
_PROT_RW, _MAP_SHARED_POPULATE = 0x1 | 0x2, 0x01 | 0x8000


# -- what this process knows ------------------------------------------------------------------------
@dataclass(frozen=True)
class Availability:
    """Whether io_uring reads work in this process: ``usable`` None until asked."""

    usable: bool | None
    detail: str


@dataclass(frozen=True)
class Activity:
    """What the rings did in this process: rings made, batches and reads submitted, and
    ``io_uring_enter`` calls. Snapshots subtract (``after - before``)."""

    rings: int = 0
    batches: int = 0
    reads: int = 0
    enters: int = 0

    def __sub__(self, other: Activity) -> Activity:
        return Activity(self.rings - other.rings, self.batches - other.batches, self.reads - other.reads,
                        self.enters - other.enters)


class _State:
    """The kernel in use and what was learnt of it; replaced (so that every ring made before is
    stale) by :func:`use_kernel` and in a forked child."""

    def __init__(self, kernel: Kernel, known: Availability) -> None:
        self.kernel = kernel
        self.known = known
        self.pid = os.getpid()


_UNASKED = Availability(None, "not asked yet")
_lock = threading.Lock()
_state: _State | None = None          # made on first use: ``import`` opens no library
_local = threading.local()
_rings: weakref.WeakSet[Ring] = weakref.WeakSet()
_counts = [0, 0, 0, 0]  # Activity's fields, in order: a list, since batches count on the hot path


def _current() -> _State:
    global _state
    state = _state
    if state is None:
        with _lock:
            if _state is None:
                _state = _State(Kernel(), _UNASKED)
            state = _state
    return state


def _note(rings: int = 0, batches: int = 0, reads: int = 0, enters: int = 0) -> None:
    with _lock:
        c = _counts
        c[0] += rings
        c[1] += batches
        c[2] += reads
        c[3] += enters


def activity() -> Activity:
    """A snapshot of :class:`Activity`."""
    with _lock:
        return Activity(*_counts)


def _learn(state: _State, known: Availability) -> None:
    with _lock:
        if state.known.usable is not False:
            state.known = known


def mark_unusable(detail: str) -> None:
    """Remember that io_uring reads do not work here (a kernel that refused IORING_OP_READ)."""
    _learn(_current(), Availability(False, detail))


#: Refusals of ``io_uring_setup`` that will not change in this process's life.
_LASTING = {errno.ENOSYS: "no io_uring_setup system call (kernel older than 5.1 or built without io_uring)",
            errno.EPERM: "io_uring_setup refused (EPERM: a seccomp filter, a sandbox or kernel.io_uring_disabled)",
            errno.EACCES: "io_uring_setup refused (EACCES)",
            errno.ENOMEM: "io_uring_setup failed (ENOMEM: no memory or RLIMIT_MEMLOCK too small)",
            errno.EINVAL: "io_uring_setup refused its parameters (EINVAL)"}


def availability() -> Availability:
    """Whether io_uring reads work in this process, asking the kernel (one ring made and
    closed) if no ring has been made yet. Never raises."""
    state = _current()
    if state.known.usable is None:
        try:
            ring = Ring.make(state)
        except Exception:  # noqa: BLE001 - an inspection never fails
            return Availability(False, "ring set-up failed")
        if ring is not None:
            ring.close()
    return state.known


# -- one ring ----------------------------------------------------------------------------------------
class Ring:
    """One io_uring instance with its three mappings; used by one thread at a time."""

    def __init__(self, state: _State, fd: int, p: Params, maps: list[tuple[int, int]],
                 sq_base: int, cq_base: int, sqes_base: int) -> None:
        self._state = state
        self._kernel = state.kernel
        self.fd = fd
        self.entries = p.sq_entries
        self._sq_mask = ctypes.c_uint32.from_address(sq_base + p.sq_off.ring_mask).value
        self._cq_mask = ctypes.c_uint32.from_address(cq_base + p.cq_off.ring_mask).value
        self._sq_head = ctypes.c_uint32.from_address(sq_base + p.sq_off.head)
        self._sq_tail = ctypes.c_uint32.from_address(sq_base + p.sq_off.tail)
        self._cq_head = ctypes.c_uint32.from_address(cq_base + p.cq_off.head)
        self._cq_tail = ctypes.c_uint32.from_address(cq_base + p.cq_off.tail)
        sqes = np.frombuffer((ctypes.c_char * (p.sq_entries * 64)).from_address(sqes_base), dtype=np.uint64)
        sqes = sqes.reshape(p.sq_entries, _SQE_WORDS)
        sqes[:] = 0
        # Every SQE is a read whose user_data is its own index; per round only the SQ ring's index
        # array changes where the round's slots begin, so a round always fills SQEs 0..k-1.
        sqes.view(np.uint8)[:, 0] = _OP_READ
        sqes[:, _SQE_USER_DATA] = np.arange(p.sq_entries, dtype=np.uint64)
        self._sqes = sqes
        sqes32 = sqes.view(np.int32)
        # One column each, made once: slicing a 1-D view costs a fraction of a 2-D index.
        # The offset column is signed: an offset of 2**63 or more raises OverflowError before
        # anything is submitted, as os.preadv would.
        self._off, self._addr = sqes.view(np.int64)[:, _SQE_OFF], sqes[:, _SQE_ADDR]
        self._fd, self._len = sqes32[:, _SQE_FD32], sqes32[:, _SQE_LEN32]
        self._filled = (-1, -1, 0)  # (fd, size, count) the SQEs' fd and len fields already hold
        self._array = np.frombuffer((ctypes.c_char * (p.sq_entries * 4)).from_address(sq_base + p.sq_off.array),
                                    dtype=np.uint32)
        self._cqes32 = np.frombuffer((ctypes.c_char * (p.cq_entries * 16)).from_address(cq_base + p.cq_off.cqes),
                                     dtype=np.int32).reshape(p.cq_entries, _CQE_WORDS32)
        self._iota = np.arange(p.sq_entries, dtype=np.uint32)
        self._results = np.empty(p.sq_entries, dtype=np.int32)  # each SQE's read's result, by index
        self._use = threading.Lock()   # held while a batch is in flight: close() never unmaps under it
        self._closing = False
        self.closed = False
        # What the kernel gave, let go exactly once: by close(), or when the ring is dropped
        # unclosed (its thread ended). weakref.finalize stops calling at its own exit hook, which
        # runs before the ordered exit, so close() does not go through it.
        self._resources = _Resources(fd, maps)
        weakref.finalize(self, self._resources.release).atexit = False

    @staticmethod
    def make(state: _State, entries: int = RING_ENTRIES) -> Ring | None:
        """A new ring on ``state``'s kernel, or None where io_uring does not work (remembered)."""
        kernel = state.kernel
        fd, p = -errno.EINVAL, Params()
        for flags in _SETUP_FLAGS:
            p = Params(flags=flags)
            fd = kernel.setup(entries, p)
            if fd != -errno.EINVAL:
                break
        if fd < 0:
            if -fd in _LASTING:
                _learn(state, Availability(False, _LASTING[-fd]))
            return None  # EMFILE and the like: not now, maybe later
        maps: list[tuple[int, int]] = []
        try:
            sq_len = p.sq_off.array + p.sq_entries * 4
            cq_len = p.cq_off.cqes + p.cq_entries * 16
            if p.features & _FEAT_SINGLE_MMAP:
                sq_base = cq_base = _map(fd, max(sq_len, cq_len), _OFF_SQ_RING, maps)
            else:
                sq_base = _map(fd, sq_len, _OFF_SQ_RING, maps)
                cq_base = _map(fd, cq_len, _OFF_CQ_RING, maps)
            sqes_base = _map(fd, p.sq_entries * 64, _OFF_SQES, maps)
        except OSError as exc:
            _release(fd, maps)
            if exc.errno == errno.ENOMEM:
                _learn(state, Availability(False, "the ring could not be mapped (ENOMEM)"))
            return None
        if state.known.usable is None:
            why = _read_unsupported(kernel, fd)
            if why is not None:
                _release(fd, maps)
                _learn(state, Availability(False, why))
                return None
            _learn(state, Availability(True, f"IORING_OP_READ, {p.sq_entries}-entry rings"
                                             f"{', one mapping' if p.features & _FEAT_SINGLE_MMAP else ''}"
                                             f", setup flags {p.flags:#x}"))
        ring = Ring(state, fd, p, maps, sq_base, cq_base, sqes_base)
        with _lock:
            _rings.add(ring)
        _note(rings=1)
        return ring

    def stale(self) -> bool:
        """Whether this ring may no longer be used: closed, made by another process or on another
        kernel, or io_uring found not to work after all."""
        state = self._state
        return (self.closed or self._closing or state is not _state or state.known.usable is False
                or state.pid != os.getpid())

    def read(self, fd: int, view: memoryview, file_offsets: Sequence[int], buf_offsets: Sequence[int],
             size: int) -> list[int]:
        """Read ``size`` bytes at each of ``file_offsets`` of ``fd`` into ``view`` at ``buf_offsets``;
        each read's result: the bytes it read, or ``-errno``.

        Returns (or raises) only when no read submitted can write into ``view`` any more. An
        offset no file can have (2**63 or more) raises ``OverflowError`` before anything is
        submitted.
        """
        n = len(file_offsets)
        if len(buf_offsets) != n or not 0 < size < 1 << 31:
            raise ValueError("one buffer offset per read and a size of 1 byte to 2 GiB")
        if not n:
            return []
        if min(buf_offsets) < 0 or max(buf_offsets) + size > view.nbytes:
            raise ValueError("a read falls outside the memory it reads into")
        return self._in_rounds(view, fd, file_offsets, buf_offsets, size)

    def read_each(self, fds: Sequence[int], view: memoryview, file_offsets: Sequence[int],
                  buf_offsets: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Read ``sizes[k]`` bytes at ``file_offsets[k]`` of ``fds[k]`` into ``view`` at
        ``buf_offsets[k]``, for every ``k`` (many files, each read once); each read's result, as
        :meth:`read` gives it, with the same guarantee: it returns (or raises) only when no read
        it submitted can write into ``view`` any more."""
        n = len(fds)
        if not len(file_offsets) == len(buf_offsets) == len(sizes) == n:
            raise ValueError("one descriptor, file offset, buffer offset and size per read")
        if not n:
            return []
        size = np.asarray(sizes, dtype=np.int64)
        place = np.asarray(buf_offsets, dtype=np.int64)
        if int(size.min()) <= 0 or int(size.max()) >= 1 << 31:
            raise ValueError("each read's size must be 1 byte to 2 GiB")
        if int(place.min()) < 0 or int((place + size).max()) > view.nbytes:
            raise ValueError("a read falls outside the memory it reads into")
        return self._in_rounds(view, fds, file_offsets, buf_offsets, sizes)

    def _in_rounds(self, view: memoryview, fd: int | Sequence[int], file_offsets: Sequence[int],
                   buf_offsets: Sequence[int], size: int | Sequence[int]) -> list[int]:
        """Every read, checked by the caller, a ring's worth at a time (``fd`` and ``size``: one
        for all the reads, or one a read)."""
        base = ctypes.addressof(ctypes.c_char.from_buffer(view))  # the view's own address, nothing else
        n = len(file_offsets)
        each = not isinstance(fd, int)
        results: list[int] = []
        enters = 0
        with self._use:
            if self.closed:
                raise RuntimeError("the ring is closed")
            for start in range(0, n, self.entries):
                part = slice(start, min(n, start + self.entries))
                enters += self._round(fd[part] if each else fd, file_offsets[part], buf_offsets[part], base,  # type: ignore[index]
                                      size[part] if each else size, results)  # type: ignore[index]
        _note(batches=1, reads=n, enters=enters)
        if self._closing:
            self.close()
        return results

    def _round(self, fd: int | Sequence[int], offs: Sequence[int], places: Sequence[int], base: int,
               size: int | Sequence[int], results: list[int]) -> int:
        """At most ``entries`` reads: submit them, wait for every one the kernel took, append each
        one's result to ``results``; how many ``io_uring_enter`` calls that took."""
        k = len(offs)
        tail = self._sq_tail.value
        off = self._off[:k]
        off[:] = offs  # OverflowError here (an offset of 2**63 or more): nothing submitted
        if int(off.min()) < 0:  # to the kernel, -1 means "the file's position": never submitted
            raise ValueError("a file offset is negative")
        addr = self._addr[:k]
        addr[:] = places
        addr += base
        if isinstance(fd, int) and isinstance(size, int):
            filled_fd, filled_size, filled = self._filled
            if filled_fd != fd or filled_size != size or filled < k:  # a batch's later rounds find them set
                self._fd[:k] = fd
                self._len[:k] = size
                self._filled = (fd, size, k)
        else:  # one descriptor and size a read
            self._fd[:k] = fd
            self._len[:k] = size
            self._filled = (-1, -1, 0)
        _put(self._array, tail & self._sq_mask, k, self._iota[:k])
        out = self._results
        completed = enters = 0
        pending: BaseException | None = None
        backoff = 0.0
        stored = False
        while True:
            try:
                if not stored:  # inside the try: once the tail moves, nothing leaves before the wait
                    self._sq_tail.value = (tail + k) & 0xFFFFFFFF  # no SQ polling thread: read at enter
                    stored = True
                taken = (self._sq_head.value - tail) & 0xFFFFFFFF
                if taken >= k and completed >= k:
                    break
                r = self._kernel.enter(self.fd, k - taken, k - completed, _ENTER_GETEVENTS)
                enters += 1
                completed += self._reap(out)
                if r >= 0 or r == -errno.EINTR:
                    continue
                if r in (-errno.EAGAIN, -errno.EBUSY):
                    time.sleep(0.0001)  # the kernel is short of something: let it catch up
                    continue
                # Any other refusal: what the kernel has not taken will not be submitted (the tail
                # goes back over it; nothing else reads this ring), and what it took is waited for.
                taken = (self._sq_head.value - tail) & 0xFFFFFFFF
                if taken < k:
                    self._sq_tail.value = (tail + taken) & 0xFFFFFFFF
                    out[taken:k] = r
                    k = taken
                if completed < k:  # never expected: keep waiting, slower, rather than return early
                    backoff = min(0.1, max(0.001, backoff * 2))
                    time.sleep(backoff)
            except BaseException as exc:  # noqa: BLE001 - finish waiting first, then raise it
                pending = pending or exc
        if pending is not None:
            raise pending
        results.extend(out[:len(offs)].tolist())
        return enters

    def _reap(self, out: np.ndarray) -> int:
        """Copy every posted completion's result into ``out`` (at its SQE's index, the CQE's
        user_data); how many there were."""
        head = self._cq_head.value
        count = (self._cq_tail.value - head) & 0xFFFFFFFF
        if count:
            first = head & self._cq_mask
            end = first + count
            cqes = self._cqes32
            if end <= len(cqes):
                part = cqes[first:end]
                out.put(part[:, _CQE_USER_DATA32], part[:, _CQE_RES32], mode="clip")
            else:
                for part in (cqes[first:], cqes[:end - len(cqes)]):
                    out.put(part[:, _CQE_USER_DATA32], part[:, _CQE_RES32], mode="clip")
            self._cq_head.value = (head + count) & 0xFFFFFFFF
        return count

    def close(self) -> None:
        """Unmap and close the ring; where a batch is in flight on it, its thread does that
        when the batch ends."""
        if not self._use.acquire(blocking=False):
            self._closing = True
            return
        try:
            self._drop()
        finally:
            self._use.release()

    def _drop(self) -> None:
        if not self.closed:
            self.closed = True
            self._sqes = self._cqes32 = self._array = None  # type: ignore[assignment]
            self._off = self._addr = self._fd = self._len = None  # type: ignore[assignment]
            self._resources.release()


def _put(column: np.ndarray, first: int, k: int, values: np.ndarray) -> None:
    """``column[first:first + k] = values``, wrapping at the ring's end."""
    end = first + k
    if end <= len(column):
        column[first:end] = values
        return
    split = len(column) - first
    column[first:] = values[:split]
    column[:end - len(column)] = values[split:]


def _map(fd: int, length: int, offset: int, maps: list[tuple[int, int]]) -> int:
    addr = _mmap(None, length, _PROT_RW, _MAP_SHARED_POPULATE, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    maps.append((addr, length))
    return addr


class _Resources:
    """A ring's descriptor and mappings; :meth:`release` lets them go once (a second close of a
    descriptor number could close a file opened since)."""

    def __init__(self, fd: int, maps: list[tuple[int, int]]) -> None:
        self.fd, self.maps = fd, maps
        self._lock = threading.Lock()
        self.released = False

    def release(self) -> None:
        with self._lock:
            if not self.released:
                self.released = True
                _release(self.fd, self.maps)


def _release(fd: int, maps: list[tuple[int, int]]) -> None:
    for addr, length in maps:
        _munmap(addr, length)
    maps.clear()
    try:
        os.close(fd)
    except OSError:
        pass


class _ProbeOp(ctypes.Structure):
    _fields_ = [("op", ctypes.c_uint8), ("resv", ctypes.c_uint8), ("flags", ctypes.c_uint16),
                ("resv2", ctypes.c_uint32)]


class _Probe(ctypes.Structure):
    _fields_ = [("last_op", ctypes.c_uint8), ("ops_len", ctypes.c_uint8), ("resv", ctypes.c_uint16),
                ("resv2", ctypes.c_uint32 * 3), ("ops", _ProbeOp * _PROBE_OPS)]


def _read_unsupported(kernel: Kernel, fd: int) -> str | None:
    """Why this kernel's rings cannot read (IORING_OP_READ came with 5.6, as did the
    opcode probe), or None."""
    probe = _Probe()
    r = kernel.register(fd, _REGISTER_PROBE, ctypes.addressof(probe), _PROBE_OPS)
    if r < 0:
        return f"no IORING_OP_READ (the kernel cannot list its io_uring operations: {errno.errorcode.get(-r, -r)})"
    if probe.last_op < _OP_READ or _OP_READ >= probe.ops_len or not probe.ops[_OP_READ].flags & _OP_SUPPORTED:
        return "no IORING_OP_READ in this kernel"
    return None


# -- one ring per thread -----------------------------------------------------------------------------
def ring_for_thread() -> Ring | None:
    """This thread's ring (made on first use), or None where io_uring does not work here or
    the process is exiting."""
    ring: Ring | None = getattr(_local, "ring", None)
    if ring is not None and not ring.stale():
        return ring
    state = _current()
    if ring is not None:
        _local.ring = None
        if state.pid == os.getpid():
            ring.close()  # a stale ring of this process (closing, or made on another kernel)
    if state.pid != os.getpid():
        _after_fork_in_child()
        state = _current()
    if state.known.usable is False or shutdown.exiting():
        return None
    ring = Ring.make(state)
    _local.ring = ring
    return ring


def close_all() -> None:
    """Close every ring of this process (those in flight close when their batch ends)."""
    with _lock:
        rings = list(_rings)
    for ring in rings:
        ring.close()


def _after_fork_in_child() -> None:
    """In a forked child: the parent's rings are not this process's to use. Its own copies
    of their mappings and descriptors are let go without touching the rings themselves."""
    global _state, _lock
    _lock = threading.Lock()  # another thread of the parent may have held it: the child has none
    old, rings = _state, list(_rings)
    _rings.clear()
    if old is not None and old.pid != os.getpid():
        _state = _State(old.kernel, old.known)
    for ring in rings:
        ring.closed = True
        ring._resources.release()  # munmap of the child's view and close of its copy of the descriptor


@contextmanager
def use_kernel(kernel: Kernel | None) -> Iterator[None]:
    """Run io_uring on ``kernel`` (None: the running kernel) with nothing known about it until
    the block ends, then on the one before again. Rings made before are not used inside, nor
    those made inside after. The test seam."""
    global _state
    with _lock:
        previous = _state
        _state = _State(kernel or Kernel(), _UNASKED)
    try:
        yield
    finally:
        ring = getattr(_local, "ring", None)
        if ring is not None:
            _local.ring = None
            ring.close()
        with _lock:
            _state = previous


os.register_at_fork(after_in_child=_after_fork_in_child)
shutdown.at_exit(shutdown.CLOSE_DRIVERS, close_all)
