"""The conformance suite on the GPU paths: bounce (always) and cuFile (where libcufile can register files)."""

from __future__ import annotations

import pytest

from backend_conformance import BackendTests
from cufile_probe import cufile_unusable_reason

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
        why = cufile_unusable_reason(tmp_path)
        if why:
            pytest.skip(why)
        yield


def test_registered_stage_is_pinned_and_copies():
    import numpy as np

    from gdskit.engine import cuda

    n = (8 << 20) + 8192
    stage = cuda.RegisteredHostBuffer(n)
    dev = cuda.DeviceArray(n)
    try:
        assert cuda.pointer_info(stage.ptr).kind is cuda.MemoryKind.PINNED
        data = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
        stage.view[:] = data.tobytes()
        cuda.memcpy(dev.ptr, stage.ptr, n)
        assert np.array_equal(dev.to_numpy(), data)
    finally:
        stage.free()
        dev.free()
    stage.free()  # a second free does nothing


@pytest.mark.parametrize("alloc, kind", [("register", "RegisteredHostBuffer"), ("hostalloc", "PinnedBuffer")])
def test_ring_is_made_the_way_the_setting_says(tmp_path, alloc, kind):
    import os

    import gdskit
    from gdskit.engine import cuda, pool

    data = os.urandom(5 << 20)
    p = tmp_path / "ring.bin"
    p.write_bytes(data)
    dev = cuda.DeviceArray(len(data))
    gdskit.release_resources()
    try:
        with gdskit.settings.set(mode="bounce", chunk_size="1MiB", threads=4, pinned_alloc=alloc):
            with gdskit.open(str(p)) as f:
                assert f.read(dev) == len(data)
            stages = [type(st).__name__ for lane in pool.lanes._all for st in lane.stages]
            assert gdskit.resources().pinned_alloc == alloc
        assert stages and set(stages) == {kind}
        assert dev.to_numpy().tobytes() == data
    finally:
        gdskit.release_resources()
        dev.free()
    assert gdskit.resources().pinned_bytes == 0
