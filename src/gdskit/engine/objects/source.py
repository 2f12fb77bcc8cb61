""":class:`ObjectFile`: an object in a store (``s3://bucket/key``) with :class:`gdskit.File`'s API.

Reads are ranged GETs of at most ``settings.s3_part_size`` bytes, ``settings.s3_concurrency`` at
once, each read under the ETag the object had when it was opened (an object replaced meanwhile
is an :class:`~gdskit.errors.ObjectChangedError`, never a mix of two versions). A GET's body
goes straight into the caller's host memory, or, for GPU memory, a piece at a time into one of
the engine's pinned lanes (the bounce ring's, of the same shape) and from there by an
asynchronous copy to the GPU; no temporary file, no buffer of the whole object.

Writes (mode ``"w"``) go in order and become a multipart upload that completes at
:meth:`ObjectFile.close`: the object appears whole or not at all, and any failure (or
:meth:`~ObjectFile.abort`) aborts the upload.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import gdskit.engine.cuda as cuda
from gdskit.engine.read_route import object_reason
from gdskit.engine.buffers import BufferView, adapt
from gdskit.engine.ledger import ledger
from gdskit.engine.objects.store import Bucket, ObjectMeta, bucket_for
from gdskit.engine.objects.url import ObjectURL, parse_url
from gdskit.engine.plan import nonnegative_int
from gdskit.engine.pool import Lane, lanes, object_executor, request_executor
from gdskit.errors import (BufferTooSmallError, ClosedFileError, InvalidArgumentError, NothingToVerifyError,
                           ReadOnlyBufferError, UnsupportedOperationError)
from gdskit.settings import Settings, settings
from gdskit.vocabulary import Path

#: Part uploads of one writer in flight at once: each holds a part (``s3_part_size``) of host
#: memory, so a writer holds at most this many parts, whatever ``s3_concurrency`` says.
WRITE_PARTS_IN_FLIGHT = 4


@dataclass(frozen=True)
class _Part:
    """One ranged GET of a job: object bytes ``[offset, offset + size)`` into item ``item``'s
    buffer at ``buf_offset``."""

    item: int
    offset: int
    size: int
    buf_offset: int

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True)
class _Run:
    """One ranged GET serving several parts (all into host memory, or all into one GPU's):
    object bytes ``[start, end)``, the parts (by offset) within it; the bytes between them are
    read and dropped."""

    start: int
    end: int
    parts: tuple[_Part, ...]


def coalesce(parts: list[_Part], max_span: int, max_gap: int) -> list[_Run]:
    """Parts merged into runs, each one GET: taken by offset, a part joins the run before it
    where it starts at most ``max_gap`` bytes past the run's end (overlapping it, or touching
    it, included) and the run then spans at most ``max_span`` bytes."""
    runs: list[_Run] = []
    members: list[_Part] = []
    start = end = 0
    for part in sorted(parts, key=lambda p: (p.offset, p.end)):
        if members and part.offset - end <= max_gap and max(end, part.end) - start <= max_span:
            members.append(part)
            end = max(end, part.end)
            continue
        if members:
            runs.append(_Run(start, end, tuple(members)))
        members, start, end = [part], part.offset, part.end
    if members:
        runs.append(_Run(start, end, tuple(members)))
    return runs


class ObjectFile:
    """An object opened for reads (mode ``"r"``) or written whole (mode ``"w"``).

    A writer is always atomic (a multipart upload completed at :meth:`close`, or one PUT):
    ``atomic=True`` is taken with mode ``"w"`` and refused with ``"r"``, as for files.

    Use :func:`gdskit.open` with an ``s3://`` URL to make one. The read methods take the same
    arguments and destinations as :class:`gdskit.File`'s and return the same counts (short only
    at the end of the object).
    """

    def __init__(self, url: str | ObjectURL, mode: str = "r", *, atomic: bool = False) -> None:
        self._closed = False
        if mode not in ("r", "w"):
            raise InvalidArgumentError(f"an object opens with mode 'r' or 'w' (written whole); got {mode!r}")
        if atomic and mode != "w":
            raise InvalidArgumentError("atomic=True needs mode 'w' (a whole new object)")
        self.url = parse_url(url)
        if self.url.is_prefix:
            raise InvalidArgumentError(f"{self.url} names a prefix, not an object")
        self.path = str(self.url)
        self.mode = mode
        # A written object appears whole at close or not at all, atomic=True asked for or not.
        self.atomic = mode == "w"
        self._lock = threading.Lock()
        self._calls = 0
        self._idle = threading.Condition(self._lock)
        self._pending: set[Future[Any]] = set()
        self._bucket: Bucket = bucket_for(self.url)
        self._meta: ObjectMeta | None = None
        self._upload: _Upload | None = None
        if mode == "r":
            self._meta = self._bucket.head(self.url, settings.snapshot())
        else:
            self._upload = _Upload(self._bucket, self.url)

    # -- context manager and properties ----------------------------------
    def __enter__(self) -> ObjectFile:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()

    def __repr__(self) -> str:
        return f"<gdskit.ObjectFile {self.path!r} mode={self.mode!r} {'closed' if self._closed else 'open'}>"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def size(self) -> int:
        """The object's size (as opened), or the bytes written so far."""
        self._enter()
        try:
            if self._meta is not None:
                return self._meta.size
            assert self._upload is not None
            return self._upload.written
        finally:
            self._leave()

    @property
    def etag(self) -> str | None:
        """The ETag every read of this object is made under (None for a writer)."""
        return None if self._meta is None else self._meta.etag

    def fileno(self) -> int:
        raise UnsupportedOperationError(95, "an object in a store has no file descriptor", self.path)

    def cached(self, file_offset: int = 0, size: int | None = None) -> bool:
        """False: no page cache holds an object's bytes."""
        return False

    def fsync(self) -> None:
        """Nothing to do: a written object becomes durable, whole, at :meth:`close`."""
        self._enter()
        self._leave()

    # -- reads -------------------------------------------------------------
    def read(self, buf: Any, size: int | None = None, file_offset: int = 0, buf_offset: int = 0, *,
             verify: Any = False) -> int:
        """Read ``size`` bytes at ``file_offset`` into ``buf`` at ``buf_offset`` (as :meth:`gdskit.File.read`).
        ``verify``: an object has no digest manifest (manifests list local files), so anything but
        False is refused before a byte is read."""
        if verify is not False and verify is not None:
            raise NothingToVerifyError(f"{self.path}: a raw read of an object has no digests to check against "
                                       "(manifests list local files; a checkpoint's header digests are checked "
                                       "by the loaders)", path=self.path)
        self._enter()
        try:
            return self._read_items([self._validate_read(buf, size, file_offset, buf_offset)])[0]
        finally:
            self._leave()

    def pread(self, buf: Any, size: int | None = None, file_offset: int = 0, buf_offset: int = 0, *,
              stream: Any = None) -> Future[int]:
        """Like :meth:`read`, in the background: a ``Future`` of the byte count. Stream-ordered
        reads (``stream=``) are for files only."""
        if stream is not None:
            raise InvalidArgumentError("stream-ordered reads (stream=) are for files, not objects")
        self._enter()
        try:
            item = self._validate_read(buf, size, file_offset, buf_offset)
            fut = request_executor(settings.threads).submit(lambda: self._read_items([item])[0])
        except BaseException:
            self._leave()
            raise
        return self._track(fut)

    def read_many(self, reads: Iterable[tuple[Any, ...]], *,
                  on_bytes: Callable[[int], None] | None = None) -> list[int]:
        """Many reads as one job (as :meth:`gdskit.File.read_many`): their parts share the GETs in flight."""
        self._enter()
        try:
            return self._read_items(self._validate_many(reads), on_bytes)
        finally:
            self._leave()

    def pread_many(self, reads: Iterable[tuple[Any, ...]], *,
                   on_bytes: Callable[[int], None] | None = None) -> Future[list[int]]:
        """Like :meth:`read_many`, in the background."""
        self._enter()
        try:
            items = self._validate_many(reads)
            fut = request_executor(settings.threads).submit(self._read_items, items, on_bytes)
        except BaseException:
            self._leave()
            raise
        return self._track(fut)

    def read_batch(self, buf: Any, file_offsets: Iterable[int], size: int, buf_offsets: Iterable[int] | None = None,
                   *, latencies_ns: list[int] | None = None) -> list[int]:
        """Many reads of ``size`` bytes (as :meth:`gdskit.File.read_batch`), made as one job of
        GETs; with ``latencies_ns``, one after another, each read's time recorded."""
        self._enter()
        try:
            self._readable()
            size = nonnegative_int("size", size)
            offsets = [nonnegative_int("file_offsets", o) for o in _ints("file_offsets", file_offsets)]
            if buf_offsets is None:
                places = [i * size for i in range(len(offsets))]
            else:
                places = [nonnegative_int("buf_offsets", o) for o in _ints("buf_offsets", buf_offsets)]
                if len(places) != len(offsets):
                    raise InvalidArgumentError(f"{len(offsets)} file offsets but {len(places)} buffer offsets")
            view = adapt(buf)
            items = [self._checked(view, size, off, bo) for off, bo in zip(offsets, places)]
            if latencies_ns is None:
                return self._read_items(items)
            counts = []
            for item in items:
                t0 = time.perf_counter_ns()
                counts.append(self._read_items([item])[0])
                latencies_ns.append(time.perf_counter_ns() - t0)
            return counts
        finally:
            self._leave()

    # -- writes ------------------------------------------------------------
    def write(self, buf: Any, size: int | None = None, file_offset: int | None = None, buf_offset: int = 0) -> int:
        """Append ``size`` bytes of ``buf`` at ``buf_offset`` to the object being written.

        Writes go in order: ``file_offset`` is None or the bytes written so far. Returns ``size``.
        """
        self._enter()
        try:
            if self._upload is None:
                raise UnsupportedOperationError(9, "object opened with mode 'r' is not writable", self.path)
            view = adapt(buf)
            buf_offset = nonnegative_int("buf_offset", buf_offset)
            if view.scatter is not None:
                raise InvalidArgumentError("a scattered view is a read's destination; write from one buffer")
            if buf_offset > view.nbytes:
                raise BufferTooSmallError(f"buf_offset {buf_offset} is past the end of the {view.nbytes}-byte buffer")
            size = view.nbytes - buf_offset if size is None else nonnegative_int("size", size)
            if buf_offset + size > view.nbytes:
                raise BufferTooSmallError(f"buffer of {view.nbytes} bytes cannot hold {size} bytes at offset {buf_offset}")
            return self._upload.add(view, size, file_offset, buf_offset)
        finally:
            self._leave()

    def pwrite(self, buf: Any, size: int | None = None, file_offset: int | None = None, buf_offset: int = 0, *,
               stream: Any = None) -> Future[int]:
        """:meth:`write`, done now; its count as a finished ``Future`` (an object's writes go in order)."""
        if stream is not None:
            raise InvalidArgumentError("stream-ordered writes (stream=) are for files, not objects")
        fut: Future[int] = Future()
        try:
            fut.set_result(self.write(buf, size, file_offset, buf_offset))
        except Exception as exc:  # noqa: BLE001 - the future carries it, as a background write's would
            fut.set_exception(exc)
        return fut

    # -- lifecycle ---------------------------------------------------------
    def close(self) -> None:
        """Wait for the reads under way; for a writer, upload what is left and complete the upload
        (the object appears now), or abort it and raise the first failure."""
        if not self._start_closing():
            return
        errors = [f.exception() for f in list(self._pending) if not f.cancelled() and f.exception() is not None]
        if self._upload is not None:
            self._upload.finish()
        if errors:
            raise errors[0]

    def abort(self) -> None:
        """Close without publishing: a writer's upload is aborted; the object stays as it was."""
        if not self._start_closing():
            return
        if self._upload is not None:
            self._upload.cancel()

    def __del__(self) -> None:
        try:
            if not self._closed and getattr(self, "_upload", None) is not None:
                self.abort()  # a writer never closed: nothing published
        except Exception:  # noqa: BLE001 - at collection there is no one to tell
            pass

    # -- internals ---------------------------------------------------------
    def _start_closing(self) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            while self._calls:
                self._idle.wait()
        return True

    def _enter(self) -> None:
        with self._lock:
            if self._closed:
                raise ClosedFileError(f"I/O on closed object {self.path!r}")
            self._calls += 1

    def _leave(self) -> None:
        with self._lock:
            self._calls -= 1
            if not self._calls:
                self._idle.notify_all()

    def _track(self, fut: Future[Any]) -> Future[Any]:
        with self._lock:
            self._pending.add(fut)

        def done(f: Future[Any]) -> None:
            self._leave()

        fut.add_done_callback(done)
        return fut

    def _readable(self) -> None:
        if self._meta is None:
            raise UnsupportedOperationError(9, "object opened with mode 'w' is not readable", self.path)

    def _validate_read(self, buf: Any, size: int | None, file_offset: int, buf_offset: int
                       ) -> tuple[BufferView, int, int, int]:
        self._readable()
        view = adapt(buf)
        buf_offset = nonnegative_int("buf_offset", buf_offset)
        if buf_offset > view.nbytes:
            raise BufferTooSmallError(f"buf_offset {buf_offset} is past the end of the {view.nbytes}-byte buffer")
        size = view.nbytes - buf_offset if size is None else nonnegative_int("size", size)
        return self._checked(view, size, nonnegative_int("file_offset", file_offset), buf_offset)

    def _checked(self, view: BufferView, size: int, file_offset: int, buf_offset: int
                 ) -> tuple[BufferView, int, int, int]:
        if view.readonly:
            raise ReadOnlyBufferError("cannot read into a read-only buffer")
        if buf_offset + size > view.nbytes:
            raise BufferTooSmallError(f"buffer of {view.nbytes} bytes cannot hold {size} bytes at offset {buf_offset}")
        return view, size, file_offset, buf_offset

    def _validate_many(self, reads: Iterable[tuple[Any, ...]]) -> list[tuple[BufferView, int, int, int]]:
        self._readable()
        items = []
        for i, item in enumerate(reads):
            if not isinstance(item, tuple) or len(item) not in (3, 4):
                raise InvalidArgumentError(f"read {i}: expected (buf, size, file_offset[, buf_offset]), got {item!r:.80}")
            buf, size, file_offset = item[:3]
            if size is None or file_offset is None:
                raise InvalidArgumentError(f"read {i}: size and file_offset must be given")
            items.append(self._validate_read(buf, size, file_offset, item[3] if len(item) == 4 else 0))
        return items

    def _read_items(self, items: list[tuple[BufferView, int, int, int]],
                    on_bytes: Callable[[int], None] | None = None) -> list[int]:
        """Read every item (clipped at the object's end) as one job of ranged GETs; each item's count."""
        assert self._meta is not None
        cfg = settings.snapshot()
        end = self._meta.size
        counts = [max(0, min(size, end - off)) for _v, size, off, _b in items]
        reasons = [object_reason(view, cfg) if n else None for (view, *_rest), n in zip(items, counts)]
        for (view, *_rest), n in zip(items, counts):
            if n and view.on_device and view.producer_sync:  # kernels still writing the buffer finish first
                cuda.synchronize_producer(view.producer_stream)
        parts = [_Part(i, off + k, min(cfg.s3_part_size, n - k), bo + k)
                 for i, ((_v, _s, off, bo), n) in enumerate(zip(items, counts)) for k in range(0, n, cfg.s3_part_size)]
        if not parts:
            return counts
        # Parts that lie near each other share a GET (a batch's windows, a checkpoint's
        # neighbouring tensors): into host memory straight, into one GPU's memory through a
        # pinned lane. Fewer, larger GETs: each costs a store a round trip and a request.
        by_device: dict[int | None, list[_Part]] = {}
        for p in parts:
            view = items[p.item][0]
            by_device.setdefault(_device_of(view) if view.on_device else None, []).append(p)
        jobs = [(device, run) for device, mine in by_device.items()
                for run in coalesce(mine, cfg.s3_part_size, cfg.s3_coalesce_gap)]

        def work(job: tuple[int | None, _Run]) -> None:
            device, run = job
            if device is None:
                self._read_run(items, run, cfg, on_bytes)
            else:
                etag = self._meta.etag if self._meta is not None else None
                _read_run_to_device(self._bucket, self.url, etag, items, run, device, cfg, on_bytes)

        t0 = time.perf_counter()
        _run_parts(jobs, work, cfg.s3_concurrency)
        elapsed = time.perf_counter() - t0
        total = sum(counts) or 1
        for reason in set(r for r in reasons if r is not None):
            chosen = [i for i, r in enumerate(reasons) if r is reason]
            nbytes = sum(counts[i] for i in chosen)
            n_parts = sum(1 for _device, run in jobs if any(reasons[p.item] is reason for p in run.parts))
            devices = {items[i][0].device for i in chosen}
            ledger.record(Path.OBJECT, reason, "read", nbytes, n_parts, elapsed * nbytes / total,
                          device=devices.pop() if len(devices) == 1 else None, requests=len(chosen))
        return counts

    def _read_run(self, items: list[tuple[BufferView, int, int, int]], run: _Run, cfg: Settings,
                  on_bytes: Callable[[int], None] | None) -> None:
        """One GET of ``run`` straight into its parts' host memory (the bytes between them into a
        scratch buffer of at most ``s3_coalesce_gap`` bytes); where parts overlap, the bytes
        landed for the first are then copied to the others."""
        etag = self._meta.etag if self._meta is not None else None
        segments, copies = _landing(run)
        scratch = memoryview(bytearray(min(cfg.chunk_size, max((n for _p, n, part, _b in segments if part is None),
                                                                default=0))))
        hosts = {p.item: items[p.item][0].host_view for p in run.parts}
        at = [0]  # the segment being filled: GETs (and their resumptions) go forward

        def land(pos: int, n: int) -> memoryview:
            while segments[at[0]][0] + segments[at[0]][1] <= pos:
                at[0] += 1
            seg_pos, seg_len, part, buf_offset = segments[at[0]]
            k = min(n, seg_pos + seg_len - pos)
            if part is None:
                return scratch[:k]
            host = hosts[part.item]
            assert host is not None
            start = buf_offset + pos - seg_pos
            return host[start:start + k]

        def landed(pos: int, n: int) -> None:
            if on_bytes is not None and segments[at[0]][2] is not None:
                on_bytes(n)

        self._bucket.read_range(self.url, run.start, run.end - run.start, etag, cfg, cfg.chunk_size, land, landed)
        for part, buf_offset, pos, n in copies:
            _copy_landed(segments, hosts, pos, n, hosts[part.item], buf_offset)
            if on_bytes is not None:
                on_bytes(n)


