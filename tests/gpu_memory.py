"""What torch's caching allocator did during a piece of work (GPU tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def new_large_pool_segments(run: Callable[[], Any]) -> tuple[Any, int]:
    """``(run(), segments)``: what ``run`` returns and how many large-pool segments (one
    ``cudaMalloc`` each) torch's caching allocator made for it, starting from an empty cache."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_stats()["segment.large_pool.allocated"]
    out = run()
    torch.cuda.synchronize()
    return out, torch.cuda.memory_stats()["segment.large_pool.allocated"] - before
