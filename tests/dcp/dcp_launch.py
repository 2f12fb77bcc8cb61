"""Start one process per rank for the DCP tests and collect what each rank reported."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rank_launch import run_ranks

HERE = Path(__file__).resolve().parent


def run_world(phase: str, world: int, workdir: Path, device: str = "cpu", timeout_s: float = 240) -> dict[int, Any]:
    """Run ``phase`` of ``dcp_workers.py`` on ``world`` ranks; {rank: {check: {"ok", "detail"}}}.

    Fails (AssertionError) if a rank exits non-zero, hangs past ``timeout_s`` or
    reports nothing; every process is ended before returning.
    """
    return run_ranks(HERE / "dcp_workers.py", phase, world, workdir, extra=(device,), timeout_s=timeout_s)
