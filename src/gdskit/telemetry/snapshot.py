"""The published snapshot: what one process's ledger holds, as one JSON document.

Schema ``gdskit.stats/1`` (docs/stats.md). Level 1: bytes, ops, requests, busy
time and mean latency per path, per reason and per (path, reason, op) entry;
level 2 adds each entry's size histogram; a ledger with bytes from other ranks of a process group
(path ``peer``) also carries ``peer_bytes`` and ``peers`` (bytes per sending rank and backend); level 3 adds per-GPU figures and
cuFile's own counters. Readers keep working when later versions add keys;
:mod:`gdskit.telemetry.schema` checks a snapshot read from a file.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from gdskit.errors import FormatError
from gdskit.engine.ledger import PathStats, Stats, ledger
from gdskit.telemetry.cufile_counters import totals
from gdskit.telemetry.schema import MAX_ARGV, MAX_COUNT, SCHEMA, valid_session, validate  # noqa: F401 - validate: re-exported

#: The command line a snapshot carries is cut to this many characters (it is only shown).
MAX_ARGV_CHARS = 64 << 10


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
        **({"peer_bytes": stats.peer_bytes, "peers": [p.to_dict() for p in stats.peers]} if stats.peers else {}),
        **({"verified": stats.verified.to_dict()} if stats.verified.checks else {}),
    }


def build(*, level: int, pid: int, ticks: int | None, started_at: float, interval_s: float,
          session: str | None, final: bool, seq: int, baseline: Stats | None = None,
          gpus: dict[int, dict[str, PathStats]] | None = None,
          cufile: dict[int, dict[str, int]] | None = None) -> dict[str, Any]:
    """The snapshot document of this process (``baseline`` is subtracted: what a forked child inherited)."""
    stats = ledger.snapshot()
    if baseline is not None and baseline.entries:
        stats = _since(stats, baseline)
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "pid": pid,
        "start_ticks": ticks,
        "uid": os.geteuid(),
        "argv": command_line(getattr(sys, "orig_argv", sys.argv)),
        "level": level,
        "interval_s": interval_s,
        "session": session if valid_session(session) else None,
        "final": final,
        "seq": seq,
        "started_at": round(started_at, 3),
        "updated_at": round(time.time(), 3),
        "ledger": ledger_dict(stats, level),
    }
    if level >= 3:
        doc["gpus"] = {str(g): {p: _path_dict(ps) for p, ps in sorted(per.items())}
                       for g, per in sorted((gpus or {}).items())}
        if cufile is not None:
            # A counter out of range (a libcufile that wrapped or reset) is left out rather than make readers
            # refuse the whole snapshot.
            cufile = {g: {k: v for k, v in row.items() if 0 <= v <= MAX_COUNT} for g, row in cufile.items()}
        doc["cufile"] = (None if cufile is None else
                         {"per_gpu": {str(g): row for g, row in sorted(cufile.items())},
                          "totals": {k: v for k, v in totals(cufile).items() if v <= MAX_COUNT}})
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


def _since(stats: Stats, baseline: Stats) -> Stats:
    """``stats - baseline`` (what a forked child did itself); a row the child reset since counts whole."""
    before = {e.key: e for e in baseline.entries}
    out = []
    for e in stats.entries:
        b = before.get(e.key)
        d = e if b is None else e - b
        if min(d.bytes, d.ops, d.requests, d.busy_s, *(n for _, n in d.size_hist)) < 0:
            d = e  # gdskit.stats_reset() in the child: what is there is all its own
        out.append(d)
    verified = stats.verified - baseline.verified
    if min(verified.bytes, verified.checks) < 0:  # reset since the fork: the child's figures whole
        verified = stats.verified
    return Stats.from_entries(out, verified=verified)


def command_line(argv: list[str]) -> list[str]:
    """The command line as a snapshot carries it: UTF-8 text (undecodable bytes replaced), cut to
    MAX_ARGV_CHARS characters and MAX_ARGV arguments in all."""
    out: list[str] = []
    left = MAX_ARGV_CHARS
    for arg in argv[:MAX_ARGV]:
        try:
            raw = arg.encode("utf-8", "surrogateescape")  # the bytes the process was given
        except UnicodeEncodeError:
            raw = arg.encode("utf-8", "surrogatepass")
        arg = raw.decode("utf-8", "replace")
        if len(arg) > left:
            out.append(arg[:left] + "...")
            break
        out.append(arg)
        left -= len(arg)
    return out


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
