"""Parsing and checking a snapshot file (schema ``gdskit.stats/1``) before anything reads it.

A snapshot comes from another process, so every byte is checked: at most
:data:`MAX_SNAPSHOT_BYTES`, strict UTF-8, JSON nested at most :data:`MAX_DEPTH`
deep, no ``NaN``/``Infinity``, no integer literal longer than 20 characters,
then every field the schema knows for its type and range (docs/stats.md).
Keys this version does not know are kept (later minor versions add keys) but
obey the same depth and number rules. Anything else is a :class:`FormatError`
whose message names the field, never its value.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from gdskit.errors import FormatError
from gdskit.vocabulary import is_direct_path, is_peer_path

SCHEMA = "gdskit.stats/1"

#: The most bytes a reader takes from a snapshot file; a bigger file is refused unread.
#: The largest snapshot a process can publish stays under 1 MiB.
MAX_SNAPSHOT_BYTES = 4 << 20
#: The deepest JSON nesting accepted (the schema itself needs 5 levels).
MAX_DEPTH = 16
#: Counters (bytes, operations, requests, ticks...) are integers in [0, MAX_COUNT].
MAX_COUNT = 2**63 - 1
MAX_ENTRIES = 4096      # ledger entries (paths x reasons x operations: under 200 today)
MAX_GPUS = 1024         # keys of "gpus" and "cufile.per_gpu"
MAX_ARGV = 4096         # arguments in "argv"
MAX_SESSION_CHARS = 256
MAX_INTERVAL_S = 3600.0
MAX_TIME_S = 2.0**40    # Unix seconds (year 36812): "started_at", "updated_at"
MAX_PID = 2**31 - 1
MAX_UID = 2**32 - 2

#: Path, reason, operation and counter names: what a table cell and a Prometheus label can hold as is.
NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
_SCHEMA_NAME = re.compile(r"gdskit\.stats/([0-9]{1,9})(\.[0-9]{1,9})?")
_ID = re.compile(r"0|[1-9][0-9]{0,8}")  # a GPU's key: a canonical decimal
_DECIMAL = re.compile(r"[1-9][0-9]{0,18}")
_STRING_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_PATH_STATS_COUNTERS = ("bytes_read", "bytes_written", "ops_read", "ops_written", "requests")
_OPS = ("read", "write")


class _Refused(ValueError):
    """Raised inside the JSON decoder's hooks: the document is refused."""


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a number a snapshot may hold")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused("a number beyond the range of a double")
    return value


def _short_int(text: str) -> int:
    if len(text) > 20:  # 2**63 has 19 digits; longer literals are refused before int() spends time on them
        raise _Refused("an integer too large for a snapshot")
    return int(text)


