"""Who reads which bytes of a checkpoint, and in what order a process group shares them.

Pure Python, no torch: :func:`plan` turns the checkpoint's byte ranges (one
:class:`Segment` per tensor or storage) and the ranks that want each of them into a
:class:`FanOutPlan`:

- every wanted byte is read from storage by exactly one rank (its *owner*);
- a range only one rank wants is read by that rank and never sent;
- ranges several ranks want are cut into *units* (large tensors into pieces of at most
  ``piece_bytes``, runs of small neighbours with the same wanters into one unit) and
  spread over the ranks so that every rank reads about the same number of bytes,
  each one a contiguous stretch of the checkpoint (sequential reads);
- the units are grouped into *windows* of about ``window_bytes``, in which every rank
  reads its share; a window's shared units are broadcast from their owners in the
  order :attr:`Window.broadcasts` gives, while the ranks read the next window. A rank's
  extra memory is the staging of at most two windows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple

#: Largest unit of a large tensor: one read and one broadcast.
PIECE_BYTES = 64 << 20
#: Bytes of shared units per window (the bound on staging memory; see FanOutPlan.staging_bytes).
WINDOW_BYTES = 1 << 30
#: Tensors below this size that lie side by side are shared as one unit...
SMALL_BYTES = 1 << 20
#: ...of at most this many bytes.
MAX_UNIT_BYTES = 16 << 20


class Segment(NamedTuple):
    """``nbytes`` bytes at ``file_offset`` of file number ``file`` that hold all of ``key``."""

    key: Hashable
    file: int
    file_offset: int
    nbytes: int


class Part(NamedTuple):
    """``nbytes`` bytes of ``key`` from ``key_offset`` on, at ``unit_offset`` in their unit."""

    key: Hashable
    key_offset: int
    unit_offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Unit:
    """One read by ``owner`` of ``[file_offset, file_offset + nbytes)`` of file ``file``; shared
    (broadcast) when more than one rank wants it."""

    owner: int
    file: int
    file_offset: int
    nbytes: int
    parts: tuple[Part, ...]
    wanted_by: frozenset[int]

    @property
    def shared(self) -> bool:
        return len(self.wanted_by) > 1

    def lands_whole(self, rank: int) -> bool:
        """Whether the unit's bytes are all of one range of one key ``rank`` wants: it can land in
        that key's memory; otherwise it goes through staging and its wanted parts are copied out."""
        return len(self.parts) == 1 and rank in self.wanted_by

    def split(self, at: int) -> tuple[Unit, Unit]:
        """The unit cut ``at`` bytes in (only units of one part are ever cut)."""
        if len(self.parts) != 1 or not 0 < at < self.nbytes:
            raise ValueError(f"cannot cut {self} at {at}")
        p = self.parts[0]
        head = dataclasses.replace(self, nbytes=at, parts=(Part(p.key, p.key_offset, 0, at),))
        tail = dataclasses.replace(self, file_offset=self.file_offset + at, nbytes=self.nbytes - at,
                                   parts=(Part(p.key, p.key_offset + at, 0, self.nbytes - at),))
        return head, tail


@dataclasses.dataclass(frozen=True)
class Window:
    """The units read in one step; ``units`` are in (owner, file, offset) order."""

    units: tuple[Unit, ...]

    def reads(self, rank: int) -> tuple[Unit, ...]:
        """What ``rank`` reads from storage in this window."""
        return tuple(u for u in self.units if u.owner == rank)

    @property
    def broadcasts(self) -> tuple[Unit, ...]:
        """The shared units, in the order every rank issues their broadcasts."""
        return tuple(u for u in self.units if u.shared)

    def staging_bytes(self, rank: int) -> int:
        """Bytes of this window's shared units that do not land whole at ``rank``."""
        return sum(u.nbytes for u in self.units if u.shared and not u.lands_whole(rank))


@dataclasses.dataclass(frozen=True)
class FanOutPlan:
    """Every read and broadcast of one load by a group of ``world`` ranks."""

    world: int
    windows: tuple[Window, ...]

    def units(self) -> Iterable[Unit]:
        for w in self.windows:
            yield from w.units

    def read_bytes(self, rank: int) -> int:
        """Bytes ``rank`` reads from storage."""
        return sum(u.nbytes for u in self.units() if u.owner == rank)

    def received_bytes(self, rank: int) -> int:
        """Bytes that arrive at ``rank`` from other ranks (whole units, wanted or not)."""
        return sum(u.nbytes for u in self.units() if u.shared and u.owner != rank)

    def staging_bytes(self, rank: int) -> int:
        """The most staging one window needs at ``rank``; at most two windows' exist at once."""
        return max((w.staging_bytes(rank) for w in self.windows), default=0)


def _pieces(seg: Segment, wanted_by: frozenset[int], owner: int, piece_bytes: int) -> list[Unit]:
    out = []
    for start in range(0, seg.nbytes, piece_bytes):
        n = min(piece_bytes, seg.nbytes - start)
        out.append(Unit(owner, seg.file, seg.file_offset + start, n, (Part(seg.key, start, 0, n),), wanted_by))
    return out


