"""Entry point of the ``gdskit`` command. Each sub-command lives in its own module
with a ``register(app)`` function; this file only assembles them."""

from __future__ import annotations

import importlib
import sys

import typer

from gdskit import __version__
from gdskit.errors import GdskitError
from gdskit.settings import settings

app = typer.Typer(
    name="gdskit",
    help="Files to GPU memory by the fastest path, with proof of the path every byte took.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gdskit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print gdskit's version and exit."),
) -> None:
    """Files to GPU memory by the fastest path, with proof of the path every byte took."""


# Sub-command modules, in the order `gdskit --help` lists them.
_COMMAND_MODULES = ("check", "bench", "accept", "stats", "run", "digest", "uploads", "serve")

for _name in _COMMAND_MODULES:
    importlib.import_module(f"gdskit.cli.{_name}").register(app)


def main() -> None:
    """Run the ``gdskit`` command. One line on stderr, never a traceback, for an invalid
    ``GDSKIT_*`` variable or any other error gdskit raises on purpose (exit status 2), and for
    what the system refuses at run time that a command did not catch itself (exit status 1)."""
    try:
        settings.check_environment()  # every command depends on it, --help too: say so first
        app()
    except GdskitError as exc:
        print(f"gdskit: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except OSError as exc:  # the system refused something at run time (an address, a device): status 1
        print(f"gdskit: error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
