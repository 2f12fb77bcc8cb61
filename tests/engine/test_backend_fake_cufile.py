"""The cuFile backend's logic on stand-ins for libcufile and the CUDA runtime (CI has neither):
handle and buffer registration, the path taken from cuFile's own counters, auto-mode fallbacks."""

from __future__ import annotations

import os

import pytest

import gdskit
from gdskit.engine import cuda
from gdskit.engine import direct_path as dr
from gdskit.engine.backends import cufile as cufile_backend
from gdskit.errors import DirectPathUnavailable, GdskitIOError, NoSpaceError
from gdskit.vocabulary import Path, Reason

from backend_conformance import BackendTests
from fake_cufile import FakeCufile, OpError, cuFileError
from fake_stack import use_cufile

pytestmark = pytest.mark.skipif(cuda.device_count() > 0, reason="a real GPU is present: tests/engine/test_backend_gpu.py")

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


def test_compat_is_named_by_the_counters_and_auto_then_uses_the_ring(tmp_path, compat_cufile, route_is):
    route_is(NVFS_ROUTE)
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


def test_direct_counters_give_a_direct_path(tmp_path, monkeypatch, fake_cuda, route_is):
    fake = FakeCufile(route="nvfs")
    lib = use_cufile(monkeypatch, fake)
    route_is(NVFS_ROUTE)
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


def test_registration_failure_falls_back_with_its_reason(tmp_path, monkeypatch, fake_cuda, route_is):
    use_cufile(monkeypatch, FakeCufile(register_fails=True))
    route_is(NVFS_ROUTE)
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


# -- cuFile I/O failures, as libcufile and the bindings report them (see tests/stand_ins/fake_cufile.py) ----------

_EIO, _ENOSPC = 5, 28


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("failure, want_class, want_errno", [
    ({"returns": -_EIO}, GdskitIOError, _EIO),                       # compat mode's -errno, handed back
    ({"returns": -int(OpError.IO_ERROR)}, GdskitIOError, _EIO),      # -CUfileOpError, handed back
    ({"errno": int(OpError.CUDA_DRIVER_ERROR)}, GdskitIOError, _EIO),  # -1: the bindings raise cuFileError
    ({"errno": _EIO}, GdskitIOError, _EIO),                          # -1: the bindings raise ValueError
])
@pytest.mark.parametrize("after", [0, 2])  # the first call fails, or one in the middle of the job
def test_a_failed_cufile_call_is_an_io_error_and_leaves_nothing_behind(tmp_path, monkeypatch, fake_cuda,
                                                                       op, failure, want_class, want_errno, after):
    fake = FakeCufile(max_io=256 << 10)  # short counts: four calls for the 1 MiB
    lib = use_cufile(monkeypatch, fake)
    path, data = _file(tmp_path, 1 << 20)
    buf = cuda.DeviceArray(len(data))
    buf.copy_from_host(data)
    fake.fail_io(op, after=after, **failure)
    before = gdskit.stats()
    with gdskit.settings.set(mode="cufile", threads=1):
        with gdskit.open(path, "r+") as f, pytest.raises(want_class) as ei:
            f.read(buf) if op == "read" else f.write(buf)
    assert type(ei.value) is want_class and ei.value.errno == want_errno
    assert fake.io_calls[op] == after + 1, "the job goes on after a failed call"
    delta = gdskit.stats() - before
    assert delta.bytes_read == 0 and delta.bytes_written == 0, "a failed request claims no bytes"
    assert fake.handles == {} and lib.handles == set(), "the file handle must be deregistered on close"
    assert gdskit.resources().lanes_busy == 0
    lib.close()


def test_a_full_disk_under_cufile_is_a_no_space_error(tmp_path, monkeypatch, fake_cuda):
    fake = FakeCufile()
    lib = use_cufile(monkeypatch, fake)
    path, data = _file(tmp_path, 64 << 10)
    buf = cuda.DeviceArray(len(data))
    fake.fail_io("write", returns=-_ENOSPC)
    with gdskit.settings.set(mode="cufile"), gdskit.open(path, "r+") as f, pytest.raises(NoSpaceError) as ei:
        f.write(buf)
    assert ei.value.errno == _ENOSPC and isinstance(ei.value, OSError)
    assert fake.handles == {}
    lib.close()


def test_the_stand_in_fails_like_the_bindings():
    """The stand-in's error rules, as the real bindings show them (checked against cuda-bindings 13.5)."""
    fake = FakeCufile()
    for failure, raised in [({"returns": -_EIO}, None), ({"returns": -5011}, None),
                            ({"errno": 5011}, cuFileError), ({"errno": _EIO}, ValueError), ({"errno": 0}, cuFileError)]:
        fake.fail_io("read", **failure)
        if raised is None:
            assert fake.read(0, 0, 4096, 0, 0) == failure["returns"]
        else:
            with pytest.raises(raised) as ei:
                fake.read(0, 0, 4096, 0, 0)
            assert type(ei.value) is raised
    with pytest.raises(cuFileError) as ei:
        FakeCufile(register_fails=True).handle_register(0)
    assert ei.value.status == OpError.INTERNAL_ERROR and ei.value.cuda_error == 0
