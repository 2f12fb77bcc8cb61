"""Plan the reads of many byte ranges of one file: direct reads for large ranges, coalesced reads for small ones.

Pure Python; formats build :class:`Extent` lists, the torch-side executor runs the plan.
Why coalesce: every read through the engine costs a fixed amount of CPU time and
a round trip, so thousands of 100 KiB tensors read one by one fall far below the
disk's or the page cache's rate. Runs of small neighbours are read as one range
into a bounded staging buffer and split by device-to-device copies.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Hashable, Iterable
from typing import NamedTuple


class ReadShape(NamedTuple):
    """How a format's reads are planned: :func:`plan`'s ``small``, ``max_group`` and ``max_gap``."""

    small: int
    max_group: int
    max_gap: int


class Extent(NamedTuple):
    """``nbytes`` bytes at ``file_offset`` that belong to ``key`` (a tensor or a storage).

    A named tuple rather than a dataclass: a checkpoint of 20,000 tensors makes 20,000 of
    them, and a tuple is made several times faster.
    """

    key: Hashable
    file_offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.file_offset + self.nbytes


@dataclasses.dataclass(frozen=True)
class Group:
    """One read of ``[file_offset, file_offset + nbytes)`` that covers several small extents.

    ``members`` are in file order; the bytes between members (at most the plan's
    ``max_gap``) are read and dropped.
    """

    file_offset: int
    nbytes: int
    members: tuple[Extent, ...]


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """All reads of one file: ``direct`` ranges land in their own memory, ``groups`` go through staging."""

    direct: tuple[Extent, ...]
    groups: tuple[Group, ...]
    empty: tuple[Extent, ...]

    @property
    def payload_bytes(self) -> int:
        """Bytes the caller asked for."""
        return sum(e.nbytes for e in self.direct) + sum(m.nbytes for g in self.groups for m in g.members)

    @property
    def direct_bytes(self) -> int:
        """Bytes read straight into their own memory."""
        return sum(e.nbytes for e in self.direct)

    @property
    def group_bytes(self) -> int:
        """Bytes read as groups (their members plus the small gaps between them)."""
        return sum(g.nbytes for g in self.groups)

    @property
    def read_bytes(self) -> int:
        """Bytes actually read (payload plus the small gaps inside groups)."""
        return self.direct_bytes + self.group_bytes

    @property
    def staging_bytes(self) -> int:
        """The largest group: the size one staging buffer needs."""
        return max((g.nbytes for g in self.groups), default=0)


_by_place = operator.itemgetter(1, 2)  # file_offset, nbytes


def plan(extents: Iterable[Extent], *, small: int = 1 << 20, max_group: int = 16 << 20,
         max_gap: int = 0) -> ReadPlan:
    """Split ``extents`` into direct reads and coalesced groups.

    Parameters
    ----------
    small : int
        Extents of at least this many bytes are read directly.
    max_group : int
        Largest coalesced read (also the staging buffer size).
    max_gap : int
        Most unrequested bytes allowed between two neighbours of one group.
        0 reads exactly the requested bytes.

    Extents may come in any order; overlapping extents (two keys on the same
    bytes) are each read on their own.
    """
    ordered = sorted(extents, key=_by_place)
    direct: list[Extent] = []
    empty: list[Extent] = []
    groups: list[Group] = []
    run: list[Extent] = []
    run_start = run_end = 0  # the bytes the run covers so far

    # One pass with plain locals: a checkpoint of 20,000 small tensors goes through here.
    for e in ordered:
        _key, offset, nbytes = e
        if nbytes < 0 or offset < 0:
            raise ValueError(f"negative extent {e}")
        if nbytes == 0:
            empty.append(e)
            continue
        if nbytes >= small:
            direct.append(e)
            continue
        end = offset + nbytes
        if run:
            gap = offset - run_end
            if gap < 0 or gap > max_gap or end - run_start > max_group:
                groups.append(Group(run_start, run_end - run_start, tuple(run)))
                run = []
        if not run:
            run_start = offset
        run.append(e)
        run_end = end
    if run:
        groups.append(Group(run_start, run_end - run_start, tuple(run)))
    return ReadPlan(tuple(direct), tuple(groups), tuple(empty))
