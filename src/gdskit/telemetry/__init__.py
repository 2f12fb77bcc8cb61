"""Live gdskit figures: publication (``GDSKIT_STATS``), reading, Prometheus, ``gdskit run``.

>>> from gdskit.telemetry import run_workload
>>> report = run_workload(["python", "train.py"])      # doctest: +SKIP
>>> report.verdict                                      # doctest: +SKIP
'direct grew, posix flat'

docs/stats.md describes the files, the JSON schema and the metric names.
"""

from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use: a process that publishes (GDSKIT_STATS=1, e.g. every process under
# `gdskit run`) imports only the publisher, not the reader, exporter and workload runner.
_LAZY = {"stats_dir": ("location", "stats_dir"), "to_prometheus": ("prometheus", "render"),
         "start_exporter": ("prometheus", "start_exporter"), "publish_now": ("publish", "publish_now"),
         "start_publishing": ("publish", "start_publishing"), "clean_stale": ("read", "clean_stale"),
         "list_snapshots": ("read", "list_snapshots"), "read_snapshot": ("read", "read_snapshot"),
         "SCHEMA": ("snapshot", "SCHEMA"), "Snapshot": ("snapshot", "Snapshot"),
         "WorkloadReport": ("workload", "WorkloadReport"), "run_workload": ("workload", "run_workload")}

# Not lazy: the function shares its name with its module, which would shadow it once imported.
from gdskit.settings import settings
from gdskit.telemetry.verdict import verdict  # noqa: E402, F401 - light (the ledger is loaded anyway)

__all__ = sorted([*_LAZY, "follow_settings", "verdict"])


def follow_settings() -> None:
    """Publish this process's ledger whenever ``settings.stats_level`` is on: from now on if
    it is already (``GDSKIT_STATS`` at start-up), and each time it is switched on or back on.
    ``import gdskit`` calls this once; the publisher stops itself when the level goes to 0."""
    settings.subscribe(_stats_level_changed)
    _stats_level_changed(frozenset({"stats_level"}))


def _stats_level_changed(names: frozenset[str]) -> None:
    if "stats_level" in names and settings.stats_level > 0:
        from gdskit.telemetry.publish import start_publishing  # noqa: PLC0415 - import time

        start_publishing()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f"gdskit.telemetry.{module}"), attr)
    raise AttributeError(f"module 'gdskit.telemetry' has no attribute {name!r}")
