"""The conformance suite on the GPU paths: bounce (always) and cuFile (where libcufile can register files)."""

from __future__ import annotations

import pytest

from backend_conformance import BackendTests

pytestmark = pytest.mark.gpu


class _DeviceMemory(BackendTests):
    def make_buffer(self, nbytes):
        from devbuf import DeviceBuffer

        return DeviceBuffer(nbytes)

    def buffer_bytes(self, buf):
        return buf.to_bytes()

    def fill_buffer(self, buf, data):
        buf.fill(data)


class TestBounceBackend(_DeviceMemory):
    settings_overrides = {"mode": "bounce", "chunk_size": "1MiB"}
    expected_paths = {"bounce-cached", "bounce-direct"}


class TestBounceBackendSmallBudget(_DeviceMemory):
    settings_overrides = {"mode": "bounce", "chunk_size": "1MiB", "pinned_budget": "1MiB", "threads": 5}
    expected_paths = {"bounce-cached", "bounce-direct"}


class TestAutoOnDevice(_DeviceMemory):
    settings_overrides = {"mode": "auto", "chunk_size": "1MiB"}
    expected_paths = {"bounce-cached", "bounce-direct", "cufile-nvfs", "cufile-p2pdma", "cufile-compat"}


class TestCufileBackend(_DeviceMemory):
    settings_overrides = {"mode": "cufile", "chunk_size": "1MiB"}
    expected_paths = {"cufile-nvfs", "cufile-p2pdma", "cufile-compat"}

    @pytest.fixture(autouse=True)
    def _need_cufile(self, tmp_path):
        from gdskit.backends.cufile import cufile_library, register
        from gdskit.backends.base import OpenFile
        import os

        if not cufile_library().available():
            pytest.skip(f"libcufile not usable: {cufile_library().error}")
        p = tmp_path / "probe.bin"
        p.write_bytes(b"x" * 4096)
        fd = os.open(p, os.O_RDWR)
        of = OpenFile(str(p), fd, os.O_RDWR)
        try:
            reg = register(of)
        finally:
            of.close()
        if reg.handle is None:
            pytest.skip(f"cuFile cannot register files here: {reg.reason} {reg.detail}")
        yield
