"""A thin, lazy layer over ``cuda.bindings.driver`` (the CUDA driver API).

Nothing here imports CUDA at module import time: ``import gdskit`` must work on a
machine with no GPU, no driver and no bindings. Every call checks the CUDA error
code and raises :class:`gdskit.errors.CudaError` on failure.

Why the driver API and not the runtime: a process with torch already has a runtime
and a context, and importing the bindings' runtime module costs several times the
driver module's import, paid inside the first load (docs/engine.md, "Measurements
behind the defaults"). gdskit works in each device's primary context, the one every
runtime in the process shares.
"""

from __future__ import annotations

import ctypes
import enum
import mmap
import operator
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from gdskit.shutdown import exiting
from gdskit.errors import CudaError, InvalidArgumentError
from gdskit.engine.residency import MAP_FAILED, libc


class MemoryKind(str, enum.Enum):
    """Where a pointer's memory lives, as CUDA sees it."""

    HOST = "host"          # ordinary pageable host memory
    PINNED = "pinned"      # page-locked host memory known to CUDA
    DEVICE = "device"      # cudaMalloc / cuMemAlloc / cuMemCreate memory
    MANAGED = "managed"    # unified (managed) memory


class _DriverState:
    """What gdskit holds of one CUDA driver: the driver module, the primary contexts retained
    on it, its device count and whether it batches copies. One per driver (:func:`use_driver`)."""

    __slots__ = ("batched_copies", "contexts", "device_count", "driver", "ordered_copy", "peers_enabled",
                 "pointer_query")

    def __init__(self, driver: Any = None) -> None:
        self.driver = driver                         # None: the bindings, loaded on first use
        self.contexts: dict[int, Any] = {}
        self.device_count: int | None = None
        # Whether cuMemcpyBatchAsync works here: None until first tried, then True or False for good.
        self.batched_copies: bool | None = None
        self.ordered_copy: list[Any] | None = None   # cuMemcpyBatchAsync's attributes, made once
        self.peers_enabled: set[tuple[int, int]] = set()  # (device, peer) opened by enable_peer_access
        # pointer_info's attribute list and the memory types it compares with, made once: the
        # bindings' enum lookups cost more than the question (it is asked for every buffer).
        self.pointer_query: tuple[list[Any], int, int] | None = None


_state = _DriverState()
_state_lock = threading.Lock()
_driver_change_hooks: list[Callable[[], None]] = []


def _driver() -> Any:
    drv = _state.driver
    return drv if drv is not None else _load_bindings(_state)


def _load_bindings(state: _DriverState) -> Any:
    with _state_lock:
        if state.driver is None:
            from cuda.bindings import driver  # noqa: PLC0415 - import time

            check(driver.cuInit(0), "cuInit")
            state.driver = driver
        return state.driver


def on_driver_change(hook: Callable[[], None]) -> Callable[[], None]:
    """Call ``hook()`` before gdskit moves to another driver (:func:`use_driver`), while the one
    it leaves is still in place: what was made on it (streams, pinned memory) goes with it.
    Returns the function that stops calling it."""
    if hook not in _driver_change_hooks:
        _driver_change_hooks.append(hook)
    return lambda: _driver_change_hooks.remove(hook) if hook in _driver_change_hooks else None


@contextmanager
def use_driver(driver: Any) -> Iterator[Any]:
    """Run gdskit on ``driver`` until the block ends, then on the driver before it again.

    ``driver`` stands for ``cuda.bindings.driver`` (the functions gdskit calls, initialised):
    a stand-in in tests, a driver with faults injected. It starts with nothing known about it
    (no contexts, device count or copy batching yet), and the state learnt of the driver
    before it is kept for its return. :func:`on_driver_change` hooks (the worker pool frees its
    workers and lanes) run before each switch.
    """
    global _state
    for hook in list(_driver_change_hooks):
        hook()
    with _state_lock:
        previous, _state = _state, _DriverState(driver)
    try:
        yield driver
    finally:
        try:
            for hook in list(_driver_change_hooks):
                hook()
        finally:
            with _state_lock:
                _state = previous


def driver_or_none() -> Any | None:
    """The bindings' driver module (initialised), or ``None`` when CUDA cannot be used."""
    try:
        return _driver()
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


