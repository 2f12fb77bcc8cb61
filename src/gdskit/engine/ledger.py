"""The ledger: what path every byte took, and why.

Backends record each finished piece of work as (path, reason, op, bytes, busy
seconds). ``gdskit.stats()`` returns an immutable snapshot; snapshots subtract,
so ``after - before`` is what happened in between, and add, so the ledgers of
several processes sum.

Each record is one request (or the part of one that took one path): rows also
count records (``requests``, so ``busy_s / requests`` is the mean latency) and
keep a log2 histogram of their sizes, both under the lock the row update already
takes. ``gdskit stats`` publishes them (gdskit.telemetry).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gdskit.engine import ledger_inbox
from gdskit.vocabulary import Path, Reason, is_direct_path, is_peer_path

#: A size histogram: (k, count) pairs, sorted by k; bucket k counts records of at most 2**k bytes
#: (and more than 2**(k-1)); bucket 0 also holds empty records.
SizeHistogram = tuple[tuple[int, int], ...]


def size_bucket(nbytes: int) -> int:
    """The histogram bucket of a record of ``nbytes``: the smallest k with nbytes <= 2**k."""
    return (nbytes - 1).bit_length() if nbytes > 1 else 0


def _merge_hist(a: SizeHistogram, b: SizeHistogram, sign: int = 1) -> SizeHistogram:
    out = dict(a)
    for k, n in b:
        out[k] = out.get(k, 0) + sign * n
    return tuple(sorted((k, n) for k, n in out.items() if n))


@dataclass(frozen=True)
class PathStats:
    """Totals for one path (or one reason).

    ``requests`` counts ledger records (requests, or the part of one that took
    this path); ``mean_latency_s`` is their mean busy time.
    """

    bytes_read: int = 0
    bytes_written: int = 0
    ops_read: int = 0
    ops_written: int = 0
    busy_s: float = 0.0
    requests: int = 0

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def mean_latency_s(self) -> float | None:
        return self.busy_s / self.requests if self.requests else None

    def __add__(self, other: PathStats) -> PathStats:
        return PathStats(self.bytes_read + other.bytes_read, self.bytes_written + other.bytes_written,
                         self.ops_read + other.ops_read, self.ops_written + other.ops_written,
                         self.busy_s + other.busy_s, self.requests + other.requests)

    def __sub__(self, other: PathStats) -> PathStats:
        return PathStats(self.bytes_read - other.bytes_read, self.bytes_written - other.bytes_written,
                         self.ops_read - other.ops_read, self.ops_written - other.ops_written,
                         self.busy_s - other.busy_s, self.requests - other.requests)

    def to_dict(self) -> dict[str, Any]:
        return {"bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "ops_read": self.ops_read, "ops_written": self.ops_written, "busy_s": round(self.busy_s, 6),
                "requests": self.requests}


@dataclass(frozen=True)
class LedgerEntry:
    """Totals for one (path, reason, op) combination."""

    path: str
    reason: str
    op: str  # "read" or "write"
    bytes: int
    ops: int
    busy_s: float
    requests: int = 0
    size_hist: SizeHistogram = ()

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.path, self.reason, self.op)

    def __add__(self, other: LedgerEntry) -> LedgerEntry:
        return LedgerEntry(self.path, self.reason, self.op, self.bytes + other.bytes, self.ops + other.ops,
                           self.busy_s + other.busy_s, self.requests + other.requests,
                           _merge_hist(self.size_hist, other.size_hist))

    def __sub__(self, other: LedgerEntry) -> LedgerEntry:
        return LedgerEntry(self.path, self.reason, self.op, self.bytes - other.bytes, self.ops - other.ops,
                           self.busy_s - other.busy_s, self.requests - other.requests,
                           _merge_hist(self.size_hist, other.size_hist, -1))

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "reason": self.reason, "op": self.op, "bytes": self.bytes,
                "ops": self.ops, "busy_s": round(self.busy_s, 6), "requests": self.requests}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LedgerEntry:
        """The inverse of :meth:`to_dict`; also reads ``size_hist`` ({"<max bytes>": count}) if present."""
        hist = tuple(sorted((size_bucket(int(k)), int(n)) for k, n in (d.get("size_hist") or {}).items()))
        return cls(str(d["path"]), str(d["reason"]), str(d["op"]), int(d["bytes"]), int(d["ops"]),
                   float(d["busy_s"]), int(d.get("requests", 0)), hist)


@dataclass(frozen=True)
class PeerEntry:
    """Bytes that arrived from one rank of a process group through one backend (path ``peer``)."""

    source_rank: int
    backend: str  # the torch.distributed backend that carried them: "nccl", "gloo", ...
    bytes: int
    ops: int
    busy_s: float

    @property
    def key(self) -> tuple[int, str]:
        return (self.source_rank, self.backend)

    def _combine(self, other: PeerEntry, sign: int) -> PeerEntry:
        return PeerEntry(self.source_rank, self.backend, self.bytes + sign * other.bytes,
                         self.ops + sign * other.ops, self.busy_s + sign * other.busy_s)

    def to_dict(self) -> dict[str, Any]:
        return {"source_rank": self.source_rank, "backend": self.backend, "bytes": self.bytes,
                "ops": self.ops, "busy_s": round(self.busy_s, 6)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PeerEntry:
        return cls(int(d["source_rank"]), str(d["backend"]), int(d["bytes"]), int(d["ops"]), float(d["busy_s"]))


@dataclass(frozen=True)
class ObjectEntry:
    """Requests to one object store endpoint (path ``object``): ``ops`` requests sent (GETs for
    reads; part uploads and the like for writes), ``retries`` of them sent again after throttling,
    a server error or a dropped connection; ``bytes`` moved by the ones that succeeded."""

    endpoint: str
    op: str
    bytes: int
    ops: int
    retries: int
    busy_s: float

    @property
    def key(self) -> tuple[str, str]:
        return (self.endpoint, self.op)

    def _combine(self, other: ObjectEntry, sign: int) -> ObjectEntry:
        return ObjectEntry(self.endpoint, self.op, self.bytes + sign * other.bytes, self.ops + sign * other.ops,
                           self.retries + sign * other.retries, self.busy_s + sign * other.busy_s)

    def to_dict(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "op": self.op, "bytes": self.bytes, "ops": self.ops,
                "retries": self.retries, "busy_s": round(self.busy_s, 6)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ObjectEntry:
        return cls(str(d["endpoint"]), str(d["op"]), int(d["bytes"]), int(d["ops"]), int(d["retries"]),
                   float(d["busy_s"]))


def _merge_rows(a: tuple[Any, ...], b: tuple[Any, ...], sign: int) -> tuple[Any, ...]:
    """``a + b`` or ``a - b`` row by row, for rows with ``key``, ``bytes``, ``ops`` and
    ``_combine`` (:class:`PeerEntry`, :class:`RoutedEntry`); a difference keeps only ``a``'s rows,
    as entries do."""
    out = {r.key: r for r in a}
    for r in b:
        mine = out.get(r.key)
        if mine is not None:
            out[r.key] = mine._combine(r, sign)
        elif sign > 0:
            out[r.key] = r
    return tuple(sorted((r for r in out.values() if r.bytes or r.ops), key=lambda r: r.key))


@dataclass(frozen=True)
class RoutedEntry:
    """Bytes read for GPU ``target_gpu`` through GPU ``via_gpu`` (a routed read, gdskit.engine.gpu_routing):
    they took ``path`` from storage into ``via_gpu``, then a device-to-device copy to the target.
    The same bytes are in the entries under that path, on the target's per-GPU figures."""

    via_gpu: int
    target_gpu: int
    path: str
    op: str
    bytes: int
    ops: int
    busy_s: float

    @property
    def key(self) -> tuple[int, int, str, str]:
        return (self.via_gpu, self.target_gpu, self.path, self.op)

    def _combine(self, other: RoutedEntry, sign: int) -> RoutedEntry:
        return RoutedEntry(self.via_gpu, self.target_gpu, self.path, self.op, self.bytes + sign * other.bytes,
                           self.ops + sign * other.ops, self.busy_s + sign * other.busy_s)

    def to_dict(self) -> dict[str, Any]:
        return {"via_gpu": self.via_gpu, "target_gpu": self.target_gpu, "path": self.path, "op": self.op,
                "bytes": self.bytes, "ops": self.ops, "busy_s": round(self.busy_s, 6)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RoutedEntry:
        return cls(int(d["via_gpu"]), int(d["target_gpu"]), str(d["path"]), str(d["op"]), int(d["bytes"]),
                   int(d["ops"]), float(d["busy_s"]))


def _group(entries: list[LedgerEntry], key: str) -> dict[str, PathStats]:
    out: dict[str, PathStats] = {}
    for e in entries:
        k = getattr(e, key)
        ps = (PathStats(bytes_read=e.bytes, ops_read=e.ops, busy_s=e.busy_s, requests=e.requests) if e.op == "read"
              else PathStats(bytes_written=e.bytes, ops_written=e.ops, busy_s=e.busy_s, requests=e.requests))
        out[k] = out.get(k, PathStats()) + ps
    return out


@dataclass(frozen=True)
class VerifiedStats:
    """Bytes whose digests were checked where they landed (``verify=``): ``bytes`` in all,
    ``gpu_bytes`` of them hashed on a GPU, ``seconds`` the checks took, ``checks`` how many."""

    bytes: int = 0
    gpu_bytes: int = 0
    seconds: float = 0.0
    checks: int = 0

    def _combine(self, other: VerifiedStats, sign: int) -> VerifiedStats:
        return VerifiedStats(self.bytes + sign * other.bytes, self.gpu_bytes + sign * other.gpu_bytes,
                             self.seconds + sign * other.seconds, self.checks + sign * other.checks)

    def __add__(self, other: VerifiedStats) -> VerifiedStats:
        return self._combine(other, 1)

    def __sub__(self, other: VerifiedStats) -> VerifiedStats:
        return self._combine(other, -1)

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "gpu_bytes": self.gpu_bytes, "seconds": self.seconds, "checks": self.checks}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VerifiedStats:
        return cls(int(d.get("bytes", 0)), int(d.get("gpu_bytes", 0)), float(d.get("seconds", 0.0)),
                   int(d.get("checks", 0)))


