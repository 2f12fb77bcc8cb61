"""Reads of many files as one job over the engine's shared workers.

A dataset of many small files (shards, one sample per file) read file by file pays, per
file, a request's whole hand-over: a request thread, a chunk plan, a worker and a pinned
lane taken and drained, the ledger. A file of one chunk then runs on one thread while the
others wait for their own file's hand-over, and the reads go about one after another.

Here the chunks of every file are one list that the I/O workers share
(:func:`gdskit.engine.pool.run_chunks`): each worker keeps its lane from one file to the next,
files are opened by the worker that first needs them and closed once their last chunk is
read (so at most about one file per worker is open), and big files are still striped
across the workers. Each chunk is routed by the router (:func:`gdskit.engine.read_route.route_read`)
like any request: the bounce ring's pieces are read into the worker's lane here, host
memory and cuFile pieces (each one chunk of its backend, so it runs in the worker) go to
their backends, and a read that routing sends through another GPU is left to the
ordinary per-file path once the job is done.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import gdskit.engine.cuda as cuda
from gdskit.engine.backends.base import OpenFile, Once, Request
from gdskit.engine.backends.staged import ChunkResult, read_to_stage
from gdskit.engine.buffers import BufferView, adapt
from gdskit.durable import open_file_fd
from gdskit.errors import BufferTooSmallError, InvalidArgumentError, ReadOnlyBufferError, call_each
from gdskit.engine.ledger import record_bounce_pieces
from gdskit.engine.plan import Chunk, align_up, chunks, nonnegative_int
from gdskit.engine.pool import LaneRef, lanes, run_chunks
from gdskit.engine.residency import job_cached
from gdskit.engine.read_route import BackendKind, host_reason, route_read
from gdskit.settings import Settings, settings
from gdskit.vocabulary import Reason

__all__ = ["FileReads", "read_files"]

_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class FileReads:
    """The reads of one file: ``reads`` are ``(buf, size, file_offset)`` or
    ``(buf, size, file_offset, buf_offset)``, as :meth:`gdskit.File.read_many` takes them."""

    path: str | os.PathLike[str]
    reads: Sequence[tuple[Any, ...]]


@dataclass(frozen=True, slots=True)
class _Read:
    view: BufferView
    size: int
    file_offset: int
    buf_offset: int


@dataclass(frozen=True, slots=True)
class _Unit:
    """One chunk of one read of one file: what a worker claims."""

    file: int
    read: int
    chunk: Chunk


@dataclass(slots=True)
class _Done:
    """What a unit moved: ``nbytes`` (short only at end of file); ``bounce`` pieces read into
    the worker's lane, ``(reason, nbytes, cached)``, for the ledger; ``deferred`` when routing
    sends it through another GPU (read after the job)."""

    nbytes: int = 0
    bounce: list[tuple[Reason, int, int]] | None = None
    deferred: bool = False


def _validate(job: FileReads, i: int) -> list[_Read]:
    out = []
    for k, item in enumerate(job.reads):
        if not isinstance(item, tuple) or len(item) not in (3, 4):
            raise InvalidArgumentError(f"file {i}, read {k}: expected (buf, size, file_offset[, buf_offset]), "
                                       f"got {item!r:.80}")
        view = adapt(item[0])
        if view.readonly:
            raise ReadOnlyBufferError("cannot read into a read-only buffer")
        size = nonnegative_int("size", item[1])
        file_offset = nonnegative_int("file_offset", item[2])
        buf_offset = nonnegative_int("buf_offset", item[3]) if len(item) == 4 else 0
        if buf_offset + size > view.nbytes:
            raise BufferTooSmallError(f"buffer of {view.nbytes} bytes cannot hold {size} bytes at offset {buf_offset}")
        out.append(_Read(view, size, file_offset, buf_offset))
    return out


def _open(path: str) -> OpenFile:
    """``path`` opened for reading, as :func:`gdskit.open` opens it (errors name the file)."""
    fd, _st = open_file_fd(path, _FLAGS)
    return OpenFile(path, fd, _FLAGS)


class _Files:
    """The job's files, each opened by the first worker that needs it and closed when its
    last unit is done; :meth:`close_all` closes whatever is still open (after an error)."""

    def __init__(self, paths: list[str], units_per_file: list[int]) -> None:
        self._paths = paths
        self._left = units_per_file
        self._once: list[Once[OpenFile]] = [Once() for _ in paths]
        self._lock = threading.Lock()
        self._open: dict[int, OpenFile] = {}

    def get(self, i: int) -> OpenFile:
        def make() -> OpenFile:
            of = _open(self._paths[i])
            with self._lock:
                self._open[i] = of
            return of

        return self._once[i].get(make)

    def done(self, i: int) -> None:
        with self._lock:
            self._left[i] -= 1
            of = self._open.pop(i) if self._left[i] == 0 else None
        if of is not None:
            of.close()

    def close_all(self) -> None:
        with self._lock:
            left, self._open = list(self._open.values()), {}
        call_each(lambda of: of.close(), left)


def _plan(read: _Read, chunk: int, alignment: int, host_chunk: int) -> list[Chunk]:
    """The units of one read. Into device memory a read of up to a chunk stays one unit at any
    offset (a lane's stage holds a chunk plus alignment slack either side: an ``.npy`` file's
    array after its header is one read, not a chunk and a 128-byte tail). Into host memory the
    chunks are the host path's own, so each runs in the worker."""
    if read.size == 0:
        return []
    if read.view.on_device:
        if read.size <= chunk:
            return [Chunk(read.file_offset, read.buf_offset, read.size)]
        return chunks(read.file_offset, read.buf_offset, read.size, chunk, alignment)
    return chunks(read.file_offset, read.buf_offset, read.size, host_chunk, alignment)


