"""Moving one chunk between a file and memory: the one chunk reader of the CPU paths.

:func:`choose` decides which descriptor serves a read (page cache or O_DIRECT) and
:func:`read_chunk` reads a chunk that way, into a staging buffer (the bounce ring) or
into the caller's host memory (the host path).

Layout rule for staging buffers: file byte ``pos`` sits at stage offset ``pos % alignment``.
Then any aligned file range maps to an aligned stage range, so the same buffer serves
page-cache reads, O_DIRECT reads and O_DIRECT writes without extra copies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import ctypes
import enum
import errno
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gdskit.engine.backends.base import RWF_NOWAIT, UNKNOWN, OpenFile, Unknown, pread_full, pwrite_all
from gdskit.engine.residency import FileMapping, Residency, cachestat_answers, new_mapping, residency
from gdskit.engine.plan import Chunk, align_down, align_up
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


class Via(enum.Enum):
    """How one chunk of a read is served (:func:`choose`)."""

    BUFFERED = "buffered"  # the page cache: the policy says so, it holds some of the chunk, or no O_DIRECT here
    DIRECT = "direct"      # O_DIRECT: the policy says so, or the page cache holds none of the chunk
    PROBE = "probe"        # the kernel cannot say: a buffered RWF_NOWAIT read takes what is cached, O_DIRECT the rest


def direct_usable(f: OpenFile, policy: ODirectPolicy) -> int | None:
    """The file's O_DIRECT descriptor, unless the policy or an earlier refusal rules it out."""
    if policy is ODirectPolicy.NEVER or f.direct_refused:
        return None
    return f.direct_fd()


def file_residency(f: OpenFile, pos: int, n: int) -> Residency | None:
    """Whether the page cache holds all, none or part of ``[pos, pos + n)`` of ``f`` (None: the
    kernel cannot say), asked without causing I/O."""
    if cachestat_answers():  # no mincore mapping needed (made per file, it cost more than the question)
        return residency(f.fd, pos, n)

    def make() -> FileMapping:
        mapping = new_mapping()
        f.on_close(mapping.close)
        return mapping

    return residency(f.fd, pos, n, f.page_map.get(make))


#: A read at least this large that the page cache holds at most an eighth of goes O_DIRECT:
#: the pages a header read's readahead left cached (the first 16-128 KiB of an ``.npy`` shard)
#: would otherwise send the whole shard through the cache cold, at 15 times O_DIRECT's CPU
#: time (benchmarks/RESULTS.md, "Cold preload in interleaved pairs"). The few cached pages
#: are read again from the disk; O_DIRECT reads see dirty pages written back first.
FEW_CACHED_DIRECT_MIN = 1 << 20


def choose(f: OpenFile, policy: ODirectPolicy, pos: int, n: int,
           where: Residency | None | Unknown = UNKNOWN) -> tuple[Via, Residency | None | Unknown]:
    """How to read ``[pos, pos + n)`` of ``f``: the one decision of which descriptor serves a
    read, for every CPU path. Also returns the range's residency where it was asked
    (:data:`UNKNOWN` where the policy needed no answer), so that a later read of the same
    range need not ask again; ``where``: the answer, if the caller already has it.

    ``never``, a refused or missing O_DIRECT: buffered. ``always``: O_DIRECT. ``auto``: the
    page cache is asked without causing I/O (:mod:`gdskit.engine.residency`): a range it holds
    all or part of is read buffered, one it holds none of with O_DIRECT, and so is a range of
    at least :data:`FEW_CACHED_DIRECT_MIN` bytes it holds at most an eighth of; where the kernel
    cannot say, a buffered RWF_NOWAIT probe decides (it may start readahead, but is correct).
    """
    if policy is ODirectPolicy.NEVER or f.direct_refused or f.direct_missing:
        return Via.BUFFERED, where
    if policy is ODirectPolicy.ALWAYS:
        return (Via.BUFFERED if f.direct_fd() is None else Via.DIRECT), where
    if where is UNKNOWN:
        where = file_residency(f, pos, n)
    # The O_DIRECT descriptor is opened only for a range the page cache may not hold: a file
    # read hot (many small files) never opens it.
    if where is Residency.NONE or (where is Residency.FEW and n >= FEW_CACHED_DIRECT_MIN):
        return (Via.BUFFERED if f.direct_fd() is None else Via.DIRECT), where
    if where is None and f.nowait_supported and f.direct_fd() is not None:
        return Via.PROBE, where
    return Via.BUFFERED, where


#: Reads of a batch that :func:`choose_for_batch` asks the page cache about (first, middle, last).
BATCH_SAMPLES = 3


