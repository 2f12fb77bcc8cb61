"""Ledger rows another process recorded for this one's reads (a reader process, the resident
loader), taken in before the ledger itself is imported: importing it (its record types) costs a
load through the resident loader more than its own set-up. The ledger connects itself here when
it is imported and takes whatever waited; nothing can read the ledger before that."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from gdskit.vocabulary import Path, Reason

Row = tuple[str, str, str, int, int, float, int, tuple[tuple[int, int], ...]]

_lock = threading.Lock()
_waiting: list[Row] = []
_sink: list[Callable[[list[Row]], None]] = []


def checked(rows: Any) -> list[Row]:
    """``rows`` as the ledger takes them (``[path, reason, op, bytes, ops, busy_s, requests,
    [[bucket, count], ...]]`` each); ValueError or TypeError for anything else."""
    if not isinstance(rows, list):
        raise TypeError("ledger rows are not a list")
    out = []
    for r in rows:
        if not isinstance(r, (list, tuple)) or len(r) != 8:
            raise ValueError("a ledger row of the wrong shape")
        p, reason, op, b, n, busy, req, hist = r
        row = (str(p), str(reason), str(op), int(b), int(n), float(busy), int(req),
               tuple((int(k), int(c)) for k, c in hist))
        if not is_row(row):
            raise ValueError(f"not a ledger row: {row!r:.200}")
        out.append(row)
    return out


def is_row(row: Row) -> bool:
    """Whether a typed row is one the ledger records: a known path and reason, a read or a
    write, no negative figure."""
    p, reason, op, b, n, busy, req, hist = row
    if op not in ("read", "write") or min(b, n, req, busy) < 0 or any(k < 0 or c < 0 for k, c in hist):
        return False
    try:
        Path(p)
        Reason(reason)
    except ValueError:
        return False
    return True


def as_row(entry: Any) -> list[Any]:
    """A ledger entry (``LedgerEntry``) as a row another process takes in: plain lists, for JSON."""
    return [entry.path, entry.reason, entry.op, entry.bytes, entry.ops, entry.busy_s, entry.requests,
            [list(pair) for pair in entry.size_hist]]


def take(rows: Any) -> None:
    """Add rows another process sent (:func:`checked` first: ValueError or TypeError for a row
    that is not one) to the ledger, now if it is imported, else when it is."""
    add(checked(rows))


def add(rows: list[Row]) -> None:
    """Add checked rows to the ledger, now if it is imported, else when it is."""
    with _lock:
        if _sink:
            _sink[0](rows)
        else:
            _waiting.extend(rows)


def connect(sink: Callable[[list[Row]], None]) -> None:
    """The ledger's own: rows go to ``sink`` from now on, and those that waited go now."""
    with _lock:
        _sink[:] = [sink]
        waiting = _waiting[:]
        _waiting.clear()
        if waiting:
            sink(waiting)
