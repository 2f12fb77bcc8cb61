"""The driver calls a client makes to share its GPU memory with the resident loader: which GPU a
pointer is on, the allocation holding it, and that allocation's CUDA IPC handle.

Five functions of the driver library the process has already loaded (torch made its context),
called through ctypes: importing ``cuda.bindings.driver`` costs 15-21 ms on the GPU machines, as
much as the rest of a resident load's set-up, and these calls need none of its types.
"""

from __future__ import annotations

import bisect
import ctypes
import threading

CUDA_SUCCESS = 0
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_lock = threading.Lock()
_driver: list[ctypes.CDLL | None] = []


class IpcUnavailable(Exception):
    """Memory that cannot be shared this way; its message says why (a few words)."""


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


def _lib() -> ctypes.CDLL:
    with _lock:
        if not _driver:
            try:
                lib: ctypes.CDLL | None = ctypes.CDLL("libcuda.so.1")
            except OSError:
                lib = None
            if lib is not None:
                try:
                    _declare(lib)
                except AttributeError:  # a driver without one of them
                    lib = None
            _driver.append(lib)
    if _driver[0] is None:
        raise IpcUnavailable("no CUDA driver library (libcuda.so.1)")
    return _driver[0]


def _declare(lib: ctypes.CDLL) -> None:
    ptr, size = ctypes.c_uint64, ctypes.c_size_t
    uuid_fn = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid
    table = [
        (lib.cuPointerGetAttribute, [ctypes.c_void_p, ctypes.c_int, ptr]),
        (lib.cuDeviceGet, [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
        (uuid_fn, [ctypes.POINTER(_Uuid), ctypes.c_int]),
        (lib.cuMemGetAddressRange_v2, [ctypes.POINTER(ptr), ctypes.POINTER(size), ptr]),
        (lib.cuIpcGetMemHandle, [ctypes.POINTER(_Handle), ptr]),
    ]
    for fn, args in table:
        fn.argtypes, fn.restype = args, ctypes.c_int
    lib.gdskit_uuid = uuid_fn  # type: ignore[attr-defined]


def _check(what: str, code: int) -> None:
    if code != CUDA_SUCCESS:
        raise IpcUnavailable(f"{what} failed (CUDA error {code})")


def device_uuid(ptr: int) -> str:
    """The UUID of the GPU whose memory ``ptr`` is, as ``nvidia-smi -L`` writes it (without ``GPU-``)."""
    ordinal = ctypes.c_int(-1)
    _check("cuPointerGetAttribute", _lib().cuPointerGetAttribute(ctypes.byref(ordinal),
                                                                 _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr))
    return ordinal_uuid(ordinal.value)


def ordinal_uuid(ordinal: int) -> str:
    """The UUID of the driver's GPU number ``ordinal`` (the process's context is made: the driver
    is initialised)."""
    lib = _lib()
    dev, uuid = ctypes.c_int(), _Uuid()
    _check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), ordinal))
    _check("cuDeviceGetUuid", lib.gdskit_uuid(ctypes.byref(uuid), dev.value))
    h = bytes(uuid.bytes).hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class Segments:
    """The allocations holding a load's destinations, each asked of the driver once: the
    allocator puts many small tensors in one (a 20,000-tensor load asks a few hundred times)."""

    def __init__(self) -> None:
        self._bases: list[int] = []   # sorted
        self._ends: dict[int, int] = {}
        self._index: dict[int, int] = {}
        self.handles: list[str] = []  # hex, by segment index

    def place(self, ptr: int, nbytes: int) -> tuple[int, int]:
        """``(segment, offset in it)`` of ``nbytes`` at ``ptr``; IpcUnavailable where the memory
        cannot be shared (not from the driver's ordinary allocator: expandable segments,
        stream-ordered pools, managed or host memory)."""
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i < 0 or ptr + nbytes > self._ends[self._bases[i]]:
            base, size = self._range(ptr)
            if ptr + nbytes > base + size:
                raise IpcUnavailable(f"{nbytes} bytes at {ptr:#x} cross the end of their allocation")
            self._add(base, size)
            i = bisect.bisect_right(self._bases, ptr) - 1
        base = self._bases[i]
        return self._index[base], ptr - base

    def _range(self, ptr: int) -> tuple[int, int]:
        lib = _lib()
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        _check("cuMemGetAddressRange", lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr))
        return base.value, size.value

    def _add(self, base: int, size: int) -> None:
        handle = _Handle()
        _check("cuIpcGetMemHandle", _lib().cuIpcGetMemHandle(ctypes.byref(handle), base))
        self._index[base] = len(self.handles)
        self.handles.append(bytes(handle.reserved).hex())
        bisect.insort(self._bases, base)
        self._ends[base] = base + size
