"""The cuFile backend's logic on stand-ins for libcufile and the CUDA runtime (CI has neither):
handle and buffer registration, the path taken from cuFile's own counters, auto-mode fallbacks."""

from __future__ import annotations

import os

import pytest

import gdskit
from gdskit import cuda
from gdskit import direct_route as dr
from gdskit.backends import cufile as cufile_backend
from gdskit.errors import DirectPathUnavailable
from gdskit.vocabulary import Path, Reason

from backend_conformance import BackendTests
from fake_cufile import FakeCufile
from fake_stack import use_cufile

pytestmark = pytest.mark.skipif(cuda.device_count() > 0, reason="a real GPU is present: tests/test_backend_gpu.py")

NVFS_ROUTE = dr.DirectRoute(Path.CUFILE_NVFS, None, True, False, True)


class TestCufileOnFakes(BackendTests):
    settings_overrides = {"mode": "cufile", "chunk_size": "256KiB", "threads": 4}
    expected_paths = {"cufile-compat"}

    @pytest.fixture(autouse=True)
    def _fakes(self, compat_cufile):
        yield

    def make_buffer(self, nbytes):
        return cuda.DeviceArray(nbytes)

    def buffer_bytes(self, buf):
        return buf.to_numpy().tobytes()

    def fill_buffer(self, buf, data):
        buf.copy_from_host(data)


def _file(tmp_path, nbytes=4 << 20):
    p = tmp_path / "c.bin"
    data = os.urandom(nbytes)
    p.write_bytes(data)
    return str(p), data


def test_compat_is_named_by_the_counters_and_auto_then_uses_the_ring(tmp_path, compat_cufile, monkeypatch):
    monkeypatch.setattr("gdskit.router.direct_route", lambda: NVFS_ROUTE)
    monkeypatch.setattr(cufile_backend, "direct_route", lambda: NVFS_ROUTE)
    path, data = _file(tmp_path)
    buf = cuda.DeviceArray(len(data))
    before = gdskit.stats()
    with gdskit.settings.set(mode="auto", direct_threshold=0), gdskit.open(path) as f:
        assert f.read(buf) == len(data)
        first = gdskit.stats() - before
        assert f.read(buf) == len(data)
    assert buf.to_numpy().tobytes() == data
    assert set(first.paths) == {"cufile-compat"}, "cuFile's posix counters must name the path"
    assert set(first.reasons) == {"cufile_compat_observed"}
    second = gdskit.stats() - before - first
    assert set(second.paths) <= {"bounce-cached", "bounce-direct"}
    assert set(second.reasons) == {"cufile_compat_observed"}


def test_direct_counters_give_a_direct_path(tmp_path, monkeypatch, fake_cuda):
    fake = FakeCufile(route="nvfs")
    lib = use_cufile(monkeypatch, fake)
    monkeypatch.setattr("gdskit.router.direct_route", lambda: NVFS_ROUTE)
    path, data = _file(tmp_path)
    buf = cuda.DeviceArray(len(data))
    before = gdskit.stats()
    with gdskit.settings.set(mode="auto", direct_threshold=0), gdskit.open(path) as f:
        f.read(buf)
    delta = gdskit.stats() - before
    assert set(delta.paths) == {"cufile-nvfs"} and set(delta.reasons) == {"direct"}
    assert delta.direct_bytes == len(data)
    assert fake.handles == {}, "the handle must be deregistered on close"
    lib.close()


def test_registration_failure_falls_back_with_its_reason(tmp_path, monkeypatch, fake_cuda):
    use_cufile(monkeypatch, FakeCufile(register_fails=True))
    monkeypatch.setattr("gdskit.router.direct_route", lambda: NVFS_ROUTE)
    monkeypatch.setattr(cufile_backend, "udev_database_present", lambda: False)
    path, data = _file(tmp_path)
    buf = cuda.DeviceArray(len(data))
    before = gdskit.stats()
    with gdskit.settings.set(mode="auto", direct_threshold=0), gdskit.open(path) as f:
        f.read(buf)
        with gdskit.settings.set(mode="cufile"), pytest.raises(DirectPathUnavailable) as ei:
            f.read(buf)
    assert ei.value.reason is Reason.UDEV_MISSING
    assert set((gdskit.stats() - before).reasons) == {"udev_missing"}
    assert buf.to_numpy().tobytes() == data


def test_buffer_registration(compat_cufile):
    buf = cuda.DeviceArray(1 << 20)
    with gdskit.register_buffer(buf) as reg:
        assert reg.registered and compat_cufile.buffers == {buf.ptr: 1 << 20}
        assert not gdskit.register_buffer(buf).registered, "a second registration is a no-op"
    assert compat_cufile.buffers == {}
    managed = gdskit.register_buffer(cuda.DeviceArray(4096, managed=True))
    assert not managed.registered and managed.reason is Reason.MANAGED_MEMORY


def test_library_close_releases_everything(tmp_path, monkeypatch, fake_cuda):
    fake = FakeCufile()
    lib = use_cufile(monkeypatch, fake)
    path, _ = _file(tmp_path, 8192)
    f = gdskit.open(path)
    with gdskit.settings.set(mode="cufile"):
        f.read(cuda.DeviceArray(8192))
    gdskit.register_buffer(cuda.DeviceArray(4096))
    assert fake.handles and fake.buffers
    lib.close()
    assert fake.handles == {} and fake.buffers == {} and not fake.opened
    f.close()


@pytest.mark.parametrize("evidence, part, whole, want", [
    (None, 1, 4, None),
    ({Path.CUFILE_NVFS: 8}, 4, 4, {Path.CUFILE_NVFS: 8}),                          # the whole job
    ({Path.CUFILE_NVFS: 8, Path.CUFILE_COMPAT: 4}, 1, 2, {Path.CUFILE_NVFS: 4, Path.CUFILE_COMPAT: 2}),
    ({Path.CUFILE_NVFS: 9, Path.CUFILE_COMPAT: 1}, 1, 4, {Path.CUFILE_NVFS: 2}),    # too small for a compat op
    ({Path.CUFILE_NVFS: 1, Path.CUFILE_COMPAT: 3}, 1, 100, {Path.CUFILE_COMPAT: 1}),  # the job's usual path
])
def test_a_request_gets_its_share_of_the_jobs_counters(evidence, part, whole, want):
    assert cufile_backend._share(evidence, part, whole) == want
