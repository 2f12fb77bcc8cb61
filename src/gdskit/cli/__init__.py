"""The ``gdskit`` command line: a thin layer that renders what the library returns."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from gdskit.errors import GdskitError


@contextlib.contextmanager
def cli_errors(command: str, interrupted: str = "interrupted") -> Iterator[None]:
    """One way for every command to end on a bad argument, an unwritable file or Ctrl-C:
    a one-line message on stderr and exit status 2 (130 on Ctrl-C), never a traceback."""
    import typer  # noqa: PLC0415 - import time

    try:
        yield
    except (GdskitError, OSError) as exc:
        typer.echo(f"gdskit {command}: error: {exc}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        typer.echo(f"gdskit {command}: {interrupted}", err=True)
        raise typer.Exit(130) from None
