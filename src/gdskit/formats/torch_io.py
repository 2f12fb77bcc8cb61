"""Run a :class:`~gdskit.formats.read_plan.ReadPlan` with torch tensors as destinations.

Shared by :mod:`gdskit.safetensors` and :mod:`gdskit.torch`; imports torch, so
only those modules import it.

- Direct extents are read by the engine straight into their destination's own
  memory, all submitted at once (the engine spreads each large read over its
  worker pool).
- Groups of small extents on a GPU are read as one engine request each whose bytes the
  engine's CPU path scatters straight into every member's own memory (a
  :class:`~gdskit.engine.buffers.ScatterList`): no staging memory on the device and no copy out of
  it. Groups are submitted a few at a time, so the reads run while the next destinations are
  made.
- Elsewhere (host memory; ``mode="cufile"``, which needs one buffer per request) groups are
  read into a ring of ``depth`` staging buffers on the destination device and split with one
  batched copy per group (``torch._foreach_copy_`` / ``torch._foreach_clone``). The ring
  bounds the extra memory to ``depth * plan.staging_bytes``.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

import torch

from gdskit.engine import (ScatterList, can_scatter, no_wait, scattered_device_view, scattered_hot_workers,
                                    spread, start_warm_up, synchronized_device_view,
                                    synchronized_device_views)
from gdskit.formats.device_memory import reserve_device_memory
from gdskit.formats.progress import Progress
from gdskit.formats.read_plan import Extent, Group, ReadPlan
from gdskit.formats.safetensors_format import TruncatedFileError


def _engine_buffer(t: torch.Tensor) -> Any:
    """What the engine is handed for destination ``t``: CUDA tensors as ready views (``execute``
    has synchronised the current stream, so no per-request producer wait is needed)."""
    if t.is_cuda:
        return synchronized_device_view(t.data_ptr(), t.numel() * t.element_size(), t)
    return _flat_bytes_view(t)


def _engine_buffers(made: list[torch.Tensor], device: torch.device) -> list[Any]:
    """:func:`_engine_buffer` of each tensor ``execute`` made itself on ``device``: torch's one
    allocator made them all on one device, so the driver is asked what the memory is once, for
    the first, instead of once each (about 12 µs a question, longer while the warm-up registers
    the pinned stages: docs/engine.md, "Measurements behind the defaults")."""
    if device.type != "cuda":
        return [_flat_bytes_view(t) for t in made]
    return synchronized_device_views([(t.data_ptr(), t.numel() * t.element_size(), t) for t in made])


def has_plain_bytes(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory simply holds its values (not sparse, quantized or on the meta device)."""
    return t.layout is torch.strided and not t.is_quantized and t.device.type != "meta"


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor over contiguous memory (a copy only when ``t`` is not contiguous)."""
    t = t.detach()
    return (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)


def _check(n: int, want: int, what: str) -> None:
    if n != want:
        raise TruncatedFileError(f"short read of {what}: got {n} of {want} bytes "
                                 "(the file is truncated or shrank while being read)")


def wait_for_all(futures: Iterable[concurrent.futures.Future[Any] | None]) -> None:
    """Let every submitted I/O finish before its memory can be freed, whatever failed: the
    wait goes on through a KeyboardInterrupt (or any exception a signal handler raises),
    which is raised once nothing is left under way."""
    pending = [f for f in futures if f is not None]
    interrupted: BaseException | None = None
    while pending:
        try:
            concurrent.futures.wait(pending)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, once the I/O has ended
            interrupted = exc
        pending = [f for f in pending if not f.done()]
    if interrupted is not None:
        raise interrupted


def _clone_all(srcs: list[torch.Tensor]) -> list[torch.Tensor]:
    # On the GPU batched calls save a launch per tensor; on the CPU a plain loop is as fast and
    # avoids the batched ops' slow CPU fallback. Where torch has no _foreach_clone (2.11), the
    # byte views are copied by adding 0: new tensors, each owning its memory, made in C++
    # (cheaper than empty_like plus one _foreach_copy_: docs/engine.md).
    if not srcs or srcs[0].device.type != "cuda":
        return [s.clone() for s in srcs]
    fn = getattr(torch, "_foreach_clone", None)
    if fn is not None:
        return list(fn(srcs))
    return list(torch._foreach_add(srcs, 0))  # byte views of the staging ring: adding 0 copies them exactly


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    fn = getattr(torch, "_foreach_copy_", None)
    if fn is not None and srcs and srcs[0].device.type == "cuda":
        fn(dsts, srcs)
        return
    for d, s in zip(dsts, srcs):
        d.copy_(s)


def _flat_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``t``'s memory as a flat uint8 tensor (``t`` itself where it is one)."""
    if t.dtype is torch.uint8 and t.dim() == 1:
        return t
    return t.detach().reshape(-1).view(torch.uint8)


