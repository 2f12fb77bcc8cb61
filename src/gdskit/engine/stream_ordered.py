"""Stream-ordered reads and writes: I/O queued on the caller's CUDA stream.

``File.pread(buf, ..., stream=s)`` and ``File.pwrite(..., stream=s)`` come here. Everything
is queued on ``s`` by the calling thread, which never waits for the stream: the I/O runs once
the work queued before it on ``s`` is done, and work queued after it sees (or no longer
needs) the bytes. Each route of the request (:func:`gdskit.engine.read_route.route_read`) is queued in
order on the same stream:

* ``cufile``: ``cuFileReadAsync``/``cuFileWriteAsync``, whose parameters live in this op
  until it is settled (cuFile reads them through pointers when the I/O runs).
* ``bounce``: per chunk, a host function (``cuLaunchHostFunc``) reads the chunk into a pinned
  stage and a ``cuMemcpyHtoDAsync`` copies it on; writes copy first and write in the host
  function. Chunks take a set's two stages in turn: stream order makes a stage's last copy
  finish before its next host function runs.
* ``host`` (host memory): one host function reads or writes the caller's memory.

A first host function notes the start, a last one the outcome; the op is then settled off
the driver's thread (host functions make no CUDA call, and the future's callbacks may), and
the future gets the byte count or the error. :meth:`StreamFuture.result` waits for the op on
the device (an event recorded after it), never for the rest of the stream.

Stage sets are few and fixed (:data:`STAGE_SETS` per device of at most
:data:`STAGE_CHUNK` bytes each stage) and never waited for on the host: an op that takes a
set last used on another stream makes its own stream wait for that use first
(``cuStreamWaitEvent``), so ops on different streams sharing a set run one after another.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import gdskit.engine.cuda as cuda
from gdskit.engine.backends.base import OpenFile, Request, pread_full, pwrite_all
from gdskit.engine.backends.staged import ChunkResult, read_to_stage, write_from_stage
from gdskit.engine.buffers import BufferView
from gdskit.errors import CudaError, GdskitError, InvalidArgumentError, from_os_error
from gdskit.engine.ledger import ledger
from gdskit.engine.plan import align_down, chunks
from gdskit.engine.read_route import BackendChoice, BackendKind, host_reason, route_read
from gdskit.settings import Settings
from gdskit.shutdown import FREE_MEMORY, STOP_WORK, at_exit
from gdskit.threads import start_thread
from gdskit.vocabulary import Path

#: Stage sets per device, and the most bytes one stage holds: a fixed, small amount of pinned
#: memory (here at most 4 x 2 x 4 MiB per device) beside the bounce ring's budget.
STAGE_SETS = 4
STAGE_CHUNK = 4 << 20
#: The largest piece one cuFile Stream API call is given (its I/O size limit is just under 2 GiB).
CUFILE_PIECE = 1 << 30


class StreamFuture(Future):  # type: ignore[type-arg]
    """The ``Future`` of a stream-ordered request: its byte count, or its error.

    :meth:`result` and :meth:`exception` without a timeout first wait for the request on the
    device (an event recorded after it; later work on the stream is not waited for). With a
    timeout they only wait for the driver to run it.
    """

    _op: _StreamOp | None = None

    def wait_on_device(self) -> None:
        """Block until the request has run on its stream (no-op once it is settled)."""
        op = self._op
        if op is not None and not self.done():
            op.wait_on_device()

    def result(self, timeout: float | None = None) -> Any:
        if timeout is None:
            self.wait_on_device()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if timeout is None:
            self.wait_on_device()
        return super().exception(timeout)


def failed(exc: BaseException) -> StreamFuture:
    """A future that already holds ``exc`` (errors of a stream-ordered call are never raised)."""
    fut = StreamFuture()
    fut.set_exception(exc)
    return fut


# -- pinned stages ----------------------------------------------------------------------------------

def _pinned(nbytes: int) -> Any:
    try:
        return cuda.RegisteredHostBuffer(nbytes)
    except CudaError:
        return cuda.PinnedBuffer(nbytes)


class StageSet:
    """Two pinned stages of one device, and an event recorded after their last use."""

    def __init__(self, device: int, chunk: int, alignment: int) -> None:
        self.device = device
        self.chunk = chunk
        self.stages: list[Any] = []
        self.free_at: cuda.Event | None = None
        self.stream: int | None = None  # the stream of the last op that used it
        self.claimed = False            # an op is being queued with it right now
        self.tick = 0
        try:
            for _ in range(2):
                self.stages.append(_pinned(chunk + 2 * alignment))
            self.free_at = cuda.Event()
        except BaseException:
            self.free()
            raise

    @property
    def pinned_bytes(self) -> int:
        return sum(st.nbytes for st in self.stages)

    def free(self) -> None:
        """Free the stages once their last use has run (a host wait: only when releasing)."""
        try:
            if self.free_at is not None:
                try:
                    self.free_at.wait()
                finally:
                    self.free_at.destroy()
        finally:
            for st in self.stages:
                st.free()
            self.stages, self.free_at = [], None


class _StagePool:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._sets: dict[int, list[StageSet]] = {}
        self._ticks = itertools.count(1)

    def take(self, device: int, stream: int, cfg: Settings) -> StageSet:
        """A set for an op on ``stream``, claimed until :meth:`give`; ``stream`` ordered after the
        set's last use where that was on another stream. Waits only for another thread's queueing."""
        with self._cond:
            while True:
                sets = self._sets.setdefault(device, [])
                free = [s for s in sets if not s.claimed]
                same = [s for s in free if s.stream == stream]
                if same:
                    chosen = same[0]
                    break
                if len(sets) < STAGE_SETS:
                    chunk = max(cfg.alignment, align_down(min(cfg.chunk_size, STAGE_CHUNK), cfg.alignment))
                    chosen = StageSet(device, chunk, cfg.alignment)
                    sets.append(chosen)
                    break
                if free:
                    chosen = min(free, key=lambda s: s.tick)
                    break
                self._cond.wait()
            chosen.claimed = True
        if chosen.stream is not None and chosen.stream != stream:
            assert chosen.free_at is not None
            try:
                cuda.stream_wait_event(stream, chosen.free_at)
            except BaseException:
                self.give(chosen, None)
                raise
        return chosen

    def give(self, chosen: StageSet, stream: int | None) -> None:
        """End the claim; ``stream``: where the op was queued (its use recorded there), or None
        where nothing used the set."""
        with self._cond:
            if stream is not None:
                chosen.stream = stream
                chosen.tick = next(self._ticks)
            chosen.claimed = False
            self._cond.notify_all()

    def drop(self, chosen: StageSet) -> None:
        """Forget a set whose last use is unknown (queueing failed half-way): it is never reused
        or freed, as queued work may still use it."""
        with self._cond:
            for sets in self._sets.values():
                if chosen in sets:
                    sets.remove(chosen)
            self._cond.notify_all()

    def pinned_bytes(self) -> int:
        with self._cond:
            return sum(s.pinned_bytes for sets in self._sets.values() for s in sets)

    def release(self) -> None:
        """Free every set not being queued with right now."""
        with self._cond:
            idle = [s for sets in self._sets.values() for s in sets if not s.claimed]
            for sets in self._sets.values():
                sets[:] = [s for s in sets if s.claimed]
        for s in idle:
            try:
                s.free()
            except Exception:  # noqa: BLE001 - free the others all the same
                pass


stages = _StagePool()


# -- one request --------------------------------------------------------------------------------------

class _CufileParams(ctypes.Structure):
    """What cuFile's Stream API reads through pointers when the I/O runs, and the count it writes."""

    _fields_ = [("size", ctypes.c_size_t), ("file_offset", ctypes.c_int64), ("buf_offset", ctypes.c_int64),
                ("nbytes", ctypes.c_ssize_t)]


