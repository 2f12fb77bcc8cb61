"""GPU loads through the resident loader (``gdskit serve``, docs/resident.md): whether to ask it,
and the exchange, for every loader that fills GPU tensors it has made or been given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gdskit.engine import read_through_resident, resident_worth_asking
from gdskit.formats.progress import Progress


def worth_asking(torch: Any, device: Any, sizes: Sequence[int], paths: Sequence[str]) -> bool:
    """Whether a load of reads of ``sizes`` bytes from the files ``paths`` onto torch ``device``
    asks the resident loader first: a GPU, and the rules of
    :func:`gdskit.engine.resident.worth_asking`. Verified loads never ask (their callers do not):
    their digests are computed where the bytes land."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return resident_worth_asking(index, [n for n in sizes if n], paths)


def fill(torch: Any, device: Any, path: str, file_size: int, targets: Sequence[tuple[Any, int, int]],
         prog: Progress) -> bool:
    """Read each ``(tensor, bytes, file offset)`` of ``path`` (``file_size`` bytes, as its header
    said) into its contiguous tensor on GPU ``device`` through the resident loader. True once
    every byte has landed; False where it did not serve: the caller reads every byte itself
    (what was counted on ``prog`` meanwhile is taken back). Raises as
    :func:`gdskit.engine.read_through_resident`."""
    torch.cuda.synchronize(device)  # work queued on the targets ends before another process writes them
    raw = [(t.data_ptr(), n, offset) for t, n, offset in targets if n]
    if not raw:
        return True
    landed = [0]

    def on_bytes(n: int) -> None:
        landed[0] += n
        prog.advance(n)

    why_not = read_through_resident(path, file_size, raw, on_bytes=on_bytes)
    if why_not is not None and landed[0]:  # a loader that went away mid-load: the bytes come again
        prog.advance(-landed[0])
    return why_not is None
