"""Loading one checkpoint on every rank of a process group, each byte read from storage once.

``gdskit.safetensors.load_file(..., process_group=pg)`` and ``gdskit.torch.load(...,
process_group=pg)`` come here: every rank parses the checkpoint's header, the ranks agree
on a :class:`~gdskit.group.plan.FanOutPlan`, each reads its share through the engine and
``torch.distributed`` broadcasts carry the rest (NCCL for GPU memory, gloo for host memory).
Modules: ``plan`` (pure: who reads what, in which order), ``exchange`` (the collectives),
``failure`` (every rank raises when one fails), ``config`` (window, piece, timeout), ``pipeline`` (reads and broadcasts window
by window), ``load_safetensors`` and ``load_torch`` (the formats' side). docs/multigpu.md.
"""

from __future__ import annotations

from gdskit.errors import GroupError
from gdskit.group.config import Options, options

__all__ = ["GroupError", "Options", "options"]
