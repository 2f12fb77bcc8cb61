"""A stand-in for ``cuda.bindings.cufile`` so the cuFile backend's logic runs in CI.

Reads and writes go straight between the file descriptor and the (fake) device memory,
and bump the per-GPU level-3 counters of the route the test chooses: ``"posix"``
(compat mode, as on a machine without nvidia-fs), ``"nvfs"`` or ``"p2p"``.

Failures follow the bindings (cuda-bindings 13.x, checked against the installed module
driving a libcufile stub): each function is a C call followed by the bindings' check.

* ``cuFileRead``/``cuFileWrite`` return an ``ssize_t``. ``-1`` means "see errno": the
  bindings raise ``cuFileError(errno)``, whose constructor looks the value up in
  :class:`OpError`, so an errno that is no cuFile status (``EIO``: 5) makes the
  bindings raise ``ValueError`` instead. Any other negative value (``-errno`` from compat
  mode, ``-CUfileOpError``) is returned to the caller as it is.
* Calls returning ``CUfileError_t`` raise ``cuFileError(err, cu_err)`` when either is set.

:meth:`FakeCufile.fail_io` injects such failures into reads or writes.

The Stream API (``read_async``/``write_async``, ``stream_register``) queues its I/O on the
stand-in CUDA driver given as ``cuda=`` (tests/fake_cuda.py), in stream order: the size and
offsets are read through their pointers when the I/O runs, not when it is queued (unless the
stream was registered with the flags that fix them), and the outcome is written through
``bytes_*_p`` then: the byte count, ``-1`` for an I/O error (errno), or ``-CUfileOpError``.
Submission errors (an unknown handle or stream, no driver) raise ``cuFileError`` as the
bindings' status check does. Injected failures (``fail_io``) apply to the stream I/O too.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import os
from types import SimpleNamespace

import numpy as np

COUNTERS = ("n_nvfs_reads", "n_p2p_reads", "n_posix_reads", "n_nvfs_writes", "n_p2p_writes", "n_posix_writes")


class OpError(enum.IntEnum):
    """``CUfileOpError`` (cufile.h), with the values the bindings' ``OpError`` has."""

    SUCCESS = 0
    DRIVER_NOT_INITIALIZED = 5001
    DRIVER_INVALID_PROPS = 5002
    DRIVER_UNSUPPORTED_LIMIT = 5003
    DRIVER_VERSION_MISMATCH = 5004
    DRIVER_VERSION_READ_ERROR = 5005
    DRIVER_CLOSING = 5006
    PLATFORM_NOT_SUPPORTED = 5007
    IO_NOT_SUPPORTED = 5008
    DEVICE_NOT_SUPPORTED = 5009
    NVFS_DRIVER_ERROR = 5010
    CUDA_DRIVER_ERROR = 5011
    CUDA_POINTER_INVALID = 5012
    CUDA_MEMORY_TYPE_INVALID = 5013
    CUDA_POINTER_RANGE_ERROR = 5014
    CUDA_CONTEXT_MISMATCH = 5015
    INVALID_MAPPING_SIZE = 5016
    INVALID_MAPPING_RANGE = 5017
    INVALID_FILE_TYPE = 5018
    INVALID_FILE_OPEN_FLAG = 5019
    DIO_NOT_SET = 5020
    INVALID_VALUE = 5022
    MEMORY_ALREADY_REGISTERED = 5023
    MEMORY_NOT_REGISTERED = 5024
    PERMISSION_DENIED = 5025
    DRIVER_ALREADY_OPEN = 5026
    HANDLE_NOT_REGISTERED = 5027
    HANDLE_ALREADY_REGISTERED = 5028
    DEVICE_NOT_FOUND = 5029
    INTERNAL_ERROR = 5030
    GETNEWFD_FAILED = 5031
    NVFS_SETUP_ERROR = 5033
    IO_DISABLED = 5034
    BATCH_SUBMIT_FAILED = 5035
    GPU_MEMORY_PINNING_FAILED = 5036
    BATCH_FULL = 5037
    ASYNC_NOT_SUPPORTED = 5038
    INTERNAL_BATCH_SETUP_ERROR = 5039
    INTERNAL_BATCH_SUBMIT_ERROR = 5040
    INTERNAL_BATCH_GETSTATUS_ERROR = 5041
    INTERNAL_BATCH_CANCEL_ERROR = 5042
    NOMEM_ERROR = 5043
    IO_ERROR = 5044
    INTERNAL_BUF_REGISTER_ERROR = 5045
    HASH_OPR_ERROR = 5046
    INVALID_CONTEXT_ERROR = 5047
    NVFS_INTERNAL_DRIVER_ERROR = 5048
    BATCH_NOCOMPAT_ERROR = 5049
    IO_MAX_ERROR = 5050


class cuFileError(Exception):  # noqa: N801 - the bindings' name
    """As in the bindings: ``status`` must be an :class:`OpError` value, or building it raises ValueError."""

    def __init__(self, status: int, cu_err: int | None = None) -> None:
        self.status = status
        self.cuda_error = cu_err
        s = OpError(status)
        text = f"{s.name} ({s.value})"
        if cu_err is not None:
            text += f"; CUDA status: {cu_err}"
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.status, self.cuda_error))


