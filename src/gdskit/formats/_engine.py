"""The formats' one door to the I/O engine (``gdskit.open``, the ledger)."""

from __future__ import annotations

import os
from typing import Any


def open_file(path: str | os.PathLike[str], mode: str = "r", *, atomic: bool = False) -> Any:
    """Open ``path`` through the engine: a :class:`gdskit.File`."""
    from gdskit.file import open as engine_open
    return engine_open(path, mode, atomic=atomic)


def stats() -> Any:
    """A snapshot of the engine's ledger."""
    from gdskit.ledger import stats as ledger_stats
    return ledger_stats()


def stats_delta(before: Any, after: Any) -> Any:
    """What the ledger recorded between two snapshots."""
    from gdskit.ledger import stats_delta as delta
    return delta(before, after)
