"""Device buffers for the GPU tests: gdskit's own cudaMalloc memory (no CuPy, no torch needed)."""

from __future__ import annotations

from gdskit.engine.cuda import DeviceArray


class DeviceBuffer(DeviceArray):
    def fill(self, data: bytes, offset: int = 0) -> None:  # type: ignore[override]
        self.copy_from_host(data, offset)

    def poison(self, value: int = 0xA5) -> None:
        super().fill(value)

    def to_bytes(self) -> bytes:
        return self.to_numpy().tobytes()