def device_count() -> int:
    """Number of CUDA devices; 0 when there is no GPU, driver or bindings. Never raises."""
    state = _state
    if state.device_count is None:
        try:
            count = int(check(_driver().cuDeviceGetCount(), "cuDeviceGetCount"))
        except Exception:
            count = 0
        with _state_lock:
            if state.device_count is None:
                state.device_count = count
    return state.device_count


def available() -> bool:
    return device_count() > 0


def no_gpu_here() -> None:
    """This process uses no GPU (a dataset loader's reader process, which reads into host
    memory only): :func:`device_count` is 0 from now on, and the driver is not loaded for it."""
    with _state_lock:
        _state.device_count = 0


_CUDA_ERROR_INVALID_CONTEXT = 201


def _primary_context(device: int) -> Any:
    """The device's primary context, retained once for the life of the process (as a runtime does)."""
    state = _state
    ctx = state.contexts.get(device)
    if ctx is None:
        drv = _driver()
        with _state_lock:
            ctx = state.contexts.get(device)
            if ctx is None:
                dev = check(drv.cuDeviceGet(device), "cuDeviceGet")
                ctx = state.contexts[device] = check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    return ctx


def set_device(device: int) -> None:
    """Make ``device``'s primary context current in the calling thread."""
    check(_driver().cuCtxSetCurrent(_primary_context(device)), "cuCtxSetCurrent")


def current_device() -> int:
    """The calling thread's device; a thread with no context yet gets device 0, as with the runtime."""
    drv = _driver()
    result = drv.cuCtxGetDevice()
    if int(result[0]) == _CUDA_ERROR_INVALID_CONTEXT:
        set_device(0)
        return 0
    return int(check(result, "cuCtxGetDevice"))


def make_current(device: int) -> Any:
    """Make ``device``'s primary context current in the calling thread, and return what
    :func:`put_back` needs to put back the context current before (None where it already was
    this one: then nothing is changed, and one driver call was made)."""
    drv = _driver()
    ctx = _primary_context(device)
    before = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(before) == int(ctx):
        return None
    check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return before


def put_back(before: Any) -> None:
    """Undo :func:`make_current`: the caller's context again (or none, if it had none)."""
    if before is not None:
        check(_driver().cuCtxSetCurrent(before), "cuCtxSetCurrent")


@contextmanager
def on_device(device: int) -> Iterator[None]:
    """Make ``device``'s primary context current in the calling thread for the block, then put
    back whatever was current before (the caller's, or none): a caller's thread keeps its device,
    and so does torch, which reads it from the driver."""
    before = make_current(device)
    try:
        yield
    finally:
        put_back(before)