#: Where a run's bytes land: ``(run position, length, part or None for bytes dropped, buffer offset)``.
_Segment = tuple[int, int, "_Part | None", int]


def _landing(run: _Run) -> tuple[list[_Segment], list[tuple[_Part, int, int, int]]]:
    """The run's bytes, in order, as segments that cover it once; and the copies
    ``(part, buffer offset, run position, length)`` that give a part the bytes it shares with
    parts before it (they land once, in the first part's memory)."""
    segments: list[_Segment] = []
    copies: list[tuple[_Part, int, int, int]] = []
    covered = run.start
    for part in run.parts:
        if part.offset > covered:
            segments.append((covered - run.start, part.offset - covered, None, 0))
        shared = min(part.end, covered) - part.offset
        if shared > 0:
            copies.append((part, part.buf_offset, part.offset - run.start, shared))
        first = max(part.offset, covered)
        if part.end > first:
            segments.append((first - run.start, part.end - first, part, part.buf_offset + first - part.offset))
        covered = max(covered, part.end)
    return segments, copies


def _copy_landed(segments: list[_Segment], hosts: dict[int, Any], pos: int, n: int, dest: memoryview,
                 dest_offset: int) -> None:
    """Run bytes ``[pos, pos + n)``, landed in earlier parts' memory, into ``dest`` at ``dest_offset``."""
    for seg_pos, seg_len, part, buf_offset in segments:
        lo, hi = max(pos, seg_pos), min(pos + n, seg_pos + seg_len)
        if lo >= hi:
            continue
        assert part is not None, "shared bytes are always some part's"
        src = hosts[part.item][buf_offset + lo - seg_pos:buf_offset + hi - seg_pos]
        dest[dest_offset + lo - pos:dest_offset + hi - pos] = src


