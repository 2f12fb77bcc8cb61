"""The ledger: what path every byte took, and why.

Backends record each finished piece of work as (path, reason, op, bytes, busy
seconds). ``gdskit.stats()`` returns an immutable snapshot; snapshots subtract,
so ``after - before`` is what happened in between.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from gdskit.vocabulary import Path, Reason


@dataclass(frozen=True)
class PathStats:
    """Totals for one path (or one reason)."""

    bytes_read: int = 0
    bytes_written: int = 0
    ops_read: int = 0
    ops_written: int = 0
    busy_s: float = 0.0

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    def __add__(self, other: PathStats) -> PathStats:
        return PathStats(self.bytes_read + other.bytes_read, self.bytes_written + other.bytes_written,
                         self.ops_read + other.ops_read, self.ops_written + other.ops_written,
                         self.busy_s + other.busy_s)

    def __sub__(self, other: PathStats) -> PathStats:
        return PathStats(self.bytes_read - other.bytes_read, self.bytes_written - other.bytes_written,
                         self.ops_read - other.ops_read, self.ops_written - other.ops_written,
                         self.busy_s - other.busy_s)

    def to_dict(self) -> dict[str, Any]:
        return {"bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "ops_read": self.ops_read, "ops_written": self.ops_written, "busy_s": round(self.busy_s, 6)}


@dataclass(frozen=True)
class LedgerEntry:
    """Totals for one (path, reason, op) combination."""

    path: str
    reason: str
    op: str  # "read" or "write"
    bytes: int
    ops: int
    busy_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "reason": self.reason, "op": self.op, "bytes": self.bytes,
                "ops": self.ops, "busy_s": round(self.busy_s, 6)}


def _group(entries: list[LedgerEntry], key: str) -> dict[str, PathStats]:
    out: dict[str, PathStats] = {}
    for e in entries:
        k = getattr(e, key)
        ps = (PathStats(bytes_read=e.bytes, ops_read=e.ops, busy_s=e.busy_s) if e.op == "read"
              else PathStats(bytes_written=e.bytes, ops_written=e.ops, busy_s=e.busy_s))
        out[k] = out.get(k, PathStats()) + ps
    return out


@dataclass(frozen=True)
class Stats:
    """A snapshot of the ledger.

    ``entries`` holds one row per (path, reason, op); ``paths`` and ``reasons``
    are the same totals grouped by path and by reason.
    """

    entries: tuple[LedgerEntry, ...] = ()
    paths: dict[str, PathStats] = field(default_factory=dict)
    reasons: dict[str, PathStats] = field(default_factory=dict)

    @classmethod
    def from_entries(cls, entries: list[LedgerEntry]) -> Stats:
        entries = sorted((e for e in entries if e.ops or e.bytes), key=lambda e: (e.path, e.reason, e.op))
        return cls(tuple(entries), _group(entries, "path"), _group(entries, "reason"))

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.entries)

    @property
    def bytes_read(self) -> int:
        return sum(e.bytes for e in self.entries if e.op == "read")

    @property
    def bytes_written(self) -> int:
        return sum(e.bytes for e in self.entries if e.op == "write")

    @property
    def direct_bytes(self) -> int:
        """Bytes that provably took the direct path (cufile-nvfs or cufile-p2pdma)."""
        return sum(e.bytes for e in self.entries if Path(e.path).is_direct)

    def __sub__(self, other: Stats) -> Stats:
        mine = {(e.path, e.reason, e.op): e for e in self.entries}
        theirs = {(e.path, e.reason, e.op): e for e in other.entries}
        out = []
        for k, e in mine.items():
            o = theirs.get(k)
            if o is None:
                out.append(e)
            else:
                out.append(LedgerEntry(e.path, e.reason, e.op, e.bytes - o.bytes, e.ops - o.ops, e.busy_s - o.busy_s))
        return Stats.from_entries(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_bytes": self.total_bytes,
            "direct_bytes": self.direct_bytes,
            "paths": {k: v.to_dict() for k, v in sorted(self.paths.items())},
            "reasons": {k: v.to_dict() for k, v in sorted(self.reasons.items())},
            "entries": [e.to_dict() for e in self.entries],
        }

    def summary(self) -> str:
        """A few human lines: bytes per path with the reasons."""
        if not self.entries:
            return "ledger: no I/O recorded"
        lines = ["ledger:"]
        for e in self.entries:
            lines.append(f"  {e.op:5s} {e.path:14s} {e.bytes / 2**20:12.1f} MiB {e.ops:8d} ops  reason={e.reason}")
        return "\n".join(lines)


class Ledger:
    """Thread-safe accumulator behind ``gdskit.stats()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])

    def record(self, path: Path, reason: Reason, op: str, nbytes: int, ops: int = 1, busy_s: float = 0.0) -> None:
        with self._lock:
            row = self._rows[(path.value, reason.value, op)]
            row[0] += nbytes
            row[1] += ops
            row[2] += busy_s

    def snapshot(self) -> Stats:
        with self._lock:
            entries = [LedgerEntry(p, r, op, int(v[0]), int(v[1]), float(v[2])) for (p, r, op), v in self._rows.items()]
        return Stats.from_entries(entries)

    def reset(self) -> None:
        with self._lock:
            self._rows.clear()


ledger = Ledger()


def stats() -> Stats:
    """A snapshot of bytes, ops and busy time per path and per reason since start (or the last reset)."""
    return ledger.snapshot()


def stats_reset() -> None:
    ledger.reset()


def stats_delta(before: Stats, after: Stats) -> Stats:
    return after - before
