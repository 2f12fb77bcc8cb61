"""Snapshots as Prometheus metrics (text exposition format 0.0.4), and an optional exporter.

The text is written here by hand, so the core needs no extra package;
:func:`start_exporter` serves it over HTTP through ``prometheus_client``
(``pip install gdskit[prometheus]``). Metric names are listed in docs/stats.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from gdskit.errors import MissingDependencyError
from gdskit.engine.ledger import ledger
from gdskit.settings import settings
from gdskit.telemetry import cufile_counters
from gdskit.telemetry.snapshot import Snapshot, build

_LEDGER_COUNTERS = (
    ("gdskit_bytes_total", "bytes", "Bytes moved, by path, reason and operation."),
    ("gdskit_ops_total", "ops", "I/O operations (chunks) issued, by path, reason and operation."),
    ("gdskit_requests_total", "requests", "Requests (or their parts) recorded, by path, reason and operation."),
    ("gdskit_busy_seconds_total", "busy_s", "Seconds spent moving bytes; divided by requests: mean latency."),
)
_CUFILE_ROUTES = ("nvfs", "p2p", "posix")


def _escape_label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, Any]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items()) + "}"


def _number(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


class _Family:
    def __init__(self, name: str, kind: str, help_text: str) -> None:
        self.name, self.kind, self.help = name, kind, help_text
        self.samples: list[tuple[str, dict[str, Any], float]] = []

    def add(self, labels: dict[str, Any], value: float, suffix: str = "") -> None:
        self.samples.append((self.name + suffix, labels, value))

    def lines(self) -> list[str]:
        if not self.samples:
            return []
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        out += [f"{n}{_labels(lab)} {_number(v)}" for n, lab, v in self.samples]
        return out


def render(snapshots: Iterable[Snapshot | dict[str, Any]], *, level: int | None = None,
           pid_label: bool = True) -> str:
    """The Prometheus text of ``snapshots`` (one process or many), up to ``level``.

    ``pid_label`` adds ``pid="..."`` to every sample, which keeps several processes
    apart; an exporter inside one process leaves it out.
    """
    fams: dict[str, _Family] = {}

    def fam(name: str, kind: str, help_text: str) -> _Family:
        if name not in fams:
            fams[name] = _Family(name, kind, help_text)
        return fams[name]

    for snap in snapshots:
        doc = snap.doc if isinstance(snap, Snapshot) else snap
        lvl = min(level or 3, int(doc.get("level", 1)))
        base = {"pid": doc["pid"]} if pid_label else {}
        fam("gdskit_process_info", "gauge", "A process publishing gdskit figures (value 1).").add(
            {**base, "level": lvl, "session": doc.get("session") or ""}, 1)
        fam("gdskit_snapshot_timestamp_seconds", "gauge", "When the figures were published (Unix time).").add(
            base, float(doc.get("updated_at", 0.0)))
        entries = doc["ledger"].get("entries", [])
        for e in entries:
            labels = {**base, "path": e["path"], "reason": e["reason"], "op": e["op"]}
            for name, key, help_text in _LEDGER_COUNTERS:
                fam(name, "counter", help_text).add(labels, e.get(key, 0))
        if lvl >= 2:
            _size_histograms(fam, base, entries)
        if lvl >= 3:
            _per_gpu(fam, base, doc)
    lines: list[str] = []
    for f in fams.values():
        lines += f.lines()
    return "\n".join(lines) + "\n" if lines else ""


def _size_histograms(fam: Callable[..., _Family], base: dict[str, Any], entries: list[dict[str, Any]]) -> None:
    """One histogram per path and operation: request sizes in power-of-two buckets."""
    hist = fam("gdskit_request_size_bytes", "histogram", "Sizes of requests (or their parts), by path and operation.")
    grouped: dict[tuple[str, str], tuple[dict[int, int], int]] = {}
    for e in entries:
        counts, total = grouped.get((e["path"], e["op"]), ({}, 0))
        for le, n in (e.get("size_hist") or {}).items():
            counts[int(le)] = counts.get(int(le), 0) + int(n)
        grouped[(e["path"], e["op"])] = (counts, total + int(e.get("bytes", 0)))
    for (path, op), (counts, total) in sorted(grouped.items()):
        labels = {**base, "path": path, "op": op}
        running = 0
        for le in sorted(counts):
            running += counts[le]
            hist.add({**labels, "le": str(le)}, running, "_bucket")
        hist.add({**labels, "le": "+Inf"}, running, "_bucket")
        hist.add(labels, running, "_count")
        hist.add(labels, total, "_sum")


def _per_gpu(fam: Callable[..., _Family], base: dict[str, Any], doc: dict[str, Any]) -> None:
    gpu_bytes = fam("gdskit_gpu_bytes_total", "counter", "Bytes moved to or from each GPU, by path and operation.")
    for gpu, paths in (doc.get("gpus") or {}).items():
        for path, ps in paths.items():
            gpu_bytes.add({**base, "gpu": gpu, "path": path, "op": "read"}, ps.get("bytes_read", 0))
            gpu_bytes.add({**base, "gpu": gpu, "path": path, "op": "write"}, ps.get("bytes_written", 0))
    cu = doc.get("cufile") or {}
    ops = fam("gdskit_cufile_ops_total", "counter", "cuFile's own operation counters, by GPU, operation and route.")
    unaligned = fam("gdskit_cufile_unaligned_ops_total", "counter", "cuFile's unaligned operations, by GPU.")
    errors = fam("gdskit_cufile_errors_total", "counter", "cuFile's failed operations, by GPU and operation.")
    nbytes = fam("gdskit_cufile_bytes_total", "counter", "Bytes cuFile moved, by GPU and operation.")
    for gpu, row in (cu.get("per_gpu") or {}).items():
        for op, plural in (("read", "reads"), ("write", "writes")):
            labels = {**base, "gpu": gpu, "op": op}
            for route in _CUFILE_ROUTES:
                key = f"n_{route}_{plural}"
                if key in row:
                    ops.add({**labels, "route": route}, row[key])
            if f"n_unaligned_{plural}" in row:
                unaligned.add(labels, row[f"n_unaligned_{plural}"])
            if f"n_{plural}_err" in row:
                errors.add(labels, row[f"n_{plural}_err"])
            if f"{op}_bytes" in row:
                nbytes.add(labels, row[f"{op}_bytes"])


def start_exporter(port: int, addr: str = "127.0.0.1", *,
                   source: Callable[[], list[Snapshot | dict[str, Any]]] | None = None,
                   pid_label: bool | None = None) -> Any:
    """Serve Prometheus metrics on ``http://addr:port/metrics`` from a background thread.

    By default it serves this process's own ledger (publication need not be on;
    level ``max(settings.stats_level, 1)``). ``source`` returns the snapshots to
    serve instead, e.g. ``list_snapshots`` for every process of this user.
    Returns what ``prometheus_client.start_http_server`` returns.
    """
    try:
        from prometheus_client import CollectorRegistry, start_http_server  # noqa: PLC0415 - optional dependency (prometheus_client)
        from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415 - optional dependency (prometheus_client)
    except ImportError:
        raise MissingDependencyError("the Prometheus exporter needs prometheus-client: "
                                     "pip install 'gdskit[prometheus]'") from None
    if source is None:
        source = _own_snapshot
        pid_label = bool(pid_label)
    elif pid_label is None:
        pid_label = True

    class _Collector:
        # One source of truth for names and labels: parse the text render() writes.
        def collect(self) -> Iterable[Any]:
            yield from text_string_to_metric_families(render(source(), pid_label=bool(pid_label)))

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return start_http_server(port, addr=addr, registry=registry)


def _own_snapshot() -> list[dict[str, Any]]:
    level = max(settings.stats_level, 1)
    return [build(level=level, pid=os.getpid(), ticks=None, started_at=time.time(), interval_s=0.0, session=None,
                  final=False, seq=0, gpus=ledger.device_snapshot() if level >= 3 else None,
                  cufile=cufile_counters.read_per_gpu() if level >= 3 else None)]
