"""The benchmarks' test files: made once in a folder, reused by later runs."""

from __future__ import annotations

import os
from collections.abc import Callable


def file_made_once(folder: str, name: str, make: Callable[[str], None]) -> str:
    """``folder/name``, made by ``make(path)`` unless a run before this one made it."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        make(path)
    return path