#: Workers for a job of small files into GPU memory that the page cache holds (at most
#: SMALL_FILE_BYTES a file on average, judged by residency.CACHED_SAMPLES of them). Each such file costs
#: tens of microseconds of Python in its worker, and workers only take turns at the interpreter:
#: on the H200 machine the job of 20,000 cached 64 KiB files took 80 µs a file on one worker, 121
#: on two and 190-226 on sixteen (benchmarks/RESULTS.md, "Many small files: where the time goes,
#: and one worker when they are cached"). From the disk, or for larger files, every worker stays:
#: there the disk's queue depth is what counts.
HOT_SMALL_FILES_WORKERS = 1
SMALL_FILE_BYTES = 1 << 20


def _small_and_cached(paths: list[str], reads: list[list[_Read]]) -> bool:
    """Whether the job's files are small and the page cache holds them (judged by a sample,
    :func:`gdskit.engine.residency.job_cached`)."""
    n = len(paths)
    if n < 2 or sum(r.size for rs in reads for r in rs) > n * SMALL_FILE_BYTES:
        return False

    def range_of(i: int) -> tuple[str, int, int] | None:
        if not reads[i]:
            return None
        lo = min(r.file_offset for r in reads[i])
        return paths[i], lo, max(r.file_offset + r.size for r in reads[i]) - lo

    return job_cached(n, range_of)


