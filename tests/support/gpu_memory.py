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


def segments_holding(tensors: Any) -> int:
    """How many of torch's allocator segments (one ``cudaMalloc`` each) hold ``tensors``' bytes.
    Read from the allocator's own map, so a segment another test left cached counts as what it
    is: one segment, whether this load made it or found it free."""
    import torch

    spans = [(s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot()]
    held = set()
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        held.update(i for i, (lo, hi) in enumerate(spans) if lo <= ptr < hi)
    return len(held)


def load_from_one_segment(tmp_path: Any, save: Callable[[Any, Any], Any], load: Callable[[Any], Any],
                          name: str) -> tuple[dict[str, Any], Any, int, int]:
    """Save 24 CPU tensors of 4 MiB with ``save(tensors, path)``, load them to the GPU with
    ``load(path)``: ``(tensors, loaded, segments the load made, segments holding the loaded
    tensors)``. Without a reservation each tensor would cost torch's allocator its own block of
    a 20 MiB segment: five segments made. With a free segment left cached by earlier work (a
    block still in use in it), the load may make none and use that one."""
    import torch

    tensors = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(24)}
    path = tmp_path / name
    save(tensors, path)
    out, made = new_large_pool_segments(lambda: load(path))
    return tensors, out, made, segments_holding(out.values())
