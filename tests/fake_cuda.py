"""A stand-in for ``cuda.bindings.runtime`` so the GPU paths' logic runs in CI, which has no GPU.

"Device" memory is host memory the fake remembers as device memory; asynchronous copies
are recorded on their stream and carried out only when the stream or an event is
synchronised, so a missing wait shows up as wrong data, as on a real GPU. Errors can be
injected per function name. Only what gdskit calls is implemented, with the bindings'
calling convention (every call returns ``(error, *values)``).
"""

from __future__ import annotations

import ctypes
import enum
import threading
from types import SimpleNamespace
from typing import Any


class cudaError_t(enum.IntEnum):  # noqa: N801 - the bindings' names
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorHostMemoryAlreadyRegistered = 712
    cudaErrorHostMemoryNotRegistered = 713


class cudaMemcpyKind(enum.IntEnum):  # noqa: N801
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3
    cudaMemcpyDefault = 4


class cudaMemoryType(enum.IntEnum):  # noqa: N801
    cudaMemoryTypeUnregistered = 0
    cudaMemoryTypeHost = 1
    cudaMemoryTypeDevice = 2
    cudaMemoryTypeManaged = 3


OK = cudaError_t.cudaSuccess


class FakeRuntime:
    cudaError_t = cudaError_t
    cudaMemcpyKind = cudaMemcpyKind
    cudaMemoryType = cudaMemoryType
    cudaStreamNonBlocking = 1
    cudaHostAllocPortable = 1
    cudaHostRegisterPortable = 1
    cudaEventDisableTiming = 2
    cudaEventBlockingSync = 1
    cudaStreamPerThread = 2
    cudaMemAttachGlobal = 1

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices
        self._lock = threading.Lock()
        self._allocs: dict[int, tuple[Any, int, cudaMemoryType, int]] = {}  # ptr -> (buffer, size, kind, device)
        self._streams: dict[int, list[tuple[int, int, int]]] = {}
        self._events: dict[int, int | None] = {}
        self._next_handle = 100
        self._tls = threading.local()
        self.fail: dict[str, cudaError_t] = {}  # function name -> error to return (once set, every call)
        self.calls: dict[str, int] = {}

    # -- helpers ------------------------------------------------------------------------------
    def _count(self, name: str) -> cudaError_t | None:
        self.calls[name] = self.calls.get(name, 0) + 1
        return self.fail.get(name)

    def _alloc(self, n: int, kind: cudaMemoryType) -> int:
        raw = ctypes.create_string_buffer(n + 4096)
        ptr = (ctypes.addressof(raw) + 4095) & ~4095
        with self._lock:
            self._allocs[ptr] = (raw, n, kind, self._device())
        return ptr

    def _free(self, ptr: int) -> cudaError_t:
        with self._lock:
            return OK if self._allocs.pop(ptr, None) is not None else cudaError_t.cudaErrorInvalidValue

    def _device(self) -> int:
        return getattr(self._tls, "device", 0)

    def _handle(self) -> int:
        with self._lock:
            self._next_handle += 1
            return self._next_handle

    def _run(self, stream: int) -> None:
        with self._lock:
            pending, self._streams[stream] = self._streams.get(stream, []), []
        for dst, src, n in pending:
            ctypes.memmove(dst, src, n)

    def live_allocations(self, kind: cudaMemoryType | None = None) -> int:
        with self._lock:
            return sum(1 for _b, _n, k, _d in self._allocs.values() if kind is None or k == kind)

    # -- the API gdskit uses --------------------------------------------------------------------
    def cudaGetDeviceCount(self):  # noqa: N802
        return (self._count("cudaGetDeviceCount") or OK, self.devices)

    def cudaGetLastError(self):  # noqa: N802
        return (OK,)

    def cudaSetDevice(self, device: int):  # noqa: N802
        err = self._count("cudaSetDevice")
        if err:
            return (err,)
        self._tls.device = device
        return (OK,)

    def cudaGetDevice(self):  # noqa: N802
        return (OK, self._device())

    def cudaFree(self, ptr: int):  # noqa: N802
        return (self._free(int(ptr)),)

    cudaFreeHost = cudaFree

    def cudaMalloc(self, n: int):  # noqa: N802
        err = self._count("cudaMalloc")
        return (err, 0) if err else (OK, self._alloc(n, cudaMemoryType.cudaMemoryTypeDevice))

    def cudaMallocManaged(self, n: int, flags: int):  # noqa: N802
        return (OK, self._alloc(n, cudaMemoryType.cudaMemoryTypeManaged))

    def cudaHostAlloc(self, n: int, flags: int):  # noqa: N802
        err = self._count("cudaHostAlloc")
        return (err, 0) if err else (OK, self._alloc(n, cudaMemoryType.cudaMemoryTypeHost))

    def cudaHostRegister(self, ptr: int, n: int, flags: int):  # noqa: N802
        err = self._count("cudaHostRegister")
        if err:
            return (err,)
        with self._lock:
            if ptr in self._allocs:
                return (cudaError_t.cudaErrorHostMemoryAlreadyRegistered,)
            self._allocs[ptr] = (None, n, cudaMemoryType.cudaMemoryTypeHost, self._device())
        return (OK,)

    def cudaHostUnregister(self, ptr: int):  # noqa: N802
        err = self._count("cudaHostUnregister")
        if err:
            return (err,)
        with self._lock:
            found = self._allocs.get(ptr)
            if found is None or found[0] is not None:
                return (cudaError_t.cudaErrorHostMemoryNotRegistered,)
            del self._allocs[ptr]
        return (OK,)

    def cudaPointerGetAttributes(self, ptr: int):  # noqa: N802
        with self._lock:
            for base, (_raw, n, kind, dev) in self._allocs.items():
                if base <= ptr < base + max(n, 1):
                    return (OK, SimpleNamespace(type=kind, device=dev))
        return (OK, SimpleNamespace(type=cudaMemoryType.cudaMemoryTypeUnregistered, device=-2))

    def cudaMemcpy(self, dst: int, src: int, n: int, kind: Any):  # noqa: N802
        ctypes.memmove(int(dst), int(src), n)
        return (OK,)

    def cudaMemset(self, ptr: int, value: int, n: int):  # noqa: N802
        ctypes.memset(int(ptr), value, n)
        return (OK,)

    def cudaDeviceSynchronize(self):  # noqa: N802
        for s in list(self._streams):
            self._run(s)
        return (OK,)

    def cudaStreamCreateWithFlags(self, flags: int):  # noqa: N802
        h = self._handle()
        self._streams[h] = []
        return (OK, h)

    def cudaStreamDestroy(self, stream: int):  # noqa: N802
        self._run(stream)
        self._streams.pop(stream, None)
        return (OK,)

    def cudaStreamSynchronize(self, stream: int):  # noqa: N802
        err = self._count("cudaStreamSynchronize")
        if err:
            return (err,)
        if stream in self._streams:
            self._run(stream)
        return (OK,)

    def cudaMemcpyAsync(self, dst: int, src: int, n: int, kind: Any, stream: int):  # noqa: N802
        err = self._count("cudaMemcpyAsync")
        if err:
            return (err,)
        with self._lock:
            self._streams.setdefault(stream, []).append((int(dst), int(src), n))
        return (OK,)

    def cudaEventCreateWithFlags(self, flags: int):  # noqa: N802
        h = self._handle()
        self._events[h] = None
        return (OK, h)

    def cudaEventRecord(self, event: int, stream: int):  # noqa: N802
        self._events[event] = stream
        return (OK,)

    def cudaEventSynchronize(self, event: int):  # noqa: N802
        stream = self._events.get(event)
        if stream is not None:
            self._run(stream)
        return (OK,)

    def cudaEventDestroy(self, event: int):  # noqa: N802
        self._events.pop(event, None)
        return (OK,)

    def cudaDeviceGetPCIBusId(self, length: int, device: int):  # noqa: N802
        return (OK, b"0000:00:06.0\0")


class FakeDriver:
    """The driver-API calls gdskit makes, on top of a :class:`FakeRuntime` (same memory and streams)."""

    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime = runtime

    def cuMemcpyHtoDAsync(self, dst: int, src: int, n: int, stream: int):  # noqa: N802
        return self.runtime.cudaMemcpyAsync(dst, src, n, cudaMemcpyKind.cudaMemcpyHostToDevice, stream)

    def cuMemcpyDtoHAsync(self, dst: int, src: int, n: int, stream: int):  # noqa: N802
        return self.runtime.cudaMemcpyAsync(dst, src, n, cudaMemcpyKind.cudaMemcpyDeviceToHost, stream)