class FakeCufile:
    FileHandleType = SimpleNamespace(OPAQUE_FD=1)
    OpError = OpError
    cuFileError = cuFileError

    def __init__(self, route: str = "posix", register_fails: bool = False, max_io: int | None = None,
                 gpu_of=None, cuda=None) -> None:
        self.route = route
        self.cuda = cuda  # the stand-in CUDA driver the Stream API queues its I/O on
        self.registered_streams: dict[int, int] = {}  # stream -> cuFileStreamRegister flags
        self.async_calls = {"read": 0, "write": 0}
        # Which GPU a device pointer's memory is on (the counters are per GPU); default: all GPU 0.
        self.gpu_of = gpu_of
        self.other_gpus: dict[int, dict[str, int]] = {}  # the counters of GPUs 1..15
        self.max_io = max_io  # each read or write moves at most this much (a short count, as POSIX may)
        self.register_fails = register_fails
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.handles: dict[int, int] = {}
        self.buffers: dict[int, int] = {}
        self._objects: dict[int, object] = {}
        self._ids = itertools.count(1000)
        self._errno = 0
        self._io_failure: dict[str, tuple[int, int, int]] = {}  # op -> (C return, errno, calls left before)
        self.io_calls = {"read": 0, "write": 0}
        self.opened = False
        self.stats_level = 0
        fake = self

        class Descr:
            def __init__(self) -> None:
                self.type = 0
                self.handle = SimpleNamespace(fd=-1)
                self.fs_ops = None
                self.ptr = next(fake._ids)
                fake._objects[self.ptr] = self

        class StatsLevel3:
            def __init__(self) -> None:
                self.ptr = next(fake._ids)
                self.per_gpu_stats = None
                fake._objects[self.ptr] = self

        self.Descr = Descr
        self.StatsLevel3 = StatsLevel3

    # -- fault injection --------------------------------------------------------------------------
    def fail_io(self, op: str, *, returns: int | None = None, errno: int | None = None, after: int = 0) -> None:
        """Make every ``op`` ("read" or "write") call after the first ``after`` fail in libcufile.

        ``returns=-n``: cuFile returns ``-n`` (an ``-errno`` of compat mode, or ``-OpError``),
        which the bindings hand back. ``errno=e``: cuFile returns -1 with errno ``e``, which
        the bindings raise as ``cuFileError(e)`` (as ``ValueError`` when ``e`` is no OpError).
        """
        assert (returns is None) != (errno is None) and op in ("read", "write")
        assert returns is None or returns < -1, "-1 means errno: use errno="
        self._io_failure[op] = (returns if returns is not None else -1, errno or 0, after)

    # -- the bindings' checks --------------------------------------------------------------------
    def _check_ssize(self, status: int) -> int:
        if status == -1:
            raise cuFileError(self._errno)
        return status

    @staticmethod
    def _check_status(err: int, cu_err: int = 0) -> None:
        if err != 0 or cu_err != 0:
            raise cuFileError(err, cu_err)

    # -- driver ---------------------------------------------------------------------------------
    def driver_open(self) -> None:
        self.opened = True

    def driver_close(self) -> None:
        self.opened = False

    def get_version(self) -> int:
        return 1150

    def set_stats_level(self, level: int) -> None:
        self.stats_level = level

    def stats_start(self) -> None:
        pass

    def stats_stop(self) -> None:
        pass

    def driver_get_properties(self, addr: int) -> None:
        pass  # all zeros: no nvidia-fs

    def get_stats_l3(self, ptr: int) -> None:
        obj = self._objects[ptr]
        per_gpu = {k: np.array([v] + [self.other_gpus.get(g, {}).get(k, 0) for g in range(1, 16)])
                   for k, v in self.counters.items()}
        obj.per_gpu_stats = SimpleNamespace(**per_gpu)

    def _count(self, base: int, name: str) -> None:
        gpu = self.gpu_of(base) if self.gpu_of is not None else 0
        (self.counters if gpu == 0 else self.other_gpus.setdefault(gpu, dict.fromkeys(COUNTERS, 0)))[name] += 1

    # -- handles and buffers ---------------------------------------------------------------------
    def handle_register(self, descr_ptr: int) -> int:
        if self.register_fails:
            # What libcufile returns where it cannot find the udev database ("internal error").
            self._check_status(OpError.INTERNAL_ERROR, 0)
        handle = next(self._ids)
        # Like cuFile's compat mode, serve any offset: a buffered twin of the (O_DIRECT) descriptor.
        fd = self._objects[descr_ptr].handle.fd
        self.handles[handle] = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        return handle

    def handle_deregister(self, handle: int) -> None:
        os.close(self.handles.pop(handle))

    def buf_register(self, ptr: int, nbytes: int, flags: int) -> None:
        self._check_status(OpError.MEMORY_ALREADY_REGISTERED if ptr in self.buffers else 0)
        self.buffers[ptr] = nbytes

    def buf_deregister(self, ptr: int) -> None:
        self._check_status(0 if ptr in self.buffers else OpError.MEMORY_NOT_REGISTERED)
        del self.buffers[ptr]

    # -- I/O --------------------------------------------------------------------------------------
    def _injected(self, op: str) -> int | None:
        """The C return value of an injected failure of this call, with errno set; None if none."""
        self.io_calls[op] += 1
        found = self._io_failure.get(op)
        if found is None or self.io_calls[op] <= found[2]:
            return None
        self._errno = found[1]
        return found[0]

    def read(self, fh: int, base: int, size: int, file_offset: int, buf_offset: int) -> int:
        status = self._injected("read")
        if status is None:
            data = os.pread(self.handles[fh], min(size, self.max_io or size), file_offset)
            ctypes.memmove(base + buf_offset, data, len(data))
            self._count(base, f"n_{self.route}_reads")
            status = len(data)
        return self._check_ssize(status)

    def write(self, fh: int, base: int, size: int, file_offset: int, buf_offset: int) -> int:
        status = self._injected("write")
        if status is None:
            data = ctypes.string_at(base + buf_offset, min(size, self.max_io or size))
            status = os.pwrite(self.handles[fh], data, file_offset)
            self._count(base, f"n_{self.route}_writes")
        return self._check_ssize(status)

    # -- the Stream API (cuFileReadAsync / cuFileWriteAsync) -------------------------------------
    # Kept apart from the synchronous and batch calls above.
    _FIXED_BUF_OFFSET, _FIXED_FILE_OFFSET, _FIXED_FILE_SIZE, _PAGE_ALIGNED_INPUTS = 1, 2, 4, 8

    def stream_register(self, stream: int, flags: int) -> None:
        self._check_status(OpError.INVALID_VALUE if flags & ~0xF else 0)
        self.registered_streams[int(stream)] = int(flags)

    def stream_deregister(self, stream: int) -> None:
        self._check_status(0 if int(stream) in self.registered_streams else OpError.INVALID_VALUE)
        del self.registered_streams[int(stream)]

    def _queue_async(self, op: str, fh: int, base: int, size_p: int, file_offset_p: int, buf_offset_p: int,
                     bytes_p: int, stream: int) -> None:
        if self.cuda is None:
            self._check_status(OpError.ASYNC_NOT_SUPPORTED)
        if fh not in self.handles or not (size_p and file_offset_p and buf_offset_p and bytes_p):
            self._check_status(OpError.INVALID_VALUE)
        self.async_calls[op] += 1
        flags = self.registered_streams.get(int(stream), 0)
        size_c = ctypes.c_size_t.from_address(size_p)
        file_c = ctypes.c_int64.from_address(file_offset_p)
        buf_c = ctypes.c_int64.from_address(buf_offset_p)
        out_c = ctypes.c_ssize_t.from_address(bytes_p)
        # Fixed by registration: read now; otherwise when the I/O runs.
        fixed = (size_c.value if flags & self._FIXED_FILE_SIZE else None,
                 file_c.value if flags & self._FIXED_FILE_OFFSET else None,
                 buf_c.value if flags & self._FIXED_BUF_OFFSET else None)

        def run() -> None:
            size = fixed[0] if fixed[0] is not None else size_c.value
            file_offset = fixed[1] if fixed[1] is not None else file_c.value
            buf_offset = fixed[2] if fixed[2] is not None else buf_c.value
            status = self._injected(op)
            if status is not None:
                out_c.value = status  # -1: an I/O error (errno); else -CUfileOpError or -errno
                return
            if op == "read":
                data = os.pread(self.handles[fh], min(size, self.max_io or size), file_offset)
                ctypes.memmove(base + buf_offset, data, len(data))
                out_c.value = len(data)
            else:
                data = ctypes.string_at(base + buf_offset, min(size, self.max_io or size))
                out_c.value = os.pwrite(self.handles[fh], data, file_offset)
            self._count(base, f"n_{self.route}_{op}s")

        # The range the queued I/O touches, as known now (for the driver's race checks).
        span = (base + buf_c.value, size_c.value)
        err = self.cuda.queue_stream_work(int(stream), f"cuFile{op.title()}Async", run,
                                          **({"writes": span} if op == "read" else {"reads": span}))
        if int(err) != 0:
            self._check_status(OpError.CUDA_DRIVER_ERROR, int(err))

    def read_async(self, fh: int, base: int, size_p: int, file_offset_p: int, buf_offset_p: int,
                   bytes_read_p: int, stream: int) -> None:
        self._queue_async("read", fh, base, size_p, file_offset_p, buf_offset_p, bytes_read_p, stream)

    def write_async(self, fh: int, base: int, size_p: int, file_offset_p: int, buf_offset_p: int,
                    bytes_written_p: int, stream: int) -> None:
        self._queue_async("write", fh, base, size_p, file_offset_p, buf_offset_p, bytes_written_p, stream)
