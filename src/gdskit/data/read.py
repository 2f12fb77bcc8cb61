"""Reading samples: scattered reads of a batch's samples straight into the rows of one buffer.

A batch's reads are planned with numpy (:func:`plan_batch`): neighbouring samples that are
also neighbours in the batch merged into one read, the reads of one file and one size one
group. Into host memory (a CPU batch, or the loader's pinned staging of a GPU batch) each
group is one :meth:`gdskit.File.read_batch` call (:func:`read_now`); batches of large reads go
to a GPU by the engine's device paths, one background job per group (:func:`submit`).
Nothing is copied sample by sample in Python.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gdskit.data.errors import SampleMismatchError, TruncatedFileError
from gdskit.data.layout import Layout, batch_view
from gdskit.data.sources import Source
from gdskit.errors import InvalidArgumentError, call_each
from gdskit.formats.device import torch_device
import gdskit.engine as engine  # its buffers and driver layer load with the first read, not with this module

if TYPE_CHECKING:
    from gdskit.engine import BufferView

#: Files a loader keeps open at once (the least recently used is closed first).
OPEN_FILES = 64


class FileCache:
    """Engine files opened by path and kept open, at most ``capacity`` of them; thread-safe."""

    def __init__(self, capacity: int = OPEN_FILES) -> None:
        self.capacity = capacity
        self._files: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, path: str) -> Any:
        with self._lock:
            f = self._files.get(path)
            if f is not None:
                self._files.move_to_end(path)
                return f
        f = engine.open_file(path)
        evicted = []
        with self._lock:
            other = self._files.get(path)
            if other is not None:  # opened meanwhile by another thread
                evicted.append(f)
                f = other
            else:
                self._files[path] = f
            while len(self._files) > self.capacity:
                evicted.append(self._files.popitem(last=False)[1])
        for old in evicted:
            old.close()  # waits for its reads under way
        return f

    def close(self) -> None:
        with self._lock:
            files = list(self._files.values())
            self._files.clear()
        call_each(lambda f: f.close(), files)

    def __len__(self) -> int:
        return len(self._files)

    def __enter__(self) -> FileCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class FileReads:
    """Reads from one file: ``(nbytes, file_offset, buf_offset)`` each (a preload's)."""

    source: Source
    items: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class ReadGroup:
    """Reads of one batch from one file, all of ``size`` bytes: ``file_offsets[i]`` into the
    batch's buffer at ``buf_offsets[i]`` (one ``File.read_batch`` call)."""

    source: Source
    size: int
    file_offsets: list[int]
    buf_offsets: list[int]

    @property
    def items(self) -> list[tuple[int, int, int]]:
        """``(nbytes, file_offset, buf_offset)`` of each read."""
        return [(self.size, off, bo) for off, bo in zip(self.file_offsets, self.buf_offsets)]


#: Batches whose reads are all at most this size, and that are at most ``STAGED_BATCH_MAX`` in
#: all, go to a GPU through the loader's pinned staging (host reads, then one copy); larger
#: reads go to the engine's device paths, where cuFile or the ring's parallel chunks serve them.
STAGED_READ_MAX = 1 << 20
STAGED_BATCH_MAX = 64 << 20


@dataclass(frozen=True)
class BatchPlan:
    """What one batch reads: ``count`` samples of ``layout``, ``nbytes`` in all, by ``groups``."""

    count: int
    layout: Layout
    groups: tuple[ReadGroup, ...]

    @property
    def nbytes(self) -> int:
        return self.count * self.layout.nbytes

    @property
    def largest_read(self) -> int:
        return max((g.size for g in self.groups), default=0)

    @property
    def staged(self) -> bool:
        """Whether the batch goes to a GPU through pinned staging (the one place this is decided)."""
        return self.largest_read <= STAGED_READ_MAX and self.nbytes <= STAGED_BATCH_MAX


def plan_batch(dataset: Any, indices: np.ndarray) -> BatchPlan:
    """The reads that put samples ``indices`` (dataset indices, in batch order) in rows 0, 1, ... of one
    buffer: runs of samples that follow each other both in the file and in the batch are one read,
    and the reads of one file and one size are one group. Index arithmetic in numpy, per batch."""
    idx = np.asarray(indices, dtype=np.int64)
    files, offsets = dataset.locate(idx)
    layout = dataset.layout
    if layout is None:  # .npy files of several layouts: a batch of one, or all alike
        kinds = {dataset._layouts[int(f)] for f in np.unique(files)}
        if len(kinds) > 1:
            raise SampleMismatchError(f"a batch of {len(idx)} samples mixes {len(kinds)} shapes or dtypes")
        layout = kinds.pop()
    nb = layout.nbytes
    n = len(idx)
    if n == 0 or nb == 0:
        return BatchPlan(n, layout, ())
    sources = dataset.sources
    if len(sources) == 1 and not (np.diff(offsets) == nb).any():
        # One file and no neighbours to merge (a shuffled batch of token windows): one read per
        # sample, in batch order. A third of the general planning's cost, paid per batch.
        return BatchPlan(n, layout, (ReadGroup(sources[0], nb, offsets.tolist(), list(range(0, n * nb, nb))),))
    starts = np.ones(n, dtype=bool)
    starts[1:] = (files[1:] != files[:-1]) | (offsets[1:] != offsets[:-1] + nb)
    first = np.flatnonzero(starts)
    sizes = np.diff(np.append(first, n)) * nb
    run_files, run_offsets, run_places = files[first], offsets[first], first * nb
    if run_files[0] == run_files[-1] and (run_files == run_files[0]).all() and (sizes == sizes[0]).all():
        # The common case (one file, no neighbours merged: a shuffled batch of token windows).
        return BatchPlan(n, layout, (ReadGroup(sources[int(run_files[0])], int(sizes[0]), run_offsets.tolist(),
                                               run_places.tolist()),))
    order = np.lexsort((sizes, run_files))  # by file, then size; stable: batch order within a group
    gf, gs = run_files[order], sizes[order]
    cut = np.flatnonzero((gf[1:] != gf[:-1]) | (gs[1:] != gs[:-1])) + 1
    bounds = np.concatenate(([0], cut, [len(order)])).tolist()
    offs, places = run_offsets[order].tolist(), run_places[order].tolist()
    fl, sl = gf.tolist(), gs.tolist()
    return BatchPlan(n, layout, tuple(ReadGroup(sources[fl[a]], sl[a], offs[a:b], places[a:b])
                                      for a, b in zip(bounds[:-1], bounds[1:])))


def _truncated(group: ReadGroup, offset: int, got: int) -> TruncatedFileError:
    return TruncatedFileError(
        f"{group.source.path}: read {got} of {group.size} bytes at offset {offset}; the file is shorter "
        f"than its {group.source.size} bytes when the dataset was made (truncated or shrank)")


def read_now(files: FileCache, plan: BatchPlan, view: BufferView) -> None:
    """Every read of ``plan`` into host memory ``view``, now, in this thread: one
    :meth:`gdskit.File.read_batch` per group (the host path's tight loop of system calls; the
    engine picks buffered or O_DIRECT per read by its policy). Raises the read's error, or
    :class:`TruncatedFileError` for a short read (a file that shrank since the dataset was made)."""
    for g in plan.groups:
        check_counts(g, files.get(g.source.path).read_batch(view, g.file_offsets, g.size, g.buf_offsets))


def check_counts(group: ReadGroup, counts: Sequence[int]) -> None:
    """Raise :class:`TruncatedFileError` for the first of ``group``'s reads that came back short."""
    if len(counts) and min(counts) < group.size:
        k = next(i for i, c in enumerate(counts) if c < group.size)
        raise _truncated(group, group.file_offsets[k], counts[k])


@dataclass
class Job:
    """One group's reads of a batch, submitted."""

    reads: ReadGroup
    future: concurrent.futures.Future[list[int]]


def submit(files: FileCache, plan: BatchPlan, view: BufferView,
           on_bytes: Callable[[int], None] | None = None) -> list[Job]:
    """Start every read of ``plan`` into ``view`` in the background; one engine job per group
    (for reads into device memory by the engine's device paths)."""
    jobs: list[Job] = []
    try:
        for g in plan.groups:
            f = files.get(g.source.path)
            jobs.append(Job(g, f.pread_many([(view, n, off, bo) for n, off, bo in g.items], on_bytes=on_bytes)))
    except BaseException:
        abandon(jobs)
        raise
    return jobs


def wait(jobs: Sequence[Job]) -> None:
    """Wait for every job; raise the first error, or :class:`TruncatedFileError` for a short read
    (a file that shrank since the dataset was made). Every job has finished when this returns."""
    first: BaseException | None = None
    for job in jobs:
        try:
            counts = job.future.result()
        except BaseException as exc:  # noqa: BLE001 - wait for the others before raising
            first = first or exc
            continue
        if first is not None:
            continue
        for off, got in zip(job.reads.file_offsets, counts):
            if got != job.reads.size:
                first = _truncated(job.reads, off, got)
                break
    if first is not None:
        raise first


def abandon(jobs: Sequence[Job]) -> None:
    """Cancel the jobs not yet started and wait for the others (their memory stays in use till then)."""
    for job in jobs:
        job.future.cancel()
    concurrent.futures.wait([job.future for job in jobs])


def engine_view(raw: torch.Tensor) -> BufferView:
    """The engine's view of a flat uint8 tensor, worked out once for all the reads into it. A CUDA
    tensor's producer work is the caller's to order (see the loader's stream hand-off)."""
    return engine_views([raw])[0]


def engine_views(raws: Sequence[torch.Tensor]) -> list[BufferView]:
    """:func:`engine_view` of each flat uint8 tensor, all made by ``torch.empty`` on one device:
    what the memory is is asked of the driver once for them all."""
    if raws and raws[0].is_cuda:
        return engine.synchronized_device_views([(r.data_ptr(), r.numel(), r) for r in raws])
    return [engine.adapt(r) for r in raws]


def read_samples(dataset: Any, indices: np.ndarray, device: torch.device, files: FileCache) -> torch.Tensor:
    """Samples ``indices`` as one batch tensor on ``device`` (CPU, or a GPU with the whole device
    synchronised first), read now."""
    plan = plan_batch(dataset, indices)
    raw = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
    if raw.is_cuda:
        torch.cuda.synchronize(device)
        wait(submit(files, plan, engine_view(raw)))
    else:
        read_now(files, plan, engine_view(raw))
    return batch_view(raw, plan.count, plan.layout)


def target_device(device: Any) -> torch.device:
    """The device batches go to: ``"cuda:0"``, ``"cuda"`` (the current GPU), an index, ``"cpu"``..."""
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) and not isinstance(device, bool) \
            else torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        raise InvalidArgumentError(f"not a device: {device!r:.40}") from None
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"batches go to a CUDA GPU or the CPU, not {dev}")
    if dev.type == "cuda":
        return torch_device(torch, dev)  # DeviceUnavailableError where this process has no such GPU
    return dev