def _memmove(dst: int, src: int, n: int) -> None:
    ctypes.memmove(dst, src, n)


class _Split:
    """How one group's staging bytes split into member tensors (gaps are dropped)."""

    def __init__(self, group: Group) -> None:
        sizes: list[int] = []
        keep: list[int] = []
        pos = group.file_offset
        for m in group.members:
            if m.file_offset > pos:
                sizes.append(m.file_offset - pos)
            keep.append(len(sizes))
            sizes.append(m.nbytes)
            pos = m.end
        self.sizes = sizes
        self.keep = keep


#: Groups submitted to the engine as one job when their reads scatter: enough bytes to keep
#: every worker busy while the main thread makes the next groups' tensors.
SCATTER_BATCH_BYTES = 128 << 20
#: Scattered jobs under way at once when the page cache holds the groups: the engine gives
#: each such job a few workers (its per-copy Python shares the interpreter with the thread
#: making the tensors), and more jobs at once would bring back the crowd. From the disk,
#: every job is submitted as soon as its tensors exist, to keep the disk busy.
SCATTER_JOBS_HOT = 1

#: Where a caller asks to hear of tensors landed early (``execute(landed=...)``), the last
#: direct extents holding at least this share of the direct bytes are read as a second job,
#: submitted once the first has started: the first job's tensors are handed over while the
#: second's reads run (a verified load hashes them on the GPU meanwhile). A worker moves from
#: one job to the next as it runs out of chunks, so the reads do not drain between them.
LANDED_TAIL_SHARE = 1 / 8
#: Direct bytes below which nothing is handed over early (the work it would hide is too small).
LANDED_MIN_BYTES = 64 << 20


def landed_split(direct: tuple[Extent, ...]) -> int:
    """How many of ``direct`` (in file order) are read, and handed over, before the rest: the
    tail holds at least :data:`LANDED_TAIL_SHARE` of their bytes; 0 where nothing is split
    (fewer than two extents, or fewer than :data:`LANDED_MIN_BYTES`)."""
    total = sum(e.nbytes for e in direct)
    if len(direct) < 2 or total < LANDED_MIN_BYTES:
        return 0
    tail, cut = 0, len(direct)
    while cut > 1 and tail < total * LANDED_TAIL_SHARE:
        cut -= 1
        tail += direct[cut].nbytes
    return cut


def _uint8_alloc(device: torch.device) -> Callable[[Extent], torch.Tensor]:
    return lambda e: torch.empty(e.nbytes, dtype=torch.uint8, device=device)