def _cut(units: list[Unit], bounds: Sequence[int]) -> list[list[Unit]]:
    """``units`` (a stream) cut into ``len(bounds)`` consecutive runs, run ``i`` ending where the
    stream's byte count reaches ``bounds[i]``; a unit of one part across a bound is split there,
    a unit of several parts goes whole to the run where it starts."""
    runs: list[list[Unit]] = [[] for _ in bounds]
    i = 0
    pos = 0
    queue = list(reversed(units))
    while queue:
        u = queue.pop()
        while i < len(bounds) - 1 and pos >= bounds[i]:
            i += 1
        room = bounds[i] - pos
        if i < len(bounds) - 1 and u.nbytes > room and len(u.parts) == 1 and room > 0:
            head, tail = u.split(room)
            queue.append(tail)
            u = head
        runs[i].append(u)
        pos += u.nbytes
    return runs


def _fill_targets(loads: Sequence[int], extra: int) -> list[int]:
    """How many of ``extra`` bytes each rank takes so the totals come out as even as they can
    (water filling over the bytes each rank reads anyway); the shares sum to ``extra``."""
    order = sorted(range(len(loads)), key=lambda r: (loads[r], r))
    prefix = 0
    for k, r in enumerate(order, 1):
        prefix += loads[r]
        # Level (extra + prefix) / k lifts the k least loaded ranks; stop once it is below the next.
        if k == len(order) or (extra + prefix) < loads[order[k]] * k:
            break
    level, rem = divmod(extra + prefix, k)
    shares = [0] * len(loads)
    for i, r in enumerate(sorted(order[:k])):
        shares[r] = level - loads[r] + (1 if i < rem else 0)
    return shares


def plan(segments: Sequence[Segment], wanted_by: Sequence[frozenset[int]], world: int, *,
         piece_bytes: int = PIECE_BYTES, window_bytes: int = WINDOW_BYTES,
         small_bytes: int = SMALL_BYTES, max_unit_bytes: int = MAX_UNIT_BYTES) -> FanOutPlan:
    """Plan a load by ``world`` ranks of ``segments``, segment ``i`` wanted by ranks ``wanted_by[i]``.

    Segments nobody wants, and empty ones, are not read. The same inputs give the same plan
    on every rank (nothing here depends on the rank that computes it).
    """
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    if len(segments) != len(wanted_by):
        raise ValueError("one set of wanting ranks per segment")
    for size, what in ((piece_bytes, "piece_bytes"), (window_bytes, "window_bytes"),
                       (max_unit_bytes, "max_unit_bytes")):
        if size < 1:
            raise ValueError(f"{what} must be positive, got {size}")
    max_unit_bytes = min(max_unit_bytes, piece_bytes)

    local: list[list[Unit]] = [[] for _ in range(world)]
    stream: list[Unit] = []  # shared units in file order, owners not yet chosen
    run: list[tuple[Segment, frozenset[int]]] = []

    def flush() -> None:
        if run:
            first = run[0][0]
            parts = tuple(Part(s.key, 0, s.file_offset - first.file_offset, s.nbytes) for s, _ in run)
            stream.append(Unit(-1, first.file, first.file_offset, sum(s.nbytes for s, _ in run), parts, run[0][1]))
            run.clear()

    order = sorted(range(len(segments)), key=lambda i: (segments[i].file, segments[i].file_offset))
    for i in order:
        seg, who = segments[i], frozenset(wanted_by[i])
        if seg.nbytes < 0 or seg.file_offset < 0:
            raise ValueError(f"negative segment {seg}")
        if seg.nbytes == 0 or not who:
            continue
        if not all(0 <= r < world for r in who):
            raise ValueError(f"segment {seg.key!r} is wanted by ranks outside 0..{world - 1}: {sorted(who)}")
        if len(who) == 1:
            (rank,) = who
            local[rank].extend(_pieces(seg, who, rank, piece_bytes))
            continue
        if seg.nbytes >= small_bytes:
            flush()
            stream.extend(_pieces(seg, who, -1, piece_bytes))
            continue
        if run:
            last = run[-1][0]
            total = last.file_offset + last.nbytes - run[0][0].file_offset
            if (last.file != seg.file or last.file_offset + last.nbytes != seg.file_offset
                    or run[0][1] != who or total + seg.nbytes > max_unit_bytes):
                flush()
        run.append((seg, who))
    flush()

    # Owners: each rank a contiguous stretch of the shared stream, sized to even out the totals.
    loads = [sum(u.nbytes for u in units) for units in local]
    shared_total = sum(u.nbytes for u in stream)
    targets = _fill_targets(loads, shared_total)
    bounds = [sum(targets[:r + 1]) for r in range(world)]
    owned = [[dataclasses.replace(u, owner=r) for u in units] for r, units in enumerate(_cut(stream, bounds))]

    # Windows: every rank reads 1/K of its stretch in each.
    k_windows = max(1, math.ceil(shared_total / window_bytes))
    windows: list[list[Unit]] = [[] for _ in range(k_windows)]
    for r in range(world):
        mine = sum(u.nbytes for u in owned[r])
        steps = [mine * (j + 1) // k_windows for j in range(k_windows)]
        for j, units in enumerate(_cut(owned[r], steps)):
            windows[j].extend(units)
        total = loads[r]
        pos = 0
        for u in local[r]:  # the rank's own ranges, spread over the windows alike
            windows[min(k_windows - 1, pos * k_windows // total)].append(u)
            pos += u.nbytes
    return FanOutPlan(world, tuple(Window(tuple(sorted(w, key=lambda u: (u.owner, u.file, u.file_offset))))
                                   for w in windows))