def choose_for_batch(f: OpenFile, policy: ODirectPolicy, file_offsets: Sequence[int], n: int) -> Via | None:
    """One way to read every ``n``-byte range at ``file_offsets`` of ``f``, where one serves the
    whole batch; None where each read must be decided alone by :func:`choose`.

    ``never``, a refused or missing O_DIRECT: buffered. ``always``: O_DIRECT. ``auto``: a few
    reads spread over the batch (first, middle, last) are asked about, since asking about every
    read of a batch of 4 KiB reads costs more than the reads: O_DIRECT where the page cache holds
    none of them, else buffered (a read it does not hold is still correct, read through the
    cache; read one by one, the uncached reads of a partly cached batch of token windows took
    4-5x longer as O_DIRECT reads through a stage). A kernel that cannot say: each read alone.
    """
    if not file_offsets:
        return None
    if policy is not ODirectPolicy.AUTO or f.direct_refused or f.direct_missing:
        return choose(f, policy, file_offsets[0], n)[0]  # the policy alone decides: the same for all
    last = len(file_offsets) - 1
    if last < BATCH_SAMPLES:
        return None  # a batch this small: sampling would save nothing over asking about each
    answers = {file_residency(f, file_offsets[k], n) for k in (0, last // 2, last)}
    if None in answers:
        return None
    if answers == {Residency.NONE}:  # the O_DIRECT descriptor, opened for the first cold batch
        return Via.BUFFERED if f.direct_fd() is None else Via.DIRECT
    return Via.BUFFERED


class ChunkTarget(ABC):
    """Where a chunk's bytes land: :meth:`view` is the memory for file bytes ``[pos, pos + n)``
    (buffered reads go there), :meth:`read_direct` reads such a range with O_DIRECT."""

    @abstractmethod
    def view(self, pos: int, n: int) -> memoryview: ...

    @abstractmethod
    def read_direct(self, f: OpenFile, dfd: int, pos: int, n: int) -> int:
        """O_DIRECT read of file bytes ``[pos, pos + n)``; the count from ``pos`` (short only at
        end of file). An ``OSError`` with EINVAL means the file refuses O_DIRECT I/O."""


class StageTarget(ChunkTarget):
    """An aligned staging buffer laid out by the module's rule for a chunk starting at ``start``:
    O_DIRECT reads the aligned span around any range straight into it."""

    __slots__ = ("_alignment", "_base", "_stage")

    def __init__(self, stage: memoryview, start: int, alignment: int) -> None:
        self._stage = stage
        self._base = align_down(start, alignment)  # the file offset of stage byte 0
        self._alignment = alignment

    def view(self, pos: int, n: int) -> memoryview:
        s = pos - self._base
        return self._stage[s:s + n]

    def read_direct(self, f: OpenFile, dfd: int, pos: int, n: int) -> int:
        a = self._alignment
        span_start, span_end = align_down(pos, a), align_up(pos + n, a)
        s0 = span_start - self._base
        got = pread_full(dfd, self._stage[s0:s0 + (span_end - span_start)], span_start, f.path, alignment=a)
        return max(0, min(pos + n, span_start + got) - pos)


class MemoryTarget(ChunkTarget):
    """Host memory the caller owns (``view`` at address ``addr`` holds the chunk starting at
    file offset ``start``), rarely aligned as O_DIRECT needs: the aligned part of a range goes
    straight into it, the ragged rest through a staging buffer (``stage()``, taken only then)."""

    __slots__ = ("_addr", "_alignment", "_stage", "_start", "_view")

    def __init__(self, view: memoryview, addr: int, start: int, alignment: int, stage: Callable[[], Any]) -> None:
        self._view, self._addr, self._start = view, addr, start
        self._alignment = alignment
        self._stage = stage

    def view(self, pos: int, n: int) -> memoryview:
        s = pos - self._start
        return self._view[s:s + n]

    def read_direct(self, f: OpenFile, dfd: int, pos: int, n: int) -> int:
        a = self._alignment
        addr = self._addr + (pos - self._start)
        direct = 0
        if pos % a == 0 and addr % a == 0 and n >= a:
            # The caller's memory is aligned like the file: O_DIRECT straight into it.
            body = align_down(n, a)
            direct = pread_full(dfd, self.view(pos, body), pos, f.path, alignment=a)
            if direct < body or direct == n:
                return direct  # end of file, or all of it
            pos, n, addr = pos + direct, n - direct, addr + direct
        stage = self._stage()
        got = StageTarget(stage.view, pos, a).read_direct(f, dfd, pos, n)
        if got:
            ctypes.memmove(addr, stage.ptr + pos % a, got)
        return direct + got


def read_chunk(f: OpenFile, target: ChunkTarget, pos: int, n: int, policy: ODirectPolicy,
               where: Residency | None | Unknown = UNKNOWN) -> ChunkResult:
    """Read file bytes ``[pos, pos + n)`` into ``target``, the way :func:`choose` says: the one
    chunk reader of the host path and the bounce ring. ``where``: the range's residency, if
    already asked. An O_DIRECT refusal (EINVAL) turns the file buffered for good."""
    via, _ = choose(f, policy, pos, n, where)
    cached = 0
    if via is Via.PROBE:
        try:
            cached = pread_full(f.fd, target.view(pos, n), pos, f.path, flags=RWF_NOWAIT)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            f.nowait_supported = False
            via = Via.BUFFERED
        if cached == n:
            return ChunkResult(n, n)
    if via is not Via.BUFFERED:
        dfd = f.direct_fd()
        assert dfd is not None
        try:
            return ChunkResult(cached + target.read_direct(f, dfd, pos + cached, n - cached), cached)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # This filesystem or device wants other O_DIRECT alignment: go buffered for this file.
            f.direct_refused = True
    got = cached + pread_full(f.fd, target.view(pos + cached, n - cached), pos + cached, f.path)
    return ChunkResult(got, got)


def read_to_stage(f: OpenFile, stage: memoryview, pos: int, n: int, policy: ODirectPolicy,
                  alignment: int, where: Residency | None | Unknown = UNKNOWN) -> ChunkResult:
    """Fill ``stage[pos % alignment:][:n]`` with file bytes ``[pos, pos + n)`` (:func:`read_chunk`;
    ``where``: the range's residency, if already known)."""
    return read_chunk(f, StageTarget(stage, pos, alignment), pos, n, policy, where)


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
