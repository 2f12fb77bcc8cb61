"""The cuFile path: ``cuFileRead``/``cuFileWrite`` through ``cuda.bindings.cufile``.

cuFile silently runs its own POSIX compat mode when the direct route is
missing, so the path of every request is taken from cuFile's own evidence:
its per-GPU level-3 counters (nvfs / p2p / posix operations), read before and
after the request, and, where counters are off, the driver properties.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gdskit.shutdown import CLOSE_DRIVERS, at_exit
from gdskit.engine.backends.base import Backend, FileRegistration, OpenFile, Request
from gdskit.engine.backends.staged import contiguous_prefix
from gdskit.engine.buffers import adapt
from gdskit.engine.cuda import MemoryKind
from gdskit.engine.direct_path import direct_route, udev_database_present
from gdskit.errors import DirectPathUnavailable, GdskitIOError, from_os_error
from gdskit.engine.ledger import ledger
from gdskit.engine.plan import Chunk, chunks
from gdskit.engine.pool import run_chunks, run_requests
from gdskit.settings import settings
from gdskit.vocabulary import CufileBatch, Path, Reason


class _NvfsProps(ctypes.Structure):
    _fields_ = [("major_version", ctypes.c_uint), ("minor_version", ctypes.c_uint),
                ("poll_thresh_size", ctypes.c_size_t), ("max_direct_io_size", ctypes.c_size_t),
                ("dstatusflags", ctypes.c_uint), ("dcontrolflags", ctypes.c_uint)]


class _DriverProps(ctypes.Structure):
    """``CUfileDrvProps_t`` (cufile.h): the bindings expose only a pointer-taking getter."""

    _fields_ = [("nvfs", _NvfsProps), ("fflags", ctypes.c_uint), ("max_device_cache_size", ctypes.c_uint),
                ("per_buffer_cache_size", ctypes.c_uint), ("max_device_pinned_mem_size", ctypes.c_uint),
                ("max_batch_io_size", ctypes.c_uint), ("max_batch_io_timeout_msecs", ctypes.c_uint)]


@dataclass(frozen=True)
class DriverProperties:
    nvfs_version: tuple[int, int]
    max_direct_io_size: int
    status_flags: int
    control_flags: int
    feature_flags: int
    max_device_cache_size_kb: int
    max_device_pinned_mem_size_kb: int
    max_batch_io_size: int = 0            # entries one batch may hold (0: the driver names no limit)
    max_batch_io_timeout_ms: int = 0

    @property
    def nvidia_fs_loaded(self) -> bool:
        return self.nvfs_version != (0, 0)


_COUNTER_FIELDS = ("n_nvfs_reads", "n_p2p_reads", "n_posix_reads", "n_nvfs_writes", "n_p2p_writes", "n_posix_writes")


def _import_bindings() -> Any:
    from cuda.bindings import cufile  # noqa: PLC0415 - import time

    return cufile


class CufileLibrary:
    """libcufile for this process: opened once, stats switched on, closed at exit.

    ``loader`` returns the ``cuda.bindings.cufile`` module (tests pass a stand-in).
    """

    def __init__(self, loader: Any = _import_bindings) -> None:
        self._loader = loader
        self._lock = threading.Lock()
        self._mod: Any = None
        self._error: str | None = None
        self._opened = False
        self.stats_enabled = False
        self.handles: set[int] = set()  # registered and not yet deregistered
        self.buffers: dict[int, int] = {}  # registered buffer base -> length

    def _load(self) -> Any:
        with self._lock:
            if self._mod is None and self._error is None:
                try:
                    cufile = self._loader()
                    cufile.driver_open()
                    self._opened = True
                    self._mod = cufile
                    # Close in order at exit (after the workers stop, before pinned memory goes):
                    # libcufile crashes the interpreter's exit if left open.
                    at_exit(CLOSE_DRIVERS, functools.partial(self.close, stop_stats=False))
                    if settings.cufile_stats:
                        try:
                            cufile.set_stats_level(3)
                            cufile.stats_start()
                            self.stats_enabled = True
                        except Exception:  # older libcufile: fall back to driver properties
                            self.stats_enabled = False
                except Exception as exc:  # no bindings, no libcufile, no driver
                    self._error = f"{type(exc).__name__}: {exc}"
            return self._mod

    def available(self) -> bool:
        return self._load() is not None

    @property
    def error(self) -> str | None:
        self._load()
        return self._error

    @property
    def module(self) -> Any:
        mod = self._load()
        if mod is None:
            raise DirectPathUnavailable(f"libcufile is not usable: {self._error}", Reason.CUFILE_MISSING)
        return mod

    def version(self) -> int | None:
        mod = self._load()
        try:
            return int(mod.get_version()) if mod is not None else None
        except Exception:
            return None

    def properties(self) -> DriverProperties | None:
        mod = self._load()
        if mod is None:
            return None
        props = _DriverProps()
        try:
            mod.driver_get_properties(ctypes.addressof(props))
        except Exception:
            return None
        n = props.nvfs
        return DriverProperties((n.major_version, n.minor_version), n.max_direct_io_size, n.dstatusflags,
                                n.dcontrolflags, props.fflags, props.max_device_cache_size,
                                props.max_device_pinned_mem_size, props.max_batch_io_size,
                                props.max_batch_io_timeout_msecs)

    def counters(self, gpu: int) -> dict[str, int] | None:
        """cuFile's level-3 per-GPU operation counters, or ``None`` when stats are off."""
        if not self.stats_enabled:
            return None
        import numpy as np  # noqa: PLC0415 - import time

        mod = self.module
        try:
            s = mod.StatsLevel3()
            mod.get_stats_l3(s.ptr)
            per_gpu = s.per_gpu_stats
            out = {}
            for name in _COUNTER_FIELDS:
                values = np.asarray(getattr(per_gpu, name)).reshape(-1)
                out[name] = int(values[gpu]) if gpu < values.size else 0
            return out
        except Exception:
            return None

    def deregister(self, handle: int) -> None:
        with self._lock:
            if handle not in self.handles:
                return
            self.handles.discard(handle)
        self._mod.handle_deregister(handle)

    def register_buffer(self, ptr: int, nbytes: int) -> bool:
        """``cuFileBufRegister`` once per buffer (pins it for DMA and maps it into BAR1).

        Returns False when it was registered already.
        """
        with self._lock:
            if ptr in self.buffers:
                return False
            self.buffers[ptr] = nbytes  # claimed now: a second caller for the same buffer backs off
        try:
            self.module.buf_register(ptr, nbytes, 0)
        except BaseException:
            with self._lock:
                self.buffers.pop(ptr, None)
            raise
        return True

    def track(self, handle: int) -> None:
        """Remember a registered file handle (deregistered on close or at exit)."""
        with self._lock:
            self.handles.add(handle)

    def deregister_buffer(self, ptr: int) -> None:
        with self._lock:
            if self.buffers.pop(ptr, None) is None:
                return
        self._mod.buf_deregister(ptr)

    def close(self, *, stop_stats: bool = True) -> None:
        """Deregister what is left, stop the counters (``stop_stats``), close the driver.

        At exit the counters are left running: ``cuFileStatsStop`` there crashed the interpreter
        on the H200 machine (a segmentation fault inside it, after stream-ordered reads), and the
        driver's close frees them anyway."""
        with self._lock:
            handles = list(self.handles)
        for handle in handles:
            try:
                self.deregister(handle)
            except Exception:
                pass
        for ptr in list(self.buffers):
            try:
                self.deregister_buffer(ptr)
            except Exception:
                pass
        with self._lock:
            if self._opened and self._mod is not None:
                if self.stats_enabled and stop_stats:
                    try:
                        self._mod.stats_stop()
                    except Exception:
                        pass
                    self.stats_enabled = False
                try:
                    self._mod.driver_close()
                except Exception:
                    pass
                self._opened = False


