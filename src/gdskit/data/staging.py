"""Pinned staging for batches bound for a GPU: host reads into page-locked memory, then one copy.

A batch of many small reads costs least as host reads (the kernel copies from the page cache,
or O_DIRECT reads a cold range) into page-locked host memory, and then one asynchronous copy
of the whole batch to the GPU on the loader's stream. :class:`Staging` keeps a few such
buffers (slots) and hands them out in turn; a slot is written again only after the copy out
of it has finished (an event recorded after the copy, waited for by the thread that refills
it, never by the caller). Torch-free: the copy takes raw pointers and a stream handle, so the
same code runs on the stand-in CUDA driver in CI.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from gdskit.errors import call_each
from gdskit.engine import adapt, closed_at_exit, cuda_layer

__all__ = ["Slot", "Staging"]

_GRAIN = 64 << 10  # slot sizes are rounded up to this, so batches of nearly one size share them


class Slot:
    """One page-locked buffer, the engine's view of it, and the event after its last copy out."""

    def __init__(self, nbytes: int) -> None:
        cuda = cuda_layer()
        self.nbytes = -(-max(nbytes, 1) // _GRAIN) * _GRAIN
        self._memory: Any = cuda.RegisteredHostBuffer(self.nbytes)
        try:
            self.ptr = self._memory.ptr
            self.view = adapt(np.frombuffer(self._memory.view, dtype=np.uint8))
            self.copied = cuda.Event()
        except BaseException:
            self._memory.free()
            raise

    def reusable(self) -> None:
        """Wait until the last copy out of this slot has finished (at once where none is queued)."""
        self.copied.wait()

    def copy_to(self, dst: int, nbytes: int, stream: int) -> None:
        """Queue the copy of the first ``nbytes`` to device memory ``dst`` on ``stream``; the slot is
        reusable once it has run."""
        cuda = cuda_layer()
        cuda.copy_h2d_on(stream, dst, self.ptr, nbytes)
        self.copied.record_on(stream)

    def free(self) -> None:
        """Wait for the copy out of it, then free the memory and the event (once)."""
        if self._memory is None:
            return
        try:
            self.copied.wait()
        finally:
            memory, self._memory = self._memory, None
            self.view = None  # type: ignore[assignment]
            try:
                self.copied.destroy()
            finally:
                memory.free()


class Staging:
    """``count`` pinned slots, slot ``k % count`` for a loader's ``k``-th batch of a pass.

    The loader starts a batch only while fewer than ``prefetch`` are started and not handed
    over, so with ``prefetch + 2`` slots the batches in flight never share one and a refill's
    wait for the copy out is nearly always already over. A slot grows when a batch needs more;
    the memory is freed by :meth:`close` (a later batch makes it again) and at exit.
    """

    def __init__(self, count: int) -> None:
        self.count = max(1, count)
        self._slots: list[Slot | None] = [None] * self.count
        self._lock = threading.Lock()
        _live.add(self)

    def slot(self, k: int, nbytes: int) -> Slot:
        """Slot ``k % count``, at least ``nbytes`` large, its last copy out finished."""
        i = k % self.count
        with self._lock:
            s = self._slots[i]
        if s is not None and s.nbytes >= nbytes:
            s.reusable()
            return s
        if s is not None:
            s.free()  # waits for its copy out
        s = Slot(nbytes)
        with self._lock:
            self._slots[i] = s
        return s

    @property
    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._slots if s is not None)

    def close(self) -> None:
        """Free every slot (each after its copy out has finished); raises the first error."""
        with self._lock:
            slots = [s for s in self._slots if s is not None]
            self._slots = [None] * self.count
        call_each(Slot.free, slots)


# At exit, while CUDA still runs: every loader's staging freed.
_live = closed_at_exit(lambda staging: staging.close(), free_memory=True)
