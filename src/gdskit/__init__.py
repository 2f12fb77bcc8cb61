"""gdskit: files to GPU (or host) memory by the fastest path, with a ledger of the path every byte took.

>>> import gdskit, numpy as np
>>> buf = np.empty(1 << 20, dtype=np.uint8)
>>> with gdskit.open("data.bin") as f:          # doctest: +SKIP
...     n = f.read(buf)
>>> gdskit.stats().paths                        # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

# Eager, and first: the submodule gdskit.settings shares its name with the settings object
# exported here; once imported, no later `import gdskit.settings` can rebind the name.
from gdskit import errors
from gdskit.errors import GdskitError
from gdskit.settings import Settings, settings
from gdskit.vocabulary import Mode, ODirectPolicy, Path, PinnedAlloc, Reason

if TYPE_CHECKING:
    from gdskit import cuda
    from gdskit.backends.cufile import BufferRegistration
    from gdskit.file import File, open
    from gdskit.ledger import LedgerEntry, PathStats, Stats, stats, stats_delta, stats_reset
    from gdskit.numa import NumaPlace
    from gdskit.pool import ResourceUsage
    from gdskit.routing import StorageFacts

# The engine loads on first use, not at import: `import gdskit.safetensors` (or a program that
# only reads settings) does not pay for the modules its first call does not touch.
_LAZY = {"File": "file", "open": "file", "LedgerEntry": "ledger", "PathStats": "ledger", "Stats": "ledger",
         "stats": "ledger", "stats_delta": "ledger", "stats_reset": "ledger", "ResourceUsage": "pool"}


def __getattr__(name: str) -> Any:
    if name == "cuda":
        return importlib.import_module("gdskit.cuda")
    if name in _LAZY:
        value = getattr(importlib.import_module(f"gdskit.{_LAZY[name]}"), name)
        globals()[name] = value  # looked up once
        return value
    raise AttributeError(f"module 'gdskit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, "cuda"})


__version__ = "0.1.0"

_telemetry_follows = False


def _stats_level_changed(names: frozenset[str]) -> None:
    """Live statistics follow settings.stats_level (GDSKIT_STATS); the engine never calls up into
    them. Telemetry is imported only once the level is on, and from then on follows the settings
    itself: a process that never publishes never loads it."""
    global _telemetry_follows
    if not _telemetry_follows and "stats_level" in names and settings.stats_level > 0:
        from gdskit.telemetry import follow_settings  # noqa: PLC0415

        _telemetry_follows = True
        follow_settings()


settings.subscribe(_stats_level_changed)
_stats_level_changed(frozenset({"stats_level"}))  # GDSKIT_STATS at start-up: publish from import on


def _machine_route_facts(st_dev: int, gpu_bus_ids: tuple[str, ...]) -> "StorageFacts":
    """Where a file's storage sits relative to each GPU, read from sysfs (gdskit.probe.routes)."""
    from gdskit.probe.routes import live_storage_facts  # noqa: PLC0415 - read only when a read may be routed

    return live_storage_facts(st_dev, gpu_bus_ids)


def _gpu_numa_place(pci_bus_id: str) -> "NumaPlace":
    """A GPU's NUMA node and its CPUs, read from sysfs (gdskit.probe.numa_facts)."""
    from gdskit.probe.numa_facts import live_numa_place  # noqa: PLC0415 - read when a device lane is first made

    return live_numa_place(pci_bus_id)


_FACT_SOURCES = {"routing": _machine_route_facts, "numa": _gpu_numa_place}


class _Package(types.ModuleType):
    """Routing and the bounce path's NUMA placement take their facts about the machine from the
    probes' sysfs readers: the engine never reads the topology itself (gdskit.routing, gdskit.numa).
    Each gets its source as it loads, with the engine's first use (the import system sets every
    submodule it loads on its package), so that ``import gdskit`` loads neither."""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        source = _FACT_SOURCES.get(name)
        if source is not None and isinstance(value, types.ModuleType):
            value.use_facts(source)


sys.modules[__name__].__class__ = _Package


def resources() -> ResourceUsage:
    """What gdskit holds right now: lanes (staging areas), pinned bytes, worker threads."""
    from gdskit import pool  # noqa: PLC0415

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
    from gdskit import pool  # noqa: PLC0415

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
    from gdskit.backends.cufile import BufferRegistration  # noqa: PLC0415

    return BufferRegistration(buf)


def release_resources() -> None:
    """Free idle pinned buffers, routing's device staging, the stream-ordered requests' stages,
    streams and worker threads (they come back on the next request)."""
    from gdskit import pool, routed, streamed  # noqa: PLC0415

    pool.shutdown()
    routed.rings.release_idle()
    streamed.release_idle()


__all__ = [
    "File", "GdskitError", "LedgerEntry", "Mode", "ODirectPolicy", "Path", "PathStats", "PinnedAlloc", "Reason",
    "ResourceUsage", "Settings", "Stats", "__version__", "cuda", "errors", "open", "prepare", "register_buffer", "release_resources",
    "resources", "settings", "stats", "stats_delta", "stats_reset",
]
