"""Checkpoint formats: pure-Python parsing and planning (torch is imported only on request).

The torch-facing entry points are :mod:`gdskit.safetensors` and :mod:`gdskit.torch`.
"""

from __future__ import annotations

from typing import Any

from gdskit.errors import MissingDependencyError


def require_torch(user: str) -> Any:
    """The torch module, imported on first use by ``user`` (e.g. ``"gdskit.torch"``);
    :class:`~gdskit.errors.MissingDependencyError` (an ImportError) when it is not installed."""
    try:
        import torch  # noqa: PLC0415 - optional dependency (torch)
    except ImportError:
        raise MissingDependencyError(f"{user} needs torch: pip install 'gdskit[torch]'") from None
    return torch
