"""`gdskit run -- CMD ARGS...`: run a workload with gdskit publication on, then say where its bytes went.

The report goes to stderr (the workload owns stdout); ``--json`` prints it to
stdout, ``--report FILE`` writes it to a file. Exit status: the workload's own
status when it failed (128+N when signal N ended it); otherwise 1 when
``--require direct`` is not met; 124 past ``--timeout``; 127 command not found;
126 found but not executable; 2 bad arguments; else 0.
"""

from __future__ import annotations

import enum
import json
import sys
from typing import Any, Optional

import typer

from gdskit.cli import cli_errors
from gdskit.errors import GdskitError, GdskitFileNotFoundError, GdskitIOError, WorkloadTimeoutError


class Requirement(str, enum.Enum):
    direct = "direct"


_HELP = (
    "Run a workload with gdskit's figures published (GDSKIT_STATS), and when it ends print the path "
    "split of every gdskit process it started and a verdict in plain words.\n\n"
    "Example: gdskit run --require direct -- python train.py --epochs 1"
)


def register(app: typer.Typer) -> None:
    app.command("run", help=_HELP, no_args_is_help=True,
                context_settings={"allow_interspersed_args": False})(run)


def run(
    command: list[str] = typer.Argument(..., metavar="-- CMD [ARGS]...", help="The workload to run."),
    require: Optional[Requirement] = typer.Option(  # noqa: UP007
        None, "--require", help="direct: exit 1 unless bytes moved and every one took a direct path."),
    level: int = typer.Option(3, "-l", "--level", min=1, max=3, help="Publication level the workload runs with."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout (schema gdskit.run/1)."),
    report_file: Optional[str] = typer.Option(None, "--report", metavar="FILE", help="Also write the JSON report to FILE."),  # noqa: UP007
    timeout: Optional[float] = typer.Option(None, "--timeout", min=0.01, help="Stop the workload after this many seconds."),  # noqa: UP007
) -> None:
    from gdskit.durable import check_output_file, write_text_whole  # noqa: PLC0415 - import time
    from gdskit.telemetry import run_workload  # noqa: PLC0415 - import time

    if report_file:
        with cli_errors("run"):  # settled before the workload runs, not found wrong after it
            check_output_file(report_file, "--report")
    timed_out = False
    try:
        report = run_workload(command, level=level, timeout=timeout)
    except WorkloadTimeoutError as exc:
        report, timed_out = exc.report, True
    except GdskitFileNotFoundError as exc:
        typer.echo(f"gdskit run: {exc.filename}: command not found", err=True)
        raise typer.Exit(127) from None
    except GdskitIOError as exc:
        if exc.filename != command[0]:
            typer.echo(f"gdskit run: error: {exc}", err=True)
            raise typer.Exit(2) from None
        # There, but it cannot be run (not executable, a directory, not a program): 126, as a shell says.
        typer.echo(f"gdskit run: {exc.filename}: cannot execute: {exc.strerror}", err=True)
        raise typer.Exit(126) from None
    except GdskitError as exc:
        typer.echo(f"gdskit run: error: {exc}", err=True)
        raise typer.Exit(2) from None
    doc = report.to_dict()
    if report_file:
        with cli_errors("run"):  # the old report or the new one, never part of one
            write_text_whole(report_file, json.dumps(doc, indent=2) + "\n")
    if as_json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        render(report)
    if timed_out:
        typer.echo(f"gdskit run: the workload ran past --timeout {timeout:g} s and was stopped", err=True)
        raise typer.Exit(124)
    if report.returncode != 0:
        raise typer.Exit(128 - report.returncode if report.returncode < 0 else report.returncode)
    if require is Requirement.direct and not report.all_direct:
        typer.echo(f"gdskit run: requirement 'direct' NOT met: {report.verdict}", err=True)
        raise typer.Exit(1)


def render(report: Any) -> None:
    """The path split, the non-direct reasons, cuFile's counters and the verdict, on stderr."""
    from rich.console import Console  # noqa: PLC0415 - import time
    from rich.text import Text  # noqa: PLC0415 - import time

    from gdskit.telemetry.render import (
        human_bytes,
        paths_table,
        reasons_table,
        verdict_text,
        verified_text,
    )  # noqa: PLC0415 - import time

    console = Console(stderr=True)
    console.print(Text(f"gdskit run: {' '.join(report.argv)[:200]}", style="bold"))
    status = (f"exited with {report.returncode}" if report.returncode >= 0
              else f"ended by signal {-report.returncode}")
    console.print(f"workload {status} after {report.duration_s:.2f} s; {report.processes} gdskit "
                  f"process{'es' if report.processes != 1 else ''} published"
                  + (" (some ended without a final snapshot: their last one was used)" if report.partial else ""))
    if report.stats.entries:
        console.print(paths_table(report.stats, title="Path split"))
        console.print(reasons_table(report.stats))
    if report.stats.verified.checks:  # the workload's loads were checked against their digests
        console.print(verified_text(report.stats))
    if report.cufile_counters:
        c = report.cufile_counters
        console.print("cuFile's own counters: "
                      f"nvfs {c.get('n_nvfs_reads', 0)}/{c.get('n_nvfs_writes', 0)}, "
                      f"p2p {c.get('n_p2p_reads', 0)}/{c.get('n_p2p_writes', 0)}, "
                      f"posix {c.get('n_posix_reads', 0)}/{c.get('n_posix_writes', 0)} (reads/writes)")
    console.print(Text.assemble(("verdict: ", "bold"), verdict_text(report.stats),
                                f"  (direct {human_bytes(report.direct_bytes)}, "
                                f"not direct {human_bytes(report.posix_bytes)})"))
