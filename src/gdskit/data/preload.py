"""``preload``: whole files into memory on a device at job start, ``.npy`` arrays as their tensors."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from gdskit.data import npy
from gdskit.data.errors import TruncatedFileError
from gdskit.data.layout import Layout, from_numpy, sample_view
from gdskit.data.read import FileReads, engine_views, target_device
from gdskit.data.sources import Files, Source, iter_resolve
from gdskit.durable import open_file_fd
from gdskit.formats._engine import read_files as engine_read_files
from gdskit.formats._engine import read_whole_files as engine_read_whole_files
from gdskit.formats._engine import (first_page_cached, no_wait, start_warm_up, stats, stats_delta,
                                    whole_file_limit, worker_threads)
from gdskit.formats._gc import collector_paused
from gdskit.formats.progress import Progress, ProgressArg
from gdskit.plan import spread

__all__ = ["preload"]


def _is_npy(src: Source) -> bool:
    return src.path.lower().endswith(".npy")


def _layout_and_offset(src: Source, whole_file_ahead: int = 0) -> tuple[Layout, int]:
    """A file's tensor layout and where its bytes start: an ``.npy`` file's array, or all of any other file.
    A file of at most ``whole_file_ahead`` bytes is asked into the page cache whole meanwhile."""
    if not _is_npy(src):
        if 0 < src.size <= whole_file_ahead:
            _read_ahead(src)
        return Layout(torch.uint8, (src.size,)), 0
    h, size = npy.read_header(src.path, whole_file_ahead=whole_file_ahead)
    if size < h.data_offset + h.nbytes:
        raise TruncatedFileError(f"{src.path}: {size} bytes, but its header describes {h.data_offset + h.nbytes}")
    return from_numpy(h.dtype, h.shape, h.fortran_order), h.data_offset


def _read_ahead(src: Source) -> None:
    """Ask the kernel to bring the whole file into the page cache; advice only (the read that
    follows reports any error)."""
    try:
        fd, _st = open_file_fd(src.path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, src.size, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


#: Headers sampled, spread over the list, to choose how they are all read. From the page cache
#: they are read one after another (about 13 µs each; threads would only take turns at the
#: interpreter, two to three times slower); where any sampled one is not cached, on the engine's
#: threads, so that the disk has many reads at once.
HEADER_SAMPLE = 8
#: From the disk, files up to this size are asked into the page cache whole as their headers are
#: read: one request a file instead of two (the header's, then the array's), and the reads after
#: come from the page cache (where one worker serves many small files best).
WHOLE_FILE_AHEAD = 1 << 20


Failure = tuple[int, BaseException]  # (the file's place in the list, its error)


def _layouts(sources: list[Source]) -> tuple[list[tuple[Layout, int]], Failure | None]:
    """Every file's layout and data offset, in order, up to the first bad file (in order), whose
    place and error come second."""
    npys = [s for s in sources if _is_npy(s)]
    threads = min(worker_threads(), len(npys) // HEADER_SAMPLE)
    sample = [npys[i].path for i in spread(len(npys), HEADER_SAMPLE)]
    if threads < 2 or not any(first_page_cached(p) is False for p in sample):
        return _part_layouts(sources, 0, 0)
    per = -(-len(sources) // threads)
    with ThreadPoolExecutor(threads, thread_name_prefix="gdskit-headers") as pool:
        parts = [pool.submit(_part_layouts, sources[k:k + per], k, WHOLE_FILE_AHEAD)
                 for k in range(0, len(sources), per)]
    out: list[tuple[Layout, int]] = []
    for part in parts:
        lays, bad = part.result()
        out.extend(lays)
        if bad is not None:
            return out, bad
    return out, None


def _part_layouts(sources: list[Source], first: int, whole_file_ahead: int) -> tuple[list[tuple[Layout, int]],
                                                                                     Failure | None]:
    out = []
    for k, s in enumerate(sources):
        try:
            out.append(_layout_and_offset(s, whole_file_ahead))
        except Exception as exc:  # noqa: BLE001 - raised by the caller, first in list order
            return out, (first + k, exc)
    return out, None


#: Files up to this size are read whole into GPU memory, header and array in one read
#: (:mod:`gdskit.whole_files`); larger ones have their headers read first and are striped
#: over the engine's workers by the many-file job.
WHOLE_FILE_MAX = 1 << 20


#: Small files handed to the whole-file reader at a time while the listing goes on, the first
#: batch soonest, each next one twice as many, up to the last: the reads of the first files start
#: while the rest are stat'ed (100,000 files from the disk took about a second to list, one stat
#: after another), and each batch is one engine job (its first stage is read without read-ahead).
LISTED_FIRST, LISTED_MOST = 256, 8192


class _WholeReader:
    """Small files read whole on a thread of their own while the caller lists the rest: each
    file's tensor made as its bytes arrive (the tensor, or ``(bytes, layout)`` where its bytes
    must be swapped once they have landed), by the file's place in the list; the failed files'
    ``(place, error)``. After a failure no further batch is read."""

    def __init__(self, dev: Any, on_bytes: Callable[[int], None]) -> None:
        self.made: dict[int, Any] = {}
        self.failed: list[Failure] = []
        self._dev, self._on_bytes = dev, on_bytes
        self._todo: queue.SimpleQueue[list[tuple[int, Source]] | None] = queue.SimpleQueue()
        self._stop_after: int | None = None
        self._thread = threading.Thread(target=self._run, name="gdskit-preload-whole", daemon=True)
        self._thread.start()

    def add(self, batch: list[tuple[int, Source]]) -> None:
        self._todo.put(batch)

    def stop_after(self, place: int) -> None:
        """Files after ``place`` need not be read (a file there failed)."""
        self._stop_after = place

    def finish(self) -> None:
        """Wait until every batch added is read or skipped (again: at once)."""
        if self._thread.is_alive():
            self._todo.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (batch := self._todo.get()) is not None:
            if self.failed or (self._stop_after is not None and batch[0][0] > self._stop_after):
                continue
            try:
                self._read(batch)
            except BaseException as exc:  # noqa: BLE001 - the caller raises it, in list order
                self.failed.append((batch[0][0], exc))

    def _read(self, batch: list[tuple[int, Source]]) -> None:
        made, dev = self.made, self._dev

        def place(i: int, data: memoryview) -> tuple[tuple[int, int, int], ...]:
            k, src = batch[i]
            lay, off = _layout_in(src, data)
            raw = torch.empty(lay.nbytes, dtype=torch.uint8, device=dev)
            # Views cost no kernel: made here, while other files' reads are at the disk.
            made[k] = (raw, lay) if lay.byteswap else sample_view(raw, lay)
            return ((raw.data_ptr(), off, lay.nbytes),) if lay.nbytes else ()

        failed: list[Failure] = []
        engine_read_whole_files([s.path for _k, s in batch], [s.size for _k, s in batch], dev.index, place,
                                self._on_bytes, failed)
        self.failed.extend((batch[i][0], exc) for i, exc in failed)


class _Later:
    """Bytes done before the total is known (while the files are listed), handed to the
    progress once it is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = 0
        self._to: Callable[[int], None] | None = None

    def __call__(self, nbytes: int) -> None:
        with self._lock:
            to = self._to
            if to is None:
                self._done += nbytes
                return
        to(nbytes)

    def attach(self, advance: Callable[[int], None]) -> None:
        with self._lock:
            done, self._to = self._done, advance
        if done:
            advance(done)


