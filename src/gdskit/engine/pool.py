"""Shared machinery: the I/O worker threads and the *lanes* they work in.

A lane is what one worker needs to move a chunk: a staging area (pinned host
memory and a CUDA stream for device requests; page-aligned scratch memory for
host requests). Lanes are created on first use, by the worker that needs one,
reused across calls (pinned memory is slow to make), and their total pinned
memory never exceeds ``settings.pinned_budget``.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import gdskit.engine.cuda as cuda
from gdskit.engine.direct_path import direct_route

import gdskit.engine.numa as numa
from gdskit.shutdown import FREE_MEMORY, STOP_WORK, at_exit
from gdskit.errors import CudaError
from gdskit.engine.plan import Chunk, align_down, chunks
from gdskit.settings import settings
from gdskit.threads import executor
from gdskit.vocabulary import PinnedAlloc

T = TypeVar("T")
C = TypeVar("C")  # a unit of work: a Chunk, or a (request, Chunk) pair

# Seconds each lane took to set up (pinned allocation dominates); for benchmarks and diagnostics.
setup_seconds: list[float] = []


def anonymous_memory(nbytes: int, huge_pages: bool = True) -> mmap.mmap:
    """Page-aligned private anonymous memory, with huge-page advice unless ``huge_pages`` is False.

    Private, not Python's default shared anonymous mapping: that is shmem, which takes no
    huge pages. The advice is only advice (transparent huge pages off, or an old kernel).
    """
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mem.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return mem


class _HostStage:
    """Page-aligned anonymous memory (O_DIRECT needs aligned buffers), on transparent huge pages
    where the system allows: an O_DIRECT read into physically contiguous memory can reach the
    device as fewer, larger requests (measured: docs/engine.md, "Measurements behind the defaults")."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        # Unlike the pinned stages, a forked child keeps this one: it may read through the host
        # path with the lanes it inherited.
        self._map = anonymous_memory(nbytes)
        self.view = memoryview(self._map)
        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    def free(self) -> None:
        if self._map is not None:
            self.view.release()
            self.ptr = 0
            try:
                self._map.close()
            except BufferError:  # a ctypes export is still alive; the GC frees it
                pass
            self._map = None  # type: ignore[assignment]


class Lane:
    """A worker's staging buffer(s) and, for device lanes, a stream and an event per buffer.

    Device lanes get pinned memory from ``pinned``: :class:`cuda.RegisteredHostBuffer`
    (made by the calling worker, so the lanes of a request are made in parallel) or
    :class:`cuda.PinnedBuffer` (``cudaHostAlloc``).
    """

    # One pinned stage per device lane: a second one bought no throughput and doubled the
    # set-up cost (docs/engine.md, "Measurements behind the defaults").
    stages_per_device_lane = 1

    def __init__(self, device: int | None, stage_bytes: int, pinned: Callable[[int], Any] | None = None) -> None:
        t0 = time.perf_counter()
        self.device = device
        self.stage_bytes = stage_bytes
        self.stages: list[Any] = []
        self.events: list[cuda.Event] = []
        self.stream: cuda.Stream | None = None
        # What a read of one small chunk in its caller's thread waits on (backends.bounce): no
        # blocking sync, so the wait for a copy of a few KiB ends when the copy does, not when an
        # interrupt wakes the thread (docs/engine.md, "Small reads").
        self.quick_event: cuda.Event | None = None
        self.numa_node: int | None = None  # the NUMA node the stages were made on, where one was chosen
        self.counted_pinned = 0  # the pinned bytes the pool counts for this lane (LanePool._add)
        self.turn = 0
        try:
            if device is None:
                self.stages = [_HostStage(stage_bytes)]
            else:
                # Made in the device's context; a caller's thread (a small read makes its lane
                # there) keeps its own context.
                with cuda.on_device(device):
                    self.stream = cuda.Stream(device)
                    # The stages' pages are faulted in here, by this thread: on the GPU's NUMA node.
                    node = numa.place_of(device).node
                    with numa.memory_on(node) as bound:
                        for _ in range(self.stages_per_device_lane):
                            self.stages.append((pinned or cuda.PinnedBuffer)(stage_bytes))
                            self.events.append(cuda.Event())
                    self.quick_event = cuda.Event(blocking_sync=False)
                self.numa_node = node if bound else None
        except BaseException:
            self.free()
            raise
        setup_seconds.append(time.perf_counter() - t0)

    @property
    def pinned_bytes(self) -> int:
        return self.stage_bytes * len(self.stages) if self.device is not None else 0

    def next_stage(self) -> tuple[Any, cuda.Event | None]:
        """The next staging buffer, once the copy that last used it has finished."""
        i = self.turn
        self.turn = (self.turn + 1) % len(self.stages)
        ev = self.events[i] if self.events else None
        if ev is not None:
            ev.wait()
        return self.stages[i], ev

    def drain(self) -> None:
        for ev in self.events:
            ev.wait()
        if self.quick_event is not None:
            self.quick_event.wait()
        if self.stream is not None:
            self.stream.synchronize()

    def free(self) -> None:
        # A worker that failed mid-chunk hands its lane back undrained: copies still queued on
        # its stream read the stages (and write the caller's buffer), so they end first.
        if self.stream is not None:
            try:
                self.stream.synchronize()
            except Exception:  # noqa: BLE001 - a stream in error runs nothing more
                pass
        for ev in self.events:
            ev.destroy()
        if self.quick_event is not None:
            self.quick_event.destroy()
        for st in self.stages:
            st.free()
        if self.stream is not None:
            self.stream.destroy()
        self.events, self.stages, self.stream, self.quick_event = [], [], None, None


