"""Reading samples: scattered reads of a batch's samples straight into the rows of one buffer.

The reads of a batch are grouped by file, neighbouring samples that are also neighbours in
the batch merged into one read, and each file's reads go to the engine as one job
(:meth:`gdskit.File.pread_many`): the engine shares its workers among them and routes
device memory through its own paths. Nothing is copied sample by sample in Python.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gdskit.data.errors import SampleMismatchError, TruncatedFileError
from gdskit.data.layout import Layout, batch_view
from gdskit.data.sources import Source
from gdskit.formats._engine import BufferView, adapt, open_file, synchronized_device_view

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
        f = open_file(path)
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
        errors = []
        for f in files:
            try:
                f.close()
            except BaseException as exc:  # noqa: BLE001 - close the rest, raise the first
                errors.append(exc)
        if errors:
            raise errors[0]

    def __len__(self) -> int:
        return len(self._files)

    def __enter__(self) -> FileCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class FileReads:
    """The reads of one batch from one file: ``(nbytes, file_offset, buf_offset)`` each."""

    source: Source
    items: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class BatchPlan:
    """What one batch reads: ``count`` samples of ``layout``, ``nbytes`` in all, from ``reads``."""

    count: int
    layout: Layout
    reads: tuple[FileReads, ...]

    @property
    def nbytes(self) -> int:
        return self.count * self.layout.nbytes


def plan_batch(dataset: Any, indices: np.ndarray) -> BatchPlan:
    """The reads that put samples ``indices`` (dataset indices, in batch order) in rows 0, 1, ... of one buffer."""
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
    # Runs of samples that follow each other both in the file and in the batch: one read each.
    starts = np.ones(n, dtype=bool)
    starts[1:] = (files[1:] != files[:-1]) | (offsets[1:] != offsets[:-1] + nb)
    first = np.flatnonzero(starts)
    lengths = np.diff(np.append(first, n))
    run_files = files[first]
    order = np.argsort(run_files, kind="stable")
    by_file: dict[int, list[tuple[int, int, int]]] = {}
    for f, length, off, row in zip(run_files[order].tolist(), lengths[order].tolist(),
                                   offsets[first][order].tolist(), first[order].tolist()):
        by_file.setdefault(f, []).append((length * nb, off, row * nb))
    sources = dataset.sources
    return BatchPlan(n, layout, tuple(FileReads(sources[f], tuple(items)) for f, items in by_file.items()))


@dataclass
class Job:
    """One file's reads of a batch, submitted."""

    reads: FileReads
    future: concurrent.futures.Future[list[int]]


def submit(files: FileCache, plan: BatchPlan, view: BufferView,
           on_bytes: Callable[[int], None] | None = None) -> list[Job]:
    """Start every read of ``plan`` into ``view``; one engine job per file."""
    jobs: list[Job] = []
    try:
        for r in plan.reads:
            f = files.get(r.source.path)
            jobs.append(Job(r, f.pread_many([(view, n, off, bo) for n, off, bo in r.items], on_bytes=on_bytes)))
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
        for (n, off, _bo), got in zip(job.reads.items, counts):
            if got != n:
                first = TruncatedFileError(
                    f"{job.reads.source.path}: read {got} of {n} bytes at offset {off}; the file is shorter "
                    f"than its {job.reads.source.size} bytes when the dataset was made (truncated or shrank)")
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
    if raw.is_cuda:
        return synchronized_device_view(raw.data_ptr(), raw.numel(), raw)
    return adapt(raw)


def read_samples(dataset: Any, indices: np.ndarray, device: torch.device, files: FileCache) -> torch.Tensor:
    """Samples ``indices`` as one batch tensor on ``device`` (CPU, or a GPU with the whole device
    synchronised first), read now."""
    plan = plan_batch(dataset, indices)
    raw = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
    if raw.is_cuda:
        torch.cuda.synchronize(device)
    wait(submit(files, plan, engine_view(raw)))
    return batch_view(raw, plan.count, plan.layout)


def target_device(device: Any) -> torch.device:
    """The device batches go to: ``"cuda:0"``, ``"cuda"`` (the current GPU), an index, ``"cpu"``..."""
    from gdskit.errors import InvalidArgumentError

    try:
        dev = torch.device("cuda", device) if isinstance(device, int) and not isinstance(device, bool) \
            else torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        raise InvalidArgumentError(f"not a device: {device!r:.40}") from None
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"batches go to a CUDA GPU or the CPU, not {dev}")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev
