"""Read-only inspection of a machine for GPUDirect Storage: platform, GPUs, topology, mounts.

``run_check`` (in :mod:`gdskit.probe.check`) is the whole of ``gdskit check`` as a
library call, over the facts :mod:`gdskit.machine` reads. The names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"run_check": "gdskit.probe.check", "CheckReport": "gdskit.probe.report", "Finding": "gdskit.probe.verdict",
         "MountCheck": "gdskit.probe.verdict", "SystemRoot": "gdskit.machine.root"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gdskit.probe' has no attribute {name!r}")
