"""The formats' one door to the I/O engine (``gdskit.open``, the ledger)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
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


def no_wait() -> None:
    """What waiting for a warm-up that never started does: nothing."""


def start_warm_up(device: int, nbytes: int) -> Callable[[], None]:
    """Set the engine up for a read of ``nbytes`` onto GPU ``device`` in the background
    (``gdskit.prepare``: pinned stages, streams, worker threads, the direct-route facts) while
    the caller allocates the destinations; returns the function that waits for it.

    Nothing starts once the ring exists, or for a read too small to use every worker's lane.
    Measured on the H200 machine, this set-up is 40-70 ms of a fresh process's first 8 GiB read.
    A failure here is left for the read itself to report.
    """
    from gdskit import pool, prepare
    from gdskit.settings import settings

    if nbytes < settings.threads * settings.chunk_size or pool.lanes.holds(device):
        return no_wait

    def run() -> None:
        try:
            prepare(device)
        except Exception:  # noqa: BLE001 - the read that follows meets the same error and raises it
            pass

    worker = threading.Thread(target=run, name="gdskit-warm-up", daemon=True)
    worker.start()
    return worker.join
