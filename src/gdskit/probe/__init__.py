"""Read-only inspection of a machine for GPUDirect Storage: platform, GPUs, topology, mounts.

``run_check`` (in :mod:`gdskit.probe.check`) is the whole of ``gdskit check`` as a
library call. The names below load on first use, so that the engine, which reads
a few facts through :mod:`gdskit.probe.gds`, does not import the whole check.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"run_check": "check", "CheckReport": "report", "Finding": "verdict", "MountCheck": "verdict",
         "SystemRoot": "root"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"gdskit.probe.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'gdskit.probe' has no attribute {name!r}")
