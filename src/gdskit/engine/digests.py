"""Digests of bytes where they landed: device memory on its GPU (one kernel launch pair for
all of a device's buffers, :mod:`gdskit.engine.gpu_hash`), host memory on the CPU
(:mod:`gdskit.verify.digest`). Every check is counted in the ledger (bytes, GPU bytes, seconds)."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from typing import Any

import gdskit.engine.cuda as cuda
from gdskit.engine.ledger import ledger
from gdskit.errors import CudaError
from gdskit.verify.digest import blake3_hex


def _host_digest(ptr: int, nbytes: int) -> str:
    if nbytes == 0:
        return blake3_hex(b"")
    return blake3_hex((ctypes.c_char * nbytes).from_address(ptr))


class StartedDigests:
    """Digests of buffers under way (:func:`start_digests`): host buffers hashed already, device
    buffers' kernels queued. :meth:`result` waits for them and counts the check in the ledger;
    :meth:`abandon` drops them (the GPU's work is let finish before its memory is freed)."""

    def __init__(self, found: list[str | None], launched: list[tuple[list[int], Any]], total: int,
                 gpu_bytes: int, seconds: float) -> None:
        self._found, self._launched = found, launched
        self._total, self._gpu_bytes, self._seconds = total, gpu_bytes, seconds

    def result(self) -> list[str]:
        """The digests (hex), one per buffer in the order given."""
        start = time.perf_counter()
        try:
            while self._launched:
                indices, pending = self._launched[0]
                found = pending.wait()
                self._launched.pop(0)
                if len(found) != len(indices):  # never pair a buffer with another's digest, nor leave one unchecked
                    raise CudaError(f"a GPU gave {len(found)} digests for {len(indices)} buffers")
                for i, digest in zip(indices, found):
                    self._found[i] = digest
        except BaseException:
            self.abandon()
            raise
        # The time the caller spent on the check: starting it and waiting for it here.
        ledger.record_verified(self._total, self._seconds + time.perf_counter() - start, self._gpu_bytes,
                               checks=len(self._found))
        return _every_digest(self._found)

    def abandon(self) -> None:
        """Drop the digests not yet read back."""
        launched, self._launched = self._launched, []
        for _indices, pending in launched:
            pending.abandon()


def start_digests(buffers: Sequence[tuple[int, int]], stream: int = 0, device: int | None = None) -> StartedDigests:
    """Start the BLAKE3 digests of ``buffers``, ``(address, nbytes)`` pairs of host or device
    memory, each hashed where it lies: host buffers now, on this thread; device buffers by
    kernels queued on ``stream`` (a raw handle: the stream their bytes landed on), which run
    while the caller goes on. ``device``: every buffer is memory of that GPU (the caller knows:
    CUDA is not asked pointer by pointer). The buffers must stay alive until
    :meth:`StartedDigests.result` (or ``abandon``) returns."""
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
    launched: list[tuple[list[int], Any]] = []
    try:
        for gpu, indices in on_device.items():
            if not indices:
                continue
            items = [(int(buffers[i][0]), int(buffers[i][1])) for i in indices]
            launched.append((indices, launch_cuda_digests(items, gpu, stream)))
            gpu_bytes += sum(n for _p, n in items)
    except BaseException:
        for _indices, pending in launched:
            pending.abandon()
        raise
    total = sum(int(n) for _p, n in buffers)
    return StartedDigests(out, launched, total, gpu_bytes, time.perf_counter() - start)


def digest_buffers(buffers: Sequence[tuple[int, int]], stream: int = 0, device: int | None = None) -> list[str]:
    """The BLAKE3 digests (hex) of ``buffers`` (:func:`start_digests`), waiting for the GPU's."""
    return start_digests(buffers, stream, device).result()


def _every_digest(found: list[str | None]) -> list[str]:
    """``found`` with every slot filled: a slot left empty is refused, never dropped (dropping it
    would shift every later digest onto the wrong buffer)."""
    missing = [i for i, d in enumerate(found) if d is None]
    if missing:
        raise CudaError(f"no digest was computed for buffer {missing[0]} of {len(found)}")
    return [d for d in found if d is not None]


def launch_cuda_digests(items: list[tuple[int, int]], device: int, stream: int) -> Any:
    """The GPU's digests of ``items`` on ``device``, queued (compiled and loaded at first use)."""
    from gdskit.engine.gpu_hash import launch_digests  # noqa: PLC0415 - import time
    return launch_digests(items, device, stream)
