"""`gdskit demo` (written with the engine)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    pass