@dataclass(frozen=True)
class Stats:
    """A snapshot of the ledger.

    ``entries`` holds one row per (path, reason, op); ``paths`` and ``reasons``
    are the same totals grouped by path and by reason. ``peers`` splits the bytes of
    path ``peer`` by the rank that sent them and the backend that carried them.
    ``routed`` lists the bytes that went through another GPU (``via_gpu``) on their way.
    ``objects`` counts the requests (GETs, part uploads) and retries per object store endpoint.
    ``verified`` counts the bytes whose digests were checked after they landed: all of them,
    those hashed on a GPU, and the seconds the checks took (``gdskit.verify``).
    """

    entries: tuple[LedgerEntry, ...] = ()
    paths: dict[str, PathStats] = field(default_factory=dict)
    reasons: dict[str, PathStats] = field(default_factory=dict)
    peers: tuple[PeerEntry, ...] = ()
    routed: tuple[RoutedEntry, ...] = ()
    objects: tuple[ObjectEntry, ...] = ()
    verified: VerifiedStats = field(default_factory=lambda: VerifiedStats())

    @classmethod
    def from_entries(cls, entries: list[LedgerEntry], peers: tuple[PeerEntry, ...] = (),
                     routed: tuple[RoutedEntry, ...] = (), objects: tuple[ObjectEntry, ...] = (),
                     verified: VerifiedStats | None = None) -> Stats:
        entries = sorted((e for e in entries if e.ops or e.bytes or e.requests), key=lambda e: e.key)
        return cls(tuple(entries), _group(entries, "path"), _group(entries, "reason"),
                   _merge_rows((), tuple(peers), 1), _merge_rows((), tuple(routed), 1),
                   _merge_rows((), tuple(objects), 1), verified if verified is not None else VerifiedStats())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Stats:
        """Rebuild a snapshot from :meth:`to_dict` output (the ``entries``, ``peers`` and
        ``routed`` carry everything)."""
        return cls.from_entries([LedgerEntry.from_dict(e) for e in d.get("entries", ())],
                                tuple(PeerEntry.from_dict(p) for p in d.get("peers", ())),
                                tuple(RoutedEntry.from_dict(r) for r in d.get("routed", ())),
                                tuple(ObjectEntry.from_dict(o) for o in d.get("objects", ())),
                                VerifiedStats.from_dict(d.get("verified") or {}))

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
        return sum(e.bytes for e in self.entries if is_direct_path(e.path))

    @property
    def peer_bytes(self) -> int:
        """Bytes that arrived from other ranks of a process group (path ``peer``): no storage I/O here."""
        return sum(e.bytes for e in self.entries if is_peer_path(e.path))

    @property
    def storage_bytes(self) -> int:
        """Bytes moved between storage and memory: every path but ``peer``."""
        return self.total_bytes - self.peer_bytes

    @property
    def routed_bytes(self) -> int:
        """Bytes read through another GPU than their target (``routed``); part of the paths' bytes."""
        return sum(r.bytes for r in self.routed)

    @property
    def requests(self) -> int:
        return sum(e.requests for e in self.entries)

    def __sub__(self, other: Stats) -> Stats:
        theirs = {e.key: e for e in other.entries}
        out = []
        for e in self.entries:
            o = theirs.get(e.key)
            out.append(e if o is None else e - o)
        return Stats.from_entries(out, _merge_rows(self.peers, other.peers, -1),
                                  _merge_rows(self.routed, other.routed, -1),
                                  _merge_rows(self.objects, other.objects, -1), self.verified - other.verified)

    def __add__(self, other: Stats) -> Stats:
        out = {e.key: e for e in self.entries}
        for e in other.entries:
            out[e.key] = out[e.key] + e if e.key in out else e
        return Stats.from_entries(list(out.values()), _merge_rows(self.peers, other.peers, 1),
                                  _merge_rows(self.routed, other.routed, 1),
                                  _merge_rows(self.objects, other.objects, 1), self.verified + other.verified)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "total_bytes": self.total_bytes,
            "direct_bytes": self.direct_bytes,
            "paths": {k: v.to_dict() for k, v in sorted(self.paths.items())},
            "reasons": {k: v.to_dict() for k, v in sorted(self.reasons.items())},
            "entries": [e.to_dict() for e in self.entries],
        }
        if self.peers:
            d["peer_bytes"] = self.peer_bytes
            d["peers"] = [p.to_dict() for p in self.peers]
        if self.routed:
            d["routed_bytes"] = self.routed_bytes
            d["routed"] = [r.to_dict() for r in self.routed]
        if self.objects:
            d["objects"] = [o.to_dict() for o in self.objects]
        if self.verified.checks:
            d["verified"] = self.verified.to_dict()
        return d

    def summary(self) -> str:
        """A few human lines: bytes per path with the reasons (and, for ``peer``, which rank sent them)."""
        if not self.entries and not self.verified.checks:
            return "ledger: no I/O recorded"
        lines = ["ledger:"]
        for e in self.entries:
            lines.append(f"  {e.op:5s} {e.path:14s} {e.bytes / 2**20:12.1f} MiB {e.ops:8d} ops  reason={e.reason}")
        for p in self.peers:
            lines.append(f"        {'from rank ' + str(p.source_rank):14s} {p.bytes / 2**20:12.1f} MiB {p.ops:8d} ops  "
                         f"over {p.backend}")
        if self.peer_bytes:
            lines.append(f"  storage {self.storage_bytes / 2**20:.1f} MiB, from peers {self.peer_bytes / 2**20:.1f} MiB")
        for r in self.routed:
            lines.append(f"  {r.op:5s} {r.path:14s} {r.bytes / 2**20:12.1f} MiB {r.ops:8d} ops  "
                         f"for GPU {r.target_gpu} through GPU {r.via_gpu}")
        for o in self.objects:
            lines.append(f"  {o.op:5s} {'object':14s} {o.bytes / 2**20:12.1f} MiB {o.ops:8d} requests  "
                         f"{o.retries} retried  at {o.endpoint}")
        v = self.verified
        if v.checks:
            lines.append(f"  verified {v.bytes / 2**20:.1f} MiB ({v.gpu_bytes / 2**20:.1f} MiB on a GPU) "
                         f"in {v.seconds:.3f} s, {v.checks} checks")
        return "\n".join(lines)