@dataclass(frozen=True)
class ResourceUsage:
    """What the pool holds right now (for tests and ``gdskit.resources()``).

    ``pinned_alloc`` says how the pinned stages held now were made (``register``,
    ``hostalloc``, ``mixed``, or ``none``); ``register_error`` is why registration was
    refused, if it was (gdskit then uses ``cudaHostAlloc`` for the rest of the process).
    """

    lanes: int
    lanes_busy: int
    pinned_bytes: int
    threads: int
    pinned_alloc: str = "none"
    register_error: str | None = None
    numa_nodes: tuple[int, ...] = ()  # the NUMA nodes pinned stages were placed on (gdskit.engine.numa)


@functools.lru_cache(maxsize=64)
def _device_stage_layout(threads: int, chunk_size: int, budget: int, alignment: int, k: int) -> tuple[int, int]:
    """:meth:`LanePool.stage_layout` for device lanes of ``k`` stages: pure, and asked by every
    request (so remembered)."""
    lanes = threads
    per_stage = budget // (lanes * k)
    while lanes > 1 and per_stage - 2 * alignment < 64 * 1024:
        lanes -= 1
        per_stage = budget // (lanes * k)
    chunk = min(chunk_size, align_down(per_stage - 2 * alignment, alignment))
    return lanes, max(alignment, chunk)


