"""The bounce path: gdskit's own CPU path for device memory.

Workers read chunks into a bounded ring of pinned host buffers (one per
worker by default, see ``Lane``) and copy them to the GPU with asynchronous
copies on one stream per worker; with several stages a worker reads chunk
*i+1* while chunk *i* is still being copied. Writes run the same ring
backwards. The ring is reused across calls: pinned memory is slow to allocate.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from gdskit import cuda
from gdskit.backends.base import Backend, OpenFile, Request
from gdskit.backends.staged import ChunkResult, contiguous_prefix, file_residency, read_to_stage, write_from_stage
from gdskit.ledger import ledger
from gdskit.plan import Chunk, chunks
from gdskit.pool import LaneRef, lanes, run_chunks, run_requests
from gdskit.residency import Residency
from gdskit.settings import Settings, settings
from gdskit.vocabulary import Path

# Workers for a job of scattered reads whose bytes the page cache holds. Such a job is many
# small copies, and each costs Python in its worker, which shares the interpreter with the
# caller making the destinations: past a few workers they only crowd it (docs/engine.md,
# "Measurements behind the defaults"). From the disk every worker stays: there the disk's
# queue depth is what counts.
SCATTERED_HOT_WORKERS = 4


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


def _scattered_and_cached(f: OpenFile, reqs: Sequence[Request]) -> bool:
    """Whether every request scatters into many destinations and the page cache holds all their
    bytes: the callers' answer where they asked (a loader asks once for all its jobs), else the
    page cache's."""
    if any(r.buf.scatter is None for r in reqs):
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
    def _layout(req: Request) -> tuple[Settings, int, int, int]:
        """Settings, device, lanes and chunk bytes for requests into ``req``'s device (chunks fit the pinned budget)."""
        cfg = settings.snapshot()
        device = req.buf.device if req.buf.device is not None else cuda.current_device()
        n_lanes, chunk = lanes.stage_layout(device, cfg.threads, cfg.chunk_size, cfg.pinned_budget, cfg.alignment)
        return cfg, device, n_lanes, chunk

    def read(self, f: OpenFile, req: Request) -> int:
        return self.read_many(f, [req])[0]

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
        cfg, device, n_lanes, chunk = self._layout(reqs[0])
        if _scattered_and_cached(f, reqs):
            n_lanes = min(n_lanes, SCATTERED_HOT_WORKERS)
        align = cfg.alignment
        t0 = time.perf_counter()

        def work(ref: LaneRef, job: tuple[Request, Chunk]) -> ChunkResult:
            req, ch = job
            lane = ref.get()
            stage, event = lane.next_stage()
            res = read_to_stage(f, stage.view, ch.file_offset, ch.size, cfg.odirect, align)
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
        cfg, device, n_lanes, chunk = self._layout(req)
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
