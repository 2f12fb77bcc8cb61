"""``auto`` routing decisions and reasons, without a GPU: device buffers are described, not allocated."""

from __future__ import annotations

import os

import pytest

import gdskit
from gdskit.engine import direct_path as dr
from gdskit.engine.backends import cufile as cufile_backend
from gdskit.engine.backends.base import UNKNOWN, OpenFile
from gdskit.engine.buffers import BufferView
from gdskit.engine.cuda import MemoryKind
from gdskit.errors import DirectPathUnavailable, InvalidArgumentError
from gdskit.machine.root import SystemRoot
from gdskit.engine.read_route import choose_backends
from gdskit.vocabulary import Path, Reason
from repo_paths import CHECK_FIXTURES

FIXTURES = str(CHECK_FIXTURES)
MiB = 1 << 20


@pytest.mark.parametrize("fixture, route, reason", [
    ("nvme-ext4-nvfs", Path.CUFILE_NVFS, None),
    ("p2pdma-no-nvfs", Path.CUFILE_P2PDMA, None),
    ("raid0-p2pdma", Path.CUFILE_P2PDMA, None),
    ("vm-firecracker", None, Reason.NVIDIA_FS_MISSING),
    ("no-gpu", None, Reason.NVIDIA_FS_MISSING),
])
def test_route_of_fixture_machines(fixture, route, reason):
    got = dr.route_of(SystemRoot(os.path.join(FIXTURES, fixture)))
    assert got.route == route
    assert got.reason == reason


def _device_buf(ptr: int = 1 << 30, nbytes: int = 64 * MiB, kind: MemoryKind = MemoryKind.DEVICE) -> BufferView:
    return BufferView(ptr, nbytes, kind, 0, False)


@pytest.fixture
def open_file(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"\0" * 4096)
    fd = os.open(p, os.O_RDWR)
    of = OpenFile(str(p), fd, os.O_RDWR)
    yield of
    of.close()


@pytest.fixture
def direct_machine(monkeypatch, route_is, tmp_path):
    """A machine with nvidia-fs whose cuFile registers every file, and no measured cut-off."""
    route_is(dr.DirectRoute(Path.CUFILE_NVFS, None, True, False, True))
    monkeypatch.setattr(cufile_backend, "register", lambda f: cufile_backend.FileRegistration(1234, None))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # no profile store: the setting's cut-off


def _routes(of, buf, size, foff, boff=0, **settings):
    with gdskit.settings.set(**settings) as cfg:
        return [(r.backend, r.reason, r.file_offset, r.buf_offset, r.size)
                for r in choose_backends(of, buf, size, foff, boff, cfg.snapshot())]


def test_aligned_device_request_goes_to_cufile(open_file, direct_machine):
    assert _routes(open_file, _device_buf(), 8 * MiB, 4096) == [("cufile", Reason.DIRECT, 4096, 0, 8 * MiB)]


def test_unaligned_edges_go_through_the_ring(open_file, direct_machine):
    got = _routes(open_file, _device_buf(), 8 * MiB, 100, 100)
    assert got == [("bounce", Reason.UNALIGNED, 100, 100, 3996),
                   ("cufile", Reason.DIRECT, 4096, 4096, 8 * MiB - 4096),
                   ("bounce", Reason.UNALIGNED, 8 * MiB, 8 * MiB, 100)]


def test_misaligned_memory_goes_through_the_ring(open_file, direct_machine):
    assert _routes(open_file, _device_buf(ptr=(1 << 30) + 8), 8 * MiB, 0) == \
        [("bounce", Reason.UNALIGNED, 0, 0, 8 * MiB)]


def test_small_requests_skip_cufile(open_file, direct_machine):
    assert _routes(open_file, _device_buf(), 64 * 1024, 0, direct_threshold="1MiB") == \
        [("bounce", Reason.BELOW_THRESHOLD, 0, 0, 64 * 1024)]


def test_compat_seen_sends_later_requests_to_the_ring(open_file, direct_machine):
    open_file.compat_seen = True
    assert _routes(open_file, _device_buf(), 8 * MiB, 0)[0][:2] == ("bounce", Reason.CUFILE_COMPAT_OBSERVED)


def test_registration_failure_reason(open_file, monkeypatch, route_is, tmp_path):
    route_is(dr.DirectRoute(Path.CUFILE_NVFS, None, True, False, False))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # no profile store
    monkeypatch.setattr(cufile_backend, "register",
                        lambda f: cufile_backend.FileRegistration(None, Reason.UDEV_MISSING, "udev property not found"))
    assert _routes(open_file, _device_buf(), 8 * MiB, 0)[0][:2] == ("bounce", Reason.UDEV_MISSING)
    with pytest.raises(DirectPathUnavailable) as ei:
        _routes(open_file, _device_buf(), 8 * MiB, 0, mode="cufile")
    assert ei.value.reason is Reason.UDEV_MISSING


