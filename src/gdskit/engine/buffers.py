"""Adapt the objects users pass as buffers to one plain description of memory.

Accepted: anything with ``__cuda_array_interface__`` (CuPy, Numba, torch CUDA
tensors), the buffer protocol (numpy, bytearray, memoryview, mmap), or DLPack
(torch tensors on any device, JAX, ...). The object must be C-contiguous. numpy
and CuPy users never need torch.
"""

from __future__ import annotations

import bisect
import ctypes
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import gdskit.engine.cuda as cuda
from gdskit.engine.cuda import MemoryKind
from gdskit.errors import UnsupportedBufferError


@dataclass
class BufferView:
    """Raw facts about a buffer: where it lives and how big it is.

    ``host_view`` is a byte memoryview for host memory (``None`` for device memory).
    ``owner`` keeps the exporting object (and any DLPack capsule) alive.
    """

    ptr: int
    nbytes: int
    kind: MemoryKind
    device: int | None
    readonly: bool
    host_view: memoryview | None = None
    owner: Any = field(default=None, repr=False)
    # Work the producer may still have queued on the memory: sync this stream before
    # reading device memory out (None with producer_sync: unknown stream, sync the device).
    producer_stream: int | None = None
    producer_sync: bool = False
    # Device memory in several separate allocations (see scattered_device_view); ``ptr`` is then 0.
    scatter: ScatterList | None = None
    # For a scattered read: whether its caller found all the bytes it reads in the page cache
    # (None: not asked). The engine takes that answer instead of asking again.
    source_cached: bool | None = None
    # For a scattered read: whether the caller's thread goes on making destinations while it runs
    # (None: not said, taken as yes). Such a job, from the page cache, gets few workers.
    caller_busy: bool | None = None

    @property
    def on_device(self) -> bool:
        return self.kind in (MemoryKind.DEVICE, MemoryKind.MANAGED)


# -- __cuda_array_interface__ ------------------------------------------------

def _itemsize(typestr: str) -> int:
    try:
        return int(typestr[2:])
    except ValueError as exc:
        raise UnsupportedBufferError(f"unknown typestr {typestr!r} in __cuda_array_interface__") from exc


def _check_c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...] | None, itemsize: int) -> None:
    if strides is None or math.prod(shape) == 0:
        return
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            raise UnsupportedBufferError("buffer is not C-contiguous; pass a contiguous copy")
        expected *= dim


def _from_cuda_array_interface(obj: Any, cai: dict[str, Any]) -> BufferView:
    shape = tuple(int(d) for d in cai["shape"])
    itemsize = _itemsize(cai["typestr"])
    strides = cai.get("strides")
    _check_c_contiguous(shape, tuple(strides) if strides else None, itemsize)
    ptr, readonly = cai["data"]
    nbytes = math.prod(shape) * itemsize
    info = cuda.pointer_info(int(ptr)) if ptr else cuda.PointerInfo(MemoryKind.DEVICE, None)
    # CAI v3: "stream": None means nothing to wait for; a missing key (v2 producers) means unknown.
    stream = cai.get("stream", -1)
    sync = stream is not None
    return BufferView(int(ptr or 0), nbytes, info.kind, info.device, bool(readonly), None, obj,
                      int(stream) if stream not in (None, -1) else None, sync)


def _from_device_array(arr: cuda.DeviceArray) -> BufferView:
    """gdskit's own device memory: its kind and device are known from its allocation, so the
    driver is not asked (a small read's description would otherwise cost more than its copy)."""
    if not arr.ptr:
        raise UnsupportedBufferError("this DeviceArray has been freed")
    kind = MemoryKind.MANAGED if arr.managed else MemoryKind.DEVICE
    return BufferView(arr.ptr, arr.nbytes, kind, arr.device, False, None, arr)


# -- buffer protocol ---------------------------------------------------------

