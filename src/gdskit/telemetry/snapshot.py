"""The published snapshot: what one process's ledger holds, as one JSON document.

Schema ``gdskit.stats/1`` (docs/stats.md). Level 1: bytes, ops, requests, busy
time and mean latency per path, per reason and per (path, reason, op) entry;
level 2 adds each entry's size histogram; level 3 adds per-GPU figures and
cuFile's own counters. Readers keep working when later versions add keys.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from gdskit.errors import FormatError
from gdskit.ledger import PathStats, Stats, ledger

SCHEMA = "gdskit.stats/1"


def _path_dict(ps: PathStats) -> dict[str, Any]:
    d = ps.to_dict()
    lat = ps.mean_latency_s
    d["mean_latency_s"] = None if lat is None else round(lat, 9)
    return d


def ledger_dict(stats: Stats, level: int) -> dict[str, Any]:
    """A ledger snapshot as published at ``level``."""
    entries = []
    for e in stats.entries:
        d = e.to_dict()
        if level >= 2:
            d["size_hist"] = {str(1 << k): n for k, n in e.size_hist}
        entries.append(d)
    return {
        "total_bytes": stats.total_bytes,
        "direct_bytes": stats.direct_bytes,
        "posix_bytes": stats.total_bytes - stats.direct_bytes,
        "requests": stats.requests,
        "paths": {k: _path_dict(v) for k, v in sorted(stats.paths.items())},
        "reasons": {k: _path_dict(v) for k, v in sorted(stats.reasons.items())},
        "entries": entries,
    }


def build(*, level: int, pid: int, ticks: int | None, started_at: float, interval_s: float,
          session: str | None, final: bool, seq: int, baseline: Stats | None = None,
          gpus: dict[int, dict[str, PathStats]] | None = None,
          cufile: dict[int, dict[str, int]] | None = None) -> dict[str, Any]:
    """The snapshot document of this process (``baseline`` is subtracted: what a forked child inherited)."""
    from gdskit.telemetry.cufile_counters import totals  # noqa: PLC0415

    stats = ledger.snapshot()
    if baseline is not None and baseline.entries:
        stats = stats - baseline
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "pid": pid,
        "start_ticks": ticks,
        "uid": os.geteuid(),
        "argv": list(getattr(sys, "orig_argv", sys.argv)),
        "level": level,
        "interval_s": interval_s,
        "session": session,
        "final": final,
        "seq": seq,
        "started_at": round(started_at, 3),
        "updated_at": round(time.time(), 3),
        "ledger": ledger_dict(stats, level),
    }
    if level >= 3:
        doc["gpus"] = {str(g): {p: _path_dict(ps) for p, ps in sorted(per.items())}
                       for g, per in sorted((gpus or {}).items())}
        doc["cufile"] = (None if cufile is None else
                         {"per_gpu": {str(g): row for g, row in sorted(cufile.items())}, "totals": totals(cufile)})
    return doc


def restrict(doc: dict[str, Any], level: int) -> dict[str, Any]:
    """``doc`` as it would have been published at ``level`` (not above what it was published at)."""
    level = min(level, int(doc.get("level", 1)))
    out = dict(doc, level=level)
    if level < 3:
        out.pop("gpus", None)
        out.pop("cufile", None)
    if level < 2 and "ledger" in out:
        led = dict(out["ledger"])
        led["entries"] = [{k: v for k, v in e.items() if k != "size_hist"} for e in led.get("entries", [])]
        out["ledger"] = led
    return out


def validate(doc: Any, source: str) -> dict[str, Any]:
    """Check that ``doc`` is a snapshot this version can read; :class:`FormatError` otherwise."""
    schema = str(doc.get("schema", "")) if isinstance(doc, dict) else ""
    if not schema.startswith("gdskit.stats/"):
        raise FormatError(f"{source}: not a gdskit stats snapshot")
    if schema.split("/", 1)[1].split(".")[0] != SCHEMA.split("/", 1)[1]:
        # Minor versions (gdskit.stats/1.x) only add keys; another major version is another format.
        raise FormatError(f"{source}: snapshot schema {schema!r} is not one this gdskit reads ({SCHEMA})")
    for key in ("pid", "level", "ledger"):
        if key not in doc:
            raise FormatError(f"{source}: snapshot lacks {key!r}")
    if not isinstance(doc["ledger"], dict) or not isinstance(doc["ledger"].get("entries", []), list):
        raise FormatError(f"{source}: snapshot ledger is malformed")
    return doc


@dataclass(frozen=True)
class Snapshot:
    """One process's published figures, as read back (``doc`` is the JSON document)."""

    doc: dict[str, Any]
    file: str = ""

    @property
    def pid(self) -> int:
        return int(self.doc["pid"])

    @property
    def level(self) -> int:
        return int(self.doc["level"])

    @property
    def session(self) -> str | None:
        return self.doc.get("session")

    @property
    def final(self) -> bool:
        return bool(self.doc.get("final"))

    @property
    def updated_at(self) -> float:
        return float(self.doc.get("updated_at", 0.0))

    @property
    def command(self) -> str:
        return " ".join(self.doc.get("argv") or [])

    @property
    def stats(self) -> Stats:
        try:
            return Stats.from_dict(self.doc["ledger"])
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{self.file or 'snapshot'}: malformed ledger entry ({exc})") from None

    @property
    def cufile_totals(self) -> dict[str, int] | None:
        cu = self.doc.get("cufile")
        return None if not cu else {k: int(v) for k, v in cu.get("totals", {}).items()}
