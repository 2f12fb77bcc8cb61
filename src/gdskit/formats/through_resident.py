"""GPU loads through the resident loader (``gdskit serve``, docs/resident.md): whether to ask it,
and the exchange, for every loader that fills GPU tensors it has made or been given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gdskit.engine import read_through_resident, resident_worth_asking
from gdskit.formats.device_memory import reserve_device_memory
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


def fill(torch: Any, device: Any, files: Sequence[tuple[str, int]], targets: Sequence[tuple[int, int, int, int]],
         prog: Progress | None = None) -> bool:
    """Read each ``(address, bytes, file, file offset)`` into memory of GPU ``device`` (a
    contiguous tensor's ``data_ptr()``, or a place in one) through the resident loader:
    ``file`` indexes ``files``, each ``(path, bytes as its header said)``. True once every byte
    has landed; False where it did not serve: the caller reads every byte itself (what was
    counted on ``prog`` meanwhile is taken back). Raises as
    :func:`gdskit.engine.read_through_resident`."""
    torch.cuda.synchronize(device)  # work queued on the targets ends before another process writes them
    raw = [(ptr, n, k, offset) for ptr, n, k, offset in targets if n]
    if not raw:
        return True
    landed = [0]

    def on_bytes(n: int) -> None:
        landed[0] += n
        if prog is not None:
            prog.advance(n)

    why_not = read_through_resident(files, raw, on_bytes=on_bytes)
    if why_not is not None and landed[0] and prog is not None:  # a loader that went away mid-load
        prog.advance(-landed[0])  # the bytes come again
    return why_not is None


def fill_new(torch: Any, device: Any, files: Sequence[tuple[str, int]],
             wants: Sequence[tuple[Any, int, int, int]], make: Any,
             prog: Progress | None = None) -> tuple[dict[Any, Any], bool]:
    """Tensors made here and filled through the resident loader (:func:`fill`): one for each
    ``(key, bytes, file, file offset)`` of ``wants``, made by ``make(key)`` (a contiguous tensor
    of exactly those bytes on GPU ``device``). The tensors by key, and whether every byte landed
    (False: the caller reads them itself). The large ones are made at the cost of one
    allocation: one cudaMalloc here, and one mapping for the loader to open instead of one per
    tensor."""
    reserve_device_memory(device, [n for _key, n, _k, _offset in wants])
    made = {}
    targets = []
    for key, n, k, offset in wants:
        t = made[key] = make(key)
        targets.append((t.data_ptr(), n, k, offset))
    return made, fill(torch, device, files, targets, prog)
