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
stand-in CUDA driver given as ``cuda=`` (tests/stand_ins/fake_cuda.py), in stream order: the size and
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
import random
import time
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
        # All zeros (no nvidia-fs) but for the batch limits, as libcufile fills them in.
        if self.props_batch_limits:
            ctypes.c_uint.from_address(addr + _PROPS_MAX_BATCH_IO_SIZE).value = self.io_batchsize
            ctypes.c_uint.from_address(addr + _PROPS_MAX_BATCH_IO_SIZE + 4).value = self.batch_timeout_ms

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
    # -- batch API (cuFileBatchIOSetUp / Submit / GetStatus / Cancel / Destroy) ----------------------
    #
    # The rules of libcufile's batch API, as the cuFile API reference states them, and where it
    # says nothing, the stricter reading (the stand-in is never more forgiving than the library):
    #
    # * ``batch_io_set_up(nr)``: 0 < nr <= the ``io_batchsize`` limit, else INVALID_VALUE; every
    #   set-up gives a new batch id.
    # * ``batch_io_submit(id, nr, params, flags)``: a live id, flags 0, 0 < nr <= the set-up's nr;
    #   each entry in mode CUFILE_BATCH, opcode read or write, a registered handle, device memory,
    #   non-negative offsets, and 4 KiB-aligned file offset, memory and size (stricter: the
    #   reference leaves unaligned batch entries to the implementation). An invalid entry refuses
    #   the whole submit (INVALID_VALUE). A submit while entries of the last one are still to be
    #   reaped is refused (BATCH_FULL): one submit at a time per batch.
    # * Entries go WAITING -> PENDING -> COMPLETE (or FAILED, CANCELED) and finish in any order
    #   (drawn from ``seed``), only while ``batch_io_get_status`` is called, as if the caller's
    #   poll were what let them run. A get-status call reports each finished entry once, at most
    #   ``*nr`` of them, and at least ``min_nr`` where that many can finish (``min_nr > *nr`` is
    #   INVALID_VALUE). A NULL timeout (0) is a breach: it can block forever.
    # * ``batch_io_cancel(id)``: entries not yet finished become CANCELED (reported by later polls).
    # * ``batch_io_destroy(id)``: a second destroy, or any use after it, is a breach (undefined
    #   behaviour in C), and so is destroying a batch with entries still in flight.
    #
    # Breaches are recorded in ``violations`` (the batch tests check it is empty) and raised.

    BatchMode = SimpleNamespace(BATCH=1)
    Opcode = SimpleNamespace(READ=0, WRITE=1)
    Status = SimpleNamespace(WAITING=1, PENDING=2, INVALID=4, CANCELED=8, COMPLETE=16, TIMEOUT=32, FAILED=64)
    SizeTConfigParameter = SimpleNamespace(PROPERTIES_IO_BATCHSIZE=9, PROPERTIES_BATCH_IO_TIMEOUT_MS=11)

    io_batchsize = 128          # cufile.json "io_batchsize" (its default)
    batch_timeout_ms = 0        # cufile.json "batch_io_timeout_msecs" (0 here: entries never time out)
    props_batch_limits = True   # driver_get_properties fills max_batch_io_size (False: zero, as an old driver)
    batch_counts = "l1"         # which counters a batch entry moves: "l1", "l3", "both" or "none"

    def configure_batch(self, *, io_batchsize: int | None = None, counts: str | None = None,
                        device_of=None, seed: int | None = None, parameters: bool = True,
                        props_limits: bool | None = None) -> None:
        """The batch API's configuration: the ``io_batchsize`` limit, which counters entries move,
        which pointers are device memory (``device_of(ptr)`` -> device or None; default: all),
        the completion order's ``seed``, and whether ``get_parameter_size_t`` exists
        (``parameters=False``: an older library, the limit comes from the driver properties)."""
        if io_batchsize is not None:
            self.io_batchsize = io_batchsize
        if counts is not None:
            assert counts in ("l1", "l3", "both", "none")
            self.batch_counts = counts
        if props_limits is not None:
            self.props_batch_limits = props_limits
        state = self._batch_state()
        state["device_of"] = device_of
        if seed is not None:
            state["rng"] = random.Random(seed)
        if not parameters:
            state["no_parameters"] = True

    def _batch_state(self) -> dict:
        state = self.__dict__.get("_batch")
        if state is None:
            state = self.__dict__["_batch"] = {
                "live": {}, "destroyed": set(), "device_of": None, "no_parameters": False,
                "rng": random.Random(int(os.environ.get("GDSKIT_STAND_IN_SEED", "0"))),
                "submitted": 0, "faults": {}, "stall": False, "interrupt_at": None, "polls": 0,
                "l1": dict.fromkeys(_L1_FIELDS, 0), "setups": 0, "destroys": 0}
            self.violations = getattr(self, "violations", [])
        return state

    @property
    def live_batches(self) -> int:
        """Batches set up and not yet destroyed."""
        return len(self._batch_state()["live"])

    @property
    def batch_calls(self) -> dict[str, int]:
        state = self._batch_state()
        return {"set_up": state["setups"], "destroy": state["destroys"], "entries": state["submitted"],
                "polls": state["polls"]}

    def fail_batch_entry(self, nth: int, status: int | None = None, ret: int = -5) -> None:
        """The ``nth`` entry submitted (0-based, over every batch) finishes with ``status``
        (default FAILED) and ``ret`` (``-errno`` or ``-CUfileOpError``, as a size_t)."""
        self._batch_state()["faults"][nth] = (self.Status.FAILED if status is None else status, ret)

    def stall_batches(self, stalled: bool = True, cancel_works: bool = True) -> None:
        """Entries stop finishing (a hung device): polls return nothing until they are cancelled
        (``cancel_works=False``: not even then)."""
        self._batch_state()["stall"] = stalled
        self._batch_state()["cancel_ignored"] = not cancel_works

    def interrupt_batch_poll(self, nth: int) -> None:
        """The ``nth`` get-status call (1-based) raises KeyboardInterrupt, as a signal would."""
        self._batch_state()["interrupt_at"] = nth

    def _batch_breach(self, message: str, status: int = OpError.INVALID_VALUE) -> None:
        self.violations.append(message)
        raise cuFileError(status)

    def _live_batch(self, batch_id: int, what: str) -> dict:
        state = self._batch_state()
        found = state["live"].get(batch_id)
        if found is None:
            if batch_id in state["destroyed"]:
                self._batch_breach(f"{what} of batch {batch_id:#x} after its destroy")
            self._check_status(OpError.INVALID_VALUE)
        return found

    def get_parameter_size_t(self, param: int) -> int:
        if self._batch_state()["no_parameters"]:
            raise AttributeError("get_parameter_size_t")  # not in this (older) library
        if param == self.SizeTConfigParameter.PROPERTIES_IO_BATCHSIZE:
            return self.io_batchsize
        if param == self.SizeTConfigParameter.PROPERTIES_BATCH_IO_TIMEOUT_MS:
            return self.batch_timeout_ms
        self._check_status(OpError.INVALID_VALUE)

    def batch_io_set_up(self, nr: int) -> int:
        state = self._batch_state()
        if not 0 < nr <= self.io_batchsize:
            self._check_status(OpError.INVALID_VALUE)
        batch_id = next(self._ids) << 4
        state["live"][batch_id] = {"capacity": nr, "entries": []}
        state["setups"] += 1
        return batch_id

    def batch_io_submit(self, batch_id: int, nr: int, params_ptr: int, flags: int) -> None:
        state = self._batch_state()
        batch = self._live_batch(batch_id, "submit")
        if flags != 0 or not 0 < nr <= batch["capacity"] or not params_ptr:
            self._check_status(OpError.INVALID_VALUE)
        if any(e["state"] != "reaped" for e in batch["entries"]):
            self._check_status(OpError.BATCH_FULL)
        params = np.frombuffer((ctypes.c_char * (nr * IO_PARAMS.itemsize)).from_address(params_ptr),
                               dtype=IO_PARAMS).copy()  # libcufile takes the entries during the call
        device_of = state["device_of"]
        for p in params:
            u = p["u"]
            base, foff, boff, size = int(u["dev_ptr_base"]), int(u["file_offset"]), int(u["dev_ptr_offset"]), \
                int(u["size"])
            ok = (int(p["mode"]) == self.BatchMode.BATCH and int(p["opcode"]) in (0, 1)
                  and int(p["fh"]) in self.handles and foff >= 0 and boff >= 0 and size > 0
                  and (device_of is None or device_of(base) is not None)
                  and foff % 4096 == 0 and (base + boff) % 4096 == 0 and size % 4096 == 0)
            if not ok:
                self._check_status(OpError.INVALID_VALUE)
        batch["entries"] = []
        for p in params:
            u = p["u"]
            fault = state["faults"].pop(state["submitted"], None)
            state["submitted"] += 1
            batch["entries"].append({"state": "waiting", "cookie": int(p["cookie"]), "fh": int(p["fh"]),
                                     "op": int(p["opcode"]), "base": int(u["dev_ptr_base"]),
                                     "file_offset": int(u["file_offset"]), "buf_offset": int(u["dev_ptr_offset"]),
                                     "size": int(u["size"]), "fault": fault, "status": 0, "ret": 0})

    def _finish_entry(self, e: dict) -> None:
        """Run one entry's I/O (or its injected failure)."""
        if e["fault"] is not None:
            e["status"], ret = e["fault"]
            e["ret"] = ret % (1 << 64)  # a size_t
        else:
            size = min(e["size"], self.max_io or e["size"])
            addr = e["base"] + e["buf_offset"]
            if e["op"] == self.Opcode.READ:
                data = os.pread(self.handles[e["fh"]], size, e["file_offset"])
                ctypes.memmove(addr, data, len(data))
                n = len(data)
            else:
                n = os.pwrite(self.handles[e["fh"]], ctypes.string_at(addr, size), e["file_offset"])
            e["status"], e["ret"] = self.Status.COMPLETE, n
            kind = "reads" if e["op"] == self.Opcode.READ else "writes"
            if self.batch_counts in ("l3", "both"):
                self._count(e["base"], f"n_{self.route}_{kind}")
            if self.batch_counts in ("l1", "both"):
                l1 = self._batch_state()["l1"]
                l1[{"posix": "batch_posix_processed_ops", "nvfs": "batch_nvfs_submit_ops",
                    "p2p": "batch_p2p_submit_ops"}[self.route]] += 1
                l1["batch_read_bytes" if kind == "reads" else "batch_write_bytes"] += n
        e["state"] = "finished"

    def batch_io_get_status(self, batch_id: int, min_nr: int, nr_ptr: int, events_ptr: int, timeout_ptr: int) -> None:
        state = self._batch_state()
        state["polls"] += 1
        if state["interrupt_at"] is not None and state["polls"] == state["interrupt_at"]:
            raise KeyboardInterrupt
        batch = self._live_batch(batch_id, "get-status")
        nr = ctypes.c_uint.from_address(nr_ptr)
        if min_nr > nr.value or not events_ptr:
            self._check_status(OpError.INVALID_VALUE)
        if not timeout_ptr:
            self._batch_breach("batch_io_get_status without a timeout: it can block forever")
        for e in batch["entries"]:
            if e["state"] == "waiting":
                e["state"] = "pending"
        running = [e for e in batch["entries"] if e["state"] == "pending"]
        rng = state["rng"]
        if not state["stall"] and running:
            rng.shuffle(running)
            ready = sum(1 for e in batch["entries"] if e["state"] == "finished")
            # Some finish now: at least enough for min_nr (where that many are left), any number more.
            need = max(0, min(min_nr - ready, len(running)))
            for e in running[:rng.randint(max(need, 1), len(running))]:
                self._finish_entry(e)
        elif state["stall"]:
            time.sleep(0.001)  # the poll's timeout runs out (kept short here)
        done = [e for e in batch["entries"] if e["state"] == "finished"]
        rng.shuffle(done)
        done = done[:nr.value]
        out = np.frombuffer((ctypes.c_char * (max(len(done), 1) * IO_EVENTS.itemsize)).from_address(events_ptr),
                            dtype=IO_EVENTS)
        for i, e in enumerate(done):
            out[i] = (e["cookie"], e["status"], e["ret"])
            e["state"] = "reaped"
        nr.value = len(done)

    def batch_io_cancel(self, batch_id: int) -> None:
        batch = self._live_batch(batch_id, "cancel")
        if self._batch_state().get("cancel_ignored"):
            return
        for e in batch["entries"]:
            if e["state"] in ("waiting", "pending"):
                e["state"], e["status"], e["ret"] = "finished", self.Status.CANCELED, 0

    def batch_io_destroy(self, batch_id: int) -> None:
        state = self._batch_state()
        batch = state["live"].pop(batch_id, None)
        if batch is None:
            self._batch_breach(f"destroy of batch {batch_id:#x}, which is "
                               + ("destroyed already" if batch_id in state["destroyed"] else "no batch"))
        state["destroyed"].add(batch_id)
        state["destroys"] += 1
        in_flight = sum(1 for e in batch["entries"] if e["state"] in ("waiting", "pending"))
        if in_flight:
            self._batch_breach(f"destroy of batch {batch_id:#x} with {in_flight} entries still in flight")

    # -- level-1 statistics (the batch counters) -------------------------------------------------
    @property
    def StatsLevel1(self):  # noqa: N802 - the bindings' name
        fake = self

        class StatsLevel1:
            def __init__(self) -> None:
                self.ptr = next(fake._ids)
                fake._objects[self.ptr] = self

        return StatsLevel1

    def get_stats_l1(self, ptr: int) -> None:
        obj = self._objects[ptr]
        for k, v in self._batch_state()["l1"].items():
            setattr(obj, k, v)


#: ``CUfileIOParams_t`` and ``CUfileIOEvents_t`` as cufile.h lays them out (x86-64).
IO_PARAMS = np.dtype({"names": ["mode", "u", "fh", "opcode", "cookie"],
                      "formats": ["<i4", np.dtype([("dev_ptr_base", "<i8"), ("file_offset", "<i8"),
                                                   ("dev_ptr_offset", "<i8"), ("size", "<u8")]),
                                  "<i8", "<i4", "<i8"],
                      "offsets": [0, 8, 40, 48, 56], "itemsize": 64})
IO_EVENTS = np.dtype({"names": ["cookie", "status", "ret"], "formats": ["<i8", "<i4", "<u8"],
                      "offsets": [0, 8, 16], "itemsize": 24})
_L1_FIELDS = ("batch_posix_processed_ops", "batch_nvfs_submit_ops", "batch_p2p_submit_ops",
              "batch_read_bytes", "batch_write_bytes")
_PROPS_MAX_BATCH_IO_SIZE = 48  # offset of max_batch_io_size in CUfileDrvProps_t
