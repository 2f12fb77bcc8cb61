"""Making many large tensors on a GPU at the cost of one allocation (torch's caching allocator)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

# torch's caching allocator serves requests above 1 MiB from its large pool, rounded up to 512 bytes.
_SMALL_POOL_MAX = 1 << 20
_ROUND = 512


def _allocator_splits_blocks(torch: Any) -> bool:
    """Whether torch's allocator will carve later allocations out of one freed large block:
    true for its native allocator unless a setting stops it (``max_split_size_mb`` keeps
    big blocks whole; expandable segments and cudaMallocAsync manage memory otherwise)."""
    conf = ",".join(os.environ.get(v, "") for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    if any(k in conf for k in ("max_split_size_mb", "expandable_segments", "cudaMallocAsync")):
        return False
    try:
        return torch.cuda.memory.get_allocator_backend() == "native"
    except (AttributeError, RuntimeError):
        return False


def reserve_device_memory(device: Any, sizes: Iterable[int]) -> None:
    """Let torch's allocator take, in one ``cudaMalloc``, the memory of the large tensors about to be made.

    Separate allocations made while the engine's copies are in flight cost several times as
    much (docs/engine.md, "Measurements behind the defaults"), and the resident loader maps
    each allocation it reads into (CUDA IPC) once. One block of the total, freed at once, stays
    in torch's cache and each later allocation is split from it; every tensor still owns its
    memory. Nothing is reserved where that would not hold, or when the block does not fit.
    """
    if device.type != "cuda":
        return
    import torch  # noqa: PLC0415 - optional dependency (torch)

    total = sum(-(-n // _ROUND) * _ROUND for n in sizes if n > _SMALL_POOL_MAX)
    if total < 2 * (32 << 20) or not _allocator_splits_blocks(torch):
        return  # a few allocations cost less than the check
    try:
        block = torch.empty(total, dtype=torch.uint8, device=device)
    except torch.cuda.OutOfMemoryError:
        return
    del block