def execute(f: Any, plan: ReadPlan, device: torch.device, *,
            dests: Mapping[Hashable, torch.Tensor] | None = None,
            alloc: Callable[[Extent], torch.Tensor] | None = None,
            progress: Progress | None = None, depth: int = 4,
            scatter: bool | None = None,
            landed: Callable[[dict[Hashable, torch.Tensor]], None] | None = None) -> dict[Hashable, torch.Tensor]:
    """Read every extent of ``plan`` from the open engine file ``f``.

    Parameters
    ----------
    dests : mapping, optional
        Preallocated contiguous destinations by key (each exactly the extent's size, of any
        dtype and shape).
    alloc : callable, optional
        ``alloc(extent)`` makes the destination of an extent without one in ``dests`` on a GPU:
        a new contiguous tensor on ``device`` of exactly ``extent.nbytes`` bytes, of any dtype
        and shape (a loader makes the final tensor at once). Default, and always in host
        memory: a 1-D uint8 tensor.
    depth : int
        Staging buffers of the ring, where groups are not scattered.
    scatter : bool, optional
        On a GPU, whether groups are scattered by the engine straight into their members
        (default: wherever the engine can) or read through the staging ring and split on the
        device (False).
    landed : callable, optional
        ``landed(tensors)`` (key -> tensor) is called on this thread with the first direct
        extents' tensors once their bytes are in place, while the last ones
        (:func:`landed_split`) are still being read, so that the caller can queue work on them
        (a verified load on a GPU queues their hash); not called where nothing is split. An
        error it raises ends the load.

    Returns
    -------
    dict
        key -> the tensor holding the extent's bytes (the caller views a uint8 one as it needs).
    """
    dests = dests or {}
    out: dict[Hashable, torch.Tensor] = {}
    on_cuda = device.type == "cuda"
    make = alloc if (alloc is not None and on_cuda) else _uint8_alloc(device)
    scatter = on_cuda and bool(plan.groups) and can_scatter() and scatter is not False

    def dest_for(e: Extent) -> torch.Tensor:
        t = dests.get(e.key)
        if t is None:
            t = make(e)
        out[e.key] = t
        return t

    wait_for_warm_up = no_wait
    index = 0
    groups_hot = scatter and _held_in_page_cache(f, plan.groups)
    # Where every small tensor has its destination already (load_into), this thread makes none
    # while the groups are read: their jobs need not leave it the interpreter.
    groups_given = bool(dests) and all(m.key in dests for g in plan.groups for m in g.members)
    if on_cuda:
        index = device.index if device.index is not None else torch.cuda.current_device()
        # Where hot small tensors hold most of the bytes, set up only the staging of the few
        # workers their reads get; reads of the large tensors make any other lanes they need.
        few = groups_hot and not groups_given and plan.group_bytes > plan.direct_bytes
        wait_for_warm_up = start_warm_up(index, plan.read_bytes, scattered_hot_workers() if few else None)
    made_here = [e for e in plan.direct if e.key not in dests]  # the direct tensors this call makes
    try:
        if on_cuda:
            # Blocks torch's caching allocator hands out, and given destinations, may still be in use
            # by queued work; the engine writes from its own streams or threads. One wait here, for
            # the whole device, covers every request below (which then skip their own waits).
            torch.cuda.synchronize(device)
            # Group members are small (below every caller's 1 MiB threshold: torch's small pool), so
            # only the direct tensors and the staging ring count.
            fresh = [e.nbytes for e in made_here]
            if not scatter:
                fresh += [plan.staging_bytes] * min(depth, len(plan.groups))
            reserve_device_memory(device, fresh)
        for e in plan.empty:
            dest_for(e)
        ring: list[torch.Tensor] = []
        if plan.groups and not scatter:
            nbuf = min(depth, len(plan.groups))
            ring = [torch.empty(plan.staging_bytes, dtype=torch.uint8, device=device) for _ in range(nbuf)]
        views = dict(zip((e.key for e in made_here), _engine_buffers([dest_for(e) for e in made_here], device)))
        views.update((e.key, _engine_buffer(dest_for(e))) for e in plan.direct if e.key in dests)
        reads = [(views[e.key], e.nbytes, e.file_offset) for e in plan.direct]
    finally:
        wait_for_warm_up()

    futures: list[concurrent.futures.Future[Any]] = []
    try:
        # Every direct extent in one engine job (File.pread_many): the workers keep their
        # lanes from tensor to tensor, where separate jobs would hand them over and drain them
        # at every boundary. The small-tensor groups are read meanwhile.
        job: concurrent.futures.Future[list[int]] | None = None
        on_bytes = progress.advance if progress is not None else None
        cut = landed_split(plan.direct) if landed is not None else 0
        early: concurrent.futures.Future[list[int]] | None = None
        if cut:
            early = _first_job(f, reads[:cut], on_bytes)
            futures.append(early)
            reads = reads[cut:]
        if reads:
            job = f.pread_many(reads, on_bytes=on_bytes)
            futures.append(job)
        if scatter:
            _scatter_groups(f, plan.groups, dest_for, index, on_bytes, futures,
                            SCATTER_JOBS_HOT if groups_hot and not groups_given else len(plan.groups),
                            source_cached=groups_hot, caller_busy=not groups_given)
        else:
            _run_groups(f, plan.groups, ring, out, dests, device, progress, futures)
        if early is not None and landed is not None:
            for e, n in zip(plan.direct[:cut], early.result()):
                _check(n, e.nbytes, f"{e.key!r} of {f.path}")
            landed({e.key: out[e.key] for e in plan.direct[:cut]})
        if job is not None:
            for e, n in zip(plan.direct[cut:], job.result()):
                _check(n, e.nbytes, f"{e.key!r} of {f.path}")
    except BaseException:
        wait_for_all(futures)
        if on_cuda:
            torch.cuda.current_stream(device).synchronize()
        raise
    return out


def _first_job(f: Any, reads: list[tuple[Any, int, int]],
               on_bytes: Callable[[int], None] | None) -> concurrent.futures.Future[list[int]]:
    """``reads`` submitted as one engine job, returned once its first bytes have landed (or it has
    ended): a job submitted after it then queues behind its workers, not ahead of them."""
    begun = threading.Event()

    def counted(n: int) -> None:
        begun.set()
        if on_bytes is not None:
            on_bytes(n)

    job = f.pread_many(reads, on_bytes=counted)
    job.add_done_callback(lambda _job: begun.set())
    begun.wait()
    return job


#: Groups, spread over a plan, whose page-cache residency says whether the page cache holds them
#: all: one question about the whole span of a 20,000-tensor file took about 20 ms on the H200
#: machine, a tenth of its hot load. A partly cached file passes for cached only if every sampled
#: group is held; it is then read by fewer workers, still correctly.
CACHED_GROUP_SAMPLES = 16


