"""Digests of bytes where they landed: device memory on its GPU (one kernel launch pair for
all of a device's buffers, :mod:`gdskit.engine.gpu_hash`), host memory on the CPU
(:mod:`gdskit.verify.digest`). Every check is counted in the ledger (bytes, GPU bytes, seconds)."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence

import gdskit.engine.cuda as cuda
from gdskit.engine.ledger import ledger
from gdskit.errors import CudaError
from gdskit.verify.digest import blake3_hex


def _host_digest(ptr: int, nbytes: int) -> str:
    if nbytes == 0:
        return blake3_hex(b"")
    return blake3_hex((ctypes.c_char * nbytes).from_address(ptr))


def digest_buffers(buffers: Sequence[tuple[int, int]], stream: int = 0, device: int | None = None) -> list[str]:
    """The BLAKE3 digests (hex) of ``buffers``, ``(address, nbytes)`` pairs of host or device
    memory, each hashed where it lies; device buffers on ``stream`` (a raw handle: the stream
    their bytes landed on). ``device``: every buffer is memory of that GPU (the caller knows:
    CUDA is not asked pointer by pointer). Waits for the GPU's digests."""
    start = time.perf_counter()
    out: list[str | None] = [None] * len(buffers)
    on_device: dict[int, list[int]] = {}
    if device is not None:
        on_device[device] = [i for i, (_p, n) in enumerate(buffers) if n]
        for i, (_p, n) in enumerate(buffers):
            if not n:
                out[i] = _host_digest(0, 0)
    for i, (ptr, nbytes) in enumerate(buffers if device is None else ()):
        info = cuda.pointer_info(int(ptr)) if nbytes else None
        if info is not None and info.device is not None and info.kind in (cuda.MemoryKind.DEVICE,
                                                                          cuda.MemoryKind.MANAGED):
            on_device.setdefault(info.device, []).append(i)
        else:
            out[i] = _host_digest(int(ptr), int(nbytes))
    gpu_bytes = 0
    for gpu, indices in on_device.items():
        items = [(int(buffers[i][0]), int(buffers[i][1])) for i in indices]
        found = cuda_digests(items, gpu, stream)
        if len(found) != len(items):  # never pair a buffer with another's digest, nor leave one unchecked
            raise CudaError(f"GPU {gpu} gave {len(found)} digests for {len(items)} buffers")
        for i, digest in zip(indices, found):
            out[i] = digest
        gpu_bytes += sum(n for _p, n in items)
    total = sum(int(n) for _p, n in buffers)
    ledger.record_verified(total, time.perf_counter() - start, gpu_bytes, checks=len(buffers))
    return _every_digest(out)


def _every_digest(found: list[str | None]) -> list[str]:
    """``found`` with every slot filled: a slot left empty is refused, never dropped (dropping it
    would shift every later digest onto the wrong buffer)."""
    missing = [i for i, d in enumerate(found) if d is None]
    if missing:
        raise CudaError(f"no digest was computed for buffer {missing[0]} of {len(found)}")
    return [d for d in found if d is not None]


def cuda_digests(items: list[tuple[int, int]], device: int, stream: int) -> list[str]:
    """The GPU's digests of ``items`` on ``device`` (compiled and loaded at first use)."""
    from gdskit.engine.gpu_hash import digest_device  # noqa: PLC0415 - import time
    return digest_device(items, device, stream)