def read_files(jobs: Iterable[FileReads], *, on_bytes: Callable[[int], None] | None = None) -> list[list[int]]:
    """Read many files as one job; for each file, the byte count of each of its reads (short
    only at end of file).

    Every read is checked before anything is read. The first error (a file missing or
    unreadable, named) stops the job: no further chunk starts, those under way finish, every
    file the job opened is closed, and the error is raised. ``on_bytes`` is called with each
    piece's byte count as it lands (from I/O threads; an exception it raises abandons the job).
    Device memory must be free of queued producer work or say its stream (as for
    :meth:`gdskit.File.read_many`).
    """
    jobs = list(jobs)
    paths = [os.fspath(j.path) for j in jobs]
    reads = [_validate(j, i) for i, j in enumerate(jobs)]
    cfg = settings.snapshot()
    counts: list[list[int]] = [[0] * len(rs) for rs in reads]
    _wait_for_producers(r.view for rs in reads for r in rs)
    # One job per device (and one for host memory): a lane serves one device.
    by_device: dict[int | None, list[_Unit]] = {}
    layout: dict[int | None, tuple[int, int]] = {}
    for i, rs in enumerate(reads):
        for k, r in enumerate(rs):
            dev = _device_of(r.view)
            if dev not in layout:
                layout[dev] = ((cfg.threads, cfg.chunk_size) if dev is None else
                               lanes.stage_layout(dev, cfg.threads, cfg.chunk_size, cfg.pinned_budget, cfg.alignment))
            for ch in _plan(r, layout[dev][1], cfg.alignment, cfg.chunk_size):
                by_device.setdefault(dev, []).append(_Unit(i, k, ch))
    results: list[tuple[_Unit, _Done]] = []
    hot_small = any(dev is not None for dev in by_device) and _small_and_cached(paths, reads)
    for dev, units in by_device.items():
        n_lanes, chunk = layout[dev]
        packed = dev is not None and hot_small
        per_file = [0] * len(jobs)
        for u in units:
            per_file[u.file] += 1
        files = _Files(paths, per_file)
        work = _worker(files, reads, cfg, on_bytes)
        run = {"device": dev, "stage_bytes": chunk + 2 * cfg.alignment, "max_lanes": n_lanes,
               "budget": cfg.pinned_budget}
        t0 = time.perf_counter()
        try:
            if packed:  # one worker, the files packed into its stages
                (done,) = run_chunks([units], _packed(files, reads, cfg, on_bytes, work),
                                     threads=HOT_SMALL_FILES_WORKERS, **run)
            else:
                done = run_chunks(units, work, threads=cfg.threads, **run)
        finally:
            files.close_all()
        _record_bounce(done, dev, time.perf_counter() - t0)
        results.extend(zip(units, done))
    _read_deferred(paths, reads, [(u, d) for u, d in results if d.deferred], on_bytes)
    # Each read's count: its units' bytes up to the first short one (the end of the file), as pread.
    stopped: set[tuple[int, int]] = set()
    for u, d in sorted(results, key=lambda ud: (ud[0].file, ud[0].read, ud[0].chunk.file_offset)):
        key = (u.file, u.read)
        if key in stopped:
            continue
        counts[u.file][u.read] += d.nbytes
        if d.nbytes < u.chunk.size:
            stopped.add(key)
    return counts


def _device_of(view: BufferView) -> int | None:
    if not view.on_device:
        return None
    return view.device if view.device is not None else cuda.current_device()


def _wait_for_producers(views: Iterable[BufferView]) -> None:
    """Kernels still queued on a destination finish first (gdskit copies on its own streams):
    one wait per producer stream."""
    waited: set[Any] = set()
    for v in views:
        if v.on_device and v.producer_sync and v.producer_stream not in waited:
            cuda.synchronize_producer(v.producer_stream)
            waited.add(v.producer_stream)


def _worker(files: _Files, reads: list[list[_Read]], cfg: Settings,
            on_bytes: Callable[[int], None] | None) -> Callable[[LaneRef, _Unit], _Done]:
    from gdskit.engine.file import backend  # noqa: PLC0415 - import time

    align = cfg.alignment

    def bounce(ref: LaneRef, f: OpenFile, view: BufferView, pos: int, n: int, bo: int) -> ChunkResult:
        lane = ref.get()
        stage, event = lane.next_stage()
        res = read_to_stage(f, stage.view, pos, n, cfg.odirect, align)
        if res.nbytes:
            assert lane.stream is not None and event is not None
            src = stage.ptr + pos % align
            if view.scatter is None:
                lane.stream.copy_h2d(view.ptr + bo, src, res.nbytes)
            else:
                lane.stream.copy_h2d_many([(dst, src + skip, size) for dst, skip, size
                                           in view.scatter.pieces(bo, res.nbytes)])
            event.record(lane.stream)
            if on_bytes is not None:
                on_bytes(res.nbytes)
        return res

    def work(ref: LaneRef, unit: _Unit) -> _Done:
        ch = unit.chunk
        r = reads[unit.file][unit.read]
        f = files.get(unit.file)
        out = _Done()
        if not r.view.on_device:
            out.nbytes = backend(BackendKind.HOST).read(f, Request("read", r.view, ch.size, ch.file_offset, ch.buf_offset,
                                                         host_reason()))
            if on_bytes is not None and out.nbytes:
                on_bytes(out.nbytes)
            files.done(unit.file)
            return out
        route = route_read(f, r.view, ch.size, ch.file_offset, ch.buf_offset, cfg)
        if route.through_other_gpu:
            out.deferred = True
            files.done(unit.file)
            return out
        out.bounce = []
        for rt in route.pieces:
            if rt.backend is BackendKind.BOUNCE:
                res = bounce(ref, f, r.view, rt.file_offset, rt.size, rt.buf_offset)
                out.bounce.append((rt.reason, res.nbytes, res.cached))
                got = res.nbytes
            else:  # cufile: one chunk of its own, run here
                got = backend(rt.backend).read(f, Request("read", r.view, rt.size, rt.file_offset, rt.buf_offset,
                                                          rt.reason))
                if on_bytes is not None and got:
                    on_bytes(got)
            out.nbytes += got
            if got < rt.size:  # end of file: later pieces would leave a gap
                break
        files.done(unit.file)
        return out

    return work


