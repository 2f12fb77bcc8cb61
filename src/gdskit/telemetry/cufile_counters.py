"""cuFile's own per-GPU level-3 counters, for the level-3 snapshot.

Read only where this process already opened libcufile with its statistics on:
publishing must never be what loads cuFile.
"""

from __future__ import annotations

import sys
from typing import Any

# Our name -> cuFile's CUfilePerGpuStats_t field (cuFile spells the written bytes "writes_bytes").
FIELDS = {
    "read_bytes": "read_bytes",
    "n_total_reads": "n_total_reads",
    "n_nvfs_reads": "n_nvfs_reads",
    "n_p2p_reads": "n_p2p_reads",
    "n_posix_reads": "n_posix_reads",
    "n_unaligned_reads": "n_unaligned_reads",
    "n_reads_err": "n_reads_err",
    "write_bytes": "writes_bytes",
    "n_total_writes": "n_total_writes",
    "n_nvfs_writes": "n_nvfs_writes",
    "n_p2p_writes": "n_p2p_writes",
    "n_posix_writes": "n_posix_writes",
    "n_unaligned_writes": "n_unaligned_writes",
    "n_writes_err": "n_writes_err",
    "n_mmap_err": "n_mmap_err",
}


def read_per_gpu() -> dict[int, dict[str, int]] | None:
    """Counters of every GPU cuFile has counted something on, or ``None`` when cuFile is not in use here."""
    cufile_backend = sys.modules.get("gdskit.engine.backends.cufile")
    if cufile_backend is None:
        return None
    try:
        lib = cufile_backend.cufile_library()
        if not lib.stats_enabled:
            return None
        mod = lib.module
        s = mod.StatsLevel3()
        mod.get_stats_l3(s.ptr)
        return _per_gpu(s)
    except Exception:  # a closing or older libcufile: no counters this time
        return None


def _per_gpu(s: Any) -> dict[int, dict[str, int]]:
    import numpy as np  # noqa: PLC0415 - import time

    per_gpu = s.per_gpu_stats
    columns = {}
    for ours, theirs in FIELDS.items():
        values = getattr(per_gpu, theirs, None)
        if values is not None:
            columns[ours] = np.asarray(values).reshape(-1)
    n = max((c.size for c in columns.values()), default=0)
    n = min(n, int(getattr(s, "num_gpus", n) or n))
    out = {}
    for gpu in range(n):
        row = {k: int(c[gpu]) for k, c in columns.items() if gpu < c.size}
        if any(row.values()):
            out[gpu] = row
    return out


def totals(per_gpu: dict[int, dict[str, int]] | dict[str, dict[str, int]]) -> dict[str, int]:
    """The counters summed over GPUs."""
    out: dict[str, int] = {}
    for row in per_gpu.values():
        for k, v in row.items():
            out[k] = out.get(k, 0) + int(v)
    return out


def subtract(now: dict[int, dict[str, int]], before: dict[int, dict[str, int]] | None) -> dict[int, dict[str, int]]:
    """``now - before`` per GPU (a forked child publishes only what it did itself)."""
    if not before:
        return now
    out = {}
    for gpu, row in now.items():
        base = before.get(gpu, {})
        # A counter below its baseline was reset since (cuFile opened again): all of it is new.
        diff = {k: v - base.get(k, 0) if v >= base.get(k, 0) else v for k, v in row.items()}
        if any(diff.values()):
            out[gpu] = diff
    return out