def _held_in_page_cache(f: Any, groups: tuple[Group, ...]) -> bool:
    if not groups:
        return False
    return all(f.cached(groups[i].file_offset, groups[i].nbytes) for i in spread(len(groups), CACHED_GROUP_SAMPLES))


def _scatter_groups(f: Any, groups: tuple[Group, ...], dest_for: Callable[[Extent], torch.Tensor],
                    device: int, on_bytes: Callable[[int], None] | None,
                    futures: list[concurrent.futures.Future[Any]], jobs_at_once: int, *,
                    source_cached: bool | None = None, caller_busy: bool = True) -> None:
    """Read each group of GPU ``device`` in one request whose bytes land straight in its
    members' tensors; about SCATTER_BATCH_BYTES of groups go to the engine as one job, at
    most ``jobs_at_once`` jobs under way (the next one's tensors are made meanwhile).
    ``source_cached``: whether the page cache holds all the groups' bytes, where asked (the
    engine then does not ask again for each job). ``caller_busy``: whether ``dest_for`` makes
    tensors (False: every member has one already)."""
    jobs: deque[tuple[list[Group], concurrent.futures.Future[list[int]]]] = deque()

    def finish_oldest() -> None:
        batch, fut = jobs.popleft()
        for g, n in zip(batch, fut.result()):
            _check(n, g.nbytes, f"{len(g.members)} tensors at offset {g.file_offset} of {f.path}")

    batch: list[Group] = []
    reads: list[tuple[Any, int, int]] = []
    pending = 0
    for i, g in enumerate(groups):
        members = [dest_for(m) for m in g.members]
        targets = ScatterList((m.file_offset - g.file_offset, t.data_ptr(), m.nbytes)
                              for m, t in zip(g.members, members))
        reads.append((scattered_device_view(targets, g.nbytes, device, members, source_cached=source_cached,
                                            caller_busy=caller_busy), g.nbytes, g.file_offset))
        batch.append(g)
        pending += g.nbytes
        if pending >= SCATTER_BATCH_BYTES or i == len(groups) - 1:
            while len(jobs) >= jobs_at_once:
                finish_oldest()
            fut = f.pread_many(reads, on_bytes=on_bytes)
            futures.append(fut)
            jobs.append((batch, fut))
            batch, reads, pending = [], [], 0
    while jobs:
        finish_oldest()


def _run_groups(f: Any, groups: tuple[Group, ...], ring: list[torch.Tensor],
                out: dict[Hashable, torch.Tensor], dests: Mapping[Hashable, torch.Tensor],
                device: torch.device, progress: Progress | None,
                futures: list[concurrent.futures.Future[int]]) -> None:
    on_cuda = device.type == "cuda"
    ring_views = [_engine_buffer(r) for r in ring]
    free: deque[tuple[int, Any]] = deque((i, None) for i in range(len(ring)))
    pending: deque[tuple[Group, int, concurrent.futures.Future[int]]] = deque()
    it = iter(groups)
    exhausted = False
    while True:
        while free and not exhausted:
            g = next(it, None)
            if g is None:
                exhausted = True
                break
            slot, event = free.popleft()
            if event is not None:
                event.synchronize()  # the previous split out of this buffer has finished
            fut = f.pread(ring_views[slot], size=g.nbytes, file_offset=g.file_offset)
            futures.append(fut)
            pending.append((g, slot, fut))
        if not pending:
            return
        g, slot, fut = pending.popleft()
        _check(fut.result(), g.nbytes, f"{len(g.members)} tensors at offset {g.file_offset} of {f.path}")
        members = g.members
        fixed = [m for m in members if m.key in dests] if dests else []
        n_fresh = len(members) - len(fixed)
        if fixed and not on_cuda:  # host memory: copies between addresses, no tensor views to make
            base = ring[slot].data_ptr() - g.file_offset
            for m in fixed:
                d = dests[m.key]
                _memmove(d.data_ptr(), base + m.file_offset, m.nbytes)
                out[m.key] = d
            fixed = []
        if fixed or n_fresh:
            split = _Split(g)
            parts = torch.split_with_sizes(ring[slot][:g.nbytes], split.sizes)
            pairs = list(zip(members, (parts[i] for i in split.keep)))
            if fixed:
                to_fill = [(m, s) for m, s in pairs if m.key in dests]
                dst = [dests[m.key] for m, _ in to_fill]
                _copy_all([_flat_bytes_view(d) for d in dst], [s for _, s in to_fill])
                for (m, _), d in zip(to_fill, dst):
                    out[m.key] = d
            if n_fresh:
                fresh = [(m, s) for m, s in pairs if m.key not in dests]
                for (m, _), t in zip(fresh, _clone_all([s for _, s in fresh])):
                    out[m.key] = t
        event = None
        if on_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        free.append((slot, event))
        if progress is not None:
            progress.advance(sum(m.nbytes for m in g.members))
