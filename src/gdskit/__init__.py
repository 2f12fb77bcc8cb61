"""gdskit: files to GPU (or host) memory by the fastest path, with a ledger of the path every byte took.

>>> import gdskit, numpy as np
>>> buf = np.empty(1 << 20, dtype=np.uint8)
>>> with gdskit.open("data.bin") as f:          # doctest: +SKIP
...     n = f.read(buf)
>>> gdskit.stats().paths                        # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Eager, and first: the submodule gdskit.settings shares its name with the settings object
# exported here; once imported, no later `import gdskit.settings` can rebind the name.
from gdskit import errors
from gdskit.errors import GdskitError
from gdskit.settings import Settings, settings
from gdskit.version import __version__
from gdskit.vocabulary import Mode, ODirectPolicy, Path, PinnedAlloc, Reason

if TYPE_CHECKING:
    from gdskit.engine.backends.cufile import BufferRegistration
    from gdskit.engine.file import File, open
    from gdskit.engine.ledger import LedgerEntry, PathStats, Stats, stats, stats_delta, stats_reset
    from gdskit.engine.pool import ResourceUsage

# The engine loads on first use, not at import: `import gdskit.safetensors` (or a program that
# only reads settings) does not pay for the modules its first call does not touch.
_LAZY = {"File": "file", "open": "file", "LedgerEntry": "ledger", "PathStats": "ledger", "Stats": "ledger",
         "stats": "ledger", "stats_delta": "ledger", "stats_reset": "ledger", "ResourceUsage": "pool"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"gdskit.engine.{_LAZY[name]}"), name)
        globals()[name] = value  # looked up once
        return value
    raise AttributeError(f"module 'gdskit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})



_telemetry_follows = False


def _stats_level_changed(names: frozenset[str]) -> None:
    """Live statistics follow settings.stats_level (GDSKIT_STATS); the engine never calls up into
    them. Telemetry is imported only once the level is on, and from then on follows the settings
    itself: a process that never publishes never loads it."""
    global _telemetry_follows
    if not _telemetry_follows and "stats_level" in names and settings.stats_level > 0:
        from gdskit.telemetry import follow_settings  # noqa: PLC0415 - import time

        _telemetry_follows = True
        follow_settings()


settings.subscribe(_stats_level_changed)
_stats_level_changed(frozenset({"stats_level"}))  # GDSKIT_STATS at start-up: publish from import on


def resources() -> ResourceUsage:
    """What gdskit holds right now: lanes (staging areas), pinned bytes, worker threads."""
    import gdskit.engine.pool as pool  # noqa: PLC0415 - import time

    return pool.lanes.usage(settings.threads)


def prepare(device: int | None = None, *, workers: int | None = None) -> ResourceUsage:
    """Set up the bounce ring for ``device`` now (pinned buffers, streams, worker threads), and
    work out whether this machine has a direct route at all (``auto`` mode asks once per process).

    The first large read otherwise pays for this set-up; call it early, e.g. while a
    model is being built, so that loading its weights runs at full speed at once.
    ``workers`` sets up the staging of only that many workers (default: all
    ``settings.threads``), for work that will use fewer. Returns what is held afterwards.
    Without a GPU it only starts the worker threads.
    """
    import gdskit.engine.pool as pool  # noqa: PLC0415 - import time

    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise errors.InvalidArgumentError(f"workers must be a positive integer, got {workers!r}")
    pool.set_up(device, workers)
    return pool.lanes.usage(settings.threads)


def register_buffer(buf: object) -> BufferRegistration:
    """Register a GPU buffer with cuFile for repeated direct I/O (``cuFileBufRegister``).

    cuFile then DMAs straight into it instead of through its own bounce buffers.
    Use as a context manager, or call ``.release()``; whatever is left is released
    at exit. Where cuFile cannot take the buffer (no libcufile, host or managed
    memory) nothing happens and ``.registered`` is False, with ``.reason``.
    """
    from gdskit.engine.backends.cufile import BufferRegistration  # noqa: PLC0415 - import time

    return BufferRegistration(buf)


def release_resources() -> None:
    """Free idle pinned buffers, routing's device staging, the stream-ordered requests' stages,
    streams and worker threads (they come back on the next request)."""
    import gdskit.engine.pool as pool  # noqa: PLC0415 - import time
    import gdskit.engine.stream_ordered as stream_ordered  # noqa: PLC0415 - import time
    import gdskit.engine.via_gpu as via_gpu  # noqa: PLC0415 - import time

    pool.shutdown()
    via_gpu.rings.release_idle()
    stream_ordered.release_idle()


__all__ = [
    "File", "GdskitError", "LedgerEntry", "Mode", "ODirectPolicy", "Path", "PathStats", "PinnedAlloc", "Reason",
    "ResourceUsage", "Settings", "Stats", "__version__", "errors", "open", "prepare", "register_buffer", "release_resources",
    "resources", "settings", "stats", "stats_delta", "stats_reset",
]
