"""Where each item of one rank's checkpoint file goes. Pure arithmetic, no torch, no I/O.

A tensor item is a small torch.save archive: ``head`` bytes (zip headers and the
pickle), the tensor's ``payload`` bytes, then ``tail`` bytes (the remaining
records and the zip directory). Large payloads are placed so that they start on
an ``alignment`` boundary of the *file*: the archive itself starts wherever that
requires, the gap before it stays a hole. Small items and raw byte items are
packed back to back: they are read in coalesced groups, where alignment buys
nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gdskit.engine.plan import align_up


@dataclasses.dataclass(frozen=True)
class ItemShape:
    """The three parts of one item's bytes (raw byte items have no head or tail, and are
    always packed, however large: nothing reads them straight into device memory)."""

    head: int
    payload: int
    tail: int
    raw: bool = False

    @property
    def length(self) -> int:
        return self.head + self.payload + self.tail


@dataclasses.dataclass(frozen=True)
class Placement:
    """One item's place in the file: ``[offset, offset + length)``, payload at ``payload_offset``."""

    offset: int
    length: int
    payload_offset: int
    aligned: bool

    @property
    def end(self) -> int:
        return self.offset + self.length


def place(shapes: Sequence[ItemShape], *, alignment: int = 4096, large: int = 1 << 20,
          start: int = 0) -> tuple[list[Placement], int]:
    """Place ``shapes`` one after another from ``start``.

    Payloads of at least ``large`` bytes start on a multiple of ``alignment``, unless raw.

    Returns
    -------
    (placements, file_size)
    """
    if alignment <= 0 or large < 0 or start < 0:
        raise ValueError("alignment must be > 0, large and start >= 0")
    out: list[Placement] = []
    pos = start
    for s in shapes:
        if min(s.head, s.payload, s.tail) < 0:
            raise ValueError(f"negative item part in {s}")
        aligned = not s.raw and s.payload >= large and s.payload > 0
        offset = align_up(pos + s.head, alignment) - s.head if aligned else pos
        out.append(Placement(offset, s.length, offset + s.head, aligned))
        pos = offset + s.length
    return out, pos