def _new_row() -> list[Any]:
    return [0, 0, 0.0, 0, {}]  # bytes, ops, busy seconds, records, size histogram {bucket: count}


class _Shard:
    """One thread's rows: each thread adds to its own, so a record takes no lock."""

    __slots__ = ("rows", "device_rows", "peer_rows", "routed_rows", "object_rows", "route", "records", "thread")

    def __init__(self, thread: threading.Thread | None) -> None:
        self.rows: dict[tuple[str, str, str], list[Any]] = defaultdict(_new_row)
        self.device_rows: dict[tuple[int, str, str], list[Any]] = defaultdict(_new_row)
        self.peer_rows: dict[tuple[int, str], list[Any]] = defaultdict(_new_row)  # (source rank, backend)
        self.routed_rows: dict[tuple[int, int, str, str], list[Any]] = defaultdict(_new_row)  # (via, target, path, op)
        # (endpoint, op) -> bytes, requests, busy seconds, retries (the histogram's slot), {}
        self.object_rows: dict[tuple[str, str], list[Any]] = defaultdict(_new_row)
        self.route: tuple[int, int] | None = None  # (via GPU, target GPU) while a routed read records
        self.records = 0
        self.thread = thread  # None: the rows of threads that have ended


def _add_rows(into: dict[tuple[Any, ...], list[Any]], rows: dict[tuple[Any, ...], list[Any]]) -> None:
    for key, v in list(rows.items()):
        acc = into.get(key)
        if acc is None:
            into[key] = [v[0], v[1], v[2], v[3], dict(v[4])]
            continue
        acc[0] += v[0]
        acc[1] += v[1]
        acc[2] += v[2]
        acc[3] += v[3]
        for b, c in list(v[4].items()):
            acc[4][b] = acc[4].get(b, 0) + c


