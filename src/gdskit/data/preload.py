"""``preload``: whole files into memory on a device at job start, ``.npy`` arrays as their tensors."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from gdskit.formats import npy_format as npy
from gdskit.data.errors import TruncatedFileError
from gdskit.data.layout import Layout, from_numpy, sample_view
from gdskit.data.read import FileReads, engine_views, target_device
from gdskit.data.sources import Files, Source, resolve
from gdskit.durable import open_file_fd
from gdskit.engine import read_files as engine_read_files
from gdskit.engine import read_whole_files as engine_read_whole_files
from gdskit.engine import (first_page_cached, is_object_url, no_wait, open_file, start_warm_up, stats,
                           stats_delta, whole_file_limit, worker_threads)
from gdskit.errors import InvalidArgumentError
from gdskit.formats import through_resident
from gdskit.formats.gc_pause import collector_paused
from gdskit.verify import OFF, VerifyMode, verify_mode
from gdskit.formats.progress import Progress, ProgressArg
from gdskit.engine.plan import spread
from gdskit.threads import executor

if TYPE_CHECKING:
    from gdskit.verify import Expectation

__all__ = ["preload"]


def _is_npy(src: Source) -> bool:
    return src.path.lower().endswith(".npy")


def _layout_and_offset(src: Source, whole_file_ahead: int = 0) -> tuple[Layout, int]:
    """A file's tensor layout and where its bytes start: an ``.npy`` file's array, or all of any other file.
    A file of at most ``whole_file_ahead`` bytes is asked into the page cache whole meanwhile."""
    if not _is_npy(src):
        if 0 < src.size <= whole_file_ahead and not is_object_url(src.path):
            _read_ahead(src)
        return Layout(torch.uint8, (src.size,)), 0
    h, size = npy.read_header(src.path, whole_file_ahead=whole_file_ahead)  # an object's too
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
    with executor(threads, "gdskit-headers") as pool:
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
#: (:mod:`gdskit.engine.whole_files`); larger ones have their headers read first and are striped
#: over the engine's workers by the many-file job.
WHOLE_FILE_MAX = 1 << 20


def _read_whole(sources: list[Source], dev: Any, on_bytes: Callable[[int], None]) -> list[Any]:
    """Small files read whole, each file's tensor made as its bytes arrive, in order: the tensor,
    or ``(bytes, layout)`` where its bytes must be swapped once they have landed. The first bad
    file (in order) raises."""
    made: list[Any] = [None] * len(sources)
    # The last .npy header parsed: (its bytes, layout, data offset, whether the tensor is made
    # in the layout itself). A dataset's files mostly share one header; a file whose first bytes
    # are those has that layout. One tuple, swapped whole: two workers may place at once.
    last: list[tuple[bytes, Any, int, bool]] = [(b"", None, 0, False)]

    def place(i: int, data: memoryview) -> tuple[tuple[int, int, int], ...]:
        src = sources[i]
        head, lay, off, plain = last[0]
        npy_file = _is_npy(src)
        if not (npy_file and head and bytes(data[:off]) == head and len(data) >= src.size):
            lay, off = _layout_in(src, data)
            plain = not lay.byteswap and not lay.fortran
            if npy_file:
                last[0] = (bytes(data[:off]), lay, off, plain)
        nbytes = lay.nbytes
        if src.size < off + nbytes:
            raise TruncatedFileError(f"{src.path}: {src.size} bytes, but its header describes {off + nbytes}")
        if plain:  # the tensor itself, no views to make
            t = torch.empty(lay.shape, dtype=lay.dtype, device=dev)
            made[i] = t
        else:
            t = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            # Views cost no kernel: made here, while other files' reads are at the disk.
            made[i] = (t, lay) if lay.byteswap else sample_view(t, lay)
        return ((t.data_ptr(), off, nbytes),) if nbytes else ()

    engine_read_whole_files([s.path for s in sources], [s.size for s in sources], dev.index, place, on_bytes)
    return made


def _verify(sources: list[Source], in_whole: list[bool], made: list[Any], raws: list[torch.Tensor],
            layouts: list[tuple[Layout, int]], expect: dict[str, Expectation]) -> None:
    """Check each file's landed bytes (its array, or all of it) against its manifest's digest."""
    from gdskit.formats.verified import tensor_digests  # noqa: PLC0415 - import time
    from gdskit.verify import mismatch  # noqa: PLC0415 - import time

    landed = iter(made)
    read = iter(zip(raws, layouts))
    named, ranges, wants = [], {}, {}
    for s, w in zip(sources, in_whole):
        if w:
            t = next(landed)
            t = t[0] if isinstance(t, tuple) else t
            storage = t.untyped_storage()
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))
        else:
            raw, _lay = next(read)
        if s.path not in expect:
            continue
        exp = expect[s.path]
        assert exp.file is not None  # a manifest entry: datasets have no header digests
        array = exp.file.tensors.get("array") if _is_npy(s) else None
        start = array.offset if array is not None else 0
        if raw.nbytes != (array.nbytes if array is not None else exp.file.size):
            raise mismatch(exp, "array" if array is not None else None, (start, start + raw.nbytes),
                           array.digest if array is not None else exp.file.digest, "0" * 64)
        named.append((s.path, raw))
        ranges[s.path] = (start, start + raw.nbytes)
        wants[s.path] = ("array" if array is not None else None, array.digest if array is not None else exp.file.digest)
    for path, digest in tensor_digests(named).items():
        tensor, want = wants[path]
        if digest != want:
            raise mismatch(expect[path], tensor, ranges[path], want, digest)


def _is_manifest(src: Source) -> bool:
    from gdskit.verify import DIRECTORY_MANIFEST, MANIFEST_SUFFIX  # noqa: PLC0415 - import time

    name = os.path.basename(src.path)
    return name == DIRECTORY_MANIFEST or name.endswith(MANIFEST_SUFFIX)


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
    """Read many files into their destinations as one engine job (``gdskit.engine.many_files``: the
    files' chunks share the engine's workers, each file open only while it is read); every
    read checked for its full length.

    Each ``(FileReads, view)`` pair names the reads of one file into one engine buffer view.
    A file shorter than it was when listed raises :class:`TruncatedFileError` (named).
    """
    jobs = [(r, view) for r, view in reads if r.items]
    local = [k for k, (r, _view) in enumerate(jobs) if not is_object_url(r.source.path)]
    counts: list[list[int]] = [[] for _ in jobs]
    for k, got in zip(local, engine_read_files([(jobs[k][0].source.path, [(jobs[k][1], n, off, bo)
                                                                          for n, off, bo in jobs[k][0].items])
                                                for k in local], on_bytes)):
        counts[k] = got
    for k, (r, view) in enumerate(jobs):
        if not is_object_url(r.source.path):
            continue
        with open_file(r.source.path) as obj:  # its parts' GETs in parallel (settings.s3_concurrency)
            counts[k] = obj.read_many([(view, n, off, bo) for n, off, bo in r.items], on_bytes=on_bytes)
    for (r, _view), got in zip(jobs, counts):
        for (n, off, _bo), m in zip(r.items, got):
            if m != n:
                raise TruncatedFileError(
                    f"{r.source.path}: read {m} of {n} bytes at offset {off}; the file is shorter than its "
                    f"{r.source.size} bytes when it was listed (truncated or shrank)")


def preload(files: Files, device: Any = "cuda:0", *, progress: ProgressArg = None,
            return_stats: bool = False, verify: Any = False) -> Any:
    """Read whole files into tensors on ``device``.

    Parameters
    ----------
    files : a list of paths, a directory (recursively) or a glob
    device : ``"cuda:0"``, ``"cpu"``, a ``torch.device`` or a GPU index
    progress : bool, callable or None
        None: a bar on stderr when it is a terminal and the preload takes over 2 s; True:
        always; False: none; a callable gets ``(bytes_done, bytes_total)``.
    return_stats : also return the ledger's delta of this preload
    verify : bool or path
        Check each file's bytes where they landed against a digest manifest (``gdskit digest``
        of the files or of a directory above them; docs/verify.md): True (found beside the file
        or in a directory up to four levels above it) or a manifest's path. An ``.npy`` file's
        array is checked against its array digest, any other file against its whole-file digest.

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
    mode = verify_mode(verify)
    if mode.whole_file:
        raise InvalidArgumentError("preload checks digest manifests (verify=True or a manifest's path), not a sha256")
    with collector_paused():
        return _preload(files, device, progress, return_stats, mode)


