"""A stand-in for ``cuda.bindings.driver`` so the GPU paths' logic runs in CI, which has no GPU.

"Device" memory is host memory the fake remembers as device memory; asynchronous copies
are recorded on their stream and carried out only when the stream or an event is
synchronised, so a missing wait shows up as wrong data, as on a real GPU. Errors can be
injected per function name. Only what gdskit calls is implemented, with the bindings'
calling convention (every call returns ``(error, *values)``). Contexts are per thread,
as in the driver: a thread must make one current before it allocates.
"""

from __future__ import annotations

import ctypes
import enum
import threading
from types import SimpleNamespace
from typing import Any


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
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


class CUmemcpyAttributes:
    srcAccessOrder = 0  # noqa: N815 - the bindings' name


class FakeDriver:
    CUresult = CUresult
    CUmemorytype = CUmemorytype
    CUpointer_attribute = CUpointer_attribute
    CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1)
    CUevent_flags = SimpleNamespace(CU_EVENT_BLOCKING_SYNC=1, CU_EVENT_DISABLE_TIMING=2)
    CUmemAttach_flags = SimpleNamespace(CU_MEM_ATTACH_GLOBAL=1)
    CU_MEMHOSTALLOC_PORTABLE = 1
    CU_MEMHOSTREGISTER_PORTABLE = 1
    CUdeviceptr = int
    CUmemcpyAttributes = CUmemcpyAttributes
    CUmemcpySrcAccessOrder = SimpleNamespace(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM=1)

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices
        # Re-entrant: a collection that runs inside a locked block may finalise a DeviceArray,
        # whose cuMemFree takes the lock again on the same thread.
        self._lock = threading.RLock()
        self._allocs: dict[int, tuple[Any, int, CUmemorytype, int]] = {}  # ptr -> (buffer, size, kind, device)
        self._streams: dict[int, list[tuple[int, int, int]]] = {}
        self._events: dict[int, int | None] = {}
        self._next_handle = 100
        self._tls = threading.local()
        self.fail: dict[str, CUresult] = {}  # function name -> error to return (once set, every call)
        self.calls: dict[str, int] = {}

    # -- helpers ------------------------------------------------------------------------------
    def _count(self, name: str) -> CUresult | None:
        self.calls[name] = self.calls.get(name, 0) + 1
        return self.fail.get(name)

    def _context(self) -> int | None:
        return getattr(self._tls, "ctx", None)

    def _alloc(self, n: int, kind: CUmemorytype) -> tuple[CUresult, int]:
        ctx = self._context()
        if ctx is None:
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT, 0)
        raw = ctypes.create_string_buffer(n + 4096)
        ptr = (ctypes.addressof(raw) + 4095) & ~4095
        with self._lock:
            self._allocs[ptr] = (raw, n, kind, ctx)
        return (OK, ptr)

    def _free(self, ptr: int) -> CUresult:
        with self._lock:
            return OK if self._allocs.pop(ptr, None) is not None else CUresult.CUDA_ERROR_INVALID_VALUE

    def _handle(self) -> int:
        with self._lock:
            self._next_handle += 1
            return self._next_handle

    def _run(self, stream: int) -> None:
        with self._lock:
            pending, self._streams[stream] = self._streams.get(stream, []), []
        for dst, src, n in pending:
            ctypes.memmove(dst, src, n)

    def _enqueue(self, name: str, dst: int, src: int, n: int, stream: int) -> tuple[CUresult]:
        err = self._count(name)
        if err:
            return (err,)
        with self._lock:
            self._streams.setdefault(stream, []).append((int(dst), int(src), n))
        return (OK,)

    def live_allocations(self, kind: CUmemorytype | None = None) -> int:
        with self._lock:
            allocs = list(self._allocs.values())
        return sum(1 for _b, _n, k, _d in allocs if kind is None or k == kind)

    # -- the API gdskit uses --------------------------------------------------------------------
    def cuInit(self, flags: int):  # noqa: N802
        return (OK,)

    def cuDeviceGetCount(self):  # noqa: N802
        return (self._count("cuDeviceGetCount") or OK, self.devices)

    def cuDeviceGet(self, ordinal: int):  # noqa: N802
        return (OK, ordinal) if 0 <= ordinal < self.devices else (CUresult.CUDA_ERROR_INVALID_VALUE, 0)

    def cuDevicePrimaryCtxRetain(self, dev: int):  # noqa: N802
        return (OK, 1000 + dev)  # the context of device d is 1000 + d

    def cuCtxSetCurrent(self, ctx: int):  # noqa: N802
        err = self._count("cuCtxSetCurrent")
        if err:
            return (err,)
        self._tls.ctx = int(ctx) - 1000
        return (OK,)

    def cuCtxGetCurrent(self):  # noqa: N802
        ctx = self._context()
        return (OK, 0 if ctx is None else 1000 + ctx)

    def cuCtxGetDevice(self):  # noqa: N802
        ctx = self._context()
        return (CUresult.CUDA_ERROR_INVALID_CONTEXT, 0) if ctx is None else (OK, ctx)

    def cuCtxSynchronize(self):  # noqa: N802
        for s in list(self._streams):
            self._run(s)
        return (OK,)

    def cuMemFree(self, ptr: int):  # noqa: N802
        return (self._free(int(ptr)),)

    cuMemFreeHost = cuMemFree

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
        with self._lock:
            found = self._allocs.get(ptr)
            if found is None or found[0] is not None:
                return (CUresult.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,)
            del self._allocs[ptr]
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
        ctypes.memmove(int(dst), int(src), n)
        return (OK,)

    def cuMemsetD8(self, ptr: int, value: int, n: int):  # noqa: N802
        ctypes.memset(int(ptr), value, n)
        return (OK,)

    def cuStreamCreate(self, flags: int):  # noqa: N802
        h = self._handle()
        self._streams[h] = []
        return (OK, h)

    def cuStreamDestroy(self, stream: int):  # noqa: N802
        self._run(stream)
        self._streams.pop(stream, None)
        return (OK,)

    def cuStreamSynchronize(self, stream: int):  # noqa: N802
        err = self._count("cuStreamSynchronize")
        if err:
            return (err,)
        if stream in self._streams:
            self._run(stream)
        return (OK,)

    def cuMemcpyHtoDAsync(self, dst: int, src: int, n: int, stream: int):  # noqa: N802
        return self._enqueue("cuMemcpyHtoDAsync", dst, src, n, stream)

    def cuMemcpyBatchAsync(self, dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, stream):  # noqa: N802
        err = self._count("cuMemcpyBatchAsync")
        if err:
            return (err,)
        assert len(dsts) == len(srcs) == len(sizes) == count and num_attrs == len(attrs) == len(attr_idxs) == 1
        with self._lock:
            self._streams.setdefault(stream, []).extend(
                (int(d), int(s), n) for d, s, n in zip(dsts, srcs, sizes))
        return (OK,)

    def cuMemcpyDtoHAsync(self, dst: int, src: int, n: int, stream: int):  # noqa: N802
        return self._enqueue("cuMemcpyDtoHAsync", dst, src, n, stream)

    def cuEventCreate(self, flags: int):  # noqa: N802
        h = self._handle()
        self._events[h] = None
        return (OK, h)

    def cuEventRecord(self, event: int, stream: int):  # noqa: N802
        self._events[event] = stream
        return (OK,)

    def cuEventSynchronize(self, event: int):  # noqa: N802
        stream = self._events.get(event)
        if stream is not None:
            self._run(stream)
        return (OK,)

    def cuEventDestroy(self, event: int):  # noqa: N802
        self._events.pop(event, None)
        return (OK,)

    def cuDeviceGetPCIBusId(self, length: int, device: int):  # noqa: N802
        return (OK, b"0000:00:06.0\0")
