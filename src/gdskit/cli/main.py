"""Entry point of the ``gdskit`` command. Each sub-command lives in its own module
with a ``register(app)`` function; this file only assembles them."""

from __future__ import annotations

import importlib
import sys

import typer

app = typer.Typer(
    name="gdskit",
    help="Files to GPU memory by the fastest path, with proof of the path every byte took.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

@app.callback()
def _root() -> None:
    """Files to GPU memory by the fastest path, with proof of the path every byte took."""


# Sub-command modules, in the order `gdskit --help` lists them.
_COMMAND_MODULES = ("check", "bench", "accept", "stats", "run")

for _name in _COMMAND_MODULES:
    importlib.import_module(f"gdskit.cli.{_name}").register(app)


def main() -> None:
    from gdskit.errors import GdskitError

    try:
        app()
    except GdskitError as exc:  # a clear message and a non-zero exit, never a traceback
        print(f"gdskit: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