def _plain_tensor(torch: Any, t: Any) -> bool:
    """Whether ``t`` is a tensor gdskit may describe itself rather than through DLPack: strided,
    contiguous, not quantized, and neither requiring grad nor carrying a conjugate or negative bit
    (DLPack refuses those)."""
    return (t.layout is torch.strided and not t.requires_grad and not t.is_quantized
            and not t.is_conj() and not t.is_neg() and t.is_contiguous())


def _plain_cpu_tensor_bytes(torch: Any, t: Any) -> Any:
    """A plain CPU tensor's bytes as a uint8 ndarray over its memory (about 3 µs, where
    DLPack's export takes about 15: paid per tensor of a checkpoint, per batch of a loader);
    None for anything DLPack must judge: other devices, pinned memory (DLPack may say so), and
    whatever is not :func:`_plain_tensor`."""
    if t.device.type != "cpu" or not _plain_tensor(torch, t) or t.is_pinned():
        return None
    try:
        if t.dtype is not torch.uint8:
            t = (t if t.dim() else t.reshape(1)).view(torch.uint8)  # contiguous: the last dimension widens
        return t.numpy()
    except (RuntimeError, TypeError):
        return None


def _plain_cuda_tensor_view(torch: Any, t: Any) -> BufferView | None:
    """A CUDA tensor ``t`` (its caller checked ``is_cuda``), if plain, described from torch itself
    without a DLPack export (about 15 µs, more than a small read's copy): the producer work to wait
    for is what is queued on torch's current stream of the tensor's device, as the export's
    ``stream=1`` would order it. None for anything DLPack must judge (see
    :func:`_plain_tensor`)."""
    if not _plain_tensor(torch, t):
        return None
    ptr = t.data_ptr()
    if not ptr:
        return None
    info = cuda.pointer_info(ptr)  # torch's allocator may be a managed-memory one
    if info.kind is not MemoryKind.DEVICE and info.kind is not MemoryKind.MANAGED:
        return None
    index = t.device.index
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # the handle alone: no Stream object made
    stream = raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream
    return BufferView(ptr, t.numel() * t.element_size(), info.kind, info.device, False, None, t,
                      int(stream), True)


def _from_buffer_protocol(obj: Any) -> BufferView:
    """numpy arrays, bytearray, memoryview, mmap...: small reads are dominated by this per-call work."""
    mv = memoryview(obj)
    if not mv.c_contiguous:
        raise UnsupportedBufferError("buffer is not C-contiguous; pass a contiguous copy")
    if "O" in mv.format:  # reading bytes over Python object pointers would corrupt the interpreter
        raise UnsupportedBufferError("an array of Python objects has no plain bytes to read into or write from")
    if not mv.nbytes:
        return BufferView(0, 0, MemoryKind.HOST, None, mv.readonly, memoryview(b""), obj)
    byte_view = mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")
    if not mv.readonly:
        # ctypes finds a writable buffer's address about three times faster than numpy.
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(byte_view))
    else:  # ctypes takes only writable buffers
        import numpy as np  # noqa: PLC0415 - import time

        ptr = int(np.frombuffer(byte_view, dtype=np.uint8).ctypes.data)
    return BufferView(ptr, mv.nbytes, MemoryKind.HOST, None, mv.readonly, byte_view, obj)


# -- DLPack ------------------------------------------------------------------

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]