@dataclass(eq=False)
class _Piece:
    """One queued unit of a request, in file order: its planned size and what it moved."""

    route: BackendChoice
    size: int
    done: int = 0
    result: ChunkResult | None = None
    params: _CufileParams | None = None


@dataclass(eq=False)
class _StreamOp:
    op: str
    f: OpenFile
    view: BufferView
    stream: int
    device: int | None
    future: StreamFuture
    on_error: Callable[[BaseException], None] | None
    pieces: list[_Piece] = field(default_factory=list)
    error: BaseException | None = None
    short: bool = False            # a read came short (the file shrank): later pieces read nothing
    done_event: cuda.Event | None = None
    cufile_before: dict[int, Any] = field(default_factory=dict)
    t_start: float = 0.0
    t_end: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    settled: bool = False

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc

    def wait_on_device(self) -> None:
        with self.lock:
            if self.settled or self.done_event is None:
                return
            try:
                self.done_event.wait()
                return
            except CudaError as exc:  # the stream failed: its host functions will never run
                error: BaseException = exc
        _settle(self, error)


_inflight: set[_StreamOp] = set()
_inflight_lock = threading.Lock()


# -- settling, off the driver's threads ------------------------------------------------------------------

_settle_queue: queue.SimpleQueue[_StreamOp | None] = queue.SimpleQueue()
_settler: threading.Thread | None = None
_settler_lock = threading.Lock()


