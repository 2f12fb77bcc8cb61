"""The I/O buffers of benchmark workers, and the known data pattern of ``-V``.

Host buffers are numpy arrays over fresh anonymous mappings (page-aligned; with
``--huge-pages`` on 2 MiB transparent huge pages, so their physical layout is the same in
every run and every tool that is given huge pages). Device
buffers come straight from ``cudaMalloc`` (the only memory the direct path accepts)
and expose ``__cuda_array_interface__``, so the benchmark needs neither torch nor CuPy.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from gdskit.engine import cuda
from gdskit.errors import CudaError
from gdskit.engine.pool import anonymous_memory

PAGE = 4096
HUGE_PAGE = 2 * 1024 * 1024
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd: distinct offsets give distinct words


def pattern(offset: int, nbytes: int, seed: int = 0) -> np.ndarray:
    """The bytes ``-V`` expects at ``offset``: a function of the 8-byte word's position only.

    ``offset`` and ``nbytes`` must be multiples of 8 (every bench I/O is 4 KiB-aligned).
    """
    first = offset // 8
    words = np.arange(first, first + nbytes // 8, dtype=np.uint64)
    words *= _MULT
    words ^= np.uint64(seed)
    return words.view(np.uint8)


class HostBuffer:
    """Page-aligned host memory: a fresh anonymous mapping, touched now (as fio's ``iomem=mmap``).

    Not a numpy allocation: that may come from the heap, whose pages are scattered in
    physical memory, and an O_DIRECT read into scattered pages can be split into more, smaller
    device requests (docs/bench.md, "Host buffers", has the figures).
    """

    on_device = False

    def __init__(self, nbytes: int, huge_pages: bool = False) -> None:
        if huge_pages:
            # Whole 2 MiB pages: the mapping is one page longer so that a 2 MiB-aligned start
            # lies inside it (a huge page can only back an aligned 2 MiB range).
            span = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
            self._map: mmap.mmap | None = anonymous_memory(span + HUGE_PAGE, huge_pages=True)
            whole = np.frombuffer(self._map, dtype=np.uint8)
            start = -whole.ctypes.data % HUGE_PAGE
            self.array = whole[start:start + nbytes]
        else:
            # Private anonymous memory on ordinary pages, as malloc's large blocks and fio's are.
            self._map = anonymous_memory(max(nbytes, 1), huge_pages=False)
            self.array = np.frombuffer(self._map, dtype=np.uint8)[:nbytes]
        self.array.fill(0)  # touch every page now, not inside the timed window
        self.nbytes = nbytes

    @property
    def obj(self) -> Any:
        return self.array

    def load(self, data: np.ndarray, offset: int = 0) -> None:
        self.array[offset:offset + data.size] = data

    def to_host(self, nbytes: int | None = None) -> np.ndarray:
        return self.array[: self.nbytes if nbytes is None else nbytes]

    def free(self) -> None:
        if self._map is None:
            return
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._map.close()
        except BufferError:  # a view of it is still alive somewhere; the GC unmaps it
            pass
        self._map = None


class DeviceBuffer:
    """``cudaMalloc`` memory on one GPU (zeroed, so timed runs touch no fresh pages), freed exactly once."""

    on_device = True

    def __init__(self, nbytes: int, device: int) -> None:
        if cuda.driver_or_none() is None:
            raise CudaError("cuda.bindings is not importable; cannot allocate GPU memory")
        self.device = device
        self.nbytes = nbytes
        self._mem = cuda.DeviceArray(nbytes, device)
        self._mem.fill(0)

    @property
    def ptr(self) -> int:
        return self._mem.ptr

    @property
    def obj(self) -> Any:
        return self._mem

    def load(self, data: np.ndarray, offset: int = 0) -> None:
        self._mem.copy_from_host(np.ascontiguousarray(data), offset)

    def to_host(self, nbytes: int | None = None) -> np.ndarray:
        return self._mem.to_numpy(nbytes)

    def free(self) -> None:
        self._mem.free()


def allocate(on_device: bool, nbytes: int, device: int, huge_pages: bool = False) -> HostBuffer | DeviceBuffer:
    return DeviceBuffer(nbytes, device) if on_device else HostBuffer(nbytes, huge_pages)


def transparent_huge_pages() -> str | None:
    """The kernel's transparent-huge-page mode (always, madvise or never); None where unknown."""
    try:
        with open(THP_SETTING, encoding="ascii") as fh:
            text = fh.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def anon_huge_bytes() -> int | None:
    """Bytes of this process's anonymous memory on transparent huge pages (``AnonHugePages`` of
    ``/proc/self/smaps_rollup``); None where the kernel does not say."""
    try:
        with open("/proc/self/smaps_rollup", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