class LanePool:
    """Lanes per device (``None`` = host), bounded by count and pinned budget."""

    def __init__(self) -> None:
        # Taken as ``self._lock`` where nothing waits (a Condition's ``with`` runs in Python, and
        # every small read takes a lane and gives it back); ``self._cond`` to wait and notify.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._idle: dict[Any, list[Lane]] = {}
        self._all: list[Lane] = []
        self._all_pinned = 0  # the pinned bytes of the lanes in _all (a sum every request would ask for)
        self._busy = 0
        self._creating: dict[tuple[int | None, int], int] = {}
        self._creating_pinned = 0
        # cudaHostAlloc calls made at once do not finish sooner, but made one after another the
        # first lanes are ready soon and their workers start (docs/engine.md, "Measurements").
        self._pin_lock = threading.Lock()
        self._register_error: str | None = None  # set once registration is refused

    def stage_layout(self, device: int | None, threads: int, chunk_size: int, budget: int,
                     alignment: int) -> tuple[int, int]:
        """(lanes, chunk bytes) that fit the pinned budget; each stage holds a chunk plus alignment slack."""
        if device is None:
            return threads, chunk_size
        return _device_stage_layout(threads, chunk_size, budget, alignment, Lane.stages_per_device_lane)

    def acquire(self, device: int | None, stage_bytes: int, max_lanes: int, budget: int) -> Lane:
        """An idle lane of this shape, or a new one if the count and the pinned budget allow; else wait.

        Lanes being created count against both limits, so concurrent requests cannot overshoot.
        """
        key = (device, stage_bytes)
        needed = Lane.stages_per_device_lane * stage_bytes if device is not None else 0
        with self._lock:
            while True:
                # The budget may have shrunk since idle lanes were made: trim them first.
                while self._pinned() > budget and self._drop_one_idle(keep=None):
                    pass
                idle = self._idle.get(device, [])
                for i in range(len(idle) - 1, -1, -1):  # the last one given back: its memory is warmest
                    if idle[i].stage_bytes == stage_bytes:
                        self._busy += 1
                        return idle.pop(i)
                count = sum(1 for ln in self._all if (ln.device, ln.stage_bytes) == key) + self._creating.get(key, 0)
                if count < max_lanes:
                    # Free idle lanes of other shapes until the new one fits the budget.
                    while self._pinned() + needed > budget and self._drop_one_idle(keep=stage_bytes):
                        pass
                    if self._pinned() + needed <= budget:
                        break
                self._cond.wait()
            self._busy += 1
            self._creating[key] = self._creating.get(key, 0) + 1
            self._creating_pinned += needed
        lane: Lane | None = None
        try:
            lane = self._make_lane(device, stage_bytes)
        finally:
            with self._cond:
                self._creating[key] -= 1
                self._creating_pinned -= needed
                if lane is None:
                    self._busy -= 1
                else:
                    self._add(lane)
                self._cond.notify_all()
        return lane

    def _make_lane(self, device: int | None, stage_bytes: int) -> Lane:
        if device is None:
            return Lane(device, stage_bytes)
        if settings.pinned_alloc is PinnedAlloc.REGISTER and self._register_error is None:
            try:
                # No lock: each worker faults in its own stage, all at once.
                return Lane(device, stage_bytes, cuda.RegisteredHostBuffer)
            except CudaError as exc:
                with self._cond:  # several workers may fail at once: say it once
                    first = self._register_error is None
                    if first:
                        self._register_error = str(exc)
                if first:
                    warnings.warn(f"gdskit: pinned staging falls back to cudaHostAlloc ({exc}); "
                                  "the first large read will set up more slowly", RuntimeWarning, stacklevel=2)
        with self._pin_lock:
            return Lane(device, stage_bytes, cuda.PinnedBuffer)

    def release(self, lane: Lane) -> None:
        with self._lock:
            self._busy -= 1
            self._idle.setdefault(lane.device, []).append(lane)
            self._cond.notify_all()

    def discard(self, lane: Lane) -> None:
        """Drop a lane whose state is unknown after an error."""
        try:
            lane.free()
        finally:
            with self._cond:
                self._busy -= 1
                self._remove(lane)
                self._cond.notify_all()

    def discard_after_failure(self, lane: Lane) -> None:
        """:meth:`discard` while a failure is being raised: freeing the lane often fails for the
        same cause (a sticky GPU error refuses the unregistration too), and the failure under way,
        not the clean-up's, is the one its caller must see."""
        try:
            self.discard(lane)
        except Exception:  # noqa: BLE001 - see above; the lane is out of the pool either way
            pass

    def _pinned(self) -> int:
        return self._all_pinned + self._creating_pinned

    def _add(self, lane: Lane) -> None:
        lane.counted_pinned = lane.pinned_bytes
        self._all.append(lane)
        self._all_pinned += lane.counted_pinned

    def _remove(self, lane: Lane) -> None:
        """Forget a lane (freed or about to be: its own count may already be 0)."""
        if lane in self._all:
            self._all.remove(lane)
            self._all_pinned -= lane.counted_pinned

    def _drop_one_idle(self, keep: int | None) -> bool:
        """Free one idle device lane (not of stage size ``keep``); False when there is none."""
        for lanes in self._idle.values():
            for i, lane in enumerate(lanes):
                if lane.device is not None and lane.stage_bytes != keep:
                    lanes.pop(i)
                    self._remove(lane)
                    lane.free()
                    return True
        return False

    def holds(self, device: int | None) -> bool:
        """Whether any lane for ``device`` exists now (idle or busy)."""
        with self._cond:
            return any(ln.device == device for ln in self._all)

    def usage(self, threads: int) -> ResourceUsage:
        with self._cond:
            made = {"register" if isinstance(st, cuda.RegisteredHostBuffer) else "hostalloc"
                    for ln in self._all if ln.device is not None for st in ln.stages}
            how = made.pop() if len(made) == 1 else "mixed" if made else "none"
            nodes = tuple(sorted({ln.numa_node for ln in self._all if ln.numa_node is not None}))
            return ResourceUsage(len(self._all), self._busy, self._pinned(), threads, how, self._register_error,
                                 nodes)

    def forget_register_error(self) -> None:
        """Try registering pinned memory again (a refusal was the driver's, and the driver changed)."""
        with self._cond:
            self._register_error = None

    def release_idle(self) -> None:
        """Free every idle lane (pinned memory, streams). Busy lanes are left alone."""
        with self._cond:
            for lanes in self._idle.values():
                for lane in lanes:
                    self._remove(lane)
                    lane.free()
            self._idle.clear()


