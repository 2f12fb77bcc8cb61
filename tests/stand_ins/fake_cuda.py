"""A stand-in for ``cuda.bindings.driver`` so the GPU paths' logic runs in CI, which has no GPU.

"Device" memory is host memory the fake remembers as device memory. Only what gdskit
calls is implemented, with the bindings' calling convention (every call returns
``(error, *values)``); errors can be injected per function name. Contexts are per
thread, as in the driver: a thread must make one current before it allocates.

The fake keeps CUDA's ordering rules, and is never more forgiving than a GPU:

* An asynchronous copy runs only when something waits for it, never sooner (the
  timing that exposes most races). Work on one stream runs in the order queued.
* An event remembers its place in its stream's queue: ``cuEventSynchronize`` runs
  exactly the work queued before it was recorded, ``cuStreamWaitEvent`` makes later work
  on another stream wait for exactly that work; ``cuStreamSynchronize`` runs all of a
  stream, ``cuCtxSynchronize`` all of a device. When a wait needs work of several streams,
  their copies are interleaved in an order drawn from ``seed``: any order the rules allow.
* Copies on different streams that touch the same bytes (one of them writing) without an
  event ordering them are a race, reported when the second is queued; so is a blocking
  ``cuMemcpy``/``cuMemsetD8`` on bytes a copy still queued on a non-blocking stream uses.
* The host must leave pinned memory alone while a queued copy uses it. When a copy from
  pinned memory is queued, the fake keeps the bytes and fills the source with a poison
  pattern; when it runs, it checks the pattern is intact, copies the kept bytes and puts
  them back. A destination in pinned memory is poisoned until its copy runs and must
  still hold the pattern then. So any host write (``preadv`` into a stage, ``ctypes``,
  numpy), even one of the same bytes, is caught, and a host read before the copy ran
  sees poison. Freeing memory a queued copy uses is caught too. (CUDA lets the host
  *read* the source of a queued copy; here it sees poison. gdskit never does.)
  Pageable host memory follows the driver: a copy from it takes the bytes during the
  call, a copy into it returns only once done.

Several devices (``devices=``) each have a PCI bus id (``bus_ids=``) and reach the others'
memory as ``peers=`` says (pairs ``(device, peer)``; by default every pair). As in the
driver, ``cuDeviceCanAccessPeer`` reports it, ``cuCtxEnablePeerAccess`` opens it from the
current context (refusing a device and itself, a pair that cannot, and a second opening),
and ``cuMemcpyPeerAsync`` is a device-to-device copy on a stream, ordered like every other
copy; its source and destination must be memory of the devices it names, and its stream
belong to one of them. Where the stream's device has not opened access to the other one,
the driver stages the copy through host memory: it still lands, and ``peer_copies`` records
it as not direct. An event is recorded only on a stream of the context it was made in.

Host functions (``cuLaunchHostFunc``) run in stream order like any other work: only once
everything queued before them on their stream (and what that waits for) has run, and later
work waits for them. A CUDA call from inside a host function is a breach, as CUDA forbids
it. A copy queued behind a host function not yet run takes its source bytes when it runs (as
on a GPU), not when queued: the host function may be what fills its pinned source, so such a
copy's pinned memory is not poisoned. :meth:`FakeDriver.queue_stream_work` queues other
stream-ordered work: a test's stand-in for a kernel, the stand-in libcufile's stream I/O.

Each breach of these rules is recorded in ``violations`` and raised as
:class:`StandInViolation` from the call that found it; the test fixtures fail a test
that leaves any recorded, so an engine that swallows the exception still fails.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import enum
import functools
import os
import random
import re
import struct
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import numpy as np


class StandInViolation(AssertionError):
    """Something that on a real GPU is a race, a use of freed memory or undefined behaviour."""


class StandInLimitation(NotImplementedError):
    """A legal use of CUDA this stand-in does not model (so it cannot vouch for it)."""


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_PEER_ACCESS_UNSUPPORTED = 217
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_INVALID_IMAGE = 200
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209
    CUDA_ERROR_INVALID_PTX = 218
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
    CUDA_ERROR_LAUNCH_FAILED = 719
    CUDA_ERROR_NOT_SUPPORTED = 801


class CUmemorytype(enum.IntEnum):
    CU_MEMORYTYPE_UNREGISTERED = 0  # what the driver reports for memory it does not know
    CU_MEMORYTYPE_HOST = 1
    CU_MEMORYTYPE_DEVICE = 2
    CU_MEMORYTYPE_MANAGED = 99  # not a driver value: the fake's tag; the driver reports DEVICE + IS_MANAGED


class CUpointer_attribute(enum.IntEnum):  # noqa: N801 - the bindings' names
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
    CU_POINTER_ATTRIBUTE_IS_MANAGED = 8
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9


OK = CUresult.CUDA_SUCCESS
_NON_BLOCKING = 1
_SRC_ACCESS_ORDER_STREAM = 1
# Handles the driver gives the legacy and per-thread default streams.
_DEFAULT_STREAMS = (0, 1, 2)
# The poison repeats with a prime period, so no aligned copy of one poisoned range into
# another can reproduce the pattern that belongs at the destination.
_POISON_PERIOD = 1_048_573


class CUmemcpyAttributes:
    srcAccessOrder = 0  # noqa: N815 - the bindings' name


@dataclass(eq=False)
class _Op:
    """One entry of a stream's queue: a copy, or a wait for another stream's work."""

    stream: int
    seq: int
    what: str                      # the driver call that queued it
    dst: int = 0
    src: int = 0
    n: int = 0
    pinned_src: bool = False       # source in pinned host memory: poisoned, bytes kept in ``kept``
    pinned_dst: bool = False       # destination in pinned host memory: poisoned until the copy runs
    kept: bytes | None = None      # the source bytes (pinned: kept at queue time; pageable: taken then)
    wait_for: tuple[int, int] | None = None  # (stream, position) for a cuStreamWaitEvent entry
    cancelled: bool = False        # its memory was freed under it (already reported)
    work: Callable[[], None] | None = None  # a host function or other stream work, run when the op runs
    host_func: bool = False        # queued by cuLaunchHostFunc: CUDA calls from inside it are a breach

    def touches(self, lo: int, hi: int) -> bool:
        return self.wait_for is None and self.n > 0 and (
            _overlap(self.dst, self.n, lo, hi - lo) or _overlap(self.src, self.n, lo, hi - lo))


@dataclass
class _Stream:
    handle: int
    device: int
    blocking: bool
    queue: collections.deque[_Op]
    queued: int = 0   # entries ever queued (the next one's position)
    done: int = 0     # entries run: always a prefix of the queue's history
    destroyed: bool = False


def _overlap(a: int, an: int, b: int, bn: int) -> bool:
    return an > 0 and bn > 0 and a < b + bn and b < a + an


def _view(addr: int, n: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_uint8 * n).from_address(addr), dtype=np.uint8)


class FakeDriver:
    CUresult = CUresult
    CUmemorytype = CUmemorytype
    CUpointer_attribute = CUpointer_attribute
    CUstream_flags = SimpleNamespace(CU_STREAM_DEFAULT=0, CU_STREAM_NON_BLOCKING=_NON_BLOCKING)
    CUevent_flags = SimpleNamespace(CU_EVENT_BLOCKING_SYNC=1, CU_EVENT_DISABLE_TIMING=2)
    CUmemAttach_flags = SimpleNamespace(CU_MEM_ATTACH_GLOBAL=1)
    CU_MEMHOSTALLOC_PORTABLE = 1
    CU_MEMHOSTREGISTER_PORTABLE = 1
    CUdeviceptr = int
    CUhostFn = int  # the bindings wrap a function's address; the stand-in calls that address
    CUmemcpyAttributes = CUmemcpyAttributes
    CUmemcpySrcAccessOrder = SimpleNamespace(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM=_SRC_ACCESS_ORDER_STREAM)
    CUdevice_attribute = SimpleNamespace(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR=75,
                                         CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR=76)

    def __init__(self, devices: int = 1, seed: int | None = None, bus_ids: list[str] | None = None,
                 peers: set[tuple[int, int]] | None = None) -> None:
        self.devices = devices
        if bus_ids is not None and len(bus_ids) != devices:
            raise ValueError(f"{devices} devices need {devices} bus ids, not {len(bus_ids)}")
        self.bus_ids = list(bus_ids) if bus_ids is not None else [f"0000:{6 + d:02x}:00.0" for d in range(devices)]
        self.peers = ({(a, b) for a in range(devices) for b in range(devices) if a != b} if peers is None
                      else set(peers))
        self._peer_enabled: set[tuple[int, int]] = set()  # (context's device, peer device) opened
        self.peer_copies: list[tuple[int, int, int, bool]] = []  # (from device, to device, bytes, direct)
        self.seed = int(os.environ.get("GDSKIT_STAND_IN_SEED", "0")) if seed is None else seed
        self._rng = random.Random(self.seed)
        self._poison = np.random.default_rng(self.seed ^ 0x5EED).integers(0, 256, _POISON_PERIOD, dtype=np.uint8)
        # Re-entrant: a collection that runs inside a locked block may finalise a DeviceArray,
        # whose cuMemFree comes back in on the same thread (and is then put off until the
        # outer call ends, so that no state changes under it).
        self._lock = threading.RLock()
        self._depth = 0
        self._deferred_frees: list[int] = []
        self._allocs: dict[int, tuple[Any, int, CUmemorytype, int]] = {}  # ptr -> (buffer, size, kind, device)
        self.kernel_impls: dict[str, tuple[list[Any], Callable[..., None]]] = {}
        self.modules: dict[int, tuple[bytes, int | None]] = {}     # module -> (image, context)
        self.functions: dict[int, tuple[str, int | None]] = {}     # function -> (name, context)
        self._streams: dict[int, _Stream] = {}
        self._events: dict[int, tuple[int, int] | None] = {}  # event -> (stream, position) of its last record
        self._event_device: dict[int, int | None] = {}  # event -> the device of the context it was made in
        self.event_flags: dict[int, int] = {}  # event -> the flags it was made with
        self.waited_events: collections.deque[int] = collections.deque(maxlen=1000)  # cuEventSynchronize'd
        self._next_handle = 100
        self._tls = threading.local()
        self.fail: dict[str, CUresult] = {}  # function name -> error to return (once set, every call)
        self.calls: dict[str, int] = {}
        self.violations: list[str] = []
        self.ran: collections.deque[tuple[int, int]] = collections.deque(maxlen=10_000)  # (stream, position) run

    # -- bookkeeping ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _api(self) -> Iterator[None]:
        """One driver call: under the lock; breaches found during it are raised when it ends."""
        with self._lock:
            first = len(self.violations)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    while self._deferred_frees:
                        self._free_now(self._deferred_frees.pop())
            if self._depth == 0 and len(self.violations) > first:
                raise StandInViolation("; ".join(self.violations[first:]))

    def _violate(self, message: str) -> None:
        self.violations.append(message)

    def take_violations(self) -> list[str]:
        """The breaches recorded so far, forgetting them (the fixtures call this after each test)."""
        with self._lock:
            out, self.violations = self.violations, []
        return out

    def pending(self) -> int:
        """Copies queued and not yet run."""
        with self._lock:
            return sum(1 for s in self._streams.values() for op in s.queue if op.wait_for is None and not op.cancelled)

    def _count(self, name: str) -> CUresult | None:
        self.calls[name] = self.calls.get(name, 0) + 1
        return self.fail.get(name)

    def _context(self) -> int | None:
        return getattr(self._tls, "ctx", None)

    def _handle(self) -> int:
        with self._lock:
            self._next_handle += 1
            return self._next_handle

    def live_events(self) -> int:
        """Events made and not yet destroyed."""
        with self._lock:
            return len(self._events)

    def live_allocations(self, kind: CUmemorytype | None = None) -> int:
        with self._lock:
            allocs = list(self._allocs.values())
        return sum(1 for _b, _n, k, _d in allocs if kind is None or k == kind)

    def allocated(self) -> set[int]:
        """The addresses of every allocation and host registration the stand-in holds now."""
        with self._lock:
            return set(self._allocs)

    def unregister_host_since(self, before: set[int]) -> None:
        """Unregister the host memory registered since ``before`` (an :meth:`allocated`): what gdskit
        had to leave registered where a test made the driver refuse the unregistration."""
        with self._lock:
            new = [p for p, (_b, _n, kind, _d) in self._allocs.items()
                   if p not in before and kind == CUmemorytype.CU_MEMORYTYPE_HOST]
        for ptr in new:
            self.cuMemHostUnregister(ptr)

    # -- memory -----------------------------------------------------------------------------------
    def _alloc(self, n: int, kind: CUmemorytype) -> tuple[CUresult, int]:
        ctx = self._context()
        if ctx is None:
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT, 0)
        raw = ctypes.create_string_buffer(n + 4096)
        ptr = (ctypes.addressof(raw) + 4095) & ~4095
        with self._lock:
            self._allocs[ptr] = (raw, n, kind, ctx)
        return (OK, ptr)

    def _memory(self, ptr: int, n: int, what: str) -> str:
        """``device``, ``pinned`` or ``pageable`` for ``[ptr, ptr + n)``; a range that starts in an
        allocation must end in it."""
        # A snapshot (made in one step under the interpreter lock): another thread may allocate or
        # free meanwhile, as the driver allows.
        for base, (_raw, size, kind, _dev) in list(self._allocs.items()):
            if base <= ptr < base + max(size, 1):
                if ptr + n > base + max(size, 1):
                    self._violate(f"{what}: [{ptr:#x}, +{n}) runs past the end of its allocation "
                                  f"[{base:#x}, +{size})")
                return "pinned" if kind == CUmemorytype.CU_MEMORYTYPE_HOST else "device"
        return "pageable"

    def device_of(self, ptr: int) -> int | None:
        """The device whose memory ``ptr`` is (``None``: host memory)."""
        with self._lock:
            allocs = list(self._allocs.items())
        for base, (_raw, size, kind, dev) in allocs:
            if base <= ptr < base + max(size, 1):
                return None if kind == CUmemorytype.CU_MEMORYTYPE_HOST else dev
        return None

    def _free_checked(self, ptr: int, what: str) -> bool:
        """Forget allocation ``ptr``; False if there is none. Queued copies that use it are a breach."""
        found = self._allocs.get(ptr)
        if found is None:
            return False
        if self._depth > 1:  # called back from inside another call (a finaliser): after it ends
            self._deferred_frees.append(ptr)
            return True
        self._free_now(ptr, what)
        return True

    def _free_now(self, ptr: int, what: str = "cuMemFree (deferred)") -> None:
        found = self._allocs.pop(ptr, None)
        if found is None:
            return
        size = max(found[1], 1)
        for s in self._streams.values():
            for op in s.queue:
                if not op.cancelled and op.touches(ptr, ptr + size):
                    self._violate(f"{what} of [{ptr:#x}, +{size}) while {op.what} on stream {s.handle} "
                                  "still uses it (wait for the copy first)")
                    op.cancelled = True  # the memory is gone: the copy must not touch it

    # -- poison -----------------------------------------------------------------------------------
    def _pattern(self, addr: int, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.uint8)
        i = 0
        while i < n:
            start = (addr + i) % _POISON_PERIOD
            k = min(n - i, _POISON_PERIOD - start)
            out[i:i + k] = self._poison[start:start + k]
            i += k
        return out

    def _poison_range(self, addr: int, n: int) -> None:
        _view(addr, n)[:] = self._pattern(addr, n)

    def _poison_intact(self, addr: int, n: int) -> bool:
        return bool(np.array_equal(_view(addr, n), self._pattern(addr, n)))

    def _queued_copies(self) -> Iterator[_Op]:
        for s in self._streams.values():
            for op in s.queue:
                if op.wait_for is None and not op.cancelled:
                    yield op

    def _true_bytes(self, addr: int, n: int) -> bytes:
        """The host bytes at ``[addr, addr + n)`` as the program left them (poisoned sources
        hold their kept bytes)."""
        out = bytearray(ctypes.string_at(addr, n))
        for op in self._queued_copies():
            if op.pinned_src and _overlap(op.src, op.n, addr, n):
                lo, hi = max(op.src, addr), min(op.src + op.n, addr + n)
                out[lo - addr:hi - addr] = op.kept[lo - op.src:hi - op.src]
        return bytes(out)

    def _claimed(self, addr: int, n: int) -> np.ndarray:
        """Which bytes of ``[addr, addr + n)`` queued copies hold poisoned (as pinned source or destination)."""
        held = np.zeros(n, dtype=bool)
        for other in self._queued_copies():
            for start, pinned in ((other.src, other.pinned_src), (other.dst, other.pinned_dst)):
                if pinned and _overlap(start, other.n, addr, n):
                    held[max(start, addr) - addr:min(start + other.n, addr + n) - addr] = True
        return held

    # -- ordering ---------------------------------------------------------------------------------
    def _stream(self, handle: int) -> _Stream | None:
        s = self._streams.get(int(handle))
        if s is None and int(handle) in _DEFAULT_STREAMS:
            # The default streams exist without being made; the legacy one (0, 1) synchronises
            # with blocking streams, which this fake does not model beyond that flag.
            s = self._streams[int(handle)] = _Stream(int(handle), self._context() or 0, True, collections.deque())
        return None if s is None or s.destroyed else s

    def _needs(self, targets: dict[int, int]) -> dict[int, int]:
        """Per stream, how much of it must have run for ``targets`` (stream -> position) to have
        run: the targets and, transitively, what the waits among their work wait for."""
        need = {h: p for h, p in targets.items() if self._streams[h].done < p}
        todo = list(need)
        while todo:
            h = todo.pop()
            s = self._streams[h]
            for op in s.queue:
                if op.seq >= need[h]:
                    break
                if op.wait_for is not None:
                    other, pos = op.wait_for
                    if self._streams[other].done < pos and need.get(other, 0) < pos:
                        need[other] = pos
                        todo.append(other)
        return need

    def _complete(self, targets: dict[int, int]) -> None:
        """Run queued work until every target (stream -> position) is reached, interleaving the
        streams involved in a seeded order that keeps each stream's order and every wait."""
        need = self._needs(targets)
        while True:
            ready = []
            live = False
            for h in sorted(need):
                s = self._streams[h]
                if s.done >= need[h]:
                    continue
                live = True
                head = s.queue[0]
                if head.wait_for is not None and self._streams[head.wait_for[0]].done < head.wait_for[1]:
                    continue
                ready.append(s)
            if not live:
                return
            assert ready, "waits form a cycle, which CUDA's recording rules cannot produce"
            s = self._rng.choice(ready)
            op = s.queue.popleft()
            s.done += 1
            self.ran.append((s.handle, op.seq))
            if op.wait_for is None and not op.cancelled:
                self._execute(op)

    def _execute(self, op: _Op) -> None:
        if op.work is not None:
            self._run_work(op)
            return
        if op.n == 0:
            return
        if op.pinned_src and not self._poison_intact(op.src, op.n):
            self._violate(f"{op.what} on stream {op.stream}: the host wrote its pinned source "
                          f"[{op.src:#x}, +{op.n}) before the copy ran (wait for its event first)")
        if op.pinned_dst and not self._poison_intact(op.dst, op.n):
            self._violate(f"{op.what} on stream {op.stream}: the host wrote its pinned destination "
                          f"[{op.dst:#x}, +{op.n}) before the copy ran")
        data = op.kept if op.kept is not None else ctypes.string_at(op.src, op.n)
        ctypes.memmove(op.dst, data, op.n)
        if op.pinned_dst:
            # A later queued copy into the same pinned bytes keeps them poisoned until it runs.
            held = self._claimed(op.dst, op.n)
            if held.any():
                _view(op.dst, op.n)[held] = self._pattern(op.dst, op.n)[held]
        if op.pinned_src:
            # Put the kept bytes back where no other queued copy still holds them.
            free = ~self._claimed(op.src, op.n)
            _view(op.src, op.n)[free] = np.frombuffer(op.kept, dtype=np.uint8)[free]

    def _ordered_before(self, stream: int) -> dict[int, int]:
        """Per other stream, the prefix that work queued now on ``stream`` is ordered after."""
        s = self._streams[stream]
        return self._needs({stream: s.queued})

    def _check_race(self, what: str, stream: int | None, reads: tuple[int, int], writes: tuple[int, int]) -> None:
        """Report queued copies on other streams (or, for a blocking call, ``stream`` None, on
        non-blocking streams) that conflict with new work reading ``reads``, writing ``writes``."""
        after = self._ordered_before(stream) if stream is not None else {}
        for other in self._queued_copies():
            if other.stream == stream or other.n == 0:
                continue
            if stream is not None and other.seq < after.get(other.stream, 0):
                continue  # an event orders it first
            if (_overlap(writes[0], writes[1], other.dst, other.n) or _overlap(writes[0], writes[1], other.src, other.n)
                    or _overlap(reads[0], reads[1], other.dst, other.n)):
                self._violate(f"{what} races with {other.what} on stream {other.stream} (no event orders them): "
                              f"[{reads[0]:#x}, +{reads[1]}) -> [{writes[0]:#x}, +{writes[1]}) vs "
                              f"[{other.src:#x}, +{other.n}) -> [{other.dst:#x}, +{other.n})")

    def _queue_copy(self, what: str, s: _Stream, dst: int, src: int, n: int, direction: str) -> None:
        src_kind = self._memory(src, n, what)
        dst_kind = self._memory(dst, n, what)
        want_src, want_dst = ("host", "device") if direction == "h2d" else ("device", "host")
        for name, kind, want in (("source", src_kind, want_src), ("destination", dst_kind, want_dst)):
            if (kind == "device") != (want == "device"):
                self._violate(f"{what}: the {name} {src if name == 'source' else dst:#x} is {kind} memory")
        self._check_race(what, s.handle, (src, n), (dst, n))
        op = _Op(s.handle, s.queued, what, dst, src, n)
        if self._behind_host_work(s) and "pageable" not in (src_kind, dst_kind):
            # A host function queued before it may fill its source or use its destination:
            # the copy takes its bytes when it runs, as on a GPU.
            s.queue.append(op)
            s.queued += 1
            return
        if src_kind == "pinned" and n:
            for earlier in self._queued_copies():
                if earlier.stream == s.handle and earlier.pinned_dst and _overlap(earlier.dst, earlier.n, src, n):
                    raise StandInLimitation(f"{what}: a copy from pinned memory an earlier queued copy writes")
            op.pinned_src, op.kept = True, self._true_bytes(src, n)
            self._poison_range(src, n)
        elif src_kind == "pageable" and n:
            # The driver first waits for the stream, then takes the bytes before returning.
            self._complete({s.handle: s.queued})
            op.kept = ctypes.string_at(src, n)
        if dst_kind == "pinned" and n:
            op.pinned_dst = True
            self._poison_range(dst, n)
        s.queue.append(op)
        s.queued += 1
        if dst_kind == "pageable" and n:
            self._complete({s.handle: s.queued})  # into pageable memory the call returns when done

    def _enqueue(self, name: str, dst: int, src: int, n: int, stream: int, direction: str) -> tuple[CUresult]:
        with self._api():
            err = self._count(name)
            if err:
                return (err,)
            s = self._stream(stream)
            if s is None:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            self._queue_copy(name, s, int(dst), int(src), int(n), direction)
        return (OK,)

    def _blocking_access(self, what: str, reads: tuple[int, int], writes: tuple[int, int]) -> None:
        """A call on the legacy default stream: it waits for blocking streams, not the others."""
        blocking = {h: s.queued for h, s in self._streams.items() if s.blocking}
        self._complete(blocking)
        self._check_race(what, None, reads, writes)

    # -- host functions and other stream work ---------------------------------------------------
    def _behind_host_work(self, s: _Stream) -> bool:
        """Whether work queued now on ``s`` would wait for host work not yet run."""
        need = self._needs({s.handle: s.queued})
        for h, pos in need.items():
            for op in self._streams[h].queue:
                if op.seq >= pos:
                    break
                if op.work is not None and not op.cancelled:
                    return True
        return False

    def _run_work(self, op: _Op) -> None:
        if op.cancelled:
            return
        if not op.host_func:
            op.work()
            return
        self._tls.host_func = True
        try:
            op.work()
        finally:
            self._tls.host_func = False

    def in_host_func(self) -> bool:
        """Whether the calling thread is running a host function now."""
        return bool(getattr(self._tls, "host_func", False))

    def queue_stream_work(self, stream: int, what: str, fn: Callable[[], None], *,
                          reads: tuple[int, int] = (0, 0), writes: tuple[int, int] = (0, 0)) -> CUresult:
        """Queue ``fn()`` on ``stream`` as device-side work (a kernel, libcufile's stream I/O): it
        runs in stream order, and races like a copy reading ``reads`` and writing ``writes``
        (``(ptr, nbytes)``)."""
        with self._api():
            s = self._stream(stream)
            if s is None:
                return CUresult.CUDA_ERROR_INVALID_HANDLE
            self._check_race(what, s.handle, reads, writes)
            s.queue.append(_Op(s.handle, s.queued, what, writes[0], writes[0], writes[1], work=fn))
            s.queued += 1
        return OK

    def cuLaunchHostFunc(self, stream: int, fn: int, user_data: int):  # noqa: N802
        with self._api():
            err = self._count("cuLaunchHostFunc")
            if err:
                return (err,)
            s = self._stream(stream)
            if s is None:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            if not int(fn):
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            call = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(int(fn))  # the address, called as the driver would
            data = int(user_data or 0)
            s.queue.append(_Op(s.handle, s.queued, "cuLaunchHostFunc", work=lambda: call(data), host_func=True))
            s.queued += 1
        return (OK,)

    # -- the API gdskit uses --------------------------------------------------------------------
    def cuInit(self, flags: int):  # noqa: N802
        return (OK,)

    def cuDeviceGetCount(self):  # noqa: N802
        return (self._count("cuDeviceGetCount") or OK, self.devices)

    # -- kernels ---------------------------------------------------------------------------------
    # The stand-in runs no machine code: a test registers, by name, what a kernel does
    # (``register_kernel``), over the fake's "device" memory. A module is a cubin (an ELF image,
    # sized by its header) that must hold the name of each function asked of it; a launch is
    # checked as the driver checks it (a current context, a live function, block and grid sizes,
    # the parameter array) and its parameters are copied at launch; the work runs in stream order.

    compute_capability = (9, 0)

    def register_kernel(self, name: str, params: list[Any], run: Callable[..., None]) -> None:
        """``run(grid, block, *args)`` does what kernel ``name`` does; ``params`` are its parameters'
        ctypes types, in order (what a launch reads through its ``kernelParams`` pointers)."""
        self.kernel_impls[name] = (list(params), run)

    def is_device_memory(self, ptr: int, n: int) -> bool:
        """Whether ``[ptr, ptr + n)`` lies in one device allocation (what a kernel may touch)."""
        return self._memory(int(ptr), int(n), "a kernel's access") == "device"

    def cuDeviceGetAttribute(self, attr: int, dev: int):  # noqa: N802
        if not 0 <= int(dev) < self.devices:
            return (CUresult.CUDA_ERROR_INVALID_DEVICE, 0)
        found = {75: self.compute_capability[0], 76: self.compute_capability[1]}.get(int(attr))
        return (OK, found) if found is not None else (CUresult.CUDA_ERROR_INVALID_VALUE, 0)

    def cuModuleLoadData(self, image: int):  # noqa: N802
        """A cubin (ELF64 for EM_CUDA, its section table ending with what it holds) for this GPU's
        architecture or an earlier one of its major version, or PTX text (NUL-terminated) for this
        architecture or an earlier one: refused otherwise, as the driver refuses it."""
        err = self._count("cuModuleLoadData")
        if err:
            return (err, 0)
        if self._context() is None:
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT, 0)
        head = ctypes.string_at(int(image), 64)
        if head[:4] != b"\x7fELF":
            return self._load_ptx(int(image))
        if head[4:7] != b"\x02\x01\x01" or struct.unpack_from("<HHI", head, 0x10)[1:] != (190, 1):
            return (CUresult.CUDA_ERROR_INVALID_IMAGE, 0)  # not ELF64, little-endian, version 1, for EM_CUDA
        shoff, = struct.unpack_from("<Q", head, 0x28)
        flags, ehsize = struct.unpack_from("<IH", head, 0x30)
        shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
        if ehsize != 64 or shentsize != 64 or not 1 <= shnum <= 4096 or not 64 <= shoff <= 16 << 20:
            return (CUresult.CUDA_ERROR_INVALID_IMAGE, 0)
        if ctypes.string_at(int(image) + shoff, 64) != bytes(64):  # section 0 is the null section
            return (CUresult.CUDA_ERROR_INVALID_IMAGE, 0)
        arch = (flags >> 8) & 0xFF if head[8] >= 8 else flags & 0xFF  # EF_CUDA_SM, by ELF ABI version
        major, minor = self.compute_capability
        if arch // 10 != major or arch % 10 > minor:
            return (CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU, 0)
        return self._new_module(ctypes.string_at(int(image), shoff + shentsize * shnum))

    def _load_ptx(self, image: int):
        text = ctypes.string_at(image)  # PTX is read up to its NUL
        found = re.search(rb"^\s*\.target\s+sm_(\d+)", text, re.M)
        if b".version" not in text or found is None:
            return (CUresult.CUDA_ERROR_INVALID_PTX, 0)
        major, minor = self.compute_capability
        if int(found.group(1)) > 10 * major + minor:
            return (CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU, 0)
        return self._new_module(text)

    def _new_module(self, body: bytes):
        handle = self._handle()
        with self._lock:
            self.modules[handle] = (body, self._context())
        return (OK, handle)

    def cuModuleGetFunction(self, module: int, name: bytes):  # noqa: N802
        found = self.modules.get(int(module))
        if found is None:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE, 0)
        if not isinstance(name, bytes) or name not in found[0] or name.decode() not in self.kernel_impls:
            return (CUresult.CUDA_ERROR_NOT_FOUND, 0)
        handle = self._handle()
        with self._lock:
            self.functions[handle] = (name.decode(), found[1])
        return (OK, handle)

    def cuLaunchKernel(self, f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int,  # noqa: N802
                       shared: int, stream: int, params: int, extra: int):
        err = self._count("cuLaunchKernel")
        if err:
            return (err,)
        found = self.functions.get(int(f))
        if found is None:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        name, ctx = found
        if self._context() != ctx:
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        grid, block = (int(gx), int(gy), int(gz)), (int(bx), int(by), int(bz))
        if (min(grid + block) < 1 or grid[0] > 2**31 - 1 or max(grid[1:]) > 65535 or block[0] * block[1] * block[2] > 1024
                or block[2] > 64 or int(shared) > 48 << 10 or int(extra) != 0):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        types, run = self.kernel_impls[name]
        if types and not int(params):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        pointers = (ctypes.c_void_p * max(len(types), 1)).from_address(int(params)) if types else []
        args = [t.from_address(pointers[i]).value for i, t in enumerate(types)]  # copied now, as the driver does
        err = self.queue_stream_work(int(stream), f"kernel {name}", lambda: run(grid, block, *args))
        return (err,)

    def cuDeviceGet(self, ordinal: int):  # noqa: N802
        return (OK, ordinal) if 0 <= ordinal < self.devices else (CUresult.CUDA_ERROR_INVALID_VALUE, 0)

    def cuDevicePrimaryCtxRetain(self, dev: int):  # noqa: N802
        return (OK, 1000 + dev)  # the context of device d is 1000 + d

    def cuCtxSetCurrent(self, ctx: int):  # noqa: N802
        err = self._count("cuCtxSetCurrent")
        if err:
            return (err,)
        self._tls.ctx = None if not int(ctx) else int(ctx) - 1000  # NULL unbinds, as in CUDA
        return (OK,)

    def cuCtxGetCurrent(self):  # noqa: N802
        ctx = self._context()
        return (OK, 0 if ctx is None else 1000 + ctx)

    def cuCtxGetDevice(self):  # noqa: N802
        ctx = self._context()
        return (CUresult.CUDA_ERROR_INVALID_CONTEXT, 0) if ctx is None else (OK, ctx)

    def cuCtxSynchronize(self):  # noqa: N802
        with self._api():
            ctx = self._context()
            if ctx is None:
                return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
            self._complete({h: s.queued for h, s in self._streams.items() if s.device == ctx})
        return (OK,)

    def cuMemFree(self, ptr: int):  # noqa: N802
        with self._api():
            found = self._free_checked(int(ptr), "cuMemFree")
        return (OK if found else CUresult.CUDA_ERROR_INVALID_VALUE,)

    def cuMemFreeHost(self, ptr: int):  # noqa: N802
        with self._api():
            found = self._free_checked(int(ptr), "cuMemFreeHost")
        return (OK if found else CUresult.CUDA_ERROR_INVALID_VALUE,)

    def cuMemAlloc(self, n: int):  # noqa: N802
        err = self._count("cuMemAlloc")
        return (err, 0) if err else self._alloc(n, CUmemorytype.CU_MEMORYTYPE_DEVICE)

    def cuMemAllocManaged(self, n: int, flags: int):  # noqa: N802
        return self._alloc(n, CUmemorytype.CU_MEMORYTYPE_MANAGED)

    def cuMemHostAlloc(self, n: int, flags: int):  # noqa: N802
        err = self._count("cuMemHostAlloc")
        return (err, 0) if err else self._alloc(n, CUmemorytype.CU_MEMORYTYPE_HOST)

    def cuMemHostRegister(self, ptr: int, n: int, flags: int):  # noqa: N802
        err = self._count("cuMemHostRegister")
        if err:
            return (err,)
        if self._context() is None:
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        with self._lock:
            if ptr in self._allocs:
                return (CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,)
            self._allocs[ptr] = (None, n, CUmemorytype.CU_MEMORYTYPE_HOST, self._context())
        return (OK,)

    def cuMemHostUnregister(self, ptr: int):  # noqa: N802
        err = self._count("cuMemHostUnregister")
        if err:
            return (err,)
        with self._api():
            found = self._allocs.get(ptr)
            if found is None or found[0] is not None:
                return (CUresult.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,)
            # Never deferred: the caller unmaps the memory as soon as this returns.
            self._free_now(ptr, "cuMemHostUnregister")
        return (OK,)

    def cuPointerGetAttributes(self, count: int, attributes: list, ptr: int):  # noqa: N802
        kind, managed, device = CUmemorytype.CU_MEMORYTYPE_UNREGISTERED, False, -2
        with self._lock:
            allocs = dict(self._allocs)  # a finaliser run here may free (and so change) the original
        for base, (_raw, n, k, dev) in allocs.items():
            if base <= ptr < base + max(n, 1):
                managed = k == CUmemorytype.CU_MEMORYTYPE_MANAGED
                kind = CUmemorytype.CU_MEMORYTYPE_DEVICE if managed else k
                device = dev
                break
        by_name = {CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE: int(kind),
                   CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_MANAGED: managed,
                   CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: device}
        return (OK, [by_name[a] for a in attributes[:count]])

    def cuMemcpy(self, dst: int, src: int, n: int):  # noqa: N802
        dst, src = int(dst), int(src)
        if self._context() is None:  # a blocking copy runs in the current context: none, refused
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        with self._api():
            self._memory(src, n, "cuMemcpy")
            self._memory(dst, n, "cuMemcpy")
            self._blocking_access("cuMemcpy", (src, n), (dst, n))
            if n:
                ctypes.memmove(dst, self._true_bytes(src, n), n)
        return (OK,)

    def cuMemsetD8(self, ptr: int, value: int, n: int):  # noqa: N802
        with self._api():
            self._memory(int(ptr), n, "cuMemsetD8")
            self._blocking_access("cuMemsetD8", (0, 0), (int(ptr), n))
            ctypes.memset(int(ptr), value, n)
        return (OK,)

    def cuStreamCreate(self, flags: int):  # noqa: N802
        h = self._handle()
        with self._lock:
            self._streams[h] = _Stream(h, self._context() or 0, not int(flags) & _NON_BLOCKING, collections.deque())
        return (OK, h)

    def cuStreamDestroy(self, stream: int):  # noqa: N802
        # As in CUDA, work still queued runs later (here: when the context is synchronised);
        # only the handle goes.
        with self._api():
            s = self._stream(stream)
            if s is None:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            s.destroyed = True
        return (OK,)

    def cuStreamSynchronize(self, stream: int):  # noqa: N802
        with self._api():
            err = self._count("cuStreamSynchronize")
            # A stream made by cuStreamCreate names its context; the null stream is the current
            # context's, and a thread with none is refused (measured on an H200). The legacy and
            # per-thread handles name that context's default stream too: taken alike, not measured.
            if int(stream) in (0, 1, 2) and self._context() is None:
                return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
            s = self._stream(stream)
            if s is None:
                return (err or CUresult.CUDA_ERROR_INVALID_HANDLE,)
            if err:
                self._abort(s)
                return (err,)
            self._complete({s.handle: s.queued})
        return (OK,)

    def _abort(self, s: _Stream) -> None:
        """An error reported by a wait is the failure of the stream's work: none of it runs."""
        for op in s.queue:
            op.cancelled = True
        s.done = s.queued
        s.queue.clear()

    def cuStreamWaitEvent(self, stream: int, event: int, flags: int = 0):  # noqa: N802
        with self._api():
            s = self._stream(stream)
            if s is None or int(event) not in self._events:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            mark = self._events[int(event)]
            if mark is not None:  # an event never recorded is complete: nothing to wait for
                s.queue.append(_Op(s.handle, s.queued, "cuStreamWaitEvent", wait_for=mark))
                s.queued += 1
        return (OK,)

    def cuMemcpyHtoDAsync(self, dst: int, src: int, n: int, stream: int):  # noqa: N802
        return self._enqueue("cuMemcpyHtoDAsync", dst, src, n, stream, "h2d")

    def cuMemcpyBatchAsync(self, dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, stream):  # noqa: N802
        with self._api():
            err = self._count("cuMemcpyBatchAsync")
            if err:
                return (err,)
            assert len(dsts) == len(srcs) == len(sizes) == count and num_attrs == len(attrs) == len(attr_idxs) == 1
            if attrs[0].srcAccessOrder != _SRC_ACCESS_ORDER_STREAM:
                raise StandInLimitation("cuMemcpyBatchAsync: only stream-ordered source access is modelled")
            s = self._stream(stream)
            if s is None:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            for d, src, n in zip(dsts, srcs, sizes):
                self._queue_copy("cuMemcpyBatchAsync", s, int(d), int(src), int(n), "h2d")
        return (OK,)

    def cuMemcpyDtoHAsync(self, dst: int, src: int, n: int, stream: int):  # noqa: N802
        return self._enqueue("cuMemcpyDtoHAsync", dst, src, n, stream, "d2h")

    # -- several devices ----------------------------------------------------------------------
    def cuDeviceCanAccessPeer(self, dev: int, peer: int):  # noqa: N802
        if not (0 <= int(dev) < self.devices and 0 <= int(peer) < self.devices):
            return (CUresult.CUDA_ERROR_INVALID_DEVICE, 0)
        return (OK, int(int(dev) != int(peer) and (int(dev), int(peer)) in self.peers))

    def cuCtxEnablePeerAccess(self, peer_ctx: int, flags: int):  # noqa: N802
        with self._api():
            err = self._count("cuCtxEnablePeerAccess")
            if err:
                return (err,)
            ctx = self._context()
            if ctx is None:
                return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
            peer = int(peer_ctx) - 1000
            if int(flags) != 0 or not 0 <= peer < self.devices:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            if peer == ctx:
                return (CUresult.CUDA_ERROR_INVALID_DEVICE,)
            if (ctx, peer) not in self.peers:
                return (CUresult.CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,)
            if (ctx, peer) in self._peer_enabled:
                return (CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,)
            self._peer_enabled.add((ctx, peer))
        return (OK,)

    def cuMemcpyPeerAsync(self, dst: int, dst_ctx: int, src: int, src_ctx: int, n: int, stream: int):  # noqa: N802
        what = "cuMemcpyPeerAsync"
        dst, src, n = int(dst), int(src), int(n)
        with self._api():
            err = self._count(what)
            if err:
                return (err,)
            s = self._stream(stream)
            if s is None:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            dst_dev, src_dev = int(dst_ctx) - 1000, int(src_ctx) - 1000
            if not (0 <= dst_dev < self.devices and 0 <= src_dev < self.devices):
                return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
            for name, ptr, dev in (("source", src, src_dev), ("destination", dst, dst_dev)):
                self._memory(ptr, n, what)
                owner = self.device_of(ptr)
                if n and owner != dev:
                    self._violate(f"{what}: the {name} {ptr:#x} is not memory of device {dev} "
                                  f"({'host memory' if owner is None else f'device {owner}'})")
            if s.device not in (src_dev, dst_dev) and s.handle not in _DEFAULT_STREAMS:
                self._violate(f"{what}: stream {s.handle} belongs to device {s.device}, neither device "
                              f"{src_dev} nor {dst_dev}")
            self._check_race(what, s.handle, (src, n), (dst, n))
            s.queue.append(_Op(s.handle, s.queued, what, dst, src, n))
            s.queued += 1
            other = dst_dev if s.device == src_dev else src_dev
            self.peer_copies.append((src_dev, dst_dev, n, src_dev == dst_dev or (s.device, other) in self._peer_enabled))
        return (OK,)

    def cuEventCreate(self, flags: int):  # noqa: N802
        h = self._handle()
        with self._lock:
            self._events[h] = None
            self._event_device[h] = self._context()
            self.event_flags[h] = int(flags)
        return (OK, h)

    def cuEventRecord(self, event: int, stream: int):  # noqa: N802
        with self._api():
            err = self._count("cuEventRecord")
            if err:
                return (err,)
            s = self._stream(stream)
            if s is None or int(event) not in self._events:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            made_in = self._event_device.get(int(event))
            if s.handle not in _DEFAULT_STREAMS and made_in is not None and made_in != s.device:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)  # the event and the stream are of two contexts
            self._events[int(event)] = (s.handle, s.queued)  # the work queued so far, no more
        return (OK,)

    def cuEventSynchronize(self, event: int):  # noqa: N802
        with self._api():
            if int(event) not in self._events:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            err = self._count("cuEventSynchronize")
            self.waited_events.append(int(event))
            mark = self._events[int(event)]
            if err:
                if mark is not None:
                    self._abort(self._streams[mark[0]])
                return (err,)
            if mark is not None:
                self._complete({mark[0]: mark[1]})
        return (OK,)

    def cuEventDestroy(self, event: int):  # noqa: N802
        with self._lock:
            if int(event) not in self._events:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            del self._events[int(event)]
            self._event_device.pop(int(event), None)
            self.event_flags.pop(int(event), None)
        return (OK,)

    def cuDeviceGetPCIBusId(self, length: int, device: int):  # noqa: N802
        err = self._count("cuDeviceGetPCIBusId")
        if err:
            return (err, b"")
        if not 0 <= int(device) < self.devices:
            return (CUresult.CUDA_ERROR_INVALID_DEVICE, b"")
        return (OK, self.bus_ids[int(device)].upper().encode()[:length - 1] + b"\0")


def _no_cuda_from_host_funcs(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: FakeDriver, *args: Any, **kwargs: Any) -> Any:
        if getattr(self._tls, "host_func", False):
            message = f"{name} called from inside a host function (cuLaunchHostFunc): CUDA forbids it"
            self.violations.append(message)
            raise StandInViolation(message)
        return method(self, *args, **kwargs)

    return call


for _name, _method in list(vars(FakeDriver).items()):
    if _name.startswith("cu") and callable(_method):
        setattr(FakeDriver, _name, _no_cuda_from_host_funcs(_name, _method))
