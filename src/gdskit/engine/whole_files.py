"""Whole small files into GPU memory: each file one read into a pinned stage, placed by its caller.

A job of many small files (a dataset of one sample a file) read the usual way pays, per file, a
header read and then the array's read, each with its own open, page-cache question, read, copy and
event, and from the disk two requests that wait one after the other. Here each file is opened once
and read whole, in one request, into the next slot of a worker's pinned stage:

- the reads of a stage's files (up to a ring's worth) go to the kernel in one ``io_uring_enter``
  (:mod:`gdskit.engine.backends.uring`): cached files cost one system call between them; where io_uring
  does not work, each file is one ``preadv``;
- the caller's ``place`` then sees each file's bytes in host memory and says where in GPU memory
  which of them go (the data layer parses an ``.npy`` header and makes the file's tensor there);
- the stage goes to the GPU in one batched copy with one event.

A job the page cache holds (judged by a sample, :func:`gdskit.engine.residency.job_cached`) runs on
:data:`HOT_WORKERS` workers. Any other runs on one worker, beside a helper thread that opens the
next stage's files and asks them into the page cache (``posix_fadvise(WILLNEED)``, which queues
their reads and returns) while the worker reads, places and copies the current stage's: the disk
reads one stage while the interpreter works on the one before. Two workers waiting on the disk in
turn were slower (their Python phases then meet at the interpreter); benchmarks/RESULTS.md, "Many
small files read whole". ``settings.odirect="always"``
reads every file with O_DIRECT instead. Only a job the bounce ring serves whatever the file comes
here (:func:`gdskit.engine.read_route.bounce_for_any_file`); the ledger records its bytes as bounce-cached
(read through the page cache) or bounce-direct with that reason.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from gdskit.engine.backends.base import pread_full
from gdskit.durable import open_file_fd
from gdskit.errors import InvalidArgumentError, from_os_error
from gdskit.engine.ledger import record_bounce_pieces
from gdskit.engine.plan import align_up, nonnegative_int
from gdskit.engine.pool import LaneRef, lanes, run_chunks
from gdskit.engine.residency import job_cached
from gdskit.engine.read_route import bounce_for_any_file
from gdskit.settings import Settings, settings
from gdskit.threads import executor
from gdskit.vocabulary import IoUring, ODirectPolicy, Reason

__all__ = ["Copy", "Place", "limit", "read_whole_files"]

#: ``(device address, offset in the file's bytes, bytes)``: one copy of part of a file to the GPU.
Copy = tuple[int, int, int]
#: ``place(index, data) -> copies``: called in a worker with file ``index``'s bytes as read (at most
#: its listed size); the copies it returns land the file in GPU memory. ``data`` is valid only
#: during the call. An exception it raises is the file's error.
Place = Callable[[int, memoryview], Sequence[Copy]]

#: Workers for a job the page cache holds: the second one's ring calls and batched copies run
#: while the first holds the interpreter (more only take turns at it).
HOT_WORKERS = 2

# The descriptor's status flags once its kind is known: read through the page cache, or O_DIRECT.
_BUFFERED, _DIRECT = 0, getattr(os, "O_DIRECT", 0)


def limit(device: int) -> int:
    """The largest file :func:`read_whole_files` takes into ``device``'s memory under the current
    settings (a worker's stage holds it); 0 where the reads must be routed file by file."""
    cfg = settings.snapshot()
    if bounce_for_any_file(cfg) is None:
        return 0
    return lanes.stage_layout(device, cfg.threads, cfg.chunk_size, cfg.pinned_budget, cfg.alignment)[1]


@dataclass(slots=True)
class _Job:
    paths: Sequence[str]
    sizes: Sequence[int]
    place: Place
    reason: Reason
    cfg: Settings
    ring: bool
    on_bytes: Callable[[int], None] | None
    lock: threading.Lock
    errors: list[tuple[int, BaseException]]
    pieces: list[tuple[Reason, int, int]]
    ahead: bool = False   # cold: each file asked into the page cache a stage before it is read
    direct_refused: bool = False


def read_whole_files(paths: Sequence[str], sizes: Sequence[int], device: int, place: Place,
                     *, on_bytes: Callable[[int], None] | None = None) -> None:
    """Read each file of ``paths`` whole (its listed ``sizes[i]`` bytes, at most) and land it in
    ``device``'s memory where ``place`` says (see :data:`Place`). Only for files of at most
    :func:`limit` bytes, where that is not 0.

    The copies ``place`` returns must name device memory of ``device`` free of queued work.
    Every copy has landed when this returns. After a file fails (it cannot be opened or read,
    or ``place`` raises) no further stage is started; those under way finish, and the error of
    the first failed file in list order is raised. ``on_bytes`` gets each stage's bytes read
    (the files', headers included) once its copies are queued.
    """
    if len(paths) != len(sizes):
        raise InvalidArgumentError("one size per file")
    cfg = settings.snapshot()
    n_lanes, chunk = lanes.stage_layout(device, cfg.threads, cfg.chunk_size, cfg.pinned_budget, cfg.alignment)
    stage_bytes = chunk + 2 * cfg.alignment
    reason = bounce_for_any_file(cfg)
    if reason is None:
        raise InvalidArgumentError("these reads must be routed file by file: read them by the many-file job")
    sizes = [nonnegative_int("size", s) for s in sizes]
    if sizes and max(sizes) > chunk:
        raise InvalidArgumentError(f"a file of {max(sizes)} bytes is larger than a stage ({chunk} bytes); "
                                   "read it by the many-file job")
    ring = cfg.io_uring is IoUring.AUTO and _ring_usable()
    job = _Job(paths, sizes, place, reason, cfg, ring, on_bytes, threading.Lock(), [], [])
    groups = _groups(sizes, stage_bytes, cfg.alignment)
    run = {"device": device, "stage_bytes": stage_bytes, "max_lanes": n_lanes, "budget": cfg.pinned_budget}
    t0 = time.perf_counter()
    try:
        if job_cached(len(paths), lambda i: (paths[i], 0, sizes[i])):
            run_chunks(groups, lambda ref, g: _stage(job, ref, g), threads=HOT_WORKERS, **run)
        else:
            job.ahead = cfg.odirect is not ODirectPolicy.ALWAYS
            run_chunks([groups], lambda ref, gs: _stages(job, ref, gs), threads=1, **run)
    finally:
        record_bounce_pieces(job.pieces, device, time.perf_counter() - t0)
    if job.errors:
        raise min(job.errors, key=lambda e: e[0])[1]


def _ring_usable() -> bool:
    from gdskit.engine.backends import uring  # noqa: PLC0415 - import time

    return uring.availability().usable is True


def _groups(sizes: list[int], stage_bytes: int, align: int) -> list[tuple[int, int]]:
    """Consecutive files, ``(first, end)``, whose aligned slots fill at most a stage and a ring."""
    from gdskit.engine.backends.uring import RING_ENTRIES  # noqa: PLC0415 - import time

    out: list[tuple[int, int]] = []
    first, fill = 0, 0
    for i, size in enumerate(sizes):
        slot = align_up(size, align)
        if i > first and (fill + slot > stage_bytes or i - first >= RING_ENTRIES):
            out.append((first, i))
            first, fill = i, 0
        fill += slot
    if first < len(sizes):
        out.append((first, len(sizes)))
    return out


_Opened = list[tuple[int, int, int, int]]  # (file index, descriptor, slot in the stage, status flags)


def _stage(job: _Job, ref: LaneRef, group: tuple[int, int]) -> None:
    """One stage's files: opened, read into the stage, placed, copied in one batch, closed."""
    if not job.errors:  # after a failed file, start nothing more
        lane = ref.get()
        _fill(job, lane, group, _open_group(job, group))


def _stages(job: _Job, ref: LaneRef, groups: list[tuple[int, int]]) -> None:
    """Every stage in turn on one worker. The next stage's files are opened, and so asked into
    the page cache, on a helper thread while the current stage's are read, placed and copied:
    that advice is kernel work (about 10 µs a file) the worker would otherwise wait for
    (benchmarks/RESULTS.md, "Cold small files: the next stage opened beside the worker")."""
    if not groups:
        return
    lane = ref.get()
    with executor(1, "gdskit-ahead") as ahead:
        upcoming: Future[_Opened] | None = ahead.submit(_open_group, job, groups[0])
        try:
            for k, group in enumerate(groups):
                assert upcoming is not None
                current, upcoming = upcoming.result(), None
                if job.errors:
                    _close(current)
                    return  # after a failed file, start nothing more
                if k + 1 < len(groups):
                    upcoming = ahead.submit(_open_group, job, groups[k + 1])
                _fill(job, lane, group, current)  # closes the current stage's files
        finally:
            if upcoming is not None:  # the worker stopped early: the files opened ahead are closed
                try:
                    opened = upcoming.result()
                except BaseException:  # noqa: BLE001 - it closed its own; the first error is the one raised
                    opened = []
                _close(opened)


def _close(opened: _Opened) -> None:
    for _i, fd, _s, _fl in opened:
        os.close(fd)


def _open_group(job: _Job, group: tuple[int, int]) -> _Opened:
    """A stage's files opened, each with its slot; a file that cannot be opened is recorded."""
    align = job.cfg.alignment
    opened: _Opened = []
    slot = 0
    try:
        for i in range(*group):
            size = job.sizes[i]
            if size:
                try:
                    fd, flags = _open(job, job.paths[i], size)
                except Exception as exc:  # noqa: BLE001 - the file's error, raised in list order later
                    _failed(job, i, exc)
                else:
                    opened.append((i, fd, slot, flags))
            slot += align_up(size, align)
    except BaseException:
        _close(opened)
        raise
    return opened


def _fill(job: _Job, lane: Any, group: tuple[int, int], opened: _Opened) -> None:
    """Read the opened files of ``group`` into the lane's stage, place them, copy them to the
    GPU in one batch; every descriptor is closed."""
    assert lane.stream is not None
    copies: list[tuple[int, int, int]] = []
    pieces: list[tuple[Reason, int, int]] = []
    try:
        stage, event = lane.next_stage()  # waits for the copies that last used it
        got = _read(job, stage.view, opened)
        read = {i: (s, n, fl) for (i, _fd, s, _fl), (n, fl) in zip(opened, got)}
        for i in range(*group):
            if job.sizes[i] == 0:
                s, n, fl = 0, 0, _BUFFERED
            elif i in read:
                s, n, fl = read[i]
                if n < 0:
                    continue  # its error is recorded
            else:
                continue  # could not be opened
            try:
                for dst, start, nbytes in job.place(i, stage.view[s:s + n]):
                    if not (0 <= start and 0 <= nbytes and start + nbytes <= n):
                        raise InvalidArgumentError(f"a copy of {nbytes} bytes at {start} is outside the file's {n}")
                    if nbytes:
                        copies.append((dst, stage.ptr + s + start, nbytes))
            except Exception as exc:  # noqa: BLE001 - the file's error, raised in list order later
                _failed(job, i, exc)
                continue
            if job.sizes[i]:  # an empty file reads nothing
                pieces.append((job.reason, n, n if fl == _BUFFERED else 0))
    finally:
        _close(opened)
    if copies:
        lane.stream.copy_h2d_many(copies)
        assert event is not None
        event.record(lane.stream)
    with job.lock:
        job.pieces.extend(pieces)
    if job.on_bytes is not None and pieces:
        job.on_bytes(sum(n for _r, n, _c in pieces))


def _failed(job: _Job, index: int, exc: BaseException) -> None:
    with job.lock:
        job.errors.append((index, exc))


def _open(job: _Job, path: str, size: int) -> tuple[int, int]:
    """The file opened for its whole read (by :func:`~gdskit.durable.open_file_fd`, whose one
    ``F_SETFL`` also sets O_DIRECT where asked), and how it is read (``_BUFFERED``, ``_DIRECT``).
    In a cold job the kernel is asked to bring the file into the page cache meanwhile (advice:
    its errors are the read's to report)."""
    direct = bool(_DIRECT) and job.cfg.odirect is ODirectPolicy.ALWAYS and not job.direct_refused
    try:
        fd, _st = open_file_fd(path, os.O_RDONLY | (_DIRECT if direct else _BUFFERED))
    except OSError as exc:
        if not direct or exc.errno != errno.EINVAL:
            raise
        job.direct_refused = True  # this filesystem takes no O_DIRECT: the page cache, from now on
        direct = False
        fd, _st = open_file_fd(path, os.O_RDONLY)
    if job.ahead and not direct:
        try:
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
    return fd, _DIRECT if direct else _BUFFERED


def _read(job: _Job, view: memoryview, fds: _Opened) -> list[tuple[int, int]]:
    """Each opened file's bytes read into its slot: the count (at most its listed size), or -1
    where it failed (recorded), and how it was read (``_BUFFERED``, ``_DIRECT``). One ring
    submission for all where io_uring works; a read that does not come back whole is done again
    alone by the plain loop, which reports errors."""
    align = job.cfg.alignment
    spans = [align_up(job.sizes[i], align) if fl == _DIRECT else job.sizes[i] for i, _fd, _s, fl in fds]
    got: list[int] | None = None  # the ring's results, where it read them
    if job.ring and fds:
        from gdskit.engine.backends import uring  # noqa: PLC0415 - import time

        ring = uring.ring_for_thread()
        if ring is not None:
            got = ring.read_each([fd for _i, fd, _s, _fl in fds], view, [0] * len(fds),
                                 [s for _i, _fd, s, _fl in fds], spans)
    out = []
    for k, (i, fd, s, fl) in enumerate(fds):
        size = job.sizes[i]
        n = -1 if got is None else got[k]
        if n < size:  # short, failed or not submitted: the plain loop, exactly
            err = -n if got is not None and n < 0 else 0
            try:
                n, fl = _read_plain(job, fd, fl, view[s:s + spans[k]], job.paths[i], err)
            except Exception as exc:  # noqa: BLE001 - the file's error, raised in list order later
                _failed(job, i, exc)
                n = -1
        out.append((min(n, size), fl))
    return out


def _read_plain(job: _Job, fd: int, flags: int, slot: memoryview, path: str, err: int) -> tuple[int, int]:
    """One file's read by ``preadv`` and how it was read; an O_DIRECT refusal (EINVAL, from the
    ring as ``err`` or from the read) reads it through the page cache."""
    if flags == _DIRECT:
        try:
            if err != errno.EINVAL:
                return pread_full(fd, slot, 0, path, alignment=job.cfg.alignment), _DIRECT
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        job.direct_refused = True
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, _BUFFERED)
        except OSError as exc:
            raise from_os_error(exc, path) from exc
    return pread_full(fd, slot, 0, path), _BUFFERED
