"""``gdskit uploads s3://bucket/prefix``: the multipart uploads left under way under a prefix
(by writers that died), and with ``--abort`` those older than ``--older-than`` aborted.

Exit status: 0 listed (and every abort asked for done); 1 an abort failed; 2 bad arguments, or
the listing failed (no such bucket, no credentials, the store unreachable).
"""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
from typing import Any

import typer

_HELP = (
    "List the multipart uploads under way (started, never completed nor aborted) whose keys start "
    "with PREFIX (s3://bucket/dir/), with their age. Their parts stay in the bucket, billed, until "
    "they are aborted: a writer that died leaves one.\n\n"
    "--abort: abort those older than --older-than (default 24h); younger ones, which a writer may "
    "still be finishing, are kept. Nothing outside PREFIX is touched."
)

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def register(app: typer.Typer) -> None:
    app.command("uploads", help=_HELP, no_args_is_help=True)(uploads)


def _one_line(message: str) -> str:
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in message)


def duration_s(text: str) -> float:
    """``90s``, ``30m``, ``24h``, ``7d`` (or a plain number of seconds) in seconds."""
    from gdskit.errors import InvalidArgumentError  # noqa: PLC0415 - import time

    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text.lower())
    if not found:
        raise InvalidArgumentError(f"--older-than {text!r} is not a duration (e.g. 90s, 30m, 24h, 7d)")
    return float(found.group(1)) * _UNITS[found.group(2) or "s"]


def uploads(
    prefix: str = typer.Argument(..., metavar="PREFIX", help="s3://bucket/prefix (keys starting with it)."),
    older_than: str = typer.Option("24h", "--older-than", metavar="AGE",
                                   help="With --abort: abort only uploads started at least AGE ago (90s, 30m, 24h, 7d)."),
    abort: bool = typer.Option(False, "--abort", help="Abort the uploads older than --older-than (default: list only)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (schema gdskit.uploads/1)."),
) -> None:
    from gdskit.engine import is_object_url, sweep_uploads  # noqa: PLC0415 - import time
    from gdskit.errors import GdskitError  # noqa: PLC0415 - import time

    try:
        if not is_object_url(prefix):
            typer.echo(f"gdskit uploads: error: not an object URL (s3://bucket/prefix): {_one_line(prefix)}", err=True)
            raise typer.Exit(2)
        sweep = sweep_uploads(prefix, duration_s(older_than), abort)
    except (GdskitError, OSError) as exc:
        typer.echo(f"gdskit uploads: error: {_one_line(str(exc))}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        sys.stdout.write(json.dumps(sweep.to_dict(), indent=2) + "\n")
    else:
        _render(sweep)
    for u in sweep.uploads:
        if u.action == "failed":
            typer.echo(f"gdskit uploads: abort failed: {_one_line(u.url)} ({_one_line(u.error or '')})", err=True)
    if sweep.failed:
        raise typer.Exit(1)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _render(s: Any) -> None:
    """A table of ``s`` (an ``UploadSweep``), then one line of totals."""
    from rich.console import Console  # noqa: PLC0415 - import time
    from rich.table import Table  # noqa: PLC0415 - import time
    from rich.text import Text  # noqa: PLC0415 - import time

    console = Console()
    if not s.uploads:
        typer.echo(f"no multipart upload under way under {_one_line(s.prefix)} at {s.endpoint}")
        return
    table = Table(box=None, header_style="bold")
    table.add_column("object", overflow="fold")
    table.add_column("age", justify="right", no_wrap=True)
    table.add_column("started (UTC)", no_wrap=True)
    table.add_column("action", no_wrap=True)
    table.add_column("upload id", no_wrap=True)
    for u in s.uploads:
        started = "unknown" if u.initiated is None else u.initiated.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(Text(_one_line(u.url)), _age(u.age_s), started,
                      u.action + (" (stale)" if u.stale and u.action == "listed" else ""),
                      Text(_one_line(u.upload_id[:16]) + ("…" if len(u.upload_id) > 16 else "")))
    console.print(table)
    more = " (more exist: not listed)" if s.more else ""
    typer.echo(f"{len(s.uploads)} upload(s){more}; {s.stale} older than {_age(s.older_than_s)}"
               + ("" if s.abort else "; --abort aborts those"))
