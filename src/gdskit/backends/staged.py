"""Moving one chunk between a file and an aligned staging buffer.

Layout rule: file byte ``pos`` sits at stage offset ``pos % alignment``. Then any
aligned file range maps to an aligned stage range, so the same buffer serves
page-cache reads, O_DIRECT reads and O_DIRECT writes without extra copies.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from dataclasses import dataclass

from gdskit.backends.base import RWF_NOWAIT, OpenFile, pread_full, pwrite_all
from gdskit.errors import from_os_error
from gdskit.residency import FileMapping, Residency, new_mapping, residency
from gdskit.plan import Chunk, align_down, align_up
from gdskit.vocabulary import ODirectPolicy


@dataclass(slots=True)
class ChunkResult:
    """What happened to one chunk: bytes moved, and how many went through the page cache."""

    nbytes: int
    cached: int  # through the page cache (the rest: O_DIRECT)


def contiguous_prefix(counts: Iterable[int], plan: Iterable[Chunk]) -> int:
    """Bytes read without a gap: stop at the first short chunk, as pread would."""
    total = 0
    for n, ch in zip(counts, plan):
        total += n
        if n < ch.size:
            break
    return total


def read_direct(fd: int, view: memoryview, offset: int, alignment: int, path: str) -> int:
    """O_DIRECT read of an aligned range; a short, unaligned count means end of file."""
    done = 0
    total = len(view)
    while done < total:
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except InterruptedError:
            continue
        except OSError as exc:
            raise from_os_error(exc, path) from exc
        done += n
        if n == 0 or n % alignment:
            break
    return done


def direct_usable(f: OpenFile, policy: ODirectPolicy) -> int | None:
    """The file's O_DIRECT descriptor, unless the policy or an earlier refusal rules it out."""
    if policy is ODirectPolicy.NEVER or f.direct_refused:
        return None
    return f.direct_fd()


def file_residency(f: OpenFile, pos: int, n: int) -> Residency | None:
    """Whether the page cache holds all, none or part of ``[pos, pos + n)`` of ``f`` (None: the
    kernel cannot say), asked without causing I/O."""
    def make() -> FileMapping:
        mapping = new_mapping()
        f.on_close(mapping.close)
        return mapping

    return residency(f.fd, pos, n, f.page_map.get(make))


def read_to_stage(f: OpenFile, stage: memoryview, pos: int, n: int, policy: ODirectPolicy,
                  alignment: int) -> ChunkResult:
    """Fill ``stage[pos % alignment:][:n]`` with file bytes ``[pos, pos + n)``.

    ``auto``: a chunk the page cache holds (all or part of it, asked without
    causing I/O: see :mod:`gdskit.residency`) is read buffered, one it does not
    hold with O_DIRECT. ``always``: all O_DIRECT. ``never``, or no O_DIRECT on
    this filesystem: all buffered.
    """
    head = pos % alignment
    cached = 0
    dfd = direct_usable(f, policy)
    if policy is ODirectPolicy.AUTO and dfd is not None:
        where = file_residency(f, pos, n)
        if where is None and f.nowait_supported:
            # Neither cachestat nor mincore: probe with RWF_NOWAIT (may start readahead, but is correct).
            try:
                cached = pread_full(f.fd, stage[head:head + n], pos, f.path, flags=RWF_NOWAIT)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                f.nowait_supported = False
                dfd = None
            if cached == n:
                return ChunkResult(n, n)
        elif where is not Residency.NONE:
            dfd = None  # all (or partly) cached: the page cache serves it fastest
    if dfd is None:
        got = cached + pread_full(f.fd, stage[head + cached:head + n], pos + cached, f.path)
        return ChunkResult(got, got)
    rest = pos + cached
    span_start = align_down(rest, alignment)
    span_end = align_up(pos + n, alignment)
    s0 = align_down(head + cached, alignment)
    try:
        got = read_direct(dfd, stage[s0:s0 + (span_end - span_start)], span_start, alignment, f.path)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        # This filesystem or device wants other O_DIRECT alignment: go buffered for this file.
        f.direct_refused = True
        got2 = pread_full(f.fd, stage[head + cached:head + n], pos + cached, f.path)
        return ChunkResult(cached + got2, cached + got2)
    valid_end = min(pos + n, span_start + got)
    total = max(cached, valid_end - pos)
    return ChunkResult(total, cached)


def write_from_stage(f: OpenFile, stage: memoryview, pos: int, n: int, policy: ODirectPolicy,
                     alignment: int) -> ChunkResult:
    """Write file bytes ``[pos, pos + n)`` from ``stage[pos % alignment:][:n]``.

    ``auto`` and ``always``: the aligned body with O_DIRECT (a copy through the
    page cache costs CPU and, before fsync, memory), unaligned head and tail
    buffered. ``never``: everything buffered.
    """
    head = pos % alignment
    dfd = direct_usable(f, policy)
    body_start = align_up(pos, alignment)
    body_end = align_down(pos + n, alignment)
    if dfd is None or body_end <= body_start:
        pwrite_all(f.fd, stage[head:head + n], pos, f.path)
        return ChunkResult(n, n)
    buffered = 0
    if body_start > pos:
        buffered += pwrite_all(f.fd, stage[head:head + (body_start - pos)], pos, f.path)
    s0 = head + (body_start - pos)
    try:
        pwrite_all(dfd, stage[s0:s0 + (body_end - body_start)], body_start, f.path)
    except OSError as exc:
        if getattr(exc, "errno", None) != errno.EINVAL:
            raise
        f.direct_refused = True
        pwrite_all(f.fd, stage[s0:s0 + (body_end - body_start)], body_start, f.path)
        buffered += body_end - body_start
    if pos + n > body_end:
        s1 = head + (body_end - pos)
        buffered += pwrite_all(f.fd, stage[s1:s1 + (pos + n - body_end)], body_end, f.path)
    return ChunkResult(n, buffered)