@functools.lru_cache(maxsize=1)
def cufile_library() -> CufileLibrary:
    return CufileLibrary()


def counters_now(device: int) -> dict[str, int] | None:
    """cuFile's own operation counters of GPU ``device``, or None where cuFile or its
    statistics are not available. Never raises: for reports taken around some work."""
    try:
        return cufile_library().counters(device)
    except Exception:
        return None


def _classify(op: str, before: dict[str, int] | None, after: dict[str, int] | None) -> dict[Path, int] | None:
    """Operation counts per path from two counter snapshots (``None``: no evidence)."""
    if before is None or after is None:
        return None
    suffix = "reads" if op == "read" else "writes"
    delta = {p: after[f"n_{k}_{suffix}"] - before[f"n_{k}_{suffix}"]
             for p, k in ((Path.CUFILE_NVFS, "nvfs"), (Path.CUFILE_P2PDMA, "p2p"), (Path.CUFILE_COMPAT, "posix"))}
    delta = {p: n for p, n in delta.items() if n > 0}
    return delta or None


def _share(evidence: dict[Path, int] | None, part: int, whole: int) -> dict[Path, int] | None:
    """One request's part of a job's per-path operation counts (the counters cover the whole
    job), in proportion to its bytes; a request too small for any whole count gets the job's
    most common path."""
    if evidence is None or part >= whole:
        return evidence
    out = {p: round(n * part / whole) for p, n in evidence.items()}
    return {p: n for p, n in out.items() if n > 0} or {max(evidence, key=lambda p: evidence[p]): 1}