_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _from_dlpack(obj: Any) -> BufferView:
    dev_type, _dev_id = obj.__dlpack_device__()
    try:
        # stream=1: the producer orders its work before the legacy default stream, which we then sync.
        capsule = obj.__dlpack__(stream=1) if int(dev_type) in (_DL_CUDA, _DL_CUDA_MANAGED) else obj.__dlpack__()
    except TypeError:
        capsule = obj.__dlpack__()
    addr = _get_pointer(capsule, b"dltensor")
    t = _DLManagedTensor.from_address(addr).dl_tensor
    shape = tuple(t.shape[i] for i in range(t.ndim))
    itemsize = (t.dtype.bits * t.dtype.lanes + 7) // 8
    strides = tuple(t.strides[i] * itemsize for i in range(t.ndim)) if t.strides else None
    _check_c_contiguous(shape, strides, itemsize)
    ptr = int(t.data or 0) + int(t.byte_offset)
    nbytes = math.prod(shape) * itemsize
    owner = (obj, capsule)  # the capsule's destructor releases the export when we drop it
    if int(t.device.device_type) in (_DL_CPU, _DL_CUDA_HOST):
        view = memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B") if nbytes else memoryview(b"")
        kind = MemoryKind.PINNED if int(t.device.device_type) == _DL_CUDA_HOST else MemoryKind.HOST
        return BufferView(ptr, nbytes, kind, None, False, view, owner)
    if int(t.device.device_type) in (_DL_CUDA, _DL_CUDA_MANAGED):
        info = cuda.pointer_info(ptr) if ptr else cuda.PointerInfo(MemoryKind.DEVICE, int(t.device.device_id))
        return BufferView(ptr, nbytes, info.kind, info.device, False, None, owner, 1, True)
    raise UnsupportedBufferError(f"DLPack device type {int(t.device.device_type)} is not supported "
                                 "(only CPU, CUDA, CUDA host and CUDA managed memory)")


class ScatterList:
    """Where the bytes of one read go when they land in several separate device allocations.

    ``targets`` are ``(offset, ptr, nbytes)``: bytes ``[offset, offset + nbytes)`` of the read
    go to ``ptr``. Targets do not overlap; bytes that no target covers are read and dropped
    (the headers between a torch archive's storages). A checkpoint's small tensors are read
    this way, a whole run of neighbours in one request, each straight into its own memory.
    """

    __slots__ = ("_offsets", "_targets")

    def __init__(self, targets: Iterable[tuple[int, int, int]]) -> None:
        self._targets = sorted(t for t in targets if t[2] > 0)
        self._offsets = [t[0] for t in self._targets]
        end = 0
        for offset, _ptr, nbytes in self._targets:
            if offset < end:
                raise UnsupportedBufferError(f"scatter targets overlap at byte {offset}")
            end = offset + nbytes

    @property
    def end(self) -> int:
        """One past the last byte any target takes."""
        return self._targets[-1][0] + self._targets[-1][2] if self._targets else 0

    def pieces(self, offset: int, nbytes: int) -> list[tuple[int, int, int]]:
        """``(ptr, skip, n)`` for the read's bytes ``[offset, offset + nbytes)``: ``n`` bytes,
        ``skip`` bytes into that range, go to ``ptr``."""
        stop = offset + nbytes
        out = []
        i = max(bisect.bisect_right(self._offsets, offset) - 1, 0)
        for t_off, ptr, n in self._targets[i:]:
            if t_off >= stop:
                break
            lo, hi = max(t_off, offset), min(t_off + n, stop)
            if lo < hi:
                out.append((ptr + lo - t_off, lo - offset, hi - lo))
        return out


def scattered_device_view(targets: ScatterList, nbytes: int, device: int, owner: Any, *,
                          source_cached: bool | None = None, caller_busy: bool | None = None) -> BufferView:
    """A read of ``nbytes`` whose bytes land in ``targets`` (memory of GPU ``device``), whose
    producer work the caller has already waited for (as :func:`synchronized_device_view`).
    ``source_cached``: whether the caller found the bytes it will read all in the page cache
    (``File.cached``), so that the engine need not ask again. ``caller_busy``: whether the
    caller's thread makes more destinations while the read runs (default: taken as yes); False
    lets a job of such reads from the page cache use every worker."""
    if targets.end > nbytes:
        raise UnsupportedBufferError(f"scatter targets reach byte {targets.end} of a {nbytes}-byte read")
    return BufferView(0, nbytes, MemoryKind.DEVICE, device, False, None, owner, scatter=targets,
                      source_cached=source_cached, caller_busy=caller_busy)