def _layout_in(src: Source, data: memoryview) -> tuple[Layout, int]:
    """A whole file's layout and where its bytes start, from its bytes as read."""
    if len(data) < src.size:
        raise TruncatedFileError(f"{src.path}: read {len(data)} of its {src.size} bytes; the file is shorter "
                                 "than when it was listed (truncated or shrank)")
    if not _is_npy(src):
        return Layout(torch.uint8, (src.size,)), 0
    h = npy.header_of(src.path, data)
    if src.size < h.data_offset + h.nbytes:
        raise TruncatedFileError(f"{src.path}: {src.size} bytes, but its header describes {h.data_offset + h.nbytes}")
    return from_numpy(h.dtype, h.shape, h.fortran_order), h.data_offset


def read_files(reads: list[tuple[FileReads, Any]], on_bytes: Callable[[int], None] | None = None) -> None:
    """Read many files into their destinations as one engine job (``gdskit.many_files``: the
    files' chunks share the engine's workers, each file open only while it is read); every
    read checked for its full length.

    Each ``(FileReads, view)`` pair names the reads of one file into one engine buffer view.
    A file shorter than it was when listed raises :class:`TruncatedFileError` (named).
    """
    jobs = [(r, view) for r, view in reads if r.items]
    counts = engine_read_files([(r.source.path, [(view, n, off, bo) for n, off, bo in r.items])
                                for r, view in jobs], on_bytes)
    for (r, _view), got in zip(jobs, counts):
        for (n, off, _bo), m in zip(r.items, got):
            if m != n:
                raise TruncatedFileError(
                    f"{r.source.path}: read {m} of {n} bytes at offset {off}; the file is shorter than its "
                    f"{r.source.size} bytes when it was listed (truncated or shrank)")