# cuFile's own error codes (CUfileOpError) start here; below are errno values of its compat mode.
_CUFILE_STATUS_BASE = 5000


def _failed_call(op: str, code: int, path: str) -> GdskitIOError:
    """The error for cuFileRead/cuFileWrite returning ``-code``: an errno, or a CUfileOpError."""
    if code >= _CUFILE_STATUS_BASE:
        return GdskitIOError(errno.EIO, f"cuFile {op} failed with cuFile status {code}", path)
    return from_os_error(OSError(code, os.strerror(code)), path)


def register(f: OpenFile) -> FileRegistration:
    """Register ``f`` with cuFile once; remember a failure so it is not retried."""
    return f.registration.get(lambda: _register(f))


def registered_handle(f: OpenFile) -> int:
    """``f``'s cuFile handle, registered on first use; where cuFile cannot serve the file,
    :class:`~gdskit.errors.DirectPathUnavailable` with the reason."""
    reg = register(f)
    if reg.handle is None:
        assert reg.reason is not None
        raise DirectPathUnavailable(f"cuFile cannot serve {f.path}: {reg.reason.value} ({reg.detail})", reg.reason)
    return reg.handle


def _register(f: OpenFile) -> FileRegistration:
    lib = cufile_library()
    if not lib.available():
        reg = FileRegistration(None, Reason.CUFILE_MISSING, lib.error or "")
    else:
        mod = lib.module
        fd = f.direct_fd()
        fd = fd if fd is not None else f.fd
        try:
            descr = mod.Descr()
            descr.type = mod.FileHandleType.OPAQUE_FD
            descr.handle.fd = fd
            descr.fs_ops = 0
            handle = int(mod.handle_register(descr.ptr))
            reg = FileRegistration(handle, None)
            lib.track(handle)
            f.on_close(lambda: lib.deregister(handle))
        except Exception as exc:
            reason = Reason.UDEV_MISSING if not udev_database_present() else Reason.HANDLE_REGISTER_FAILED
            reg = FileRegistration(None, reason, f"{type(exc).__name__}: {exc}")
    return reg


