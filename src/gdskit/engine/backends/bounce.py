"""The bounce path: gdskit's own CPU path for device memory.

Workers read chunks into a bounded ring of pinned host buffers (one per
worker by default, see ``Lane``) and copy them to the GPU with asynchronous
copies on one stream per worker; with several stages a worker reads chunk
*i+1* while chunk *i* is still being copied. Writes run the same ring
backwards. The ring is reused across calls: pinned memory is slow to allocate.

A read of one chunk (and each read of :meth:`BounceBackend.read_batch`) skips the
workers: the calling thread takes a lane, reads into its stage, queues one copy,
records one event and waits for it (:func:`_read_in_caller`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import gdskit.engine.cuda as cuda

import gdskit.engine.numa as numa
from gdskit.engine.backends.base import UNKNOWN, Backend, OpenFile, Request
from gdskit.engine.backends.staged import (ChunkResult, contiguous_prefix, file_residency, read_to_stage,
                                   write_from_stage)
from gdskit.engine.buffers import BufferView
from gdskit.errors import CudaError
from gdskit.engine.ledger import ledger, record_bounce_pieces
from gdskit.engine.plan import Chunk, chunks
from gdskit.engine.pool import LaneRef, lanes, run_chunks, run_requests
from gdskit.engine.residency import Residency
from gdskit.settings import Settings, settings
from gdskit.vocabulary import Path, Reason

# Workers for a job of scattered reads whose bytes the page cache holds, while its caller makes
# more destinations. Such a job is many small copies, and each costs Python in its worker, which
# shares the interpreter with the caller: past a few workers they only crowd it (docs/engine.md,
# "Measurements behind the defaults"). From the disk every worker stays: there the disk's
# queue depth is what counts; so it does where the caller only waits (``BufferView.caller_busy``).
SCATTERED_HOT_WORKERS = 4

# A single read done in its caller's thread moves that thread onto its GPU's NUMA node (and back)
# only from this size: below it the two sched_setaffinity calls cost more than the few KiB the
# thread writes into the stage across the CPUs' interconnect. A batch moves once for all its reads.
NUMA_MOVE_MIN = 1 << 20


def _record(req: Request, op: str, results: list[ChunkResult], total: int, elapsed: float) -> None:
    cached = sum(r.cached for r in results if r is not None)
    moved = sum(r.nbytes for r in results if r is not None)
    cached = min(cached, total)
    direct = max(0, total - cached)
    n_cached = sum(1 for r in results if r is not None and r.cached)
    n_direct = sum(1 for r in results if r is not None and r.nbytes > r.cached)
    share = (lambda b: elapsed * b / moved) if moved else (lambda b: 0.0)
    if cached or not direct:
        ledger.record(Path.BOUNCE_CACHED, req.reason, op, cached, max(n_cached, 1 if not direct else 0), share(cached),
                      device=req.buf.device)
    if direct:
        ledger.record(Path.BOUNCE_DIRECT, req.reason, op, direct, n_direct, share(direct), device=req.buf.device)


def _record_reads(reason: Reason, device: int | None, results: Sequence[ChunkResult], elapsed: float) -> None:
    """The ledger records of reads of one chunk each, as :func:`_record` makes them one by one,
    added up into one record per path (:func:`gdskit.engine.ledger.record_bounce_pieces`)."""
    record_bounce_pieces([(reason, r.nbytes, r.cached) for r in results], device, elapsed)


def _fits_one_chunk(file_offset: int, size: int, chunk: int, alignment: int) -> bool:
    """Whether :func:`gdskit.engine.plan.chunks` makes one chunk of this read (its stage holds it)."""
    return file_offset % alignment + size <= chunk


def _read_in_caller(f: OpenFile, cfg: Settings, device: int, n_lanes: int, chunk: int, buf: BufferView,
                    reads: Sequence[tuple[int, int, int]], move_thread: bool,
                    latencies_ns: list[int] | None = None,
                    on_bytes: Callable[[int], None] | None = None) -> list[ChunkResult]:
    """Reads ``(file_offset, buf_offset, size)`` of one chunk each into ``buf``, one after another
    in the calling thread, on one lane held for all of them.

    Each read is what it needs and no more: the chunk read the O_DIRECT policy picks
    (:func:`~gdskit.engine.backends.staged.read_to_stage`), one asynchronous copy, one event recorded
    after it and waited for (the lane's spinning ``quick_event``), so that the lane is idle again
    after each read and goes back to the pool undrained of nothing. ``move_thread``: run on the
    GPU's NUMA node meanwhile (:mod:`gdskit.engine.numa`), as the workers do. ``on_bytes``: called with
    each read's count once its bytes are in ``buf``.
    """
    align = cfg.alignment
    lane = lanes.acquire(device, chunk + 2 * align, n_lanes, cfg.pinned_budget)
    queued = False  # a copy may be in flight: a lane left so must not go back to the pool as it is
    cpus = None
    caller_context = None
    out: list[ChunkResult] = []
    try:
        # The copies go to the lane's stream, which belongs to the lane's device; the caller's
        # thread gets its own context back after (torch reads its current device from it).
        caller_context = cuda.make_current(device)
        if move_thread:
            cpus = numa.run_on(numa.place_of(device).cpus)
        stream, event = lane.stream, lane.quick_event
        assert stream is not None and event is not None
        clock = time.perf_counter_ns
        t0 = clock()
        for file_offset, buf_offset, size in reads:
            stage, _ = lane.next_stage()
            res = read_to_stage(f, stage.view, file_offset, size, cfg.odirect, align)
            if res.nbytes:
                src = stage.ptr + file_offset % align
                queued = True
                if buf.scatter is None:
                    stream.copy_h2d(buf.ptr + buf_offset, src, res.nbytes)
                else:
                    stream.copy_h2d_many([(dst, src + skip, n) for dst, skip, n
                                          in buf.scatter.pieces(buf_offset, res.nbytes)])
                event.record(stream)
                event.wait()
                queued = False
                if on_bytes is not None:
                    on_bytes(res.nbytes)
            out.append(res)
            if latencies_ns is not None:
                t1 = clock()
                latencies_ns.append(t1 - t0)
                t0 = t1
    except BaseException:
        numa.restore_cpus(cpus)
        if queued:
            lanes.discard_after_failure(lane)  # its copy may still read the stage: freed once its stream is done
        else:
            lanes.release(lane)
        try:
            cuda.put_back(caller_context)
        except CudaError:
            pass  # the error already under way is the one to report
        raise
    numa.restore_cpus(cpus)
    lanes.release(lane)
    cuda.put_back(caller_context)
    return out


def _scattered_cached_and_crowded(f: OpenFile, reqs: Sequence[Request]) -> bool:
    """Whether every request scatters into many destinations, the page cache holds all their
    bytes (the callers' answer where they asked: a loader asks once for all its jobs; else the
    page cache's), and the caller makes more destinations meanwhile (unless it said it does not)."""
    if any(r.buf.scatter is None or r.buf.caller_busy is False for r in reqs):
        return False
    told = {r.buf.source_cached for r in reqs}
    if None not in told:
        return told == {True}
    lo = min(r.file_offset for r in reqs)
    hi = max(r.file_offset + r.size for r in reqs)
    return file_residency(f, lo, hi - lo) is Residency.ALL


class BounceBackend(Backend):
    name = "bounce"

    @staticmethod
    def _layout(buf: BufferView) -> tuple[Settings, int, int, int]:
        """Settings, device, lanes and chunk bytes for requests into ``buf``'s device (chunks fit the pinned budget)."""
        cfg = settings.snapshot()
        device = buf.device if buf.device is not None else cuda.current_device()
        n_lanes, chunk = lanes.stage_layout(device, cfg.threads, cfg.chunk_size, cfg.pinned_budget, cfg.alignment)
        return cfg, device, n_lanes, chunk

    def read(self, f: OpenFile, req: Request) -> int:
        return self.read_many(f, [req])[0]

    def read_batch(self, f: OpenFile, buf: BufferView, file_offsets: Sequence[int], buf_offsets: Sequence[int],
                   size: int, reason: Reason, latencies_ns: list[int] | None = None) -> list[int]:
        """Reads of ``size`` bytes at ``file_offsets`` into ``buf`` at ``buf_offsets``, one after
        another, each done (its copy finished) before the next starts; the byte count of each.
        See :meth:`gdskit.File.read_batch`.

        Where every read fits one chunk they run in the calling thread on one lane, taken
        once for the batch; otherwise each is an ordinary request.
        """
        if not file_offsets:
            return []
        cfg, device, n_lanes, chunk = self._layout(buf)
        align = cfg.alignment
        if size + max(o % align for o in file_offsets) > chunk:
            counts = []
            for off, bo in zip(file_offsets, buf_offsets):
                t0 = time.perf_counter_ns()
                counts.append(self.read_many(f, [Request("read", buf, size, off, bo, reason)])[0])
                if latencies_ns is not None:
                    latencies_ns.append(time.perf_counter_ns() - t0)
            return counts
        t0 = time.perf_counter()
        results = _read_in_caller(f, cfg, device, n_lanes, chunk, buf,
                                  [(off, bo, size) for off, bo in zip(file_offsets, buf_offsets)], True,
                                  latencies_ns)
        _record_reads(reason, buf.device, results, time.perf_counter() - t0)
        return [r.nbytes for r in results]

    def read_many(self, f: OpenFile, reqs: Sequence[Request],
                  on_bytes: Callable[[int], None] | None = None) -> list[int]:
        """Several reads into memory of one device as one job; the byte count of each.

        The chunks of all requests share the workers, and each worker keeps its lane
        from one request to the next instead of handing it over and draining it at the
        end of every request (a checkpoint's hundreds of tensors). ``on_bytes`` is called
        with each chunk's count once its copy is queued (from worker threads).
        """
        if not reqs:
            return []
        cfg, device, n_lanes, chunk = self._layout(reqs[0].buf)
        if len(reqs) == 1 and _fits_one_chunk(reqs[0].file_offset, reqs[0].size, chunk, cfg.alignment):
            # One chunk: the calling thread reads it, without the workers' machinery.
            req = reqs[0]
            t0 = time.perf_counter()
            res = _read_in_caller(f, cfg, device, n_lanes, chunk, req.buf,
                                  [(req.file_offset, req.buf_offset, req.size)], req.size >= NUMA_MOVE_MIN,
                                  on_bytes=on_bytes)[0]
            _record_reads(req.reason, req.buf.device, [res], time.perf_counter() - t0)
            return [res.nbytes]
        if _scattered_cached_and_crowded(f, reqs):
            n_lanes = min(n_lanes, SCATTERED_HOT_WORKERS)
        align = cfg.alignment
        t0 = time.perf_counter()

        def work(ref: LaneRef, job: tuple[Request, Chunk]) -> ChunkResult:
            req, ch = job
            lane = ref.get()
            stage, event = lane.next_stage()
            # A caller that found all its bytes in the page cache said so: not asked again per chunk.
            where = Residency.ALL if req.buf.source_cached else UNKNOWN
            res = read_to_stage(f, stage.view, ch.file_offset, ch.size, cfg.odirect, align, where)
            if res.nbytes:
                assert lane.stream is not None and event is not None
                src = stage.ptr + ch.file_offset % align
                if req.buf.scatter is None:
                    lane.stream.copy_h2d(req.buf.ptr + ch.buf_offset, src, res.nbytes)
                else:
                    lane.stream.copy_h2d_many([(dst, src + skip, n) for dst, skip, n
                                               in req.buf.scatter.pieces(ch.buf_offset, res.nbytes)])
                event.record(lane.stream)
                if on_bytes is not None:
                    on_bytes(res.nbytes)
            return res

        done = run_requests(reqs, chunk, align, work, device=device, stage_bytes=chunk + 2 * align,
                            threads=cfg.threads, max_lanes=n_lanes, budget=cfg.pinned_budget)
        elapsed = time.perf_counter() - t0
        total_bytes = sum(r.size for r in reqs)
        counts = []
        for req, (plan, results) in zip(reqs, done):
            n = contiguous_prefix((r.nbytes for r in results), plan)
            _record(req, "read", results, n, elapsed * req.size / total_bytes)
            counts.append(n)
        return counts

    def write(self, f: OpenFile, req: Request) -> int:
        cfg, device, n_lanes, chunk = self._layout(req.buf)
        align = cfg.alignment
        stage_bytes = chunk + 2 * align
        plan = chunks(req.file_offset, req.buf_offset, req.size, chunk, align)
        t0 = time.perf_counter()

        def work(ref: LaneRef, ch: Chunk) -> ChunkResult:
            lane = ref.get()
            stage, _event = lane.next_stage()
            assert lane.stream is not None
            lane.stream.copy_d2h(stage.ptr + ch.file_offset % align, req.buf.ptr + ch.buf_offset, ch.size)
            lane.stream.synchronize()
            return write_from_stage(f, stage.view, ch.file_offset, ch.size, cfg.odirect, align)

        results = run_chunks(plan, work, device=device, stage_bytes=stage_bytes, threads=cfg.threads,
                             max_lanes=n_lanes, budget=cfg.pinned_budget)
        _record(req, "write", results, req.size, time.perf_counter() - t0)
        return req.size
