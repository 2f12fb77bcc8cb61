"""Offset and size arithmetic: aligned spans and chunking. Pure functions, no I/O."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from gdskit.errors import InvalidArgumentError


def align_down(value: int, alignment: int) -> int:
    return value - (value % alignment)


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True, slots=True)
class Chunk:
    """One piece of a request: ``size`` bytes at ``file_offset`` <-> ``buf_offset``."""

    file_offset: int
    buf_offset: int
    size: int


def chunks(file_offset: int, buf_offset: int, size: int, chunk_size: int, alignment: int = 1) -> list[Chunk]:
    """Split a request into chunks of at most ``chunk_size`` bytes.

    Chunk boundaries after the first fall on multiples of ``alignment`` in the
    *file*, so that every chunk but the first starts aligned and O_DIRECT can
    read it without an extra head block.
    """
    if size <= 0:
        return []
    out: list[Chunk] = []
    pos = file_offset
    end = file_offset + size
    first_end = min(end, align_down(file_offset, alignment) + chunk_size) if alignment > 1 else min(end, pos + chunk_size)
    if first_end <= pos:
        first_end = min(end, pos + chunk_size)
    cut = first_end
    while pos < end:
        n = cut - pos
        out.append(Chunk(pos, buf_offset + (pos - file_offset), n))
        pos = cut
        cut = min(end, pos + chunk_size)
    return out


@dataclass(frozen=True)
class AlignedSpan:
    """The aligned file range that covers ``[offset, offset + size)``.

    ``head`` is how far the wanted bytes start into the span.
    """

    start: int
    length: int
    head: int


def aligned_span(offset: int, size: int, alignment: int) -> AlignedSpan:
    start = align_down(offset, alignment)
    end = align_up(offset + size, alignment)
    return AlignedSpan(start, end - start, offset - start)


@dataclass(frozen=True)
class SplitRange:
    """A request split into an unaligned head, an aligned body and an unaligned tail (file offsets)."""

    head: Chunk | None
    body: Chunk | None
    tail: Chunk | None


def split_aligned(file_offset: int, buf_offset: int, size: int, alignment: int) -> SplitRange:
    """Split so that ``body`` has aligned file offset and size (and the same buffer shift)."""
    end = file_offset + size
    body_start = align_up(file_offset, alignment)
    body_end = align_down(end, alignment)
    if body_end <= body_start:
        return SplitRange(Chunk(file_offset, buf_offset, size) if size else None, None, None)
    head = Chunk(file_offset, buf_offset, body_start - file_offset) if body_start > file_offset else None
    body = Chunk(body_start, buf_offset + body_start - file_offset, body_end - body_start)
    tail = Chunk(body_end, buf_offset + body_end - file_offset, end - body_end) if end > body_end else None
    return SplitRange(head, body, tail)


def nonnegative_int(name: str, value: Any) -> int:
    """A non-negative offset or size: an ``int`` or anything with ``__index__`` (numpy integers),
    never a ``bool`` (``file_offset=True`` is a mistake, not offset 1)."""
    if type(value) is int and value >= 0:
        return value
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be an integer, not a boolean")
    if not isinstance(value, int):
        try:
            value = operator.index(value)
        except Exception:
            raise InvalidArgumentError(f"{name} must be an integer, got {type(value).__name__}") from None
    if value < 0:
        raise InvalidArgumentError(f"{name} must be >= 0, got {value}")
    return value


def spread(n: int, k: int) -> list[int]:
    """Up to ``k`` indices of ``range(n)`` spread evenly over it, the first and last included
    (the files a job samples to judge all of them)."""
    if n <= 0 or k <= 0:
        return []
    if k == 1 or n == 1:
        return [0]
    return sorted({i * (n - 1) // (k - 1) for i in range(k)})
