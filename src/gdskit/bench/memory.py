"""The I/O buffers of benchmark workers, and the known data pattern of ``-V``.

Host buffers are page-aligned numpy arrays. Device buffers come straight from
``cudaMalloc`` (the only memory the direct path accepts) and expose
``__cuda_array_interface__``, so the benchmark needs neither torch nor CuPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gdskit import cuda
from gdskit.errors import CudaError

PAGE = 4096
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
    """Page-aligned host memory."""

    on_device = False

    def __init__(self, nbytes: int) -> None:
        raw = np.empty(nbytes + PAGE, dtype=np.uint8)
        start = (-raw.ctypes.data) % PAGE
        self.array = raw[start:start + nbytes]
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
        pass


class _CudaArray:
    """What gdskit's buffer adapter needs to see device memory."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


class DeviceBuffer:
    """``cudaMalloc`` memory on one GPU, freed exactly once."""

    on_device = True

    def __init__(self, nbytes: int, device: int) -> None:
        rt = cuda.runtime_or_none()
        if rt is None:
            raise CudaError("cuda.bindings is not importable; cannot allocate GPU memory")
        cuda.set_device(device)
        self.device = device
        self.nbytes = nbytes
        self.ptr = int(cuda.check(rt.cudaMalloc(nbytes), "cudaMalloc"))
        cuda.check(rt.cudaMemset(self.ptr, 0, nbytes), "cudaMemset")
        cuda.check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        self._obj = _CudaArray(self.ptr, nbytes)

    @property
    def obj(self) -> Any:
        return self._obj

    def load(self, data: np.ndarray, offset: int = 0) -> None:
        data = np.ascontiguousarray(data)
        cuda.memcpy(self.ptr + offset, data.ctypes.data, data.nbytes)

    def to_host(self, nbytes: int | None = None) -> np.ndarray:
        n = self.nbytes if nbytes is None else nbytes
        out = np.empty(n, dtype=np.uint8)
        cuda.memcpy(out.ctypes.data, self.ptr, n)
        return out

    def free(self) -> None:
        if self.ptr:
            rt = cuda.runtime_or_none()
            if rt is not None:
                rt.cudaFree(self.ptr)
            self.ptr = 0

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:
            pass


def allocate(on_device: bool, nbytes: int, device: int) -> HostBuffer | DeviceBuffer:
    return DeviceBuffer(nbytes, device) if on_device else HostBuffer(nbytes)
