"""The host path: the memory is host memory, so no GPU is involved.

Every read is a chunk plan run by the CPU paths' one chunk reader
(:func:`gdskit.engine.backends.staged.read_chunk`): page-cache hits are read straight into the
caller's memory by parallel ``preadv`` calls; misses (and ``odirect="always"``) go
O_DIRECT, straight into the caller's memory where it is aligned like the file, else
through a page-aligned scratch area per worker. A small read first tries to be one
system call, on the descriptor the same decision picks (:func:`_one_call_fd`).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import operator
import os
import time
from collections.abc import Callable, Sequence

from gdskit.engine.backends.base import UNKNOWN, Backend, OpenFile, Request, Unknown, pwrite_all
from gdskit.engine.backends.staged import (ChunkResult, MemoryTarget, Via, choose, choose_for_batch, contiguous_prefix,
                                    direct_usable, read_chunk, write_from_stage)
from gdskit.engine.buffers import BufferView
from gdskit.errors import InvalidArgumentError, from_os_error
from gdskit.engine.ledger import ledger
from gdskit.engine.plan import Chunk, chunks
from gdskit.engine.residency import Residency
from gdskit.engine.pool import LaneRef, run_chunks, run_requests
from gdskit.settings import Settings, settings
from gdskit.vocabulary import IoUring, ODirectPolicy, Path, Reason


_SMALL_MAX = 64 << 10  # requests up to this size try the one-syscall path first

#: Batches of at least this many reads on one descriptor go through io_uring (``settings.io_uring``):
#: below it, setting up the ring's entries costs more interpreter time than the system calls saved.
URING_MIN_READS = 16


def _one_call_fd(f: OpenFile, policy: ODirectPolicy, pos: int, size: int, addr: int,
                 align: int) -> tuple[int | None, Residency | None | Unknown]:
    """The descriptor one system call can read ``size`` bytes at ``pos`` into ``addr`` from, or None;
    and the range's residency where it was asked (the general path then need not ask again).

    As :func:`~gdskit.engine.backends.staged.choose` says, where that is one call: buffered, or
    O_DIRECT when the range and the memory are aligned. Where the page cache cannot say,
    None: it is never probed with RWF_NOWAIT here (readahead would race the O_DIRECT read).
    """
    via, where = choose(f, policy, pos, size)
    if via is Via.BUFFERED:
        return f.fd, where
    if via is Via.DIRECT and not (pos | addr | size) & (align - 1):
        return f.direct_fd(), where
    return None, where


def _preadv_once(f: OpenFile, fd: int, iov: list[memoryview], pos: int) -> int:
    """One ``preadv``; -1 where the general path must take over (interrupted, O_DIRECT refused)."""
    try:
        return os.preadv(fd, iov, pos)
    except InterruptedError:
        return -1
    except OSError as exc:
        if fd == f.fd or exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise from_os_error(exc, f.path) from exc
        return -1


def _tight_reads(fd: int, view: memoryview, file_offsets: list[int], buf_offsets: list[int], size: int,
                 latencies_ns: list[int] | None) -> tuple[int, int]:
    """``preadv`` of ``size`` bytes at each offset into ``view``, until one comes back short or
    fails; returns how many were whole and the nanoseconds they took. One buffer place for
    all (a benchmark's) keeps one iovec."""
    preadv, clock = os.preadv, time.perf_counter_ns
    same = buf_offsets.count(buf_offsets[0]) == len(buf_offsets)
    iov = [view[buf_offsets[0]:buf_offsets[0] + size]]
    done = 0
    start = t0 = clock()
    try:
        if latencies_ns is None and same:
            for off in file_offsets:
                if preadv(fd, iov, off) != size:
                    break
                done += 1
            return done, clock() - start
        record = latencies_ns.append if latencies_ns is not None else None
        for off, bo in zip(file_offsets, buf_offsets):
            if not same:
                iov = [view[bo:bo + size]]
            if preadv(fd, iov, off) != size:
                break
            if record is not None:
                t1 = clock()
                record(t1 - t0)
                t0 = t1
            done += 1
    except OSError:
        pass  # the caller's general path repeats this read and reports what is wrong
    return done, clock() - start


class HostBackend(Backend):
    name = "host"

    def read(self, f: OpenFile, req: Request) -> int:
        if req.size <= _SMALL_MAX:
            # A small request costs more in Python than in the kernel: one system call where it can.
            t0 = time.perf_counter()
            cfg = settings.snapshot()
            buf, pos = req.buf, req.file_offset
            view = buf.host_view
            fd, where = _one_call_fd(f, cfg.odirect, pos, req.size, buf.ptr + req.buf_offset, cfg.alignment)
            if fd is not None and view is not None:
                n = _preadv_once(f, fd, [view[req.buf_offset:req.buf_offset + req.size]], pos)
                if n == req.size:
                    ledger.record(Path.HOST, req.reason, "read", n, 1, time.perf_counter() - t0)
                    return n
            return self._read_general(f, req, where)
        return self._read_general(f, req)

    def read_many(self, f: OpenFile, reqs: Sequence[Request],
                  on_bytes: Callable[[int], None] | None = None) -> list[int]:
        """Several reads into host memory as one job; the byte count of each. The chunks of
        all requests share the worker threads, so many tensors are read side by side."""
        if len(reqs) <= 1:
            counts = [self.read(f, r) for r in reqs]  # one request keeps its small-read shortcuts
            if on_bytes is not None and counts:
                on_bytes(counts[0])
            return counts
        return self._read_chunked(f, reqs, settings.snapshot(), on_bytes)

    def _read_chunked(self, f: OpenFile, reqs: Sequence[Request], cfg: Settings,
                      on_bytes: Callable[[int], None] | None = None) -> list[int]:
        """Requests split into chunks, all run on the worker threads; the byte count of each."""
        if any(r.buf.host_view is None for r in reqs):
            raise InvalidArgumentError("the host path needs host memory")
        t0 = time.perf_counter()

        def work(ref: LaneRef, job: tuple[Request, Chunk]) -> ChunkResult:
            req, ch = job
            res = self._read_chunk(f, req, req.buf.host_view, cfg, ref, ch)  # type: ignore[arg-type]
            if on_bytes is not None:
                on_bytes(res.nbytes)
            return res

        done = run_requests(reqs, cfg.chunk_size, cfg.alignment, work, device=None,
                            stage_bytes=cfg.chunk_size + 2 * cfg.alignment, threads=cfg.threads,
                            max_lanes=cfg.threads, budget=cfg.pinned_budget)
        elapsed = time.perf_counter() - t0
        all_bytes = sum(r.size for r in reqs) or 1
        counts = []
        for req, (plan, results) in zip(reqs, done):
            total = contiguous_prefix((r.nbytes for r in results), plan)
            ledger.record(Path.HOST, req.reason, "read", total, len(plan), elapsed * req.size / all_bytes)
            counts.append(total)
        return counts

    def _read_general(self, f: OpenFile, req: Request, where: Residency | None | Unknown = UNKNOWN) -> int:
        """Any read into host memory; ``where``: the request's residency, if already asked."""
        cfg = settings.snapshot()
        view = req.buf.host_view
        if view is None:
            raise InvalidArgumentError("the host path needs host memory")
        t0 = time.perf_counter()
        if req.size <= cfg.chunk_size and (req.file_offset % cfg.alignment) + req.size <= cfg.chunk_size:
            # One chunk: run it right here, without the worker machinery (small I/O is all overhead).
            ch = Chunk(req.file_offset, req.buf_offset, req.size)
            ref = LaneRef(None, cfg.chunk_size + 2 * cfg.alignment, cfg.threads, cfg.pinned_budget)
            try:
                total = self._read_chunk(f, req, view, cfg, ref, ch, where).nbytes
            finally:
                ref.release()
            ledger.record(Path.HOST, req.reason, "read", total, 1, time.perf_counter() - t0)
            return total
        return self._read_chunked(f, [req], cfg)[0]

    def write(self, f: OpenFile, req: Request) -> int:
        cfg = settings.snapshot()
        view = req.buf.host_view
        if view is None:
            raise InvalidArgumentError("the host path needs host memory")
        align = cfg.alignment
        plan = chunks(req.file_offset, req.buf_offset, req.size, cfg.chunk_size, align)
        t0 = time.perf_counter()

        def work(ref: LaneRef, ch: Chunk) -> ChunkResult:
            src = view[ch.buf_offset:ch.buf_offset + ch.size]
            if cfg.odirect is ODirectPolicy.NEVER or ch.size < align or f.direct_fd() is None:
                pwrite_all(f.fd, src, ch.file_offset, f.path)
                return ChunkResult(ch.size, ch.size)
            # O_DIRECT needs aligned memory: stage the chunk (a memcpy is far cheaper than the disk).
            stage = ref.get().stages[0]
            head = ch.file_offset % align
            ctypes.memmove(stage.ptr + head, req.buf.ptr + ch.buf_offset, ch.size)
            return write_from_stage(f, stage.view, ch.file_offset, ch.size, cfg.odirect, align)

        run_chunks(plan, work, device=None, stage_bytes=cfg.chunk_size + 2 * align,
                   threads=cfg.threads, max_lanes=cfg.threads, budget=cfg.pinned_budget)
        ledger.record(Path.HOST, req.reason, "write", req.size, len(plan), time.perf_counter() - t0)
        return req.size

    def read_batch(self, f: OpenFile, buf: BufferView, file_offsets: list[int], buf_offsets: list[int], size: int,
                   reason: Reason, latencies_ns: list[int] | None) -> list[int]:
        """Many reads of ``size`` bytes; see :meth:`gdskit.File.read_batch`.

        Each read that can be one system call (:func:`_one_call_fd`) is made in a tight loop;
        any other (and one that comes back short: end of file) takes the general path. One
        ledger record covers the loop.
        """
        cfg = settings.snapshot()
        view = buf.host_view
        if view is None:
            raise InvalidArgumentError("the host path needs host memory")
        policy, align = cfg.odirect, cfg.alignment
        base, clock = buf.ptr, time.perf_counter_ns
        # Where one descriptor serves the whole batch (the policy says so, or under auto the page
        # cache holds all or none of a few reads spread over it), the reads run in one io_uring
        # submission or a loop with nothing else in it: with several workers, every microsecond
        # of interpreter time per read is time the others wait for the interpreter lock.
        via = choose_for_batch(f, policy, file_offsets, size)
        dfd = None if size % align or via is not Via.DIRECT else direct_usable(f, policy)  # opened only now
        fixed = f.fd if via is Via.BUFFERED else dfd if via is Via.DIRECT else None
        if via is Via.DIRECT and (dfd is None or (functools.reduce(operator.or_, file_offsets, 0) | base
                                                  | functools.reduce(operator.or_, buf_offsets, 0)) & (align - 1)):
            # Some read is unaligned, so not one O_DIRECT call. Under auto (a cold batch) all of
            # them are read buffered at once, the kernel reading only the pages asked for: one by
            # one, each would be an O_DIRECT read of its aligned span through a stage, waited for
            # before the next starts (5x slower for cold token windows). Under always: one by one.
            fixed = f.fd if policy is ODirectPolicy.AUTO else None
        counts: list[int] = []
        fast_ops = fast_ns = 0
        if fixed is not None and latencies_ns is None and len(file_offsets) >= URING_MIN_READS \
                and cfg.io_uring is IoUring.AUTO:
            ring_counts = self._ring_reads(f, fixed, view, buf, file_offsets, buf_offsets, size, reason)
            if ring_counts is not None:
                return ring_counts
        if fixed is not None:
            fast_ops, fast_ns = _tight_reads(fixed, view, file_offsets, buf_offsets, size, latencies_ns)
            counts = [size] * fast_ops
        # Whatever the tight loop did not finish (it stops at a short read at the end of the file
        # or an error, which the general path then reports) and every read under ``auto``:
        # decided one by one.
        t0 = clock()  # one clock read per read: each one's end is the next one's start
        for off, bo in zip(file_offsets[fast_ops:], buf_offsets[fast_ops:]):
            fd, where = _one_call_fd(f, policy, off, size, base + bo, align)
            n = -1 if fd is None else _preadv_once(f, fd, [view[bo:bo + size]], off)
            if n == size:
                t1 = clock()
                fast_ops += 1
                fast_ns += t1 - t0
            else:  # short (end of file), refused or not a one-call case: the general path, exactly
                n = self._read_general(f, Request("read", buf, size, off, bo, reason), where)
                t1 = clock()
            if latencies_ns is not None:
                latencies_ns.append(t1 - t0)
            t0 = t1
            counts.append(n)
        if fast_ops:
            ledger.record(Path.HOST, reason, "read", fast_ops * size, fast_ops, fast_ns / 1e9, requests=fast_ops)
        return counts

    def _ring_reads(self, f: OpenFile, fd: int, view: memoryview, buf: BufferView, file_offsets: list[int],
                    buf_offsets: list[int], size: int, reason: Reason) -> list[int] | None:
        """The batch through this thread's io_uring ring (:mod:`gdskit.engine.backends.uring`): every read
        submitted at once on ``fd``, those that come back whole done; each other one (short at the
        end of the file, failed) then takes the general path alone, which counts and reports it
        as a read outside a batch would. None where no ring can be had (read another way)."""
        from gdskit.engine.backends import uring  # noqa: PLC0415 - import time

        ring = uring.ring_for_thread()
        if ring is None:
            return None
        t0 = time.perf_counter_ns()
        try:
            counts = ring.read(fd, view, file_offsets, buf_offsets, size)
        except OverflowError:
            return None  # an offset beyond any file (nothing was submitted): the loop reports it
        elapsed = time.perf_counter_ns() - t0
        done = counts.count(size)
        if done < len(counts):
            if fd == f.fd and not done and counts.count(-errno.EINVAL) == len(counts):
                uring.mark_unusable("the kernel refused IORING_OP_READ (EINVAL) on a buffered descriptor")
            for i, n in enumerate(counts):
                if n != size:
                    counts[i] = self._read_general(f, Request("read", buf, size, file_offsets[i], buf_offsets[i],
                                                              reason))
        if done:
            ledger.record(Path.HOST, reason, "read", done * size, done, elapsed / 1e9, requests=done)
        return counts

    def _read_chunk(self, f: OpenFile, req: Request, view: memoryview, cfg: Settings, ref: LaneRef,
                    ch: Chunk, where: Residency | None | Unknown = UNKNOWN) -> ChunkResult:
        """One chunk into host memory (:func:`~gdskit.engine.backends.staged.read_chunk`): page-cache hits
        buffered, misses O_DIRECT. ``where``: the chunk's residency, if already asked."""
        target = MemoryTarget(view[ch.buf_offset:ch.buf_offset + ch.size], req.buf.ptr + ch.buf_offset,
                              ch.file_offset, cfg.alignment, lambda: ref.get().stages[0])
        return read_chunk(f, target, ch.file_offset, ch.size, cfg.odirect, where)