class CufileBackend(Backend):
    name = "cufile"

    def _run_many(self, f: OpenFile, reqs: Sequence[Request],
                  on_bytes: Callable[[int], None] | None = None) -> list[int]:
        """Requests of one op as one job: the chunks of all of them share the worker threads,
        so a checkpoint's many tensors are read side by side, not one after another."""
        cfg = settings.snapshot()
        lib = cufile_library()
        mod = lib.module
        handle = registered_handle(f)

        def gpu_of(req: Request) -> int:
            return req.buf.device or 0

        gpus = {gpu_of(req) for req in reqs}
        op = reqs[0].op
        call = mod.read if op == "read" else mod.write

        def work(_lane: Any, job: tuple[Request, Chunk]) -> int:
            req, ch = job
            done = 0
            while done < ch.size:
                try:
                    n = call(handle, req.buf.ptr, ch.size - done, ch.file_offset + done, ch.buf_offset + done)
                except (ValueError, getattr(mod, "cuFileError", ValueError)) as exc:
                    # -1 from cuFile: the bindings raise cuFileError(errno), or ValueError where
                    # that errno is no cuFile status (they look it up in OpError).
                    raise GdskitIOError(errno.EIO, f"cuFile {op} failed: {exc}", f.path) from exc
                if n < 0:
                    raise _failed_call(op, -int(n), f.path)
                if n == 0:
                    if op == "write":
                        raise GdskitIOError(5, "cuFileWrite wrote 0 bytes", f.path)
                    break
                done += int(n)
            if on_bytes is not None:
                on_bytes(done)
            return done

        before = {gpu: lib.counters(gpu) for gpu in gpus}
        t0 = time.perf_counter()
        batch_seen = None
        if op == "read" and _may_batch(cfg):
            done, batch_seen = _read_with_batches(f, reqs, cfg, lib, handle, work, on_bytes)
        else:
            done = run_requests(reqs, max(cfg.chunk_size, 16 * 2**20), cfg.alignment, work, device=None,
                                stage_bytes=0, threads=cfg.threads, max_lanes=cfg.threads, budget=cfg.pinned_budget)
        elapsed = time.perf_counter() - t0
        evidence = {gpu: _classify(op, before[gpu], lib.counters(gpu)) for gpu in gpus}
        job_bytes = {gpu: sum(r.size for r in reqs if gpu_of(r) == gpu) for gpu in gpus}
        all_bytes = sum(r.size for r in reqs) or 1
        if batch_seen is not None:
            # Where the per-GPU counters saw nothing, the path from libcufile's batch counters
            # (one set for the process: each GPU of the job gets its share by bytes).
            for gpu in gpus:
                if evidence[gpu] is None:
                    evidence[gpu] = _share(batch_seen, job_bytes[gpu], all_bytes)
        totals = []
        for req, (plan, sizes) in zip(reqs, done):
            total = contiguous_prefix(sizes, plan)
            seen = evidence[gpu_of(req)]
            if seen is not None and Path.CUFILE_COMPAT in seen and req.reason is Reason.DIRECT:
                f.compat_seen = True  # auto mode sends this file's later requests to the bounce ring
            self._record(req, total, len(plan), elapsed * req.size / all_bytes,
                         _share(seen, req.size, job_bytes[gpu_of(req)]))
            totals.append(total)
        return totals

    @staticmethod
    def _record(req: Request, total: int, ops: int, elapsed: float, evidence: dict[Path, int] | None) -> None:
        if evidence is None:
            # No counters: cuFile's driver properties say whether a direct route exists at all.
            props = cufile_library().properties()
            route = direct_route().route
            path = route if (route is not None and props is not None and props.nvidia_fs_loaded) else Path.CUFILE_COMPAT
            evidence = {path: ops}
        n_ops = sum(evidence.values())
        remaining = total
        items = sorted(evidence.items(), key=lambda kv: kv[0].value)
        for i, (path, count) in enumerate(items):
            nbytes = remaining if i == len(items) - 1 else total * count // n_ops
            remaining -= nbytes
            reason = req.reason
            if path is Path.CUFILE_COMPAT and reason is Reason.DIRECT:
                reason = direct_route().reason or Reason.CUFILE_COMPAT_OBSERVED
            ledger.record(path, reason, req.op, nbytes, count, elapsed * count / n_ops, device=req.buf.device)

    def read(self, f: OpenFile, req: Request) -> int:
        return self._run_many(f, [req])[0]

    def read_many(self, f: OpenFile, reqs: Sequence[Request],
                  on_bytes: Callable[[int], None] | None = None) -> list[int]:
        """Several reads as one job; the byte count of each. ``on_bytes`` is called with each
        piece's count as it lands (from worker threads)."""
        return self._run_many(f, reqs, on_bytes) if reqs else []

    def write(self, f: OpenFile, req: Request) -> int:
        return self._run_many(f, [req])[0]