class Ledger:
    """Thread-safe accumulator behind ``gdskit.stats()``.

    Every thread records into its own shard (no lock on the I/O path: a request
    from Python costs a few microseconds, and a shared lock was a good part of
    it, more so when threads contend). Snapshots add the shards up; a snapshot
    taken while I/O is in flight may see a record's bytes a moment before its
    op count. The shards of threads that have ended are folded into one when a
    new thread first records, so a program that starts many threads keeps a
    bounded number. ``version`` changes with every record and reset, so a reader
    can tell cheaply whether anything happened since it last looked.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the shard list and resets; never taken by record()
        self._retired = _Shard(None)
        self._shards: list[_Shard] = [self._retired]
        self._local = threading.local()
        self._resets = 0
        self._verified = VerifiedStats()  # under _lock: checks are few (one per load), not per I/O

    def _new_shard(self) -> _Shard:
        shard = _Shard(threading.current_thread())
        with self._lock:
            live = []
            for s in self._shards:
                if s.thread is None or s.thread.is_alive():
                    live.append(s)
                else:  # its thread has ended: nothing writes to it any more
                    _add_rows(self._retired.rows, s.rows)
                    _add_rows(self._retired.device_rows, s.device_rows)
                    _add_rows(self._retired.peer_rows, s.peer_rows)
                    _add_rows(self._retired.routed_rows, s.routed_rows)
                    _add_rows(self._retired.object_rows, s.object_rows)
                    self._retired.records += s.records
            live.append(shard)
            self._shards = live
        self._local.shard = shard
        return shard

    @property
    def version(self) -> int:
        with self._lock:
            return self._resets + sum(s.records for s in self._shards)

    def record(self, path: Path, reason: Reason, op: str, nbytes: int, ops: int = 1, busy_s: float = 0.0,
               device: int | None = None, requests: int = 1) -> None:
        """Add finished work: ``requests`` requests of ``nbytes / requests`` bytes each (one, usually);
        ``device`` (the GPU, if any) feeds the per-GPU figures."""
        try:
            shard = self._local.shard
        except AttributeError:
            shard = self._new_shard()
        each = nbytes // requests if requests > 1 else nbytes
        bucket = (each - 1).bit_length() if each > 1 else 0  # size_bucket(), inlined: this is the hot path
        row = shard.rows[(path.value, reason.value, op)]
        row[0] += nbytes
        row[1] += ops
        row[2] += busy_s
        row[3] += requests
        hist = row[4]
        hist[bucket] = hist.get(bucket, 0) + requests
        route = shard.route
        if route is not None:
            device = self._record_routed(shard, route, path, op, nbytes, ops, busy_s)
        if device is not None:
            drow = shard.device_rows[(device, path.value, op)]
            drow[0] += nbytes
            drow[1] += ops
            drow[2] += busy_s
            drow[3] += requests
        shard.records += 1

    def add_entries(self, entries: Iterable[LedgerEntry]) -> None:
        """Add rows recorded elsewhere (a reader process's, for reads it made for this one),
        exactly: bytes, ops, busy time, requests and size histogram."""
        checked = []
        for e in entries:  # every row checked before any is added (ValueError names the first bad one)
            if not ledger_inbox.is_row((e.path, e.reason, e.op, e.bytes, e.ops, e.busy_s, e.requests, e.size_hist)):
                raise ValueError(f"not a ledger row: {e!r:.200}")
            checked.append(((Path(e.path).value, Reason(e.reason).value, e.op), e))
        try:
            shard = self._local.shard
        except AttributeError:
            shard = self._new_shard()
        for key, e in checked:  # this thread's own shard, as record() adds to it
            _add_rows(shard.rows, {key: [e.bytes, e.ops, e.busy_s, e.requests, dict(e.size_hist)]})
        shard.records += len(checked)

    # -- routed reads (gdskit.engine.via_gpu) -----------------------------------------------------------
    @contextlib.contextmanager
    def routing(self, via_gpu: int, target_gpu: int) -> Iterator[None]:
        """Records this thread makes inside the block are of bytes read into GPU ``via_gpu`` for
        GPU ``target_gpu``: they also go to the ``routed`` rows, and to the target's per-GPU
        figures (not the via GPU's)."""
        try:
            shard = self._local.shard
        except AttributeError:
            shard = self._new_shard()
        before, shard.route = shard.route, (int(via_gpu), int(target_gpu))
        try:
            yield
        finally:
            shard.route = before

    @staticmethod
    def _record_routed(shard: _Shard, route: tuple[int, int], path: Path, op: str, nbytes: int, ops: int,
                       busy_s: float) -> int:
        row = shard.routed_rows[(route[0], route[1], path.value, op)]
        row[0] += nbytes
        row[1] += ops
        row[2] += busy_s
        row[3] += 1
        return route[1]

    # -- bytes from other ranks (gdskit.group) -------------------------------------------------
    def record_peer(self, nbytes: int, source_rank: int, backend: str, busy_s: float = 0.0,
                    device: int | None = None, ops: int = 1) -> None:
        """Add bytes that arrived from rank ``source_rank`` of a process group over ``backend``
        ("nccl", "gloo"): path ``peer``, reason ``fan_out``, plus the per-sender row."""
        self.record(Path.PEER, Reason.FAN_OUT, "read", nbytes, ops, busy_s, device, requests=ops)
        row = self._local.shard.peer_rows[(int(source_rank), str(backend))]
        row[0] += nbytes
        row[1] += ops
        row[2] += busy_s
        row[3] += ops

    # -- object stores (gdskit.engine.objects) ---------------------------------------------------
    def record_object(self, endpoint: str, op: str, nbytes: int, requests: int, retries: int, busy_s: float) -> None:
        """Count requests to an object store ``endpoint``: ``requests`` sent, ``retries`` of them
        again after a failure, ``nbytes`` moved (the bytes' path rows are recorded by the reader)."""
        try:
            shard = self._local.shard
        except AttributeError:
            shard = self._new_shard()
        row = shard.object_rows[(str(endpoint), op)]
        row[0] += nbytes
        row[1] += requests
        row[2] += busy_s
        row[3] += retries
        shard.records += 1

    def _merged(self, which: str) -> dict[tuple[Any, ...], list[Any]]:
        out: dict[tuple[Any, ...], list[Any]] = {}
        with self._lock:  # folding (in _new_shard) must not move rows while they are added up
            for shard in self._shards:
                _add_rows(out, getattr(shard, which))
        return out

    def snapshot(self) -> Stats:
        entries = [LedgerEntry(p, r, op, int(v[0]), int(v[1]), float(v[2]), int(v[3]), tuple(sorted(v[4].items())))
                   for (p, r, op), v in self._merged("rows").items()]
        peers = tuple(PeerEntry(rank, backend, int(v[0]), int(v[1]), float(v[2]))
                      for (rank, backend), v in self._merged("peer_rows").items())
        routed = tuple(RoutedEntry(via, target, path, op, int(v[0]), int(v[1]), float(v[2]))
                       for (via, target, path, op), v in self._merged("routed_rows").items())
        objects = tuple(ObjectEntry(endpoint, op, int(v[0]), int(v[1]), int(v[3]), float(v[2]))
                        for (endpoint, op), v in self._merged("object_rows").items())
        with self._lock:
            verified = self._verified
        return Stats.from_entries(entries, peers, routed, objects, verified)

    def record_verified(self, nbytes: int, seconds: float, gpu_bytes: int = 0, checks: int = 1) -> None:
        """Count ``nbytes`` whose digests were checked (``gpu_bytes`` of them on a GPU) in ``seconds``."""
        with self._lock:
            self._verified = self._verified + VerifiedStats(int(nbytes), int(gpu_bytes), float(seconds), int(checks))
            self._resets += 1  # a change readers of ``version`` must see

    def device_snapshot(self) -> dict[int, dict[str, PathStats]]:
        """Totals per GPU and path, from the records that named their device."""
        out: dict[int, dict[str, PathStats]] = {}
        for (device, path, op), (nbytes, ops, busy, requests, _hist) in self._merged("device_rows").items():
            ps = (PathStats(bytes_read=nbytes, ops_read=ops, busy_s=busy, requests=requests) if op == "read"
                  else PathStats(bytes_written=nbytes, ops_written=ops, busy_s=busy, requests=requests))
            per_path = out.setdefault(device, {})
            per_path[path] = per_path.get(path, PathStats()) + ps
        return out

    def reset(self) -> None:
        with self._lock:
            for shard in self._shards:
                # New dicts rather than clear(): a thread mid-record keeps its old row and cannot
                # resurrect a key in the new ones.
                shard.rows = defaultdict(_new_row)
                shard.device_rows = defaultdict(_new_row)
                shard.peer_rows = defaultdict(_new_row)
                shard.routed_rows = defaultdict(_new_row)
                shard.object_rows = defaultdict(_new_row)
            self._verified = VerifiedStats()
            self._resets += 1


ledger = Ledger()

# Fork while no thread is mid-update, so a child's ledger (and its lock) is consistent.
os.register_at_fork(before=ledger._lock.acquire, after_in_parent=ledger._lock.release,
                    after_in_child=ledger._lock.release)


def record_bounce_pieces(pieces: Iterable[tuple[Reason, int, int]], device: int | None, elapsed: float) -> None:
    """Record a job's bounce-ring pieces, each ``(reason, nbytes, cached)`` (``cached`` of its bytes
    came through the page cache, the rest O_DIRECT), as one row per reason and path; ``elapsed``,
    the job's time, is shared among the rows by their bytes."""
    items = list(pieces)
    if len(items) == 1:  # one read (a small read in its caller's thread): no rows to add up
        reason, nbytes, cached = items[0]
        cached = min(cached, nbytes)
        if cached or not nbytes:
            ledger.record(Path.BOUNCE_CACHED, reason, "read", cached, 1,
                          elapsed * cached / nbytes if nbytes else 0.0, device=device)
        if nbytes > cached:
            ledger.record(Path.BOUNCE_DIRECT, reason, "read", nbytes - cached, 1,
                          elapsed * (nbytes - cached) / nbytes, device=device)
        return
    rows: dict[tuple[Path, Reason], list[int]] = {}  # -> [bytes, pieces]
    total = sum(nbytes for _r, nbytes, _c in items) or 1
    for reason, nbytes, cached in items:
        cached = min(cached, nbytes)
        for path, n in ((Path.BOUNCE_CACHED, cached), (Path.BOUNCE_DIRECT, nbytes - cached)):
            if n or (path is Path.BOUNCE_CACHED and not nbytes):
                row = rows.setdefault((path, reason), [0, 0])
                row[0] += n
                row[1] += 1
    for (path, reason), (nbytes, count) in rows.items():
        ledger.record(path, reason, "read", nbytes, count, elapsed * nbytes / total, device=device,
                      requests=count)


def stats() -> Stats:
    """A snapshot of bytes, ops and busy time per path and per reason since start (or the last reset)."""
    return ledger.snapshot()


def stats_reset() -> None:
    ledger.reset()


def stats_delta(before: Stats, after: Stats) -> Stats:
    return after - before


def _add_checked(rows: list[ledger_inbox.Row]) -> None:
    ledger.add_entries([LedgerEntry(*r) for r in rows])


ledger_inbox.connect(_add_checked)
