"""`gdskit stats`: the live figures of a process that publishes its ledger (``GDSKIT_STATS=1``).

Exit status: 0 figures shown (or the watched process ended); 1 no such process,
it publishes nothing, it belongs to another user, or its snapshot is refused
(malformed, too large, not a regular file of that user in a directory only that
user can write); 2 bad arguments or a missing optional package. Errors are one
line on stderr, whatever the output format.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Optional

import typer

from gdskit.errors import GdskitError, MissingDependencyError, NotPublishingError, ProcessNotFoundError

_HELP = (
    "Show the live gdskit figures of a process: bytes, ops, latency and busy time per path and reason "
    "(level 2: request sizes; level 3: per GPU and cuFile's own counters).\n\n"
    "The process publishes them when started with GDSKIT_STATS=1 (2, 3), or under `gdskit run`. "
    "Without -p: list this user's publishing processes."
)


def register(app: typer.Typer) -> None:
    app.command("stats", help=_HELP, no_args_is_help=False)(stats)


def _one_line(message: str) -> str:
    """``message`` as one printable line: it may quote paths and names taken from files."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in message)


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(f"gdskit stats: error: {_one_line(message)}", err=True)
    return typer.Exit(code)


def stats(
    pid: Optional[int] = typer.Option(None, "-p", "--pid", help="The process to show (default: list them all)."),  # noqa: UP007
    level: Optional[int] = typer.Option(  # noqa: UP007
        None, "-l", "--level", min=1, max=3, help="Detail: 1 paths and reasons, 2 + request sizes, "
        "3 + GPUs and cuFile counters (default: what the process publishes)."),
    watch: Optional[float] = typer.Option(  # noqa: UP007
        None, "--watch", metavar="SECONDS", min=0.05,
        help="Refresh every SECONDS until Ctrl-C or until the process ends; shows current rates."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (schema gdskit.stats/1; one line per refresh with --watch)."),
    prometheus: bool = typer.Option(False, "--prometheus", help="Print Prometheus text exposition format."),
    serve: Optional[int] = typer.Option(  # noqa: UP007
        None, "--serve", metavar="PORT", min=1, max=65535,
        help="Serve Prometheus metrics on PORT (/metrics) until Ctrl-C (needs gdskit\\[prometheus])."),
    serve_addr: str = typer.Option("127.0.0.1", "--serve-addr", help="Address --serve listens on."),
) -> None:
    if as_json and prometheus:
        raise _fail("--json and --prometheus exclude each other", 2)
    if watch is not None and (prometheus or serve is not None):
        raise _fail("--watch shows tables or JSON; use --serve for a live Prometheus endpoint", 2)
    try:
        if serve is not None:
            _serve(pid, serve, serve_addr, level)
        elif pid is None:
            _list(as_json, prometheus, level)
        elif watch is not None:
            _watch(pid, level, watch, as_json)
        else:
            _show(pid, level, as_json, prometheus)
    except MissingDependencyError as exc:
        raise _fail(str(exc), 2) from None
    except GdskitError as exc:
        raise _fail(_message(exc)) from None


def _message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f" ({exc.filename})" if exc.filename else "")
    return str(exc)


def _level_for(snap: Any, asked: int | None) -> int:
    if asked is not None and asked > snap.level:
        typer.echo(f"gdskit stats: note: process {snap.pid} publishes level {snap.level}; start it with "
                   f"GDSKIT_STATS={asked} for level {asked} figures", err=True)
    return min(asked or snap.level, snap.level)


def _show(pid: int, level: int | None, as_json: bool, prometheus: bool) -> None:
    from gdskit.telemetry import read_snapshot, to_prometheus  # noqa: PLC0415 - import time
    from gdskit.telemetry.snapshot import restrict  # noqa: PLC0415 - import time

    snap = read_snapshot(pid)
    lvl = _level_for(snap, level)
    if as_json:
        sys.stdout.write(json.dumps(restrict(snap.doc, lvl), indent=2, allow_nan=False) + "\n")
    elif prometheus:
        sys.stdout.write(to_prometheus([snap], level=lvl))
    else:
        from rich.console import Console  # noqa: PLC0415 - import time

        from gdskit.telemetry.render import snapshot_view  # noqa: PLC0415 - import time

        Console().print(snapshot_view(snap, lvl))


