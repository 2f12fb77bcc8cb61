"""`gdskit accept`: run the production acceptance checklist and write a report to archive.

Exit status: 0 no item failed; 1 at least one item failed; 2 bad arguments.
The checklist and the report's JSON schema are in docs/accept.md.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import typer

from gdskit.cli import cli_errors
from gdskit.errors import InvalidArgumentError
from gdskit.settings import parse_size

_HELP = (
    "Run the production acceptance checklist for GPUDirect Storage and write a report "
    "(report.md, a self-contained report.html with the plots, report.json).\n\n"
    "1 platform (nvidia-fs or PCI P2PDMA, ACS, BAR1, RDMA); 2 every target mount direct; "
    "3 A/B benchmark direct vs CPU path; 4 I/O-size sweep 4 KiB..1 MiB and its cut-off; "
    "5 a real workload's bytes go direct; 6 checkpoint round trip with plain torch.load and safetensors; "
    "7 fault injection: the workload degrades to the CPU path and keeps its data.\n\n"
    "Each item passes, fails (with the fix) or is not applicable (e.g. the GPU items on a machine without "
    "a GPU). Exit status: 0 nothing failed, 1 an item failed, 2 bad arguments."
)


def _parse_items(text: str | None) -> tuple[int, ...]:
    from gdskit.accept.context import ALL_ITEMS  # noqa: PLC0415 - import time

    if text is None:
        return ALL_ITEMS
    try:
        items = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise InvalidArgumentError(f"--items takes numbers 1 to 7, comma-separated; got {text!r}") from None
    if not items:
        raise InvalidArgumentError("--items names no item")
    return items


def accept(
    paths: Optional[list[str]] = typer.Argument(  # noqa: UP007 (typer needs Optional on 3.10)
        None, help="Files or directories the data lives on; their mounts must be direct. The first one is where "
                   "the measurements write temporary files. Default: the current directory."),
    report_dir: Optional[str] = typer.Option(  # noqa: UP007
        None, "--report", metavar="DIR", help="Where to write the report (default ./gdskit-accept-<timestamp>)."),
    quick: bool = typer.Option(False, "--quick", help="Smaller sizes everywhere (a smoke test, not an acceptance)."),
    size: Optional[str] = typer.Option(  # noqa: UP007
        None, "--size", help="Checkpoint size of item 5's default workload (default 2G; 256M with --quick)."),
    workload: Optional[str] = typer.Option(  # noqa: UP007
        None, "--workload", metavar="CMD", help="Command line to run as item 5's workload instead of the default "
                                                  "checkpoint save and load."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout (schema in docs/accept.md)."),
    root: Optional[str] = typer.Option(  # noqa: UP007
        None, "--root", metavar="PREFIX", help="Judge a captured tree standing for / (as gdskit check --root): "
                                               "items 1-2 only, the measuring items are n/a."),
    items: Optional[str] = typer.Option(  # noqa: UP007
        None, "--items", metavar="LIST", help="Run only these items, e.g. 1,2,6 (the others are listed as n/a)."),
    device: int = typer.Option(0, "-d", "--device", help="GPU index."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds a child process (workload, fault case) may run."),
) -> None:
    from rich.console import Console  # noqa: PLC0415 - import time

    from gdskit.accept.context import AcceptOptions  # noqa: PLC0415 - import time
    from gdskit.accept.report import headline  # noqa: PLC0415 - import time
    from gdskit.accept.run import ConsoleProgress, default_report_dir, run_accept  # noqa: PLC0415 - import time

    err = Console(stderr=True, highlight=False)
    progress = None
    try:
        with cli_errors("accept"):  # an unwritable report directory included
            # Paths inside a captured tree are machine paths: keep them as given.
            targets = list(paths or []) if root else [os.path.abspath(p) for p in (paths or [os.getcwd()])]
            opts = AcceptOptions(
                targets=targets, report_dir=os.path.abspath(report_dir) if report_dir else default_report_dir(),
                root=root, quick=quick, size=parse_size(size) if size is not None else None, workload=workload,
                device=device, items=_parse_items(items), timeout=timeout)
            # Results go to stdout; with --json stdout holds only the JSON, so they go to stderr then.
            progress = ConsoleProgress(err if as_json else Console(highlight=False))
            report = run_accept(opts, progress=progress)
    finally:
        if progress is not None:
            progress.close()
    if as_json:
        sys.stdout.write(json.dumps(report.to_dict(), indent=2, default=str) + "\n")
    else:
        out = Console(highlight=False)
        style = {"accepted": "bold green", "not accepted": "bold red"}.get(report.verdict, "bold yellow")
        out.print(f"[{style}]{headline(report)}[/{style}]")
        for it in report.failed:
            first = (it.fix or "").splitlines()[0] if it.fix else ""
            out.print(f"  item {it.id} fix: {first}", soft_wrap=True)
    err.print(f"report: {os.path.join(opts.report_dir, 'report.html')} (and report.md, report.json)")
    raise typer.Exit(report.exit_code)


def register(app: typer.Typer) -> None:
    """Add ``accept`` to the ``gdskit`` command."""
    app.command(name="accept", help=_HELP)(accept)
