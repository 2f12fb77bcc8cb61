"""Rich tables for ``gdskit stats`` and ``gdskit run``: paths, reasons, sizes, GPUs, cuFile counters."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from gdskit.engine.ledger import Stats
from gdskit.settings import format_size
from gdskit.telemetry.snapshot import Snapshot
from gdskit.telemetry.verdict import ALL_DIRECT, NO_IO, verdict
from gdskit.vocabulary import is_direct_path


def shown(text: str) -> Text:
    """A string from a snapshot as a table cell: never read as markup, control characters escaped
    (a command line may hold escape sequences that would drive the terminal)."""
    return Text("".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text))


def human_bytes(n: float) -> str:
    return format_size(n, 1)


def human_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} us"


def verdict_text(stats: Stats) -> Text:
    words = verdict(stats)
    style = "green" if words == ALL_DIRECT else "yellow" if words == NO_IO else "bold red" if "everything" in words else "yellow"
    return Text(words, style=style)


def paths_table(stats: Stats, rates: dict[str, float] | None = None, title: str = "Paths") -> Table:
    """Bytes, requests, busy time and mean latency per path (and bytes/s since the last look)."""
    t = Table(title=title, title_justify="left")
    for col in ("path", "read", "written", "requests", "busy", "latency", "throughput"):
        t.add_column(col, justify="left" if col == "path" else "right", no_wrap=True)
    if rates is not None:
        t.add_column("now", justify="right", no_wrap=True)
    total = stats.total_bytes or 1
    for path, ps in sorted(stats.paths.items(), key=lambda kv: -kv[1].bytes):
        row = [shown(path + (" (direct)" if is_direct_path(path) else "")), human_bytes(ps.bytes_read),
               human_bytes(ps.bytes_written), str(ps.requests), human_seconds(ps.busy_s),
               human_seconds(ps.mean_latency_s), f"{human_bytes(ps.bytes / ps.busy_s)}/s" if ps.busy_s > 0 else "-"]
        if rates is not None:
            row.append(f"{human_bytes(rates.get(path, 0.0))}/s")
        t.add_row(*row, style="green" if is_direct_path(path) else None)
    if stats.peer_bytes:  # bytes from other ranks moved no storage I/O: the direct share is of the storage bytes
        storage = stats.storage_bytes or 1
        t.caption = (f"{human_bytes(stats.storage_bytes)} from storage, {100.0 * stats.direct_bytes / storage:.1f}% "
                     f"direct; {human_bytes(stats.peer_bytes)} from other ranks (peer); "
                     "latency: mean busy time per request")
    else:
        t.caption = (f"{human_bytes(stats.total_bytes)} in all, {100.0 * stats.direct_bytes / total:.1f}% direct; "
                     "latency: mean busy time per request")
    t.caption_justify = "left"
    return t


def reasons_table(stats: Stats) -> Table:
    t = Table(title="Reasons", title_justify="left")
    for col in ("reason", "bytes", "share", "requests", "mean latency"):
        t.add_column(col, justify="left" if col == "reason" else "right")
    total = stats.total_bytes or 1
    for reason, ps in sorted(stats.reasons.items(), key=lambda kv: -kv[1].bytes):
        t.add_row(shown(reason), human_bytes(ps.bytes), f"{100.0 * ps.bytes / total:.1f}%", str(ps.requests),
                  human_seconds(ps.mean_latency_s))
    return t


def peers_table(stats: Stats) -> Table | None:
    """Bytes of path ``peer`` by the rank that sent them and the backend that carried them."""
    if not stats.peers:
        return None
    t = Table(title="From other ranks (peer)", title_justify="left")
    for col in ("from rank", "backend", "bytes", "broadcasts", "busy"):
        t.add_column(col, justify="left" if col == "backend" else "right")
    for p in stats.peers:
        t.add_row(str(p.source_rank), shown(p.backend), human_bytes(p.bytes), str(p.ops), human_seconds(p.busy_s))
    return t


def sizes_table(stats: Stats) -> Table | None:
    """Level 2: how many requests of each size (power-of-two buckets) per path and operation."""
    columns: dict[tuple[str, str], dict[int, int]] = {}
    for e in stats.entries:
        col = columns.setdefault((e.path, e.op), {})
        for k, n in e.size_hist:
            col[k] = col.get(k, 0) + n
    if not any(columns.values()):
        return None
    t = Table(title="Request sizes", title_justify="left")
    t.add_column("size up to", justify="right")
    keys = sorted(columns)
    for path, op in keys:
        t.add_column(shown(f"{path} {op}"), justify="right")
    buckets = sorted({k for col in columns.values() for k in col})
    for k in buckets:
        t.add_row(human_bytes(1 << k), *[str(columns[key].get(k, 0) or "") for key in keys])
    return t


def gpus_table(doc: dict[str, Any]) -> Table | None:
    gpus = doc.get("gpus") or {}
    if not gpus:
        return None
    t = Table(title="GPUs (gdskit ledger)", title_justify="left")
    for col in ("GPU", "path", "read", "written", "requests", "mean latency"):
        t.add_column(col, justify="left" if col in ("GPU", "path") else "right")
    for gpu, paths in sorted(gpus.items(), key=lambda kv: int(kv[0])):
        for path, ps in sorted(paths.items()):
            t.add_row(gpu, shown(path), human_bytes(ps.get("bytes_read", 0)), human_bytes(ps.get("bytes_written", 0)),
                      str(ps.get("requests", 0)), human_seconds(ps.get("mean_latency_s")))
    return t


def cufile_table(doc: dict[str, Any]) -> Table | None:
    cu = doc.get("cufile") or {}
    per_gpu = cu.get("per_gpu") or {}
    if not per_gpu:
        return None
    t = Table(title="cuFile's own counters (reads / writes)", title_justify="left")
    for col in ("GPU", "nvfs", "p2p", "posix", "unaligned", "errors", "bytes"):
        t.add_column(col, justify="left" if col == "GPU" else "right")
    def pair(row: dict[str, int], r: str, w: str) -> str:
        return f"{row.get(r, 0)} / {row.get(w, 0)}"

    for gpu, row in sorted(per_gpu.items(), key=lambda kv: int(kv[0])):
        posix = Text(pair(row, "n_posix_reads", "n_posix_writes"),
                     style="bold red" if row.get("n_posix_reads") or row.get("n_posix_writes") else "")
        t.add_row(gpu, pair(row, "n_nvfs_reads", "n_nvfs_writes"), pair(row, "n_p2p_reads", "n_p2p_writes"), posix,
                  pair(row, "n_unaligned_reads", "n_unaligned_writes"), pair(row, "n_reads_err", "n_writes_err"),
                  f"{human_bytes(row.get('read_bytes', 0))} / {human_bytes(row.get('write_bytes', 0))}")
    return t


def verified_text(stats: Stats) -> Text:
    """The line that says how many bytes were checked against their digests (``gdskit stats``, ``gdskit run``)."""
    v = stats.verified
    return Text(f"verified: {human_bytes(v.bytes)} checked against their digests "
                f"({human_bytes(v.gpu_bytes)} on a GPU) in {human_seconds(v.seconds)}, {v.checks} checks",
                style="green")


def snapshot_view(snap: Snapshot, level: int, rates: dict[str, float] | None = None) -> Group:
    """Everything ``gdskit stats -p PID`` shows for one snapshot, up to ``level``."""
    doc = snap.doc
    stats = snap.stats
    age = max(0.0, time.time() - snap.updated_at)
    head = Text.assemble((f"pid {snap.pid}", "bold"), f"  level {snap.level}",
                         shown(f"  session {snap.session}") if snap.session else "",
                         f"  updated {age:.1f} s ago", "\n" if snap.command else "", shown(snap.command[:200]))
    parts: list[Any] = [head, paths_table(stats, rates), reasons_table(stats)]
    if stats.verified.checks:
        parts.append(verified_text(stats))
    peers = peers_table(stats)
    if peers is not None:
        parts.append(peers)
    if level >= 2:
        sizes = sizes_table(stats)
        if sizes is not None:
            parts.append(sizes)
    if level >= 3:
        for table in (gpus_table(doc), cufile_table(doc)):
            if table is not None:
                parts.append(table)
        if doc.get("cufile") is None:
            parts.append(Text("cuFile: not in use in this process (no counters)", style="dim"))
    parts.append(Text.assemble(("verdict: ", "bold"), verdict_text(stats)))
    return Group(*parts)


def processes_table(snaps: list[Snapshot]) -> Table:
    t = Table(title="Processes publishing gdskit figures", title_justify="left")
    sessions = any(s.session for s in snaps)
    peers = any(s.doc["ledger"].get("peer_bytes") for s in snaps)
    for col in ("pid", "level", "session", "bytes", "direct", "not direct", "peer", "updated", "command"):
        if (col == "session" and not sessions) or (col == "peer" and not peers):
            continue
        # Figures never wrap; a long command folds onto more lines instead.
        t.add_column(col, justify="left" if col in ("session", "command") else "right",
                     no_wrap=col != "command", overflow="fold" if col == "command" else "ellipsis")
    now = time.time()
    for s in snaps:
        led = s.doc["ledger"]
        row = [str(s.pid), str(s.level)] + ([shown(s.session or "")] if sessions else [])
        peer = led.get("peer_bytes", 0)
        row += [human_bytes(led.get("total_bytes", 0)), human_bytes(led.get("direct_bytes", 0)),
                human_bytes(led.get("posix_bytes", 0) - peer)]  # "not direct" counts storage bytes only
        if peers:
            row.append(human_bytes(peer))
        t.add_row(*row, f"{max(0.0, now - s.updated_at):.1f}s ago", shown(s.command))
    return t