# -- batch submission (cuFileBatchIOSubmit; the rules live in gdskit.engine.backends.cufile_batch) ---------

def _may_batch(cfg: Any) -> bool:
    """Whether a read job may put any piece in a batch (else: one call each, as ever)."""
    if cfg.cufile_batch is CufileBatch.NEVER:
        return False
    from gdskit.engine.backends.cufile_batch import batches_possible  # noqa: PLC0415 - import time

    return batches_possible(cfg.cufile_batch)


def _read_with_batches(f: OpenFile, reqs: Sequence[Request], cfg: Any, lib: CufileLibrary, handle: int,
                       work: Callable[[Any, tuple[Request, Chunk]], int],
                       on_bytes: Callable[[int], None] | None
                       ) -> tuple[list[tuple[list[Chunk], list[int]]], dict[Path, int] | None]:
    """``run_requests``' answer for a read job, the chunks a batch can take (and
    :func:`~gdskit.engine.backends.cufile_batch.batch_chosen` picks) read through batches, the others
    with one cuFileRead each on the workers (all of them where libcufile refuses batches); and
    the paths libcufile's batch counters saw (None: no batch, or no counters)."""
    from gdskit.engine.backends import cufile_batch as cb  # noqa: PLC0415 - import time

    plans = [chunks(r.file_offset, r.buf_offset, r.size, max(cfg.chunk_size, 16 * 2**20), cfg.alignment)
             for r in reqs]
    jobs = [(i, j) for i, plan in enumerate(plans) for j in range(len(plan))]
    fit = [(i, j) for i, j in jobs
           if cb.batchable(reqs[i].buf.ptr, plans[i][j].buf_offset, plans[i][j].file_offset, plans[i][j].size,
                           cfg.alignment)]
    batched = [(i, j) for i, j in fit if cb.batch_chosen(cfg.cufile_batch, plans[i][j].size, len(fit))]
    results: list[list[int]] = [[0] * len(plan) for plan in plans]
    seen = None
    if batched:
        entries = [(reqs[i].buf.ptr, plans[i][j].size, plans[i][j].file_offset, plans[i][j].buf_offset)
                   for i, j in batched]
        counters = cb.batch_counters(lib)
        try:
            counts = cb.read_batched(lib, handle, entries, cfg.alignment,
                                     lambda code: _failed_call("read", code, f.path), f.path, on_bytes)
        except cb.BatchRefused:
            batched = []
        else:
            seen = cb.batch_evidence(counters, cb.batch_counters(lib))
            for (i, j), n in zip(batched, counts):
                results[i][j] = n
    taken = set(batched)
    single = [(i, j) for i, j in jobs if (i, j) not in taken]
    if single:
        counts = run_chunks([(reqs[i], plans[i][j]) for i, j in single], work, device=None, stage_bytes=0,
                            threads=cfg.threads, max_lanes=cfg.threads, budget=cfg.pinned_budget)
        for (i, j), n in zip(single, counts):
            results[i][j] = n
    return list(zip(plans, results)), seen