def _preload(files: Files, device: Any, progress: ProgressArg, return_stats: bool, mode: VerifyMode = OFF) -> Any:
    dev = target_device(device)
    sources = resolve(files)
    # Refused before any read; a manifest among the files is the reference, not checked itself.
    expect = None
    if mode.on:
        from gdskit.formats.verified import expectations  # noqa: PLC0415 - import time

        expect = expectations([s.path for s in sources if not _is_manifest(s)], mode)
    # Objects are read by ranged GETs (open_file), never through the whole-file reads of local files.
    small = [s.size <= WHOLE_FILE_MAX and not is_object_url(s.path) for s in sources]
    # The limit is asked only where a file may be read whole: it imports the engine's reading modules.
    whole_max = min(WHOLE_FILE_MAX, whole_file_limit(dev.index)) if dev.type == "cuda" and any(small) else 0
    in_whole = [0 < whole_max and s.size <= whole_max and w for s, w in zip(sources, small)]
    whole = [s for s, w in zip(sources, in_whole) if w]
    rest = [s for s, w in zip(sources, in_whole) if not w]
    layouts, bad = _layouts(rest)  # the larger files' headers, checked before anything is read
    if bad is not None:
        bad_at = [k for k, w in enumerate(in_whole) if not w][bad[0]]
        if not any(in_whole[:bad_at]):
            raise bad[1]
        whole = [s for s, w in zip(sources[:bad_at], in_whole) if w]  # an earlier bad one among these?
    rest_bytes = sum(lay.nbytes for lay, _ in layouts)
    total = sum(s.size for s in whole) + rest_bytes
    before = stats() if return_stats else None
    with Progress(total, progress, "preloading") as prog:
        if whole:
            # Blocks torch's allocator hands out may still be used by queued work; the engine
            # writes from its own streams. One wait for the device covers every read.
            torch.cuda.synchronize(dev)
            made = _read_whole(whole, dev, prog.advance)
            if bad is not None:
                raise bad[1]
        raws, served = _through_resident(rest, layouts, dev, prog) if not mode.on else ([], False)
        if not raws:
            # The engine's pinned stages are made in the background while the tensors are allocated.
            wait_for_warm_up = start_warm_up(dev.index, rest_bytes) if dev.type == "cuda" and rest else no_wait
            try:
                raws = [torch.empty(lay.nbytes, dtype=torch.uint8, device=dev) for lay, _ in layouts]
                if dev.type == "cuda" and raws:
                    torch.cuda.synchronize(dev)
            finally:
                wait_for_warm_up()
        if raws and not served:
            reads = [(FileReads(s, ((lay.nbytes, off, 0),) if lay.nbytes else ()), view)
                     for s, (lay, off), view in zip(rest, layouts, engine_views(raws))]
            read_files(reads, prog.advance)
    if expect is not None:  # the bytes as they landed: before any byte swap
        _verify(sources, in_whole, made if whole else [], raws, layouts, expect)
    landed = iter(made) if whole else iter(())
    read = iter(zip(raws, layouts))
    out = {}
    for s, w in zip(sources, in_whole):
        if w:
            t = next(landed)
            out[s.key] = sample_view(*t) if isinstance(t, tuple) else t
        else:
            raw, (lay, _off) = next(read)
            out[s.key] = sample_view(raw, lay)
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()  # byte swaps, if any, are done when this returns
    if return_stats:
        return out, stats_delta(before, stats())
    return out


def _through_resident(rest: list[Source], layouts: list[tuple[Layout, int]], dev: Any,
                      prog: Progress) -> tuple[list[torch.Tensor], bool]:
    """The larger files' arrays read by the resident loader (``gdskit serve``) where it is worth
    asking: their tensors (made at the cost of one allocation) and whether every byte landed. No
    tensors where it was not asked; made but not filled where it did not serve (the caller reads
    them itself)."""
    sizes = [lay.nbytes for lay, _off in layouts]
    if not rest or not through_resident.worth_asking(torch, dev, sizes, [s.path for s in rest]):
        return [], False
    wants = [(k, n, k, off) for k, (n, (_lay, off)) in enumerate(zip(sizes, layouts))]  # keyed by file
    made, served = through_resident.fill_new(torch, dev, [(s.path, s.size) for s in rest], wants,
                                             lambda k: torch.empty(sizes[k], dtype=torch.uint8, device=dev), prog)
    return list(made.values()), served