def preload(files: Files, device: Any = "cuda:0", *, progress: ProgressArg = None,
            return_stats: bool = False) -> Any:
    """Read whole files into tensors on ``device``.

    Parameters
    ----------
    files : a list of paths, a directory (recursively) or a glob
    device : ``"cuda:0"``, ``"cpu"``, a ``torch.device`` or a GPU index
    progress : bool, callable or None
        None: a bar on stderr when it is a terminal and the preload takes over 2 s; True:
        always; False: none; a callable gets ``(bytes_done, bytes_total)``.
    return_stats : also return the ledger's delta of this preload

    Returns
    -------
    dict[str, torch.Tensor]
        By key: the path as given (relative to a directory given). ``.npy`` files become
        tensors of their dtype and shape (Fortran-order ones with Fortran strides, as numpy
        gives them); other files ``uint8`` tensors of their bytes. Each tensor owns its memory.

    Raises
    ------
    gdskit.errors.GdskitFileNotFoundError, gdskit.errors.GdskitPermissionError
        A file is missing or unreadable (named).
    NpyHeaderError, ObjectDtypeError, UnsupportedDtypeError, TruncatedFileError
        An ``.npy`` file's header is invalid or its dtype unsupported, or a file is shorter
        than its header says or than it was when listed. Nothing is returned.
    """
    with collector_paused():
        return _preload(files, device, progress, return_stats)


def _preload(files: Files, device: Any, progress: ProgressArg, return_stats: bool) -> Any:
    dev = target_device(device)
    listing = iter_resolve(files)
    whole_max = min(WHOLE_FILE_MAX, whole_file_limit(dev.index)) if dev.type == "cuda" else 0
    before = stats()
    later = _Later()
    reader = None
    sources: list[Source] = []
    rest: list[int] = []  # the places of the files read by the many-file job
    try:
        if whole_max:
            # Blocks torch's allocator hands out may still be used by queued work; the engine
            # writes from its own streams. One wait for the device covers every read.
            torch.cuda.synchronize(dev)
            reader = _WholeReader(dev, later)
        batch: list[tuple[int, Source]] = []
        size = LISTED_FIRST
        for src in listing:  # the small files' reads start while the rest are listed
            if reader is not None and src.size <= whole_max:
                batch.append((len(sources), src))
                if len(batch) >= size:
                    reader.add(batch)
                    batch, size = [], min(2 * size, LISTED_MOST)
            else:
                rest.append(len(sources))
            sources.append(src)
        if batch:
            reader.add(batch)  # type: ignore[union-attr]
        layouts, bad = _layouts([sources[k] for k in rest])  # the larger files' headers
        failures = [] if bad is None else [(rest[bad[0]], bad[1])]
        if reader is not None and failures:
            reader.stop_after(failures[0][0])
        whole_bytes = sum(s.size for s in sources) - sum(sources[k].size for k in rest)
        total = whole_bytes + sum(lay.nbytes for lay, _ in layouts)
        with Progress(total, progress, "preloading") as prog:
            later.attach(prog.advance)
            if reader is not None:
                reader.finish()
                failures += reader.failed
            if failures:
                raise min(failures, key=lambda f: f[0])[1]
            # The engine's pinned stages are made in the background while the tensors are allocated.
            wait_for_warm_up = (start_warm_up(dev.index, sum(lay.nbytes for lay, _ in layouts))
                                if dev.type == "cuda" and rest else no_wait)
            try:
                raws = [torch.empty(lay.nbytes, dtype=torch.uint8, device=dev) for lay, _ in layouts]
                if dev.type == "cuda" and raws:
                    torch.cuda.synchronize(dev)
            finally:
                wait_for_warm_up()
            if raws:
                reads = [(FileReads(sources[k], ((lay.nbytes, off, 0),) if lay.nbytes else ()), view)
                         for k, (lay, off), view in zip(rest, layouts, engine_views(raws))]
                read_files(reads, prog.advance)
    except BaseException:
        if reader is not None:
            reader.stop_after(-1)  # the batches not yet begun are not read
        raise
    finally:
        if reader is not None:
            reader.finish()  # after an error too: no read may still be writing into a tensor
    made = reader.made if reader is not None else {}
    for k, raw, (lay, _off) in zip(rest, raws, layouts):
        made[k] = sample_view(raw, lay)
    out = {}
    for k, s in enumerate(sources):
        t = made[k]
        out[s.key] = sample_view(*t) if isinstance(t, tuple) else t
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()  # byte swaps, if any, are done when this returns
    if return_stats:
        return out, stats_delta(before, stats())
    return out
