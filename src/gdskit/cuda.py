"""A thin, lazy layer over ``cuda.bindings.runtime``.

Nothing here imports CUDA at module import time: ``import gdskit`` must work on a
machine with no GPU, no driver and no bindings. Every call checks the CUDA error
code and raises :class:`gdskit.errors.CudaError` on failure.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any

from gdskit.errors import CudaError
from gdskit.residency import MAP_FAILED, libc


class MemoryKind(str, enum.Enum):
    """Where a pointer's memory lives, as CUDA sees it."""

    HOST = "host"          # ordinary pageable host memory
    PINNED = "pinned"      # page-locked host memory known to CUDA
    DEVICE = "device"      # cudaMalloc / cuMemAlloc / cuMemCreate memory
    MANAGED = "managed"    # unified (managed) memory


@functools.lru_cache(maxsize=1)
def _runtime() -> Any:
    from cuda.bindings import runtime  # noqa: PLC0415 - lazy on purpose

    return runtime


@functools.lru_cache(maxsize=1)
def _driver() -> Any:
    from cuda.bindings import driver  # noqa: PLC0415 - lazy on purpose

    return driver


def runtime_or_none() -> Any | None:
    """The bindings' runtime module, or ``None`` when it cannot be imported."""
    try:
        return _runtime()
    except Exception:
        return None


def check(result: Any, what: str) -> Any:
    """Unpack a cuda.bindings ``(err, *values)`` tuple, raising on error."""
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if int(err) != 0:
        name = getattr(err, "name", str(err))
        raise CudaError(f"{what} failed: {name}", code=name)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


_count_lock = threading.Lock()
_device_count: int | None = None


def device_count() -> int:
    """Number of CUDA devices; 0 when there is no GPU, driver or bindings. Never raises."""
    global _device_count
    if _device_count is not None:
        return _device_count
    with _count_lock:
        if _device_count is None:
            rt = runtime_or_none()
            if rt is None:
                _device_count = 0
            else:
                try:
                    err, n = rt.cudaGetDeviceCount()
                    _device_count = int(n) if int(err) == 0 else 0
                except Exception:
                    _device_count = 0
        return _device_count


def available() -> bool:
    return device_count() > 0


@dataclass(frozen=True)
class PointerInfo:
    kind: MemoryKind
    device: int | None  # CUDA device ordinal for device/managed memory


def pointer_info(ptr: int) -> PointerInfo:
    """Ask CUDA what kind of memory ``ptr`` points into (host if CUDA does not know it)."""
    if not available():
        return PointerInfo(MemoryKind.HOST, None)
    rt = _runtime()
    err, attrs = rt.cudaPointerGetAttributes(ptr)
    if int(err) != 0:
        # An unknown host pointer is reported as an error by some drivers: it is pageable memory.
        rt.cudaGetLastError()
        return PointerInfo(MemoryKind.HOST, None)
    t = int(attrs.type)
    if t == int(rt.cudaMemoryType.cudaMemoryTypeDevice):
        return PointerInfo(MemoryKind.DEVICE, int(attrs.device))
    if t == int(rt.cudaMemoryType.cudaMemoryTypeManaged):
        return PointerInfo(MemoryKind.MANAGED, int(attrs.device))
    if t == int(rt.cudaMemoryType.cudaMemoryTypeHost):
        return PointerInfo(MemoryKind.PINNED, None)
    return PointerInfo(MemoryKind.HOST, None)


def set_device(device: int) -> None:
    check(_runtime().cudaSetDevice(device), "cudaSetDevice")


def current_device() -> int:
    return int(check(_runtime().cudaGetDevice(), "cudaGetDevice"))


class PinnedBuffer:
    """Page-locked host memory from ``cudaHostAlloc``, freed exactly once."""

    def __init__(self, nbytes: int) -> None:
        rt = _runtime()
        self.nbytes = nbytes
        self.ptr = int(check(rt.cudaHostAlloc(nbytes, rt.cudaHostAllocPortable), "cudaHostAlloc"))
        # A writable view over the whole buffer, for os.preadv / os.pwrite.
        self.view = memoryview((ctypes.c_char * nbytes).from_address(self.ptr)).cast("B")

    def free(self) -> None:
        if self.ptr:
            self.view.release()
            check(_runtime().cudaFreeHost(self.ptr), "cudaFreeHost")
            self.ptr = 0

    def __del__(self) -> None:  # last resort; pools free explicitly
        try:
            self.free()
        except Exception:
            pass


