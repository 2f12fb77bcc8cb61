"""``gdskit bench s3://bucket/key``: one object read whole at each part size and concurrency of a
small grid, the cells interleaved and repeated, each reporting its rate, its GETs and retries
(the ledger's object rows) and a CRC-32 of the bytes it read.

The object is read into host memory (the engine's ranged GETs, straight into a buffer of at
most ``buffer_bytes``: an object larger than that is read a buffer at a time, in order). No GPU
is involved: the cells measure the store and the client, which is what part size and
concurrency tune.
"""

from __future__ import annotations

import statistics
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from gdskit.engine import is_object_url, object_endpoint_name, open_file, stats, stats_delta
from gdskit.errors import InvalidArgumentError
from gdskit.settings import settings

MiB = 1 << 20
#: The largest host buffer a cell reads into (an object larger than this is read in windows).
BUFFER_BYTES = 1024 * MiB
#: S3's limits on a part, which ``s3_part_size`` takes too.
MIN_PART, MAX_PART = 5 * MiB, 5 << 30

Progress = Callable[[int, int, str], None]


def default_grid() -> tuple[list[int], list[int]]:
    """Part sizes and concurrencies around the settings: a quarter of each and each itself."""
    part, conc = settings.s3_part_size, settings.s3_concurrency
    return sorted({max(MIN_PART, part // 4), part}), sorted({max(1, conc // 4), conc})


def _checked_grid(part_sizes: Sequence[int], concurrency: Sequence[int]) -> tuple[list[int], list[int]]:
    parts = sorted(set(int(p) for p in part_sizes))
    concs = sorted(set(int(c) for c in concurrency))
    if not parts or not concs:
        raise InvalidArgumentError("the grid needs at least one part size and one concurrency")
    bad = [p for p in parts if not MIN_PART <= p <= MAX_PART]
    if bad:
        raise InvalidArgumentError(f"part size {bad[0]} is outside S3's 5 MiB to 5 GiB")
    bad = [c for c in concs if not 1 <= c <= 256]
    if bad:
        raise InvalidArgumentError(f"concurrency {bad[0]} is outside 1 to 256")
    return parts, concs


@dataclass(frozen=True)
class ObjectCell:
    """One part size and concurrency: the median of its repetitions, and their spread."""

    part_size: int
    concurrency: int
    bytes: int                 # bytes read by each repetition (the whole object, when it went well)
    seconds: float             # median
    gb_s: float                # bytes / median seconds / 1e9
    gb_s_min: float
    gb_s_max: float
    gets: int                  # GETs of one repetition (median), retries included
    retries: int               # over every repetition
    crc32: int                 # of the bytes read (every repetition's must agree, else the cell says so)
    consistent: bool


@dataclass(frozen=True)
class ObjectBenchReport:
    url: str
    endpoint: str
    object_bytes: int
    etag: str | None
    repeat: int
    buffer_bytes: int
    cells: list[ObjectCell]

    @property
    def whole(self) -> bool:
        """Whether every cell read the whole object, the same bytes each time."""
        return all(c.bytes == self.object_bytes and c.consistent for c in self.cells) and \
            len({c.crc32 for c in self.cells}) <= 1

    @property
    def best(self) -> ObjectCell | None:
        return max(self.cells, key=lambda c: c.gb_s, default=None)

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {"url": self.url, "endpoint": self.endpoint, "object_bytes": self.object_bytes, "etag": self.etag,
                "repeat": self.repeat, "buffer_bytes": self.buffer_bytes, "whole": self.whole,
                "settings": {"s3_part_size": settings.s3_part_size, "s3_concurrency": settings.s3_concurrency},
                "best": None if best is None else {"part_size": best.part_size, "concurrency": best.concurrency,
                                                   "gb_s": best.gb_s},
                "cells": [asdict(c) for c in self.cells]}


@dataclass
class _Rep:
    seconds: float
    bytes: int
    gets: int
    retries: int
    crc32: int


def _read_whole(url: str, buf: np.ndarray) -> tuple[int, int]:
    """The object read whole, a buffer at a time, in order: bytes read and their CRC-32."""
    crc, done = 0, 0
    with open_file(url, "r") as f:
        size = f.size
        while done < size:
            n = min(buf.nbytes, size - done)
            got = f.read(buf, n, done)
            crc = zlib.crc32(memoryview(buf)[:got], crc)
            done += got
            if got < n:  # the engine raises where the object changed; a short read ends it here
                break
    return done, crc


def _one_rep(url: str, buf: np.ndarray, part: int, conc: int) -> _Rep:
    with settings.set(s3_part_size=part, s3_concurrency=conc):
        before = stats()
        t0 = time.perf_counter()
        nbytes, crc = _read_whole(url, buf)
        seconds = time.perf_counter() - t0
        delta = stats_delta(before, stats())
    reads = [o for o in delta.objects if o.op == "read"]
    return _Rep(seconds, nbytes, sum(o.ops for o in reads), sum(o.retries for o in reads), crc)


def run_object_bench(url: str, part_sizes: Sequence[int] | None = None, concurrency: Sequence[int] | None = None,
                     repeat: int = 3, buffer_bytes: int = BUFFER_BYTES,
                     progress: Progress | None = None) -> ObjectBenchReport:
    """Read the object at ``url`` whole in every cell of the grid, ``repeat`` times, the cells
    interleaved (A B C A B C ...) so that drift in the store spreads over all of them."""
    if not is_object_url(url):
        raise InvalidArgumentError(f"not an object URL (s3://bucket/key): {url!r:.200}")
    if repeat < 1:
        raise InvalidArgumentError(f"repeat must be at least 1, got {repeat}")
    if buffer_bytes < 1:
        raise InvalidArgumentError(f"the buffer must hold at least one byte, got {buffer_bytes}")
    dparts, dconcs = default_grid()
    parts, concs = _checked_grid(part_sizes or dparts, concurrency or dconcs)
    with open_file(url, "r") as f:  # a HEAD: the object's size, its ETag, and that it is there
        size, etag = f.size, f.etag
    buf = np.empty(max(1, min(size, buffer_bytes)), np.uint8)
    grid = [(p, c) for p in parts for c in concs]
    reps: dict[tuple[int, int], list[_Rep]] = {cell: [] for cell in grid}
    total = len(grid) * repeat
    for r in range(repeat):
        for i, (p, c) in enumerate(grid):
            if progress is not None:
                progress(r * len(grid) + i, total, f"{p // MiB} MiB parts x {c}")
            reps[(p, c)].append(_one_rep(url, buf, p, c))
    if progress is not None:
        progress(total, total, "done")
    return ObjectBenchReport(url, object_endpoint_name(), size, etag, repeat, buf.nbytes,
                             [_cell(p, c, reps[(p, c)]) for p, c in grid])


def _cell(part: int, conc: int, reps: list[_Rep]) -> ObjectCell:
    seconds = statistics.median(r.seconds for r in reps)
    nbytes = min(r.bytes for r in reps)
    rates = [r.bytes / r.seconds / 1e9 if r.seconds > 0 else 0.0 for r in reps]
    return ObjectCell(part, conc, nbytes, seconds, nbytes / seconds / 1e9 if seconds > 0 else 0.0,
                      min(rates), max(rates), int(statistics.median(r.gets for r in reps)),
                      sum(r.retries for r in reps), reps[0].crc32,
                      len({(r.bytes, r.crc32) for r in reps}) == 1)