def _settle_loop() -> None:
    while True:
        op = _settle_queue.get()
        if op is None:
            return
        try:
            _settle(op)
        except BaseException:  # noqa: BLE001 - the next op must still be settled
            pass


def _start_settler() -> None:
    global _settler
    with _settler_lock:
        if _settler is None or not _settler.is_alive():  # none yet, or a forked child's
            _settler = start_thread(_settle_loop, "gdskit-stream-settle")


def _settle(op: _StreamOp, error: BaseException | None = None) -> None:
    """Set the future from what the host functions left (once), record the ledger, free the event."""
    with op.lock:
        if op.settled:
            return
        op.settled = True
        error = error or op.error
        total = 0
        for piece in op.pieces:
            total += piece.done
            if piece.done < piece.size:
                break
        if error is None:
            try:
                _record(op)
            except Exception:  # noqa: BLE001 - the ledger must not lose the caller's bytes
                pass
        if op.done_event is not None:
            try:
                op.done_event.destroy()
            except Exception:  # noqa: BLE001
                pass
            op.done_event = None
    with _inflight_lock:
        _inflight.discard(op)
    if error is not None:
        if op.on_error is not None:
            op.on_error(error)
        op.future.set_exception(error)
    else:
        op.future.set_result(total)


def _record(op: _StreamOp) -> None:
    busy = max(op.t_end - op.t_start, 0.0)
    moved = sum(p.done for p in op.pieces) or 1
    by_kind: dict[str, list[_Piece]] = {}
    for piece in op.pieces:
        by_kind.setdefault(piece.route.backend, []).append(piece)
    for kind, pieces in by_kind.items():
        nbytes = sum(p.done for p in pieces)
        share = busy * nbytes / moved
        reason = pieces[0].route.reason
        if kind is BackendKind.HOST:
            ledger.record(Path.HOST, reason, op.op, nbytes, len(pieces), share)
        elif kind is BackendKind.CUFILE:
            from gdskit.engine.backends.cufile import record_async  # noqa: PLC0415 - import time

            record_async(op.f, Request(op.op, op.view, nbytes, pieces[0].route.file_offset, pieces[0].route.buf_offset,
                                 reason), nbytes, len(pieces), share, op.cufile_before.get(op.device or 0))
        else:
            cached = sum(min(p.result.cached, p.done) for p in pieces if p.result is not None)
            direct = nbytes - cached
            if cached or not direct:
                ledger.record(Path.BOUNCE_CACHED, reason, op.op, cached,
                              sum(1 for p in pieces if p.result is not None and p.result.cached), share * cached / (nbytes or 1),
                              device=op.device)
            if direct:
                ledger.record(Path.BOUNCE_DIRECT, reason, op.op, direct,
                              sum(1 for p in pieces if p.result is not None and p.done > p.result.cached),
                              share * direct / nbytes, device=op.device)