def _device_of(view: BufferView) -> int:
    return view.device if view.device is not None else cuda.current_device()


def _read_run_to_device(bucket: Bucket, url: ObjectURL, etag: str | None, items: list[tuple[BufferView, int, int, int]],
                        run: _Run, device: int, cfg: Settings, on_bytes: Callable[[int], None] | None) -> None:
    """One GET of ``run`` into its parts' memory on GPU ``device``: the body a piece at a time into
    a pinned lane of the bounce ring's shape, each piece copied on the lane's stream to every part
    it holds bytes of (parts may overlap; the bytes between parts are dropped) while the next
    piece arrives."""
    n_lanes, chunk = lanes.stage_layout(device, cfg.threads, cfg.chunk_size, cfg.pinned_budget, cfg.alignment)
    stage_bytes = chunk + 2 * cfg.alignment  # the bounce ring's lanes: the same pool serves both
    max_lanes = max(1, min(cfg.s3_concurrency, cfg.pinned_budget // stage_bytes))
    held: list[Lane] = []
    current: list[Any] = [None, None]  # the stage being filled and its event
    before = None

    def land(pos: int, n: int) -> memoryview:
        if not held:
            held.append(lanes.acquire(device, stage_bytes, max(n_lanes, max_lanes), cfg.pinned_budget))
        current[0], current[1] = held[0].next_stage()  # waits for the copy that last used the stage
        return current[0].view[:n]

    def landed(pos: int, n: int) -> None:
        ln, (stage, event) = held[0], current
        assert ln.stream is not None and event is not None
        lo_piece, hi_piece = run.start + pos, run.start + pos + n  # object offsets of this piece
        copies: list[tuple[int, int, int]] = []
        for part in run.parts:
            lo, hi = max(lo_piece, part.offset), min(hi_piece, part.end)
            if lo >= hi:
                continue
            view, dst, src = items[part.item][0], part.buf_offset + lo - part.offset, stage.ptr + lo - lo_piece
            if view.scatter is None:
                copies.append((view.ptr + dst, src, hi - lo))
            else:
                copies.extend((d, src + skip, k) for d, skip, k in view.scatter.pieces(dst, hi - lo))
        if len(copies) == 1:
            ln.stream.copy_h2d(*copies[0])
        elif copies:
            ln.stream.copy_h2d_many(copies)
        event.record(ln.stream)
        if on_bytes is not None:
            on_bytes(sum(k for _d, _s, k in copies))

    try:
        before = cuda.make_current(device)
        bucket.read_range(url, run.start, run.end - run.start, etag, cfg, chunk, land, landed)
        if held:
            held[0].drain()
    except BaseException:
        if held:  # the copies of the lane's other stages may still run: none outlives the call
            try:
                held[0].drain()
            except Exception:  # noqa: BLE001 - the read's own error is the one to report
                lanes.discard_after_failure(held[0])
            else:
                lanes.release(held[0])
        held.clear()
        raise
    finally:
        if held:
            lanes.release(held[0])
        try:
            cuda.put_back(before)
        except Exception:  # noqa: BLE001 - the error under way, if any, is the one to report
            pass


def _run_parts(parts: list[Any], work: Callable[[Any], None], concurrency: int) -> None:
    """``work(part)`` for every part (or run), ``concurrency`` at once; after the first failure
    no part starts, those under way finish, and that failure is raised."""
    if len(parts) == 1:
        work(parts[0])
        return
    failed: list[BaseException] = []

    def run(part: Any) -> None:
        if failed:
            return
        try:
            work(part)
        except BaseException as exc:
            failed.append(exc)

    gate = threading.BoundedSemaphore(max(1, concurrency))  # this job's GETs at once

    def gated(part: Any) -> None:
        try:
            run(part)
        finally:
            gate.release()

    ex = object_executor()
    futures = []
    for p in parts:
        gate.acquire()
        futures.append(ex.submit(gated, p))
    for fut in futures:
        fut.result()
    if failed:
        raise failed[0]


def _ints(name: str, values: Iterable[int]) -> list[int]:
    items = values.tolist() if hasattr(values, "tolist") else list(values)
    if any(isinstance(v, bool) for v in items):
        raise InvalidArgumentError(f"{name} must be integers, not booleans")
    return items


class _Upload:
    """The parts of an object being written, uploaded as they fill; completed or aborted once."""

    def __init__(self, bucket: Bucket, url: ObjectURL) -> None:
        self._bucket = bucket
        self._url = url
        self._cfg = settings.snapshot()  # one part size for the whole upload
        self._part = bytearray()  # grows as bytes arrive: a small object never holds a whole part
        self.written = 0
        self._upload_id: str | None = None
        self._etags: list[Future[str]] = []
        self._slots = threading.Semaphore(WRITE_PARTS_IN_FLIGHT)
        self._by_reason: dict[Any, int] = {}  # bytes taken from host or GPU memory, for the ledger
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._failed: BaseException | None = None

    def add(self, view: BufferView, size: int, file_offset: int | None, buf_offset: int) -> int:
        with self._lock:  # writes go in order: one at a time
            if self._failed is not None:
                raise self._failed
            if file_offset is not None and nonnegative_int("file_offset", file_offset) != self.written:
                raise InvalidArgumentError(f"an object is written in order: the next write goes at {self.written}, "
                                           f"not {file_offset}")
            try:
                reason = object_reason(view, self._cfg)
                self._take(view, size, buf_offset)
            except BaseException as exc:
                self._failed = exc
                raise
            self._by_reason[reason] = self._by_reason.get(reason, 0) + size
            self.written += size
            return size

    def _take(self, view: BufferView, size: int, buf_offset: int) -> None:
        done = 0
        part_size = self._cfg.s3_part_size
        while done < size:
            n = min(size - done, part_size - len(self._part))
            if view.on_device:
                _append_from_device(view, buf_offset + done, n, self._part)
            else:
                assert view.host_view is not None
                self._part += view.host_view[buf_offset + done:buf_offset + done + n]
            done += n
            if len(self._part) == part_size:
                self._send(self._part)
                self._part = bytearray()

    def _send(self, data: bytearray) -> None:
        if self._upload_id is None:
            self._upload_id = self._bucket.start_upload(self._url, self._cfg)
        number = len(self._etags) + 1
        self._slots.acquire()
        upload_id = self._upload_id

        def upload() -> str:
            try:
                return self._bucket.upload_part(self._url, upload_id, number, memoryview(data), self._cfg)
            finally:
                self._slots.release()

        self._etags.append(object_executor().submit(upload))

    def finish(self) -> None:
        """Upload the rest and complete; on any failure abort the upload and raise."""
        with self._lock:
            try:
                if self._failed is not None:
                    raise self._failed
                if self._upload_id is None:  # it all fits one part: one PUT, atomic too
                    self._bucket.put(self._url, memoryview(self._part), self._cfg)
                else:
                    if self._part:
                        self._send(self._part)
                    etags = [f.result() for f in self._etags]
                    self._bucket.complete_upload(self._url, self._upload_id, etags, self._cfg)
                self._record(max(1, len(self._etags)))
            except BaseException:
                self._abort_quietly()
                raise
            finally:
                self._part = bytearray()

    def _record(self, parts: int) -> None:
        elapsed = time.perf_counter() - self._t0
        total = sum(self._by_reason.values()) or 1
        for reason, nbytes in self._by_reason.items():
            ledger.record(Path.OBJECT, reason, "write", nbytes, parts, elapsed * nbytes / total)

    def cancel(self) -> None:
        with self._lock:
            self._abort_quietly()
            self._part = bytearray()

    def _abort_quietly(self) -> None:
        for f in self._etags:  # no part may land after the abort
            try:
                f.result()
            except BaseException:  # noqa: BLE001 - the upload is being aborted anyway
                pass
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            try:
                self._bucket.abort_upload(self._url, upload_id, self._cfg)
            except BaseException:  # noqa: BLE001 - the failure that led here is the one to report
                pass


def _append_from_device(view: BufferView, offset: int, n: int, out: bytearray) -> None:
    """Device bytes ``[offset, offset + n)`` of ``view`` appended to ``out`` through a pinned lane."""
    cfg = settings.snapshot()
    device = view.device if view.device is not None else cuda.current_device()
    n_lanes, chunk = lanes.stage_layout(device, cfg.threads, cfg.chunk_size, cfg.pinned_budget, cfg.alignment)
    lane = lanes.acquire(device, chunk + 2 * cfg.alignment, n_lanes, cfg.pinned_budget)
    before = cuda.make_current(device)
    ok = False
    try:
        if view.producer_sync:
            cuda.synchronize_producer(view.producer_stream)
        stage, _event = lane.next_stage()
        assert lane.stream is not None
        pos = 0
        while pos < n:
            k = min(chunk, n - pos)
            lane.stream.copy_d2h(stage.ptr, view.ptr + offset + pos, k)
            lane.stream.synchronize()
            out += stage.view[:k]
            pos += k
        ok = True
    finally:
        lanes.release(lane) if ok else lanes.discard_after_failure(lane)
        cuda.put_back(before)


def open_object(url: str | ObjectURL, mode: str = "r", *, atomic: bool = False) -> ObjectFile:
    """Open the object at ``url`` (``s3://bucket/key``): :class:`ObjectFile`."""
    return ObjectFile(url, mode, atomic=atomic)


class ObjectStream(io.RawIOBase):
    """An object read as a seekable binary stream, each ``readinto`` a ranged GET (wrap it in
    ``io.BufferedReader`` for small reads): for readers that take a file object (torch's zip reader)."""

    def __init__(self, url: str | ObjectURL) -> None:
        super().__init__()
        self._file = ObjectFile(url, "r")
        self._pos = 0
        self.name = self._file.path

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._file.size}.get(whence)
        if base is None or base + offset < 0:
            raise InvalidArgumentError(f"cannot seek to {offset} from {whence}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = self._file.read(view, view.nbytes, self._pos) if view.nbytes else 0
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


def open_object_stream(url: str | ObjectURL, buffer_size: int = 1 << 20) -> io.BufferedReader:
    """The object at ``url`` as a buffered, seekable binary stream (:class:`ObjectStream`)."""
    return io.BufferedReader(ObjectStream(url), buffer_size)