def _packed(files: _Files, reads: list[list[_Read]], cfg: Settings, on_bytes: Callable[[int], None] | None,
            work: Callable[[LaneRef, _Unit], _Done]) -> Callable[[LaneRef, list[_Unit]], list[_Done]]:
    """All the units of a job of cached small files into one GPU's memory, on one worker: each
    file's bytes are read (as any chunk is, by the engine's O_DIRECT policy) into the next free
    slot of the lane's stage, and a full stage goes to the GPU in one batched copy with one event.
    Read one at a time, a small file's copy and event cost as much as its read. A unit the router
    sends other than through the bounce ring, or routes through another GPU, or too big for a
    stage, takes the general path (``work``), with no stage of this one held meanwhile."""
    align = cfg.alignment

    def run(ref: LaneRef, units: list[_Unit]) -> list[_Done]:
        lane = ref.get()
        assert lane.stream is not None
        out: list[_Done] = []
        stage: Any = None
        event: Any = None
        fill = 0
        copies: list[tuple[int, int, int]] = []

        def flush() -> None:
            nonlocal stage, fill
            if copies:
                lane.stream.copy_h2d_many(copies)
                event.record(lane.stream)
                copies.clear()
            stage, fill = None, 0  # taken again with next_stage, which waits for its last copies

        for unit in units:
            ch = unit.chunk
            r = reads[unit.file][unit.read]
            f = files.get(unit.file)
            route = route_read(f, r.view, ch.size, ch.file_offset, ch.buf_offset, cfg)
            slot = align_up(ch.file_offset % align + ch.size, align)  # an O_DIRECT read's whole span
            if route.bounce_reason is None or r.view.scatter is not None or slot > lane.stage_bytes:
                flush()
                out.append(work(ref, unit))
                continue
            if stage is not None and fill + slot > lane.stage_bytes:
                flush()
            if stage is None:
                stage, event = lane.next_stage()
            res = read_to_stage(f, stage.view[fill:fill + slot], ch.file_offset, ch.size, cfg.odirect, align)
            if res.nbytes:
                copies.append((r.view.ptr + ch.buf_offset, stage.ptr + fill + ch.file_offset % align, res.nbytes))
                if on_bytes is not None:
                    on_bytes(res.nbytes)
            fill += slot
            out.append(_Done(res.nbytes, [(route.bounce_reason, res.nbytes, res.cached)]))
            files.done(unit.file)
        flush()
        return out

    return run


def _record_bounce(done: list[_Done], device: int | None, elapsed: float) -> None:
    """The ledger's record of the bounce ring's pieces (the host and cuFile backends record their own)."""
    record_bounce_pieces((piece for d in done for piece in d.bounce or ()), device, elapsed)


def _read_deferred(paths: list[str], reads: list[list[_Read]], units: list[tuple[_Unit, _Done]],
                   on_bytes: Callable[[int], None] | None) -> None:
    """The units routing sends through another GPU, by the ordinary per-file path (which owns
    routed reads), one file at a time; their counts go in their ``_Done``."""
    if not units:
        return
    from gdskit.engine.file import File  # noqa: PLC0415 - import time

    by_file: dict[int, list[tuple[_Unit, _Done]]] = {}
    for u, d in units:
        by_file.setdefault(u.file, []).append((u, d))
    for i, items in by_file.items():
        with File(paths[i]) as f:
            got = f.read_many([(reads[i][u.read].view, u.chunk.size, u.chunk.file_offset, u.chunk.buf_offset)
                               for u, _d in items], on_bytes=on_bytes)
        for (_u, d), n in zip(items, got):
            d.nbytes = n