# -- the host functions (no CUDA calls in here: CUDA's rule) ---------------------------------------------------

def _entered(op: _StreamOp) -> bool:
    """Whether the op still runs (no error, not settled) with the file's descriptors held."""
    if op.error is not None or op.settled:
        return False
    if not op.f.enter():
        op.fail(from_os_error(OSError(9, "the file was closed under a stream-ordered request"), op.f.path))
        return False
    return True


def _zero(stage: Any, offset: int, n: int) -> None:
    if n > 0:
        ctypes.memset(stage.ptr + offset, 0, n)


def _host_read_chunk(op: _StreamOp, piece: _Piece, stage: Any, pos: int, policy: Any, align: int) -> None:
    lead = pos % align
    if op.short or not _entered(op):
        _zero(stage, lead, piece.size)  # the queued copy lands zeros, never another op's bytes
        return
    try:
        res = read_to_stage(op.f, stage.view, pos, piece.size, policy, align)
        piece.result, piece.done = res, res.nbytes
        if res.nbytes < piece.size:  # the file shrank after the call
            op.short = True
            _zero(stage, lead + res.nbytes, piece.size - res.nbytes)
    except BaseException as exc:  # noqa: BLE001 - reported on the future
        op.fail(exc)
        _zero(stage, lead, piece.size)
    finally:
        op.f.leave()


def _host_write_chunk(op: _StreamOp, piece: _Piece, stage: Any, pos: int, policy: Any, align: int) -> None:
    if not _entered(op):
        return
    try:
        piece.result = write_from_stage(op.f, stage.view, pos, piece.size, policy, align)
        piece.done = piece.size
    except BaseException as exc:  # noqa: BLE001
        op.fail(exc)
    finally:
        op.f.leave()


def _host_memory(op: _StreamOp, piece: _Piece) -> None:
    if op.short or not _entered(op):
        return
    try:
        view = op.view.host_view
        if view is None:  # pinned memory named by a pointer
            view = memoryview((ctypes.c_char * op.view.nbytes).from_address(op.view.ptr)).cast("B")
        r = piece.route
        part = view[r.buf_offset:r.buf_offset + r.size]
        if op.op == "read":
            piece.done = pread_full(op.f.fd, part, r.file_offset, op.f.path)
            op.short = piece.done < r.size
        else:
            piece.done = pwrite_all(op.f.fd, part, r.file_offset, op.f.path)
    except BaseException as exc:  # noqa: BLE001
        op.fail(exc)
    finally:
        op.f.leave()


def _cufile_done(op: _StreamOp, piece: _Piece, outcome: Callable[[str, int, str], int]) -> None:
    assert piece.params is not None
    if op.error is not None:
        return
    try:
        piece.done = outcome(op.op, int(piece.params.nbytes), op.f.path)
        if piece.done < piece.size:
            if op.op == "write":
                op.fail(from_os_error(OSError(5, "cuFile wrote fewer bytes than asked"), op.f.path))
            op.short = True
    except BaseException as exc:  # noqa: BLE001
        op.fail(exc)


def _started(op: _StreamOp) -> None:
    op.t_start = time.perf_counter()


def _finished(op: _StreamOp) -> None:
    op.t_end = time.perf_counter()
    _settle_queue.put(op)  # settled by the settle thread: no CUDA call may happen here


# -- queueing ---------------------------------------------------------------------------------------------------

