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


def load_from_one_segment(tmp_path: Any, save: Callable[[Any, Any], Any], load: Callable[[Any], Any],
                          name: str) -> tuple[dict[str, Any], Any, int]:
    """Save 24 CPU tensors of 4 MiB with ``save(tensors, path)``, load them to the GPU with
    ``load(path)``: ``(tensors, loaded, large-pool segments the load made)``. Without a
    reservation each tensor would cost torch's allocator its own ``cudaMalloc``."""
    import torch

    tensors = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(24)}
    path = tmp_path / name
    save(tensors, path)
    out, segments = new_large_pool_segments(lambda: load(path))
    return tensors, out, segments