_HUGE_PAGE = 2 << 20
_MADV_DONTFORK, _MADV_HUGEPAGE, _MADV_NOHUGEPAGE, _MADV_POPULATE_WRITE = 10, 14, 15, 23


def _libc() -> Any:
    return libc  # the one ctypes view of the C library (gdskit.residency)


class RegisteredHostBuffer:
    """Page-locked host memory made by hand: anonymous memory on transparent huge pages,
    faulted in by the calling thread, then ``cudaHostRegister``-ed. Freed exactly once.

    Why not ``cudaHostAlloc``: on the H200 machine (a VM, where the first touch of guest
    memory is slow) 128 MiB from ``cudaHostAlloc`` took 54-114 ms, and allocations from
    several threads serialise; the same memory made this way by 16 threads at once took
    10-13 ms. Each worker makes its own stage, so the faults run in parallel.
    """

    def __init__(self, nbytes: int) -> None:
        libc = _libc()
        self.nbytes = nbytes
        self.ptr = 0
        span = -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        self._map_len = span + _HUGE_PAGE  # slack, so the memory can start on a huge-page boundary
        base = libc.mmap(None, self._map_len, mmap.PROT_READ | mmap.PROT_WRITE,
                         mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if base is None or base == MAP_FAILED:
            err = ctypes.get_errno()
            raise CudaError(f"mmap of {self._map_len} bytes for pinned staging failed: {os.strerror(err)}")
        self._base = base
        try:
            start = (base + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
            whole = span // _HUGE_PAGE * _HUGE_PAGE
            # Advice only; where huge pages are off this is ordinary memory. The tail stays on
            # small pages so that no huge page is locked beyond the bytes asked for.
            if whole:
                libc.madvise(start, whole, _MADV_HUGEPAGE)
            if span > whole:
                libc.madvise(start + whole, span - whole, _MADV_NOHUGEPAGE)
            # A forked child (a data-loader worker) gets none of it: it cannot use CUDA anyway,
            # and the kernel would otherwise copy every page-locked page into it at fork.
            libc.madvise(start, span, _MADV_DONTFORK)
            # Fault every page in now, in this thread (Linux 5.14+; else by writing it).
            if libc.madvise(start, span, _MADV_POPULATE_WRITE) != 0:
                ctypes.memset(start, 0, span)
            rt = _runtime()
            check(rt.cudaHostRegister(start, span, rt.cudaHostRegisterPortable), "cudaHostRegister")
        except BaseException:
            libc.munmap(base, self._map_len)
            raise
        self.ptr = start
        self.view = memoryview((ctypes.c_char * nbytes).from_address(self.ptr)).cast("B")

    def free(self) -> None:
        if self.ptr:
            self.view.release()
            ptr, self.ptr = self.ptr, 0
            rt = runtime_or_none()
            err = rt.cudaHostUnregister(ptr)[0] if rt is not None else 1
            # Unmap only what CUDA no longer holds; otherwise the exiting process takes it back.
            if int(err) == 0:
                _libc().munmap(self._base, self._map_len)
            check(err, "cudaHostUnregister")

    def __del__(self) -> None:  # last resort; pools free explicitly
        try:
            self.free()
        except Exception:
            pass


class Stream:
    """A non-blocking CUDA stream on one device, with one event for cheap waits."""

    def __init__(self, device: int) -> None:
        rt = _runtime()
        set_device(device)
        self.device = device
        self.handle = check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreate")

    # Copies go through the driver API. cuda-bindings links its own CUDA runtime, so in a
    # process with torch the memory usually comes from another runtime (torch's allocator).
    def copy_h2d(self, dst: int, src: int, nbytes: int) -> None:
        check(_driver().cuMemcpyHtoDAsync(dst, src, nbytes, self.handle), "cuMemcpyHtoDAsync")

    def copy_d2h(self, dst: int, src: int, nbytes: int) -> None:
        check(_driver().cuMemcpyDtoHAsync(dst, src, nbytes, self.handle), "cuMemcpyDtoHAsync")

    def synchronize(self) -> None:
        check(_runtime().cudaStreamSynchronize(self.handle), "cudaStreamSynchronize")

    def destroy(self) -> None:
        if self.handle is not None:
            try:
                _runtime().cudaStreamDestroy(self.handle)
            finally:
                self.handle = None


def memcpy(dst: int, src: int, nbytes: int) -> None:
    """A blocking copy in any direction (unified addressing)."""
    rt = _runtime()
    check(rt.cudaMemcpy(dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDefault), "cudaMemcpy")


def device_pci_bus_id(device: int) -> str:
    rt = _runtime()
    raw = check(rt.cudaDeviceGetPCIBusId(32, device), "cudaDeviceGetPCIBusId")
    if isinstance(raw, (bytes, bytearray)):
        raw = raw.split(b"\0", 1)[0].decode()
    return str(raw).lower()


class Event:
    """A timing-free CUDA event used to know when an async copy has finished."""

    def __init__(self) -> None:
        rt = _runtime()
        # Blocking sync: a waiting worker sleeps instead of spinning a core the other workers need.
        flags = rt.cudaEventDisableTiming | rt.cudaEventBlockingSync
        self.handle = check(rt.cudaEventCreateWithFlags(flags), "cudaEventCreate")
        self.pending = False

    def record(self, stream: Stream) -> None:
        check(_runtime().cudaEventRecord(self.handle, stream.handle), "cudaEventRecord")
        self.pending = True

    def wait(self) -> None:
        if self.pending:
            check(_runtime().cudaEventSynchronize(self.handle), "cudaEventSynchronize")
            self.pending = False

    def destroy(self) -> None:
        if self.handle is not None:
            try:
                _runtime().cudaEventDestroy(self.handle)
            finally:
                self.handle = None


def synchronize_producer(stream: int | None) -> None:
    """Wait for work the buffer's producer may still have queued on it.

    ``stream`` is the ``__cuda_array_interface__`` stream (1 = legacy default,
    2 = per-thread default, otherwise a handle). ``None`` (a producer that names
    no stream: a version-2 interface without DLPack) means the legacy default
    stream, as for Numba and CuPy. Never the whole device: that would also wait
    for gdskit's own copies of other requests in flight.
    """
    rt = _runtime()
    if stream is None or stream == 1:
        check(rt.cudaStreamSynchronize(0), "cudaStreamSynchronize")
    elif stream == 2:
        check(rt.cudaStreamSynchronize(rt.cudaStreamPerThread), "cudaStreamSynchronize")
    else:
        check(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")


class DeviceArray:
    """Plain ``cudaMalloc`` (or managed) memory exposing ``__cuda_array_interface__``.

    For programs (and gdskit's own benchmarks and tests) that need GPU buffers
    without torch or CuPy. Freed exactly once, by :meth:`free` or the GC.
    """

    def __init__(self, nbytes: int, device: int | None = None, managed: bool = False) -> None:
        rt = _runtime()
        if device is not None:
            set_device(device)
        self.device = current_device()
        self.nbytes = nbytes
        self.managed = managed
        if managed:
            self.ptr = int(check(rt.cudaMallocManaged(max(nbytes, 1), rt.cudaMemAttachGlobal), "cudaMallocManaged"))
        else:
            self.ptr = int(check(rt.cudaMalloc(max(nbytes, 1)), "cudaMalloc"))
        # "stream": None: the memory has no producer work pending (we synchronise after our own writes).
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                                         "version": 3, "strides": None, "stream": None}

    def fill(self, value: int) -> None:
        """Set every byte to ``value``."""
        rt = _runtime()
        check(rt.cudaMemset(self.ptr, value, max(self.nbytes, 1)), "cudaMemset")
        check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def copy_from_host(self, data: Any, offset: int = 0) -> None:
        """Copy ``data`` (bytes-like or a numpy array) to ``offset`` (blocking)."""
        import numpy as np  # noqa: PLC0415

        arr = np.ascontiguousarray(np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data)
        if arr.nbytes:
            memcpy(self.ptr + offset, arr.ctypes.data, arr.nbytes)

    def to_numpy(self, nbytes: int | None = None) -> Any:
        """A host copy of the first ``nbytes`` (default: all) as a uint8 numpy array."""
        import numpy as np  # noqa: PLC0415

        n = self.nbytes if nbytes is None else nbytes
        out = np.empty(n, dtype=np.uint8)
        if n:
            memcpy(out.ctypes.data, self.ptr, n)
        return out

    def free(self) -> None:
        if self.ptr:
            rt = runtime_or_none()
            if rt is not None:
                rt.cudaFree(self.ptr)
            self.ptr = 0

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:
            pass