def _list(as_json: bool, prometheus: bool, level: int | None) -> None:
    from gdskit.telemetry import SCHEMA, list_snapshots, to_prometheus  # noqa: PLC0415 - import time
    from gdskit.telemetry.snapshot import restrict  # noqa: PLC0415 - import time

    refused: list[tuple[str, Any]] = []
    snaps = [s for s in list_snapshots(refused=refused) if s.pid != os.getpid()]
    for path, exc in refused:
        typer.echo(f"gdskit stats: note: skipped {_one_line(_message(exc))}", err=True)
    if as_json:
        docs = [restrict(s.doc, level or 3) for s in snaps]
        sys.stdout.write(json.dumps({"schema": SCHEMA, "processes": docs}, indent=2, allow_nan=False) + "\n")
    elif prometheus:
        sys.stdout.write(to_prometheus(snaps, level=level))
    elif not snaps:
        typer.echo("No process of this user publishes gdskit figures. Start one with GDSKIT_STATS=1, "
                   "or run it under `gdskit run`.")
    else:
        from rich.console import Console  # noqa: PLC0415 - import time

        from gdskit.telemetry.render import processes_table  # noqa: PLC0415 - import time

        Console().print(processes_table(snaps))


def _rates(prev: Any, snap: Any, dt: float) -> dict[str, float]:
    """Bytes per second per path between two published snapshots ``dt`` seconds apart."""
    if dt <= 0:
        return {}
    delta = snap.stats - prev.stats
    return {path: ps.bytes / dt for path, ps in delta.paths.items()}


def _advance(snap: Any, nxt: Any, rates: dict[str, float], now: float) -> tuple[Any, dict[str, float]]:
    """The snapshot and rates to show after looking again and finding ``nxt``.

    Rates come from the publisher's own clock: it rewrites its snapshot every interval, and
    only when its figures changed, so looks faster than that would see zeros and spikes.
    """
    if nxt.doc.get("seq") != snap.doc.get("seq"):
        return nxt, _rates(snap, nxt, nxt.updated_at - snap.updated_at)
    if now - snap.updated_at > 2 * float(snap.doc.get("interval_s", 0.5)):
        return snap, {}  # not rewritten for two intervals: idle
    return snap, rates


def _watch(pid: int, level: int | None, every: float, as_json: bool) -> None:
    from rich.console import Console  # noqa: PLC0415 - import time
    from rich.live import Live  # noqa: PLC0415 - import time

    from gdskit.telemetry import read_snapshot  # noqa: PLC0415 - import time
    from gdskit.telemetry.render import snapshot_view  # noqa: PLC0415 - import time
    from gdskit.telemetry.snapshot import restrict  # noqa: PLC0415 - import time

    console = Console()
    snap = read_snapshot(pid)  # errors before the first frame are errors
    lvl = _level_for(snap, level)
    rates: dict[str, float] = {}
    live = Live(console=console, auto_refresh=False) if console.is_terminal and not as_json else None
    try:
        if live is not None:
            live.start()
        while True:
            if as_json:
                sys.stdout.write(json.dumps(restrict(snap.doc, lvl), separators=(",", ":"), allow_nan=False) + "\n")
                sys.stdout.flush()
            elif live is not None:
                live.update(snapshot_view(snap, lvl, rates), refresh=True)
            else:
                console.print(snapshot_view(snap, lvl, rates))
            time.sleep(every)
            try:
                nxt = read_snapshot(pid)
            except (ProcessNotFoundError, NotPublishingError):
                if live is not None:
                    live.stop()
                    live = None
                typer.echo(f"process {pid} ended (or stopped publishing)", err=True)
                return
            snap, rates = _advance(snap, nxt, rates, time.time())
    except KeyboardInterrupt:
        return
    finally:
        if live is not None:
            live.stop()


def _serve(pid: int | None, port: int, addr: str, level: int | None) -> None:
    from gdskit.telemetry import list_snapshots, read_snapshot, start_exporter  # noqa: PLC0415 - import time

    if pid is not None:
        read_snapshot(pid)  # a clear error now rather than an empty endpoint

    def source() -> list[dict[str, Any]]:
        from gdskit.telemetry.snapshot import restrict  # noqa: PLC0415 - import time

        try:
            snaps = [read_snapshot(pid)] if pid is not None else [s for s in list_snapshots() if s.pid != os.getpid()]
        except GdskitError:
            snaps = []  # the process ended: serve nothing rather than fail the scrape
        return [restrict(s.doc, level or 3) for s in snaps]

    start_exporter(port, addr, source=source, pid_label=True)
    typer.echo(f"serving gdskit metrics on http://{addr}:{port}/metrics (Ctrl-C to stop)", err=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        return
