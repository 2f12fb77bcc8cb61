"""A Typer app holding one gdskit command, as ``gdskit`` registers it: for the CLI tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def one_command_app(register: Callable[[Any], None], **typer_options: Any) -> Any:
    """A ``typer.Typer`` with the top-level callback ``gdskit`` has and one command module's
    ``register`` applied (a callback keeps the command a subcommand, as in ``gdskit check``)."""
    import typer

    app = typer.Typer(**typer_options)

    @app.callback()
    def _main() -> None:
        """gdskit"""

    register(app)
    return app