lanes = LanePool()

_exec_lock = threading.Lock()
_executors: dict[str, tuple[ThreadPoolExecutor, int]] = {}
#: The object store's executor is made once, at the most GETs ``settings.s3_concurrency`` allows
#: (its threads start only as work asks): a reader holding it is never left with one shut down
#: by another thread's change of the setting. Each job bounds its own concurrency.
OBJECT_THREADS = 256


def _executor(kind: str, threads: int) -> ThreadPoolExecutor:
    """The process's executor of this kind, remade when ``settings.threads`` changes."""
    with _exec_lock:
        found = _executors.get(kind)
        if found is not None and found[1] == threads:
            return found[0]
        if found is not None:
            found[0].shutdown(wait=False)
        ex = executor(threads, f"gdskit-{kind}")
        _executors[kind] = (ex, threads)
        return ex


def io_executor(threads: int) -> ThreadPoolExecutor:
    """Worker threads that move chunks. Tasks here never wait on other tasks here."""
    return _executor("io", threads)


def object_executor() -> ThreadPoolExecutor:
    """Threads that wait on an object store's ranged GETs and part uploads: apart from the I/O
    workers, since they mostly wait on the network, not on a disk or a copy. One for the process
    (:data:`OBJECT_THREADS`); a job bounds how many of its GETs run at once."""
    return _executor("object", OBJECT_THREADS)


def request_executor(threads: int) -> ThreadPoolExecutor:
    """Threads that run whole requests for ``pread``/``pwrite`` futures."""
    return _executor("req", threads)


class LaneRef:
    """A worker's lane, acquired only when the work first needs one (page-cache hits into
    host memory need none)."""

    def __init__(self, device: int | None, stage_bytes: int, max_lanes: int, budget: int) -> None:
        self._args = (device, stage_bytes, max_lanes, budget)
        self.lane: Lane | None = None
        self._cpus: frozenset[int] | None = None  # the thread's affinity before it ran on the GPU's node

    def get(self) -> Lane:
        if self.lane is None:
            self.lane = lanes.acquire(*self._args)
            if self.lane.device is not None:
                # Copies go to the lane's stream, which belongs to the lane's device: make it this
                # thread's current device (worker threads serve requests for any GPU).
                cuda.set_device(self.lane.device)
                self._cpus = numa.run_on(numa.place_of(self.lane.device).cpus)
        return self.lane

    def restore_cpus(self) -> None:
        """Put the thread's CPU affinity back as it was before :meth:`get` moved it."""
        before, self._cpus = self._cpus, None
        numa.restore_cpus(before)

    def release(self) -> None:
        """Give the lane back (drained) if one was taken; discard it if it cannot be drained."""
        self.restore_cpus()
        lane, self.lane = self.lane, None
        if lane is None:
            return
        try:
            lane.drain()
        except BaseException:
            lanes.discard(lane)
            raise
        lanes.release(lane)


def run_chunks(chunk_list: Sequence[C], work: Callable[[LaneRef, C], T], *, device: int | None,
               stage_bytes: int, threads: int, max_lanes: int, budget: int) -> list[T]:
    """Run ``work(lane_ref, chunk)`` for every chunk on up to ``threads`` workers; results in chunk order.

    A single chunk runs in the calling thread. Each worker holds at most one
    lane for its whole share and drains it (waits for its copies) before giving
    it back. The first error stops the others from taking new chunks and is
    raised once everything has stopped.
    """
    n = len(chunk_list)
    results: list[Any] = [None] * n
    if n == 0:
        return results
    next_index = iter(range(n))
    claim_lock = threading.Lock()
    failed: list[BaseException] = []

    def worker() -> None:
        ref = LaneRef(device, stage_bytes, max_lanes, budget)
        ok = False
        try:
            while not failed:
                with claim_lock:
                    i = next(next_index, None)
                if i is None:
                    break
                results[i] = work(ref, chunk_list[i])
            if ref.lane is not None:
                ref.lane.drain()
            ok = True
        except BaseException as exc:
            failed.append(exc)
        finally:
            ref.restore_cpus()
            if ref.lane is not None:
                if ok:
                    lanes.release(ref.lane)
                else:
                    lanes.discard_after_failure(ref.lane)  # the chunk's own error (in ``failed``) is raised

    if n == 1:
        worker()
        if failed:
            raise failed[0]
        return results
    workers = min(threads, max_lanes, n)
    if workers == 1:
        worker()
    else:
        ex = io_executor(threads)
        futures: list[Future[None]] = [ex.submit(worker) for _ in range(workers)]
        for fut in futures:
            fut.result()
    if failed:
        raise failed[0]
    return results