def _order_after_producer(view: BufferView, stream: int) -> None:
    """Make ``stream`` wait (on the device) for work the buffer's producer has queued on its own
    stream, as the synchronous path waits for it on the host."""
    if not view.producer_sync:
        return
    producer = 1 if view.producer_stream is None else view.producer_stream
    legacy = {0, 1}
    if producer == stream or (producer in legacy and stream in legacy):
        return
    ev = cuda.Event()
    try:
        ev.record_on(producer)
        cuda.stream_wait_event(stream, ev)
    finally:
        ev.destroy()


def submit(f: OpenFile, op: str, view: BufferView, size: int, file_offset: int, buf_offset: int, stream: int,
           cfg: Settings, on_error: Callable[[BaseException], None] | None = None) -> StreamFuture:
    """Queue a validated request on ``stream`` (a raw handle) from the calling thread; the future
    of its byte count. ``f`` must be entered by the caller: it is left when the op is settled
    (the caller's ``Future`` callback). Errors before anything is queued are raised here."""
    fut = StreamFuture()
    if view.scatter is not None:
        raise InvalidArgumentError("a scattered destination cannot be read in stream order")
    if op == "read" and size:
        try:
            size = max(0, min(size, os.fstat(f.fd).st_size - file_offset))  # nothing is queued past the end
        except OSError as exc:
            raise from_os_error(exc, f.path) from exc
    if size == 0:
        fut.set_result(0)
        return fut
    if view.on_device:
        routes = list(route_read(f, view, size, file_offset, buf_offset, cfg, other_gpu=False).pieces)
        device = view.device if view.device is not None else cuda.current_device()
    else:
        routes = [BackendChoice(BackendKind.HOST, host_reason(), file_offset, buf_offset, size)]
        device = None
    sop = _StreamOp(op, f, view, stream, device, fut, on_error)
    fut._op = sop
    _start_settler()
    if device is None:
        _queue(sop, routes, cfg)
    else:
        with cuda.on_device(device):
            _queue(sop, routes, cfg)
    return fut


def _queue(op: _StreamOp, routes: list[BackendChoice], cfg: Settings) -> None:
    stream = op.stream
    if op.device is not None:
        _order_after_producer(op.view, stream)
    op.done_event = cuda.Event()  # host memory: in the calling thread's context, as its stream's
    if any(r.backend is BackendKind.CUFILE for r in routes):
        from gdskit.engine.backends.cufile import counters_now  # noqa: PLC0415 - import time

        op.cufile_before[op.device or 0] = counters_now(op.device or 0)
    stage_set = stages.take(op.device, stream, cfg) if any(r.backend is BackendKind.BOUNCE for r in routes) else None
    queued = False  # anything on the stream yet: from then on, errors go to the future
    try:
        cuda.launch_host_func(stream, lambda: _started(op))
        queued = True
        turn = 0
        for route in routes:
            if route.backend is BackendKind.HOST:
                piece = _Piece(route, route.size)
                op.pieces.append(piece)
                cuda.launch_host_func(stream, lambda p=piece: _host_memory(op, p))
            elif route.backend is BackendKind.CUFILE:
                _queue_cufile(op, route)
            else:
                assert stage_set is not None
                turn = _queue_bounce(op, route, stage_set, turn, cfg)
        _queue_end(op, stage_set)
        stage_set = None
    except BaseException as exc:
        if not queued:
            if stage_set is not None:
                stages.give(stage_set, None)
            if op.done_event is not None:
                op.done_event.destroy()
            raise
        # Part of the op is on the stream: its error goes to the future once that part has run.
        op.fail(exc if isinstance(exc, GdskitError) else CudaError(f"queueing a stream-ordered {op.op} failed: "
                                                                   f"{exc}"))
        try:
            _queue_end(op, stage_set)
        except BaseException:  # noqa: BLE001 - the stream takes nothing more: settle now
            if stage_set is not None:
                stages.drop(stage_set)
            _settle(op)
            return
    with _inflight_lock:
        if not op.settled:
            _inflight.add(op)


