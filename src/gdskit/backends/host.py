"""The host path: the memory is host memory, so no GPU is involved.

Page-cache hits are read straight into the caller's memory by parallel
``preadv`` calls; misses (and ``odirect="always"``) go O_DIRECT through a
page-aligned scratch area per worker, because the caller's memory is rarely
aligned the way O_DIRECT needs.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import operator
import os
import time
from collections.abc import Callable, Sequence

from gdskit.backends.base import RWF_NOWAIT, Backend, OpenFile, Request, pread_full, pwrite_all
from gdskit.buffers import BufferView
from gdskit.backends.staged import (ChunkResult, contiguous_prefix, direct_usable, file_residency, read_direct,
                                    read_to_stage, write_from_stage)
from gdskit.residency import Residency
from gdskit.errors import InvalidArgumentError, from_os_error
from gdskit.ledger import ledger
from gdskit.plan import Chunk, align_down, chunks
from gdskit.pool import LaneRef, run_chunks, run_requests
from gdskit.settings import Settings, settings
from gdskit.vocabulary import ODirectPolicy, Path, Reason


_SMALL_MAX = 64 << 10  # requests up to this size try the one-syscall path first


def _direct_fd(f: OpenFile, cfg: Settings, size: int) -> int | None:
    """The O_DIRECT descriptor for reads of ``size`` bytes, if the policy and size allow one."""
    return None if size % cfg.alignment else direct_usable(f, cfg.odirect)


def _one_call_fd(f: OpenFile, policy: ODirectPolicy, dfd: int | None, pos: int, size: int, addr: int,
                 align: int) -> tuple[int | None, Residency | None]:
    """The descriptor one system call can read ``size`` bytes at ``pos`` into ``addr`` from, or None;
    and the range's residency where it was asked (the general path then need not ask again).

    Buffered when the policy is ``never`` or every page is cached (asked with ``cachestat``,
    never probed with RWF_NOWAIT, which would start readahead that races the O_DIRECT read);
    O_DIRECT when the range and the memory are aligned and nothing is cached. None (unaligned
    miss, partly cached range) sends the read the general way.
    """
    where = None
    if policy is ODirectPolicy.NEVER:
        return f.fd, where
    if policy is ODirectPolicy.AUTO:
        where = file_residency(f, pos, size)
        if where is Residency.ALL:
            return f.fd, where
        if where is not Residency.NONE:
            return None, where
    if dfd is None or pos % align or addr % align:
        return None, where
    return dfd, where


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
            fd, where = _one_call_fd(f, cfg.odirect, _direct_fd(f, cfg, req.size), pos, req.size,
                                     buf.ptr + req.buf_offset, cfg.alignment)
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

    def _read_general(self, f: OpenFile, req: Request, where: Residency | None = None) -> int:
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
        policy, align, dfd = cfg.odirect, cfg.alignment, _direct_fd(f, cfg, size)
        base, clock = buf.ptr, time.perf_counter_ns
        # Where the policy alone picks the descriptor (never: buffered; always: O_DIRECT, if
        # every read is aligned), the reads run in a loop with nothing else in it: with several
        # workers, every microsecond of interpreter time per read is time the others wait for
        # the interpreter lock.
        fixed = f.fd if policy is ODirectPolicy.NEVER else dfd if policy is ODirectPolicy.ALWAYS else None
        if fixed is not None and fixed == dfd and (functools.reduce(operator.or_, file_offsets, 0) | base
                                                   | functools.reduce(operator.or_, buf_offsets, 0)) & (align - 1):
            fixed = None  # some read is unaligned: decide one by one
        counts: list[int] = []
        fast_ops = fast_ns = 0
        if fixed is not None:
            fast_ops, fast_ns = _tight_reads(fixed, view, file_offsets, buf_offsets, size, latencies_ns)
            counts = [size] * fast_ops
        # Whatever the tight loop did not finish (it stops at a short read at the end of the file
        # or an error, which the general path then reports) and every read under ``auto``:
        # decided one by one.
        t0 = clock()  # one clock read per read: each one's end is the next one's start
        for off, bo in zip(file_offsets[fast_ops:], buf_offsets[fast_ops:]):
            n = -1
            fd, where = _one_call_fd(f, policy, dfd, off, size, base + bo, align)
            if fd is not None:
                try:
                    n = os.preadv(fd, [view[bo:bo + size]], off)
                except OSError:
                    pass  # interrupted or refused: the general path repeats it and reports real errors
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

    def _read_chunk(self, f: OpenFile, req: Request, view: memoryview, cfg: Settings, ref: LaneRef,
                    ch: Chunk, where: Residency | None = None) -> ChunkResult:
        """One chunk into host memory: page-cache hits buffered, misses O_DIRECT. ``where``: the
        chunk's residency, if already asked."""
        align = cfg.alignment
        dst = view[ch.buf_offset:ch.buf_offset + ch.size]
        policy = cfg.odirect
        dfd = f.direct_fd() if policy is not ODirectPolicy.NEVER and not f.direct_refused else None
        if dfd is None:
            got = pread_full(f.fd, dst, ch.file_offset, f.path)
            return ChunkResult(got, got)
        cached = 0
        if policy is ODirectPolicy.AUTO:
            if where is None:
                where = file_residency(f, ch.file_offset, ch.size)
            if where is None and f.nowait_supported:
                try:
                    cached = pread_full(f.fd, dst, ch.file_offset, f.path, flags=RWF_NOWAIT)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    f.nowait_supported = False
                if cached == ch.size:
                    return ChunkResult(cached, cached)
            elif where is not Residency.NONE or (where is None and not f.nowait_supported):
                got = pread_full(f.fd, dst, ch.file_offset, f.path)
                return ChunkResult(got, got)
        pos = ch.file_offset + cached
        rest = ch.size - cached
        addr = req.buf.ptr + ch.buf_offset + cached
        direct = 0
        if pos % align == 0 and addr % align == 0 and rest >= align:
            # The caller's memory is aligned like the file: O_DIRECT straight into it.
            body = align_down(rest, align)
            try:
                direct = read_direct(dfd, dst[cached:cached + body], pos, align, f.path)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                f.direct_refused = True
                direct = 0
            if direct < body:
                if f.direct_refused:
                    got = pread_full(f.fd, dst[cached:], pos, f.path)
                    return ChunkResult(cached + got, cached + got)
                return ChunkResult(cached + direct, cached)
            pos += direct
            rest -= direct
            if rest == 0:
                return ChunkResult(ch.size, cached)
        stage = ref.get().stages[0]
        res = read_to_stage(f, stage.view, pos, rest, ODirectPolicy.ALWAYS, align)
        if res.nbytes:
            ctypes.memmove(addr + direct, stage.ptr + pos % align, res.nbytes)
        return ChunkResult(cached + direct + res.nbytes, cached + res.cached)

