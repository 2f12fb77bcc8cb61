"""``preload``: whole files into memory on a device at job start, ``.npy`` arrays as their tensors."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from gdskit.data import npy
from gdskit.data.errors import TruncatedFileError
from gdskit.data.layout import Layout, batch_view, from_numpy
from gdskit.data.read import FileReads, Job, abandon, engine_view, target_device, wait
from gdskit.data.sources import Files, Source, resolve
from gdskit.formats._engine import open_file, stats, stats_delta, worker_threads
from gdskit.formats._gc import collector_paused
from gdskit.formats.progress import Progress, ProgressArg

__all__ = ["preload"]


def _is_npy(src: Source) -> bool:
    return src.path.lower().endswith(".npy")


def _layout_and_offset(src: Source) -> tuple[Layout, int]:
    """A file's tensor layout and where its bytes start: an ``.npy`` file's array, or all of any other file."""
    if not _is_npy(src):
        return Layout(torch.uint8, (src.size,)), 0
    h, size = npy.read_header(src.path)
    if size < h.data_offset + h.nbytes:
        raise TruncatedFileError(f"{src.path}: {size} bytes, but its header describes {h.data_offset + h.nbytes}")
    return from_numpy(h.dtype, h.shape, h.fortran_order), h.data_offset


def jobs_at_once() -> int:
    """Files read at once: enough to keep every engine worker busy with small files, few enough
    to bound the open descriptors."""
    return max(4, 2 * worker_threads())


def read_files(reads: list[tuple[FileReads, Any]], on_bytes: Callable[[int], None] | None = None,
               at_once: int | None = None) -> None:
    """Read many files into their destinations, each file one engine job (``pread_many``), at most
    ``at_once`` files open and under way; every read checked for its full length.

    A small multi-file job: the engine's jobs are per file. Each ``(FileReads, view)`` pair
    names the reads of one file into one engine buffer view.
    """
    limit = at_once or jobs_at_once()
    running: deque[tuple[Any, Job]] = deque()

    def finish_oldest() -> None:
        f, job = running.popleft()
        try:
            wait([job])
        finally:
            f.close()

    try:
        for r, view in reads:
            if not r.items:
                continue
            while len(running) >= limit:
                finish_oldest()
            f = open_file(r.source.path)
            try:
                fut = f.pread_many([(view, n, off, bo) for n, off, bo in r.items], on_bytes=on_bytes)
            except BaseException:
                f.close()
                raise
            running.append((f, Job(r, fut)))
        while running:
            finish_oldest()
    except BaseException:
        abandon([job for _f, job in running])
        for f, _job in running:
            f.close()
        raise


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
    sources = resolve(files)
    layouts = [_layout_and_offset(s) for s in sources]  # every header checked before anything is read
    total = sum(lay.nbytes for lay, _ in layouts)
    before = stats()
    raws = [torch.empty(lay.nbytes, dtype=torch.uint8, device=dev) for lay, _ in layouts]
    if dev.type == "cuda":
        # Blocks torch's allocator hands out may still be used by queued work; the engine
        # writes from its own streams. One wait for the device covers every read.
        torch.cuda.synchronize(dev)
    reads = [(FileReads(s, ((lay.nbytes, off, 0),) if lay.nbytes else ()), engine_view(raw))
             for s, (lay, off), raw in zip(sources, layouts, raws)]
    with Progress(total, progress, "preloading") as prog:
        read_files(reads, prog.advance)
    out = {s.key: batch_view(raw, 1, lay)[0] for s, (lay, _), raw in zip(sources, layouts, raws)}
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()  # byte swaps, if any, are done when this returns
    if return_stats:
        return out, stats_delta(before, stats())
    return out