def _queue_end(op: _StreamOp, stage_set: StageSet | None) -> None:
    """The op's last host function and its event on its stream, then its stage set handed back
    once the stream is past them."""
    stream = op.stream
    cuda.launch_host_func(stream, lambda: _finished(op))
    if op.done_event is not None:
        op.done_event.record_on(stream)
    if stage_set is not None:
        assert stage_set.free_at is not None
        stage_set.free_at.record_on(stream)
        stages.give(stage_set, stream)


def _queue_bounce(op: _StreamOp, route: BackendChoice, stage_set: StageSet, turn: int, cfg: Settings) -> int:
    align, policy, stream = cfg.alignment, cfg.odirect, op.stream
    for ch in chunks(route.file_offset, route.buf_offset, route.size, stage_set.chunk, align):
        stage = stage_set.stages[turn % 2]
        turn += 1
        piece = _Piece(route, ch.size)
        op.pieces.append(piece)
        lead = ch.file_offset % align
        device_ptr = op.view.ptr + ch.buf_offset
        if op.op == "read":
            cuda.launch_host_func(stream, lambda p=piece, s=stage, pos=ch.file_offset:
                                  _host_read_chunk(op, p, s, pos, policy, align))
            cuda.copy_h2d_on(stream, device_ptr, stage.ptr + lead, ch.size)
        else:
            cuda.copy_d2h_on(stream, stage.ptr + lead, device_ptr, ch.size)
            cuda.launch_host_func(stream, lambda p=piece, s=stage, pos=ch.file_offset:
                                  _host_write_chunk(op, p, s, pos, policy, align))
    return turn


def _queue_cufile(op: _StreamOp, route: BackendChoice) -> None:
    from gdskit.engine.backends.cufile import async_outcome, enqueue_async  # noqa: PLC0415 - import time

    done = 0
    while done < route.size:
        n = min(CUFILE_PIECE, route.size - done)
        params = _CufileParams(n, route.file_offset + done, route.buf_offset + done, 0)
        piece = _Piece(route, n, params=params)
        at = ctypes.addressof(params)
        enqueue_async(op.f, op.op, op.view.ptr, at + _CufileParams.size.offset,
                      at + _CufileParams.file_offset.offset, at + _CufileParams.buf_offset.offset,
                      at + _CufileParams.nbytes.offset, op.stream)
        op.pieces.append(piece)  # only once queued: a refused call moved nothing; the op keeps params alive
        cuda.launch_host_func(op.stream, lambda p=piece: _cufile_done(op, p, async_outcome))
        done += n


# -- waiting and releasing --------------------------------------------------------------------------------------

def wait_for(futures: list[Future[Any]]) -> None:
    """Wait on the device for the stream-ordered requests among ``futures`` (``File.close``)."""
    for fut in futures:
        if isinstance(fut, StreamFuture):
            fut.wait_on_device()


def drain() -> None:
    """Wait for every stream-ordered request in flight (at exit, before a driver change)."""
    with _inflight_lock:
        ops = list(_inflight)
    for op in ops:
        try:
            op.wait_on_device()
        except Exception:  # noqa: BLE001
            pass
    for op in ops:
        try:
            op.future.exception()  # settled by the settle thread
        except Exception:  # noqa: BLE001
            pass


def in_flight() -> int:
    """Stream-ordered requests queued and not yet settled."""
    with _inflight_lock:
        return len(_inflight)


def release_idle() -> None:
    """Free the stage sets (each once its last use has run)."""
    stages.release()


def _stop() -> None:
    drain()
    with _settler_lock:
        if _settler is not None and _settler.is_alive():
            _settle_queue.put(None)
            _settler.join()


def _leave_driver() -> None:
    drain()
    stages.release()


cuda.on_driver_change(_leave_driver)
at_exit(STOP_WORK, _stop)
at_exit(FREE_MEMORY, release_idle)