def run_requests(requests: Sequence[Any], chunk_size: int, alignment: int,
                 work: Callable[[LaneRef, tuple[Any, Chunk]], T], **run: Any) -> list[tuple[list[Chunk], list[T]]]:
    """The chunks of several requests (each with ``file_offset``, ``buf_offset``, ``size``) as one
    job: ``work(lane_ref, (request, chunk))`` on the shared workers (``run``: run_chunks' keywords).
    Returns, for each request, its chunks and their results in order."""
    plans = [chunks(r.file_offset, r.buf_offset, r.size, chunk_size, alignment) for r in requests]
    flat = run_chunks([(r, ch) for r, plan in zip(requests, plans) for ch in plan], work, **run)
    out, start = [], 0
    for plan in plans:
        out.append((plan, flat[start:start + len(plan)]))
        start += len(plan)
    return out


def prepare(device: int | None, threads: int, chunk_size: int, budget: int, alignment: int,
            workers: int | None = None) -> None:
    """Create every lane a large request on ``device`` will use (or the first ``workers``
    of them), in parallel on the worker threads."""
    n_lanes, chunk = lanes.stage_layout(device, threads, chunk_size, budget, alignment)
    if workers is not None:
        n_lanes = max(1, min(n_lanes, workers))
    stage_bytes = chunk + 2 * alignment
    ex = io_executor(threads)
    barrier = threading.Barrier(n_lanes)

    def make() -> Lane:
        try:
            lane = lanes.acquire(device, stage_bytes, n_lanes, budget)
        except BaseException:
            barrier.abort()
            raise
        try:
            barrier.wait(timeout=60)  # hold it until all exist, so each worker makes its own
        except threading.BrokenBarrierError:
            pass
        return lane

    futures = [ex.submit(make) for _ in range(n_lanes)] if n_lanes <= threads else []
    made, errors = [], []
    for fut in futures:  # every one, even after a failure: a straggler would keep its lane busy
        try:
            made.append(fut.result())
        except BaseException as exc:
            barrier.abort()
            errors.append(exc)
    for lane in made:
        lanes.release(lane)
    if errors:
        raise errors[0]


def set_up(device: int | None, workers: int | None = None) -> None:
    """What ``gdskit.prepare`` and a loader's warm-up set up: whether this machine has a direct
    route, then the lanes of ``device`` (default: the current one) for ``workers`` workers
    (:func:`prepare`). Without a GPU, only the worker threads."""
    cfg = settings.snapshot()
    dev = None
    if cuda.available():
        dev = cuda.current_device() if device is None else device
        # Worked out here, before the ring: side by side with the ring's set-up (another thread)
        # it made that set-up slower by as much as it saved on the H200 machine.
        direct_route()
    prepare(dev, cfg.threads, cfg.chunk_size, cfg.pinned_budget, cfg.alignment, workers)


def stop_workers() -> None:
    """Stop the worker threads, letting the work they hold finish."""
    with _exec_lock:
        found = [_executors.pop(kind, None) for kind in ("req", "io")]
    for item in found:
        if item is not None:
            item[0].shutdown(wait=True)


def shutdown() -> None:
    """Stop worker threads and free all lanes."""
    stop_workers()
    lanes.release_idle()


def _leave_driver() -> None:
    """Before gdskit moves to another CUDA driver (``cuda.use_driver``): the workers stop and the
    lanes made on the driver left (streams, pinned memory) are freed while it is still there."""
    shutdown()
    lanes.forget_register_error()


cuda.on_driver_change(_leave_driver)

# Workers stop before the cuFile driver closes; the pinned stages go after it, CUDA still running.
at_exit(STOP_WORK, stop_workers)
at_exit(FREE_MEMORY, lambda: lanes.release_idle())
