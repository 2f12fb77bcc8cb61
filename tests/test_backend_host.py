"""The conformance suite on the host path (runs everywhere)."""

from __future__ import annotations

import numpy as np

from backend_conformance import BackendTests


class TestHostBackendNumpy(BackendTests):
    settings_overrides = {"mode": "auto", "chunk_size": "256KiB"}
    expected_paths = {"host"}

    def make_buffer(self, nbytes):
        return np.empty(nbytes, dtype=np.uint8)

    def buffer_bytes(self, buf):
        return buf.tobytes()

    def fill_buffer(self, buf, data):
        buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)


class TestHostBackendBytearray(TestHostBackendNumpy):
    settings_overrides = {"mode": "host", "threads": 3, "chunk_size": "64KiB"}

    def make_buffer(self, nbytes):
        return bytearray(nbytes)

    def buffer_bytes(self, buf):
        return bytes(buf)

    def fill_buffer(self, buf, data):
        buf[: len(data)] = data