def test_no_direct_route_machine(open_file, route_is):
    route_is(dr.DirectRoute(None, Reason.NVIDIA_FS_MISSING, False, False, False))
    assert _routes(open_file, _device_buf(), 8 * MiB, 0) == [("bounce", Reason.NVIDIA_FS_MISSING, 0, 0, 8 * MiB)]


def test_managed_memory_and_forced_modes(open_file, direct_machine):
    managed = _device_buf(kind=MemoryKind.MANAGED)
    assert _routes(open_file, managed, 8 * MiB, 0)[0][:2] == ("bounce", Reason.MANAGED_MEMORY)
    with pytest.raises(DirectPathUnavailable) as ei:
        _routes(open_file, managed, 8 * MiB, 0, mode="cufile")
    assert ei.value.reason is Reason.MANAGED_MEMORY
    assert _routes(open_file, _device_buf(), 8 * MiB, 0, mode="bounce")[0][:2] == ("bounce", Reason.FORCED_BY_SETTING)
    assert _routes(open_file, _device_buf(), 8 * MiB, 0, mode="cufile")[0][:2] == ("cufile", Reason.FORCED_BY_SETTING)
    with pytest.raises(InvalidArgumentError):
        _routes(open_file, _device_buf(), 8 * MiB, 0, mode="host")


def test_host_memory_takes_the_host_path(open_file):
    host = BufferView(0, 10, MemoryKind.HOST, None, False)
    pinned = BufferView(0, 10, MemoryKind.PINNED, None, False)
    for buf in (host, pinned):
        (backend, reason, *_), = _routes(open_file, buf, 10, 0)
        assert backend == "host" and reason in (Reason.NO_GPU, Reason.HOST_MEMORY)


def test_cufile_evidence_classification():
    before = {k: 0 for k in cufile_backend._COUNTER_FIELDS}
    after = dict(before, n_posix_reads=3, n_nvfs_reads=1)
    assert cufile_backend._classify("read", before, after) == {Path.CUFILE_COMPAT: 3, Path.CUFILE_NVFS: 1}
    assert cufile_backend._classify("write", before, after) is None
    assert cufile_backend._classify("read", None, after) is None


def test_cufile_ledger_names_compat_with_the_platform_reason(route_is):
    from gdskit.engine.backends.base import Request

    route_is(dr.DirectRoute(None, Reason.NVIDIA_FS_MISSING, False, False, True))
    req = Request("read", _device_buf(), 8 * MiB, 0, 0, Reason.DIRECT)
    before = gdskit.stats()
    cufile_backend.CufileBackend._record(req, 8 * MiB, 4, 0.01, {Path.CUFILE_COMPAT: 3, Path.CUFILE_NVFS: 1})
    delta = gdskit.stats() - before
    got = {(e.path, e.reason): e.bytes for e in delta.entries}
    assert got == {("cufile-compat", "nvidia_fs_missing"): 6 * MiB, ("cufile-nvfs", "direct"): 2 * MiB}
    assert delta.direct_bytes == 2 * MiB


def test_the_mounts_measured_cut_off_is_looked_up_once_per_file_even_when_there_is_none(open_file, monkeypatch,
                                                                                        route_is):
    from gdskit.engine import profiles

    route_is(dr.DirectRoute(Path.CUFILE_NVFS, None, True, False, True))
    monkeypatch.setattr(cufile_backend, "register", lambda f: cufile_backend.FileRegistration(1234, None))
    asked: list[str] = []
    monkeypatch.setattr(profiles, "threshold_for", lambda path: asked.append(path))  # no profile: None
    assert open_file.threshold.value is UNKNOWN
    for _ in range(3):
        assert _routes(open_file, _device_buf(), 8 * MiB, 0)[0][:2] == ("cufile", Reason.DIRECT)
    assert asked == [open_file.path] and open_file.threshold.value is None


def test_per_file_state_starts_unknown_and_is_worked_out_once():
    from gdskit.engine.backends.base import Once

    cell: Once[int | None] = Once()
    made: list[int] = []
    assert cell.value is UNKNOWN
    assert cell.get(lambda: made.append(1)) is None  # None is a value like any other
    assert cell.get(lambda: made.append(2)) is None and made == [1]