def _in_context() -> Any:
    """The driver module, with a context current in the calling thread (allocations need one)."""
    drv = _driver()
    if not int(check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")):
        set_device(0)
    return drv


@dataclass(frozen=True)
class PointerInfo:
    kind: MemoryKind
    device: int | None  # CUDA device ordinal for device/managed memory


_HOST_POINTER = PointerInfo(MemoryKind.HOST, None)
_PINNED_POINTER = PointerInfo(MemoryKind.PINNED, None)


def pointer_info(ptr: int) -> PointerInfo:
    """Ask CUDA what kind of memory ``ptr`` points into (host if CUDA does not know it)."""
    if not available():
        return _HOST_POINTER
    state = _state
    drv = _in_context()
    query = state.pointer_query
    if query is None:
        attr = drv.CUpointer_attribute
        query = state.pointer_query = ([attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, attr.CU_POINTER_ATTRIBUTE_IS_MANAGED,
                                        attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL],
                                       int(drv.CUmemorytype.CU_MEMORYTYPE_DEVICE),
                                       int(drv.CUmemorytype.CU_MEMORYTYPE_HOST))
    wanted, device_type, host_type = query
    err, values = drv.cuPointerGetAttributes(3, wanted, ptr)
    if int(err) != 0:  # memory no context knows: pageable host memory
        return _HOST_POINTER
    memory_type, managed, device = (int(v) for v in values)
    if managed:
        return PointerInfo(MemoryKind.MANAGED, device)
    if memory_type == device_type:
        return PointerInfo(MemoryKind.DEVICE, device)
    if memory_type == host_type:
        return _PINNED_POINTER
    return _HOST_POINTER


class _FreedWhenCollected:
    """The last resort for memory whose owner forgot ``free()`` (each subclass's own, freeing
    exactly once): pools and callers free explicitly."""

    free: Callable[[], None]

    def __del__(self) -> None:
        if exiting():
            return  # modules are being torn down; the exiting process returns the memory
        try:
            self.free()
        except Exception:  # noqa: BLE001 - nothing may escape a finalizer
            pass


class PinnedBuffer(_FreedWhenCollected):
    """Page-locked host memory from ``cuMemHostAlloc`` (``cudaHostAlloc``), freed exactly once."""

    def __init__(self, nbytes: int) -> None:
        drv = _in_context()
        self.nbytes = nbytes
        self.ptr = int(check(drv.cuMemHostAlloc(nbytes, drv.CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc"))
        # A writable view over the whole buffer, for os.preadv / os.pwrite.
        self.view = memoryview((ctypes.c_char * nbytes).from_address(self.ptr)).cast("B")

    def free(self) -> None:
        if self.ptr:
            self.view.release()
            check(_driver().cuMemFreeHost(self.ptr), "cuMemFreeHost")
            self.ptr = 0


_HUGE_PAGE = 2 << 20
_MADV_DONTFORK, _MADV_HUGEPAGE, _MADV_NOHUGEPAGE, _MADV_POPULATE_WRITE = 10, 14, 15, 23


def _libc() -> Any:
    return libc  # the one ctypes view of the C library (gdskit.engine.residency)


class RegisteredHostBuffer(_FreedWhenCollected):
    """Page-locked host memory made by hand: anonymous memory on transparent huge pages,
    faulted in by the calling thread, then ``cuMemHostRegister``-ed. Freed exactly once.

    Why not ``cuMemHostAlloc``: its allocations from several threads serialise, and in a VM,
    where the first touch of guest memory is slow, that dominates a first read; memory made
    this way by many threads at once is ready several times sooner (docs/engine.md,
    "Measurements behind the defaults"). Each worker makes its own stage, so the faults run
    in parallel.
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
            drv = _in_context()
            check(drv.cuMemHostRegister(start, span, drv.CU_MEMHOSTREGISTER_PORTABLE), "cuMemHostRegister")
        except BaseException:
            libc.munmap(base, self._map_len)
            raise
        self.ptr = start
        self.view = memoryview((ctypes.c_char * nbytes).from_address(self.ptr)).cast("B")

    def free(self) -> None:
        if self.ptr:
            self.view.release()
            ptr, self.ptr = self.ptr, 0
            drv = driver_or_none()
            err = drv.cuMemHostUnregister(ptr)[0] if drv is not None else 1
            # Unmap only what CUDA no longer holds; otherwise the exiting process takes it back.
            if int(err) == 0:
                _libc().munmap(self._base, self._map_len)
            check(err, "cuMemHostUnregister")


def register_host(ptr: int, nbytes: int) -> None:
    """Page-lock host memory that exists already (a shared mapping) for copies to and from
    every GPU (``cuMemHostRegister``, portable); undone by :func:`unregister_host`."""
    drv = _in_context()
    check(drv.cuMemHostRegister(ptr, nbytes, drv.CU_MEMHOSTREGISTER_PORTABLE), "cuMemHostRegister")


def unregister_host(ptr: int) -> None:
    """Undo :func:`register_host` (the memory itself stays mapped)."""
    check(_driver().cuMemHostUnregister(ptr), "cuMemHostUnregister")


def copies_batched() -> bool | None:
    """Whether this driver queues many copies with one ``cuMemcpyBatchAsync`` (None: not tried yet)."""
    return _state.batched_copies


def _stream_ordered_copy(state: _DriverState) -> list[Any]:
    if state.ordered_copy is None:
        drv = _driver()
        attrs = drv.CUmemcpyAttributes()
        attrs.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        state.ordered_copy = [attrs]
    return state.ordered_copy


def _copy_batch(stream: Any, copies: list[tuple[int, int, int]]) -> bool:
    """Queue ``copies`` with one cuMemcpyBatchAsync; False (and never again) where the driver or
    the bindings have none. An error after batches have worked is raised."""
    state = _state
    drv = _driver()
    try:
        ptr = drv.CUdeviceptr
        result = drv.cuMemcpyBatchAsync([ptr(d) for d, _s, _n in copies], [ptr(s) for _d, s, _n in copies],
                                        [n for _d, _s, n in copies], len(copies), _stream_ordered_copy(state),
                                        [0], 1, stream)
    except (AttributeError, TypeError):  # bindings without it, or with another signature
        state.batched_copies = False
        return False
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0 and not state.batched_copies:
        state.batched_copies = False  # a driver older than the bindings: one call per copy
        return False
    check(err, "cuMemcpyBatchAsync")
    state.batched_copies = True
    return True


class Stream:
    """A non-blocking CUDA stream on one device."""

    def __init__(self, device: int) -> None:
        drv = _driver()
        self.device = device
        with on_device(device):  # made in the device's context; the caller's thread keeps its own
            self.handle = check(drv.cuStreamCreate(int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)),
                                "cuStreamCreate")

    def copy_h2d(self, dst: int, src: int, nbytes: int) -> None:
        check(_driver().cuMemcpyHtoDAsync(dst, src, nbytes, self.handle), "cuMemcpyHtoDAsync")

    def copy_h2d_many(self, copies: list[tuple[int, int, int]]) -> None:
        """Host-to-device copies ``(dst, src, nbytes)``, in one driver call where the driver
        batches copies (``cuMemcpyBatchAsync``, CUDA 12.8+): a fraction of the cost of a call
        per copy (docs/engine.md, "Measurements behind the defaults")."""
        if len(copies) > 1 and _state.batched_copies is not False:
            if _copy_batch(self.handle, copies):
                return
        for dst, src, nbytes in copies:
            self.copy_h2d(dst, src, nbytes)

    def copy_d2h(self, dst: int, src: int, nbytes: int) -> None:
        check(_driver().cuMemcpyDtoHAsync(dst, src, nbytes, self.handle), "cuMemcpyDtoHAsync")

    def copy_peer(self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int) -> None:
        """A device-to-device copy from memory of ``src_device`` into memory of ``dst_device``
        (``cuMemcpyPeerAsync``): peer to peer where :func:`enable_peer_access` has opened the
        way, else the driver stages it through host memory."""
        check(_driver().cuMemcpyPeerAsync(dst, _primary_context(dst_device), src, _primary_context(src_device),
                                          nbytes, self.handle), "cuMemcpyPeerAsync")

    def synchronize(self) -> None:
        check(_driver().cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def destroy(self) -> None:
        if self.handle is not None:
            try:
                _driver().cuStreamDestroy(self.handle)
            finally:
                self.handle = None


def memcpy(dst: int, src: int, nbytes: int) -> None:
    """A blocking copy in any direction (unified addressing)."""
    check(_in_context().cuMemcpy(dst, src, nbytes), "cuMemcpy")


def device_pci_bus_id(device: int) -> str:
    """The device's PCI address in sysfs form (``0000:17:00.0``), whatever width of domain
    and case the driver writes it in."""
    drv = _driver()
    dev = check(drv.cuDeviceGet(device), "cuDeviceGet")
    raw = check(drv.cuDeviceGetPCIBusId(32, dev), "cuDeviceGetPCIBusId")
    if isinstance(raw, (bytes, bytearray)):
        raw = raw.split(b"\0", 1)[0].decode()
    text = str(raw).strip().lower()
    domain, sep, rest = text.partition(":")
    try:
        return f"{int(domain, 16):04x}:{rest}" if sep else text
    except ValueError:
        return text


def open_ipc_memory(device: int, handle: bytes) -> tuple[int, int]:
    """Map another process's allocation (its CUDA IPC handle, 64 bytes) into ``device``'s primary
    context: ``(pointer, bytes)``. Undo with :func:`close_ipc_memory`."""
    drv = _driver()
    h = drv.CUipcMemHandle()
    h.reserved = bytes(handle)
    with on_device(device):
        ptr = int(check(drv.cuIpcOpenMemHandle(h, drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                        "cuIpcOpenMemHandle"))
        try:
            _base, size = check(drv.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
        except BaseException:
            drv.cuIpcCloseMemHandle(ptr)
            raise
    return ptr, int(size)


def close_ipc_memory(device: int, ptr: int) -> None:
    with on_device(device):
        check(_driver().cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")


def can_access_peer(device: int, peer: int) -> bool:
    """Whether ``device`` can reach ``peer``'s memory directly (NVLink or PCIe peer to peer),
    as the driver says (``cuDeviceCanAccessPeer``); False for a device and itself."""
    drv = _driver()
    dev = check(drv.cuDeviceGet(device), "cuDeviceGet")
    other = check(drv.cuDeviceGet(peer), "cuDeviceGet")
    return bool(check(drv.cuDeviceCanAccessPeer(dev, other), "cuDeviceCanAccessPeer"))


_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
_peers_lock = threading.Lock()


def enable_peer_access(device: int, peer: int) -> None:
    """Let ``device``'s primary context reach ``peer``'s memory (``cuCtxEnablePeerAccess``), once
    per process; a pair another library (torch) has already enabled counts as enabled. The
    calling thread's current context is left as it was."""
    key = (device, peer)
    enabled = _state.peers_enabled
    if key in enabled:
        return
    with _peers_lock:
        if key in enabled:
            return
        with on_device(device):
            result = _driver().cuCtxEnablePeerAccess(_primary_context(peer), 0)
        err = result[0] if isinstance(result, tuple) else result
        if int(err) != _CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
            check(err, "cuCtxEnablePeerAccess")
        enabled.add(key)


class Event:
    """A timing-free CUDA event used to know when an async copy has finished.

    ``blocking_sync`` (the default): a thread waiting on it sleeps until the driver wakes it;
    False: the driver spins (or yields) in the wait, which ends sooner after a short copy.
    """

    def __init__(self, blocking_sync: bool = True) -> None:
        drv = _in_context()
        # Blocking sync: a waiting worker sleeps instead of spinning a core the other workers need.
        flags = int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        if blocking_sync:
            flags |= int(drv.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
        self.handle = check(drv.cuEventCreate(flags), "cuEventCreate")
        self.pending = False

    def record(self, stream: Stream) -> None:
        self.record_on(stream.handle)

    def record_on(self, stream: int) -> None:
        """Record on a stream given by its raw handle (a caller's stream)."""
        check(_driver().cuEventRecord(self.handle, stream), "cuEventRecord")
        self.pending = True

    def wait(self) -> None:
        if self.pending:
            check(_driver().cuEventSynchronize(self.handle), "cuEventSynchronize")
            self.pending = False

    def destroy(self) -> None:
        if self.handle is not None:
            try:
                _driver().cuEventDestroy(self.handle)
            finally:
                self.handle = None


# CU_STREAM_LEGACY. The interface's 1 and 2 are the driver's own handles for the legacy and
# per-thread default streams, so they pass through as they are.
_STREAM_LEGACY = 1


def synchronize_producer(stream: int | None) -> None:
    """Wait for work the buffer's producer may still have queued on it.

    ``stream`` is the ``__cuda_array_interface__`` stream (1 = legacy default,
    2 = per-thread default, otherwise a handle). ``None`` (a producer that names
    no stream: a version-2 interface without DLPack) means the legacy default
    stream, as for Numba and CuPy. Never the whole device: that would also wait
    for gdskit's own copies of other requests in flight.
    """
    handle = _STREAM_LEGACY if stream is None else stream
    check(_in_context().cuStreamSynchronize(handle), "cuStreamSynchronize")


class DeviceArray(_FreedWhenCollected):
    """Plain ``cuMemAlloc`` (``cudaMalloc``) or managed memory exposing ``__cuda_array_interface__``.

    For programs (and gdskit's own benchmarks and tests) that need GPU buffers
    without torch or CuPy. Freed exactly once, by :meth:`free` or the GC.
    """

    def __init__(self, nbytes: int, device: int | None = None, managed: bool = False) -> None:
        drv = _driver()
        self.ptr = 0
        with on_device(device) if device is not None else nullcontext():  # the caller's device stays
            self.device = current_device()
            self.nbytes = nbytes
            self.managed = managed
            if managed:
                attach = int(drv.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL)
                self.ptr = int(check(drv.cuMemAllocManaged(max(nbytes, 1), attach),
                                     f"cuMemAllocManaged of {nbytes} bytes on GPU {self.device}"))
            else:
                self.ptr = int(check(drv.cuMemAlloc(max(nbytes, 1)), f"cuMemAlloc of {nbytes} bytes on GPU {self.device}"))
        # "stream": None: the memory has no producer work pending (we synchronise after our own writes).
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                                         "version": 3, "strides": None, "stream": None}

    def fill(self, value: int) -> None:
        """Set every byte to ``value``."""
        drv = _in_context()
        check(drv.cuMemsetD8(self.ptr, value, max(self.nbytes, 1)), "cuMemsetD8")
        check(drv.cuCtxSynchronize(), "cuCtxSynchronize")

    def copy_from_host(self, data: Any, offset: int = 0) -> None:
        """Copy ``data`` (bytes-like or a numpy array) to ``offset`` (blocking)."""
        import numpy as np  # noqa: PLC0415 - import time

        arr = np.ascontiguousarray(np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data)
        if arr.nbytes:
            memcpy(self.ptr + offset, arr.ctypes.data, arr.nbytes)

    def to_numpy(self, nbytes: int | None = None) -> Any:
        """A host copy of the first ``nbytes`` (default: all) as a uint8 numpy array."""
        import numpy as np  # noqa: PLC0415 - import time

        n = self.nbytes if nbytes is None else nbytes
        out = np.empty(n, dtype=np.uint8)
        if n:
            memcpy(out.ctypes.data, self.ptr, n)
        return out

    def free(self) -> None:
        if self.ptr:
            drv = driver_or_none()
            if drv is not None:
                drv.cuMemFree(self.ptr)
            self.ptr = 0
            # Exported as empty from now on: a consumer of the interface never sees the freed pointer.
            self.__cuda_array_interface__ = {**self.__cuda_array_interface__, "shape": (0,), "data": (0, False)}


# -- stream-ordered work on the caller's streams (gdskit.engine.stream_ordered) --------------------------------

def stream_handle(stream: Any) -> int:
    """The driver handle of a caller's CUDA stream: a raw integer handle (0 and 1 the legacy
    default stream, 2 the calling thread's per-thread default stream), a :class:`Stream`, an object with
    ``cuda_stream`` (torch) or ``ptr`` (CuPy), one with ``__cuda_stream__`` (the CUDA stream
    protocol: ``(version, handle)``), or a ``cuda.bindings`` ``CUstream``. Anything else, a
    boolean or a negative number: :class:`~gdskit.errors.InvalidArgumentError`."""
    if isinstance(stream, bool):
        raise InvalidArgumentError("stream must be a CUDA stream or its integer handle, not a boolean")
    value: Any = stream
    if isinstance(stream, Stream):  # gdskit's own
        value = stream.handle
    elif not isinstance(stream, int):
        protocol = getattr(stream, "__cuda_stream__", None)
        if callable(protocol):
            try:
                _version, value = protocol()
            except Exception as exc:  # noqa: BLE001 - the object's own protocol failed
                raise InvalidArgumentError(f"__cuda_stream__ of {type(stream).__name__} failed: {exc}") from None
        elif hasattr(stream, "cuda_stream"):
            value = stream.cuda_stream
        elif type(stream).__name__.endswith("Stream") and isinstance(getattr(stream, "ptr", None), int):
            value = stream.ptr  # CuPy
        elif hasattr(stream, "getPtr"):  # a cuda.bindings CUstream: its int() is the handle
            value = stream
    try:
        # A handle is an integer (``__index__``), never a float; a bindings' CUstream has ``int()``.
        handle = int(value) if hasattr(value, "getPtr") else operator.index(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"stream must be a CUDA stream (torch, CuPy, __cuda_stream__) or its integer "
                                   f"handle; got {type(stream).__name__}") from None
    if isinstance(value, bool) or handle < 0:
        raise InvalidArgumentError(f"a CUDA stream handle is a non-negative integer, got {value!r}")
    return handle


#: The one host-function trampoline: CUDA calls it with ``userData`` = a key into
#: ``_host_funcs``. A single callback that lives as long as the module, so no ctypes callback
#: object can be freed while CUDA still holds its address.
_HOST_FN_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_host_funcs: dict[int, Callable[[], None]] = {}
_host_funcs_lock = threading.Lock()
_host_func_keys = iter(range(1, 1 << 62))


def _run_host_func(key: int | None) -> None:
    with _host_funcs_lock:
        fn = _host_funcs.pop(int(key or 0), None)
    if fn is not None:
        try:
            fn()
        except BaseException:  # noqa: BLE001 - nothing may unwind into the driver's thread
            pass


_host_fn_trampoline = _HOST_FN_TYPE(_run_host_func)
HOST_FN_ADDRESS: int = ctypes.cast(_host_fn_trampoline, ctypes.c_void_p).value or 0


def launch_host_func(stream: int, fn: Callable[[], None]) -> None:
    """Queue ``fn()`` on ``stream`` (``cuLaunchHostFunc``): it runs on a driver thread once the
    work queued before it on the stream is done, and work queued after it waits for it.

    CUDA's rule: ``fn`` must make no CUDA call (and so must nothing it calls). Exceptions it
    raises are dropped: it reports its own failures.
    """
    drv = _driver()
    key = next(_host_func_keys)
    with _host_funcs_lock:
        _host_funcs[key] = fn
    try:
        check(drv.cuLaunchHostFunc(stream, drv.CUhostFn(HOST_FN_ADDRESS), key), "cuLaunchHostFunc")
    except BaseException:
        with _host_funcs_lock:
            _host_funcs.pop(key, None)
        raise


def host_funcs_pending() -> int:
    """Host functions queued and not yet run (for leak checks)."""
    with _host_funcs_lock:
        return len(_host_funcs)


def copy_h2d_on(stream: int, dst: int, src: int, nbytes: int) -> None:
    """A host-to-device copy queued on a caller's stream (a raw handle)."""
    check(_driver().cuMemcpyHtoDAsync(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")


def copy_d2h_on(stream: int, dst: int, src: int, nbytes: int) -> None:
    """A device-to-host copy queued on a caller's stream (a raw handle)."""
    check(_driver().cuMemcpyDtoHAsync(dst, src, nbytes, stream), "cuMemcpyDtoHAsync")


def stream_wait_event(stream: int, event: Event) -> None:
    """Make later work on ``stream`` wait for ``event``'s last record (no host wait)."""
    check(_driver().cuStreamWaitEvent(stream, event.handle, 0), "cuStreamWaitEvent")


def stream_synchronize(stream: int) -> None:
    """Wait until the work queued on a caller's stream (a raw handle) is done."""
    check(_driver().cuStreamSynchronize(stream), "cuStreamSynchronize")


# -- kernels: modules loaded from compiled images, launched on a caller's stream ---------------

def compute_capability(device: int) -> tuple[int, int]:
    """``(major, minor)`` of GPU ``device`` (9, 0 for an H100 or H200)."""
    drv = _driver()
    dev = check(drv.cuDeviceGet(device), "cuDeviceGet")
    attr = drv.CUdevice_attribute
    major = check(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
                  "cuDeviceGetAttribute")
    minor = check(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
                  "cuDeviceGetAttribute")
    return int(major), int(minor)


def load_module(image: bytes, device: int) -> Any:
    """A module loaded from a compiled image (cubin or PTX) into ``device``'s primary context
    (``cuModuleLoadData``); it lives as long as the context."""
    drv = _driver()
    held = ctypes.create_string_buffer(image, len(image) + 1)  # NUL-terminated for PTX; alive for the call
    with on_device(device):
        return check(drv.cuModuleLoadData(ctypes.addressof(held)), "cuModuleLoadData")


def module_function(module: Any, name: str) -> Any:
    """The kernel ``name`` of a loaded module (``cuModuleGetFunction``)."""
    return check(_driver().cuModuleGetFunction(module, name.encode("ascii")), "cuModuleGetFunction")


def launch_kernel(function: Any, grid: int, block: int, stream: int, args: list[Any], shared_bytes: int = 0) -> None:
    """Queue ``function`` on ``stream`` over ``grid`` blocks of ``block`` threads (one dimension
    each). ``args``: the kernel's parameters as ctypes values (``c_uint64``, ``c_int32``...), in order."""
    pointers = (ctypes.c_void_p * max(len(args), 1))(*[ctypes.addressof(a) for a in args])
    check(_driver().cuLaunchKernel(function, grid, 1, 1, block, 1, 1, shared_bytes, stream,
                                   ctypes.addressof(pointers), 0), "cuLaunchKernel")