def _check_depth(text: str, source: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH before the decoder recurses into it.

    With the strings taken out, each round removes the innermost ``[]`` and ``{}``
    pairs, which lowers the nesting by one; what is left after MAX_DEPTH rounds is
    nested deeper (or its brackets do not pair up).
    """
    brackets = re.sub(r"[^\[\]{}]+", "", _STRING_LITERAL.sub("", text))
    for _ in range(MAX_DEPTH):
        if not brackets:
            return
        brackets = brackets.replace("[]", "").replace("{}", "")
    if brackets:
        raise FormatError(f"{source}: JSON nested deeper than {MAX_DEPTH} levels (or brackets that do not pair)")


def parse(raw: bytes, source: str) -> dict[str, Any]:
    """The snapshot in ``raw`` (a file's bytes), checked; :class:`FormatError` for anything else."""
    if len(raw) > MAX_SNAPSHOT_BYTES:
        raise FormatError(f"{source}: larger than {MAX_SNAPSHOT_BYTES} bytes, the most a snapshot may be")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{source}: not UTF-8") from None
    _check_depth(text, source)
    try:
        doc = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_short_int)
    except _Refused as exc:
        raise FormatError(f"{source}: {exc}") from None
    except (ValueError, RecursionError):
        raise FormatError(f"{source}: not valid JSON") from None
    return validate(doc, source)


# -- the schema ------------------------------------------------------------------------------------

class _Checker:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, what: str) -> FormatError:
        return FormatError(f"{self.source}: {where} must be {what}")

    def obj(self, v: Any, where: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(where, "an object")
        return v

    def count(self, v: Any, where: str, top: int = MAX_COUNT) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
            raise self.fail(where, f"an integer from 0 to {top}")
        return v

    def number(self, v: Any, where: str, top: float) -> float:
        # json.loads made every float finite (parse_float); ints may still be huge.
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= top:
            raise self.fail(where, f"a number from 0 to {top:g}")
        return v

    def text(self, v: Any, where: str, limit: int | None = None) -> str:
        if not isinstance(v, str) or (limit is not None and len(v) > limit):
            raise self.fail(where, "a string" + (f" of at most {limit} characters" if limit else ""))
        try:
            v.encode("utf-8")  # a JSON escape can make a lone surrogate, which no terminal can print
        except UnicodeEncodeError:
            raise self.fail(where, "text without lone surrogates") from None
        return v

    def name(self, v: Any, where: str) -> str:
        if not isinstance(v, str) or not NAME.fullmatch(v):
            raise self.fail(where, "a name of lowercase letters, digits, '-' and '_' (at most 64)")
        return v

    def optional(self, d: dict[str, Any], key: str, check: Any, where: str, *args: Any) -> None:
        if key in d:
            check(d[key], f"{where}{key}", *args)

    def keyed(self, v: Any, where: str, key_check: Any, limit: int) -> dict[str, Any]:
        d = self.obj(v, where)
        if len(d) > limit:
            raise self.fail(where, f"an object of at most {limit} keys")
        for k in d:
            key_check(k, f"{where} key {k[:70]!r}")
        return d

    def gpu_id(self, v: str, where: str) -> None:
        if not _ID.fullmatch(v):
            raise self.fail(where, "a GPU number")

    def path_stats(self, v: Any, where: str) -> None:
        d = self.obj(v, where)
        for key in _PATH_STATS_COUNTERS:
            self.optional(d, key, self.count, f"{where}.")
        self.optional(d, "busy_s", self.number, f"{where}.", float(MAX_COUNT))
        if d.get("mean_latency_s") is not None:
            self.number(d["mean_latency_s"], f"{where}.mean_latency_s", float(MAX_COUNT))

    def path_table(self, v: Any, where: str) -> None:
        for k, ps in self.keyed(v, where, self.name, MAX_ENTRIES).items():
            self.path_stats(ps, f"{where}.{k}")

    def entry(self, v: Any, where: str) -> tuple[str, str, str]:
        e = self.obj(v, where)
        for key in ("path", "reason", "op", "bytes", "ops", "busy_s"):
            if key not in e:
                raise self.fail(f"{where}.{key}", "present")
        self.name(e["path"], f"{where}.path")
        self.name(e["reason"], f"{where}.reason")
        if e["op"] not in _OPS:
            raise self.fail(f"{where}.op", "'read' or 'write'")
        self.count(e["bytes"], f"{where}.bytes")
        self.count(e["ops"], f"{where}.ops")
        self.number(e["busy_s"], f"{where}.busy_s", float(MAX_COUNT))
        self.optional(e, "requests", self.count, f"{where}.")
        if e.get("size_hist") is not None:
            hist = self.keyed(e["size_hist"], f"{where}.size_hist", self.power_of_two, 64)
            for k, n in hist.items():
                self.count(n, f"{where}.size_hist.{k}")
        return e["path"], e["reason"], e["op"]

    def power_of_two(self, k: str, where: str) -> None:
        if not (_DECIMAL.fullmatch(k) and int(k) <= 2**63 and int(k) & (int(k) - 1) == 0):
            raise self.fail(where, "a power of two up to 2**63, in decimal")

    def ledger(self, v: Any, where: str) -> None:
        led = self.obj(v, where)
        entries = led.get("entries")
        if not isinstance(entries, list) or len(entries) > MAX_ENTRIES:
            raise self.fail(f"{where}.entries", f"a list of at most {MAX_ENTRIES} entries")
        seen = set()
        for i, e in enumerate(entries):
            key = self.entry(e, f"{where}.entries[{i}]")
            if key in seen:
                raise self.fail(f"{where}.entries[{i}]", "the only entry of its path, reason and op")
            seen.add(key)
        self.sums(led, entries, where)
        for key in ("paths", "reasons"):
            self.optional(led, key, self.path_table, f"{where}.")
        self.optional(led, "peers", self.peers, f"{where}.")
        self.optional(led, "verified", self.verified, f"{where}.")

    def verified(self, v: Any, where: str) -> None:
        """Bytes whose digests were checked where they landed (``verify=``)."""
        d = self.obj(v, where)
        for key in ("bytes", "gpu_bytes", "seconds", "checks"):
            if key not in d:
                raise self.fail(f"{where}.{key}", "present")
        total = self.count(d["bytes"], f"{where}.bytes")
        if self.count(d["gpu_bytes"], f"{where}.gpu_bytes") > total:
            raise self.fail(f"{where}.gpu_bytes", "at most bytes")
        self.count(d["checks"], f"{where}.checks")
        self.number(d["seconds"], f"{where}.seconds", float(MAX_COUNT))

    def peers(self, v: Any, where: str) -> None:
        """Bytes from other ranks of a process group: one object per (sending rank, backend)."""
        if not isinstance(v, list) or len(v) > MAX_ENTRIES:
            raise self.fail(where, f"a list of at most {MAX_ENTRIES} objects")
        seen = set()
        for i, p in enumerate(v):
            p = self.obj(p, f"{where}[{i}]")
            for key in ("source_rank", "backend", "bytes", "ops", "busy_s"):
                if key not in p:
                    raise self.fail(f"{where}[{i}].{key}", "present")
            self.count(p["source_rank"], f"{where}[{i}].source_rank", MAX_PID)
            self.name(p["backend"], f"{where}[{i}].backend")
            self.count(p["bytes"], f"{where}[{i}].bytes")
            self.count(p["ops"], f"{where}[{i}].ops")
            self.number(p["busy_s"], f"{where}[{i}].busy_s", float(MAX_COUNT))
            if (p["source_rank"], p["backend"]) in seen:
                raise self.fail(f"{where}[{i}]", "the only object of its rank and backend")
            seen.add((p["source_rank"], p["backend"]))

    def sums(self, led: dict[str, Any], entries: list[dict[str, Any]], where: str) -> None:
        """The totals, where given, are those of the entries (what the process table shows)."""
        total = sum(e["bytes"] for e in entries)
        direct = sum(e["bytes"] for e in entries if is_direct_path(e["path"]))
        requests = sum(e.get("requests", 0) for e in entries)
        if total > MAX_COUNT or requests > MAX_COUNT:
            raise self.fail(f"{where}.entries", f"entries whose bytes and requests add up to at most {MAX_COUNT}")
        peer = sum(e["bytes"] for e in entries if is_peer_path(e["path"]))
        for key, want in (("total_bytes", total), ("direct_bytes", direct), ("posix_bytes", total - direct),
                          ("requests", requests), ("peer_bytes", peer)):
            if key in led and (self.count(led[key], f"{where}.{key}") != want):
                raise self.fail(f"{where}.{key}", "the sum over the entries")

    def gpus(self, v: Any, where: str) -> None:
        for gpu, paths in self.keyed(v, where, self.gpu_id, MAX_GPUS).items():
            self.path_table(paths, f"{where}.{gpu}")

    def counter_row(self, v: Any, where: str) -> None:
        for k, n in self.keyed(v, where, self.name, 256).items():
            self.count(n, f"{where}.{k}")

    def cufile(self, v: Any, where: str) -> None:
        if v is None:
            return
        cu = self.obj(v, where)
        if "per_gpu" in cu:
            for gpu, row in self.keyed(cu["per_gpu"], f"{where}.per_gpu", self.gpu_id, MAX_GPUS).items():
                self.counter_row(row, f"{where}.per_gpu.{gpu}")
        self.optional(cu, "totals", self.counter_row, f"{where}.")


def schema_problem(schema: Any) -> str | None:
    """Why a document with this ``schema`` value is not one this gdskit reads (``None``: it is)."""
    m = _SCHEMA_NAME.fullmatch(schema) if isinstance(schema, str) else None
    if m is None:
        return "not a gdskit stats snapshot"
    if m.group(1) != SCHEMA.split("/", 1)[1]:
        # Minor versions (gdskit.stats/1.x) only add keys; another major version is another format.
        return f"snapshot schema {schema!r} is not one this gdskit reads ({SCHEMA})"
    return None


def valid_session(value: Any) -> bool:
    """Whether ``value`` may stand as a snapshot's ``session``."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_SESSION_CHARS:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return value.isprintable()


def validate(doc: Any, source: str) -> dict[str, Any]:
    """Check every field of the snapshot ``doc`` this version knows; :class:`FormatError` otherwise.

    Required: ``schema``, ``pid``, ``level``, ``ledger.entries`` and each entry's
    ``path``, ``reason``, ``op``, ``bytes``, ``ops``, ``busy_s``; every other key is
    optional but, where present, of its documented type and range. ``doc`` is
    returned as it is.
    """
    c = _Checker(source)
    if not isinstance(doc, dict):
        raise FormatError(f"{source}: not a gdskit stats snapshot")
    problem = schema_problem(doc.get("schema"))
    if problem is not None:
        raise FormatError(f"{source}: {problem}")
    for key in ("pid", "level", "ledger"):
        if key not in doc:
            raise FormatError(f"{source}: snapshot lacks {key!r}")
    if c.count(doc["pid"], "pid", MAX_PID) == 0:
        raise c.fail("pid", f"an integer from 1 to {MAX_PID}")
    if c.count(doc["level"], "level", 3) == 0:
        raise c.fail("level", "1, 2 or 3")
    if doc.get("start_ticks") is not None:
        c.count(doc["start_ticks"], "start_ticks")
    c.optional(doc, "uid", c.count, "", MAX_UID)
    c.optional(doc, "seq", c.count, "")
    c.optional(doc, "interval_s", c.number, "", MAX_INTERVAL_S)
    c.optional(doc, "started_at", c.number, "", MAX_TIME_S)
    c.optional(doc, "updated_at", c.number, "", MAX_TIME_S)
    if "final" in doc and not isinstance(doc["final"], bool):
        raise c.fail("final", "true or false")
    if doc.get("session") is not None and not valid_session(doc["session"]):
        raise c.fail("session", f"printable text of 1 to {MAX_SESSION_CHARS} characters, or null")
    if "argv" in doc:
        argv = doc["argv"]
        if not isinstance(argv, list) or len(argv) > MAX_ARGV:
            raise c.fail("argv", f"a list of at most {MAX_ARGV} strings")
        for i, a in enumerate(argv):
            c.text(a, f"argv[{i}]")
    c.ledger(doc["ledger"], "ledger")
    c.optional(doc, "gpus", c.gpus, "")
    c.optional(doc, "cufile", c.cufile, "")
    return doc
