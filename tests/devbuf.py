"""A minimal device buffer for tests: cudaMalloc memory exposing ``__cuda_array_interface__``.

It lets the GPU tests run with only cuda-bindings (no CuPy, no torch).
"""

from __future__ import annotations

import numpy as np

from gdskit import cuda


class DeviceBuffer:
    def __init__(self, nbytes: int, managed: bool = False) -> None:
        rt = cuda._runtime()
        self.nbytes = nbytes
        if managed:
            self.ptr = int(cuda.check(rt.cudaMallocManaged(max(nbytes, 1), rt.cudaMemAttachGlobal), "cudaMallocManaged"))
        else:
            self.ptr = int(cuda.check(rt.cudaMalloc(max(nbytes, 1)), "cudaMalloc"))

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3, "strides": None}

    def fill(self, data: bytes, offset: int = 0) -> None:
        if data:
            host = np.frombuffer(data, dtype=np.uint8)
            cuda.memcpy(self.ptr + offset, host.ctypes.data, len(data))

    def poison(self, value: int = 0xA5) -> None:
        cuda.check(cuda._runtime().cudaMemset(self.ptr, value, max(self.nbytes, 1)), "cudaMemset")
        cuda.check(cuda._runtime().cudaDeviceSynchronize(), "sync")

    def to_bytes(self) -> bytes:
        host = np.empty(self.nbytes, dtype=np.uint8)
        if self.nbytes:
            cuda.memcpy(host.ctypes.data, self.ptr, self.nbytes)
        return host.tobytes()

    def free(self) -> None:
        if self.ptr:
            cuda._runtime().cudaFree(self.ptr)
            self.ptr = 0

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:
            pass
