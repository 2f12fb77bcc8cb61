"""What signals a process or one of its threads blocks, as the kernel reports it (Linux)."""

from __future__ import annotations

import re
from pathlib import Path


def blocked_signals(pid: int | str = "self", tid: int | None = None) -> set[int]:
    """The signal numbers ``pid`` (or its thread ``tid``) blocks, from ``/proc``'s ``SigBlk``."""
    where = f"/proc/{pid}" + (f"/task/{tid}" if tid is not None else "")
    status = Path(where, "status").read_text()
    mask = int(re.search(r"^SigBlk:\s*([0-9a-fA-F]+)$", status, re.M).group(1), 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}