def synchronized_device_view(ptr: int, nbytes: int, owner: Any) -> BufferView:
    """A view of device memory at ``ptr`` whose producer work the caller has already waited for.

    For code that knows its buffers (gdskit's own checkpoint readers): it skips the
    buffer-interface lookup and the per-request producer-stream wait that :func:`adapt`
    implies, which matter when hundreds of requests are submitted at once.
    """
    return synchronized_device_views([(ptr, nbytes, owner)])[0]


def synchronized_device_views(allocations: Sequence[tuple[int, int, Any]]) -> list[BufferView]:
    """:func:`synchronized_device_view` of each ``(ptr, nbytes, owner)``, for allocations that one
    allocator made on one device (a loader's ``torch.empty`` calls): the driver is asked what the
    memory is once, for the first, instead of once each (a call of about 12 µs on the H200 machine,
    a seventh of what a cached 64 KiB file's preload costs)."""
    first = next((ptr for ptr, _n, _o in allocations if ptr), 0)
    info = cuda.pointer_info(first) if first else cuda.PointerInfo(MemoryKind.DEVICE, None)
    if info.kind not in (MemoryKind.DEVICE, MemoryKind.MANAGED):
        raise UnsupportedBufferError(f"memory at {first:#x} is not device memory ({info.kind.value})")
    return [BufferView(ptr, nbytes, info.kind, info.device, False, None, owner) for ptr, nbytes, owner in allocations]


def _try_dlpack(obj: Any, errors: list[str]) -> BufferView | None:
    """``obj`` through DLPack if it exports it; None (and why, in ``errors``) if not."""
    if not hasattr(obj, "__dlpack__"):
        return None
    try:
        return _from_dlpack(obj)
    except UnsupportedBufferError:
        raise
    except Exception as exc:
        errors.append(f"DLPack: {exc}")
        return None


def adapt(obj: Any) -> BufferView:
    """Describe ``obj``'s memory, or raise :class:`UnsupportedBufferError`."""
    if isinstance(obj, BufferView):
        return obj
    np = sys.modules.get("numpy")  # an ndarray exists only once numpy is imported
    if np is not None and type(obj) is np.ndarray:  # the common case first
        return _from_buffer_protocol(obj)
    if type(obj) is cuda.DeviceArray:
        return _from_device_array(obj)
    torch = sys.modules.get("torch")  # likewise a tensor
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            view = _plain_cuda_tensor_view(torch, obj)
            if view is not None:
                return view
        else:
            host = _plain_cpu_tensor_bytes(torch, obj)
            if host is not None:
                return _from_buffer_protocol(host)
    errors: list[str] = []
    cai = None
    try:
        cai = getattr(obj, "__cuda_array_interface__", None)
    except Exception as exc:  # torch raises for dtypes CAI cannot describe (bfloat16): try DLPack
        errors.append(f"__cuda_array_interface__: {exc}")
    if cai is not None:
        # A version-2 interface (torch's) names no stream, so its producer's work cannot be
        # waited for from it; DLPack's export orders that work before a stream we choose.
        view = _try_dlpack(obj, errors) if "stream" not in cai else None
        return view if view is not None else _from_cuda_array_interface(obj, cai)
    try:
        return _from_buffer_protocol(obj)
    except UnsupportedBufferError:
        raise
    except TypeError as exc:
        errors.append(f"buffer protocol: {exc}")
    view = _try_dlpack(obj, errors)
    if view is not None:
        return view
    detail = "; ".join(errors) if errors else "no buffer interface"
    raise UnsupportedBufferError(
        f"cannot use an object of type {type(obj).__name__} as a buffer ({detail}); pass a numpy or CuPy array, "
        "a torch tensor, a bytearray/memoryview, or anything exposing DLPack or __cuda_array_interface__")
