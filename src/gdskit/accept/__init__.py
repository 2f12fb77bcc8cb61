"""``gdskit accept``: the production acceptance checklist, with a report to archive.

Modules: :mod:`~gdskit.accept.items` (one function per checklist item),
:mod:`~gdskit.accept.measure` (items 3 and 4, through ``gdskit bench``),
:mod:`~gdskit.accept.checkpoint` (item 6), :mod:`~gdskit.accept.faults` and
:mod:`~gdskit.accept.fault_child` (item 7), :mod:`~gdskit.accept.workload` (item 5's
default workload), :mod:`~gdskit.accept.report` (Markdown, HTML, JSON),
:mod:`~gdskit.accept.run` (orchestration). The names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"run_accept": "run", "AcceptOptions": "context", "AcceptReport": "result", "ItemResult": "result",
         "write_report": "report"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"gdskit.accept.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'gdskit.accept' has no attribute {name!r}")