class BufferRegistration:
    """A GPU buffer registered with cuFile (see :func:`gdskit.register_buffer`); a context manager.

    ``registered`` says whether cuFile took it; ``reason`` says why not.
    """

    def __init__(self, buf: Any) -> None:
        view = adapt(buf)
        self.ptr, self.nbytes = view.ptr, view.nbytes
        self.registered = False
        self.reason: Reason | None = None
        self._owner = view.owner
        lib = cufile_library()
        if view.kind is not MemoryKind.DEVICE:
            self.reason = Reason.MANAGED_MEMORY if view.kind is MemoryKind.MANAGED else Reason.HOST_MEMORY
        elif not lib.available():
            self.reason = Reason.CUFILE_MISSING
        else:
            try:
                self.registered = lib.register_buffer(self.ptr, self.nbytes)
            except Exception as exc:
                raise GdskitIOError(5, f"cuFileBufRegister failed: {exc}") from exc

    def release(self) -> None:
        if self.registered:
            self.registered = False
            cufile_library().deregister_buffer(self.ptr)

    def __enter__(self) -> BufferRegistration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# -- the Stream API: cuFileReadAsync / cuFileWriteAsync (gdskit.engine.stream_ordered) -------------------------------
# Kept apart from the synchronous job above: gdskit.engine.stream_ordered queues these on a caller's stream.

def enqueue_async(f: OpenFile, op: str, base: int, size_p: int, file_offset_p: int, buf_offset_p: int,
                  bytes_p: int, stream: int) -> None:
    """Queue ``cuFileReadAsync``/``cuFileWriteAsync`` of ``f`` on ``stream``. The four pointers
    name memory the caller keeps valid until the stream has run the I/O: cuFile reads the size
    and offsets through them then, and writes the outcome through ``bytes_p`` (see
    :func:`async_outcome`). A refusal raises :class:`~gdskit.errors.GdskitIOError` (EIO), or
    :class:`~gdskit.errors.DirectPathUnavailable` where the bindings have no Stream API."""
    mod = cufile_library().module
    handle = registered_handle(f)
    call = getattr(mod, "read_async" if op == "read" else "write_async", None)
    if call is None:
        raise DirectPathUnavailable("this libcufile's bindings have no Stream API (cuFileReadAsync)",
                                    Reason.CUFILE_MISSING)
    try:
        call(handle, base, size_p, file_offset_p, buf_offset_p, bytes_p, stream)
    except (ValueError, getattr(mod, "cuFileError", ValueError)) as exc:
        raise GdskitIOError(errno.EIO, f"cuFile {op} on a stream refused: {exc}", f.path) from exc


def async_outcome(op: str, nbytes: int, path: str) -> int:
    """The byte count cuFile's Stream API wrote back, or the error it stands for: ``-1`` an I/O
    error, another negative value an errno or a ``CUfileOpError`` (as for :func:`_failed_call`).
    Makes no CUDA call: it runs in a host function."""
    if nbytes == -1:
        raise GdskitIOError(errno.EIO, f"cuFile {op} on a stream failed with an I/O error", path)
    if nbytes < 0:
        raise _failed_call(op, -nbytes, path)
    return nbytes


def record_async(f: OpenFile, req: Request, total: int, ops: int, elapsed: float,
                 before: dict[str, int] | None) -> None:
    """Record a stream-ordered cuFile request in the ledger, its path from cuFile's counters taken
    when it was queued (``before``) and now; compat mode seen on a direct request turns the
    file's later ``auto`` requests to the ring, as for the synchronous path."""
    gpu = req.buf.device or 0
    evidence = _classify(req.op, before, cufile_library().counters(gpu))
    if evidence is not None and Path.CUFILE_COMPAT in evidence and req.reason is Reason.DIRECT:
        f.compat_seen = True
    CufileBackend._record(req, total, ops, elapsed, evidence)
