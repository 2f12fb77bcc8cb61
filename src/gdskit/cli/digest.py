"""``gdskit digest``: BLAKE3 digests of checkpoints and datasets into a manifest beside them, and
``--check``: the files against their manifests.

Exit status: 0 written, or every file matches; 1 a file differs, is stale (changed since its
digest) or is missing; 2 bad arguments, an unreadable path or a malformed manifest.
"""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

_HELP = (
    "Record BLAKE3 digests of files (safetensors, torch.save, .npy, anything else as raw bytes): of each "
    "file, of each fixed chunk of it, and of each tensor, in a manifest beside it (FILE.gdskit-digest.json; "
    "for a directory, DIR/gdskit-digest.json listing every file under it). Loads with verify=True check "
    "against it.\n\n"
    "--check: recompute and compare; exit 1 naming each file that differs (and the tensors or chunks), "
    "is stale (changed since it was digested) or is missing."
)


def register(app: typer.Typer) -> None:
    app.command("digest", help=_HELP, no_args_is_help=True)(digest)


def _one_line(message: str) -> str:
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in message)


def digest(
    paths: list[str] = typer.Argument(..., metavar="PATH...", help="Files or directories."),
    check: bool = typer.Option(False, "--check", help="Verify against the existing manifests instead of writing them."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (schema gdskit.digest/1)."),
    chunk: str = typer.Option("64M", "--chunk", help="Chunk size of the per-chunk digests (a power of two, 1K to 1G)."),
    jobs: Optional[int] = typer.Option(None, "-j", "--jobs", min=1, max=256, help="Files digested at once (default: up to 8)."),  # noqa: UP007
    device: Optional[int] = typer.Option(None, "-d", "--device", min=0, help="Hash on this GPU, also with --check: each file read into its memory whole, one at a time (default: the CPU)."),  # noqa: UP007
) -> None:
    from gdskit.errors import GdskitError  # noqa: PLC0415 - import time
    from gdskit.formats import digest_scan  # noqa: PLC0415 - import time
    from gdskit.formats.progress import Progress  # noqa: PLC0415 - import time

    try:
        chunk_bytes = _size(chunk)
        prog = Progress(digest_scan.total_bytes(paths), None if not as_json else False, "checking" if check else "digest")
        with prog:
            if check:
                results = digest_scan.check_manifests(paths, jobs, prog.advance, device)
            else:
                results = digest_scan.make_manifests(paths, chunk_bytes, jobs, prog.advance, device)
    except GdskitError as exc:
        typer.echo(f"gdskit digest: error: {_one_line(str(exc))}", err=True)
        raise typer.Exit(2) from None
    except OSError as exc:
        typer.echo(f"gdskit digest: error: {_one_line(str(exc))}", err=True)
        raise typer.Exit(2) from None
    failed = [r for r in results if r.status not in ("ok", "written")]
    if as_json:
        doc = {"schema": "gdskit.digest/1", "check": check, "files": [r.to_dict() for r in results],
               "failed": len(failed)}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        _table(results)
    for r in failed:
        typer.echo(f"gdskit digest: {r.status}: {_one_line(r.path)}" + (f" ({', '.join(r.bad[:8])})" if r.bad else ""),
                   err=True)
    if failed:
        raise typer.Exit(1)


def _size(text: str) -> int:
    from gdskit.errors import InvalidArgumentError  # noqa: PLC0415 - import time
    from gdskit.verify.manifest import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES  # noqa: PLC0415 - import time

    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in units else ""
    try:
        n = int(t[:-1] if unit else t) * units[unit]
    except ValueError:
        raise InvalidArgumentError(f"--chunk {text!r} is not a size (e.g. 64M)") from None
    if not MIN_CHUNK_BYTES <= n <= MAX_CHUNK_BYTES or n & (n - 1):
        raise InvalidArgumentError(f"--chunk {text!r} is not a power of two from 1K to 1G")
    return n


def _table(results: list) -> None:  # type: ignore[type-arg]
    from rich.console import Console  # noqa: PLC0415 - import time
    from rich.table import Table  # noqa: PLC0415 - import time
    from rich.text import Text  # noqa: PLC0415 - import time

    table = Table(box=None, header_style="bold")
    for col in ("status", "file", "kind", "size", "tensors", "blake3", "GB/s"):
        table.add_column(col, justify="right" if col in ("size", "tensors", "GB/s") else "left")
    for r in results:
        rate = f"{r.size / r.seconds / 1e9:.2f}" if r.seconds > 0 else "-"
        table.add_row(Text(r.status), Text(r.path), r.kind, f"{r.size / 2**20:.1f} MiB", str(r.tensors),
                      Text(r.digest[:16] + ("…" if r.digest else "")), rate)
    Console().print(table)
