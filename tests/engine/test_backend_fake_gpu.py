"""The GPU paths' logic on a stand-in CUDA runtime (tests/stand_ins/fake_cuda.py), so CI covers it.

Copies on the fake take effect only when their stream or event is waited on, so a
missing synchronisation shows up as wrong bytes. Skipped where a real GPU is present:
the real suite (tests/engine/test_backend_gpu.py) runs there instead.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import gdskit
from gdskit.engine import cuda, pool
from gdskit.errors import CudaError, InvalidArgumentError

from backend_conformance import BackendTests
from fake_cuda import CUmemorytype, CUresult

pytestmark = pytest.mark.skipif(cuda.device_count() > 0, reason="a real GPU is present: tests/engine/test_backend_gpu.py covers this")


@pytest.fixture(autouse=True)
def _fake(fake_cuda):
    fake_cuda.fail.clear()
    # A refused registration is remembered for the process: each test starts from none.
    pool.lanes.forget_register_error()
    yield fake_cuda
    pool.lanes.forget_register_error()


def _spy_libc(monkeypatch, **calls):
    """gdskit.engine.cuda's C library with ``calls`` (name -> function taking the real one first) in
    front of it."""
    real = cuda._libc()

    class Libc:
        def __getattr__(self, name):
            fn = getattr(real, name)
            return (lambda *a: calls[name](fn, *a)) if name in calls else fn

    monkeypatch.setattr(cuda, "_libc", lambda: Libc())


class TestBounceOnFakeGpu(BackendTests):
    settings_overrides = {"mode": "bounce", "chunk_size": "256KiB", "threads": 4}
    expected_paths = {"bounce-cached", "bounce-direct"}

    def make_buffer(self, nbytes):
        return cuda.DeviceArray(nbytes)

    def buffer_bytes(self, buf):
        return buf.to_numpy().tobytes()

    def fill_buffer(self, buf, data):
        buf.copy_from_host(data)


class TestAutoOnFakeGpu(TestBounceOnFakeGpu):
    settings_overrides = {"mode": "auto", "chunk_size": "256KiB", "threads": 3, "pinned_budget": "1MiB"}


def test_device_memory_is_routed_and_recorded(tmp_path):
    p = tmp_path / "d.bin"
    data = os.urandom(3 << 20)
    p.write_bytes(data)
    buf = cuda.DeviceArray(len(data))
    before = gdskit.stats()
    with gdskit.open(str(p)) as f:
        assert f.read(buf) == len(data)
    assert buf.to_numpy().tobytes() == data
    delta = gdskit.stats() - before
    assert set(delta.paths) <= {"bounce-cached", "bounce-direct"}
    assert delta.bytes_read == len(data)
    assert "host" not in delta.paths and "host_memory" not in delta.reasons


def test_managed_memory(tmp_path):
    p = tmp_path / "m.bin"
    data = os.urandom(1 << 20)
    p.write_bytes(data)
    m = cuda.DeviceArray(len(data), managed=True)
    before = gdskit.stats()
    with gdskit.open(str(p)) as f:
        f.read(m)
    assert m.to_numpy().tobytes() == data
    assert set((gdskit.stats() - before).reasons) == {"managed_memory"}


def test_pinned_memory_stays_within_budget(tmp_path, fake_cuda):
    p = tmp_path / "b.bin"
    p.write_bytes(os.urandom(4 << 20))
    buf = cuda.DeviceArray(4 << 20)
    for budget in ("1MiB", "3MiB"):
        with gdskit.settings.set(mode="bounce", pinned_budget=budget, chunk_size="1MiB", threads=8):
            with gdskit.open(str(p)) as f:
                f.read(buf)
            assert gdskit.resources().pinned_bytes <= gdskit.settings.pinned_budget
    gdskit.release_resources()
    assert fake_cuda.live_allocations(CUmemorytype.CU_MEMORYTYPE_HOST) == 0, "pinned buffers leaked"


@pytest.mark.parametrize("alloc, call", [("register", "cuMemHostRegister"), ("hostalloc", "cuMemHostAlloc")])
def test_prepare_creates_the_ring_once(tmp_path, fake_cuda, alloc, call):
    gdskit.release_resources()
    before = fake_cuda.calls.get(call, 0)
    with gdskit.settings.set(mode="bounce", threads=4, chunk_size="1MiB", pinned_alloc=alloc):
        usage = gdskit.prepare()
        assert usage.lanes == 4 and usage.pinned_bytes > 0 and usage.pinned_alloc == alloc
        assert fake_cuda.calls.get(call, 0) == before + 4
        assert fake_cuda.live_allocations(CUmemorytype.CU_MEMORYTYPE_HOST) == 4
        p = tmp_path / "p.bin"
        p.write_bytes(os.urandom(4 << 20))
        with gdskit.open(str(p)) as f:
            f.read(cuda.DeviceArray(4 << 20))
        assert fake_cuda.calls.get(call, 0) == before + 4, "the first read allocated pinned memory again"
    gdskit.release_resources()
    assert fake_cuda.live_allocations(CUmemorytype.CU_MEMORYTYPE_HOST) == 0, "pinned stages leaked"
    assert gdskit.resources().pinned_alloc == "none"


def test_prepare_for_fewer_workers(fake_cuda):
    gdskit.release_resources()
    with gdskit.settings.set(mode="bounce", threads=4, chunk_size="1MiB", pinned_alloc="hostalloc"):
        assert gdskit.prepare(workers=2).lanes == 2
        assert gdskit.prepare(workers=99).lanes == 4  # never more than the threads
        for bad in (0, -1, 1.5, True, "2"):
            with pytest.raises(InvalidArgumentError):
                gdskit.prepare(workers=bad)
    gdskit.release_resources()


def test_refused_registration_falls_back_to_host_alloc(tmp_path, fake_cuda):
    data = os.urandom(3 << 20)
    p = tmp_path / "r.bin"
    p.write_bytes(data)
    buf = cuda.DeviceArray(len(data))
    gdskit.release_resources()
    registers, allocs = fake_cuda.calls.get("cuMemHostRegister", 0), fake_cuda.calls.get("cuMemHostAlloc", 0)
    assert gdskit.resources().register_error is None
    fake_cuda.fail["cuMemHostRegister"] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with gdskit.settings.set(mode="bounce", threads=4, chunk_size="256KiB"), gdskit.open(str(p)) as f:
        with pytest.warns(RuntimeWarning, match="falls back to cudaHostAlloc"):
            assert f.read(buf) == len(data)
    assert buf.to_numpy().tobytes() == data
    assert fake_cuda.calls["cuMemHostRegister"] > registers and fake_cuda.calls["cuMemHostAlloc"] > allocs
    usage = gdskit.resources()
    assert usage.pinned_alloc == "hostalloc" and "CUDA_ERROR_OUT_OF_MEMORY" in usage.register_error
    gdskit.release_resources()
    assert fake_cuda.live_allocations(CUmemorytype.CU_MEMORYTYPE_HOST) == 0


@pytest.mark.parametrize("failing", ["cuMemcpyHtoDAsync", "cuMemHostAlloc", "cuStreamSynchronize"])
def test_cuda_errors_surface_and_release_everything(tmp_path, fake_cuda, failing):
    p = tmp_path / "e.bin"
    p.write_bytes(os.urandom(2 << 20))
    buf = cuda.DeviceArray(2 << 20)
    gdskit.release_resources()
    fake_cuda.fail[failing] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    op = "write" if failing == "cuStreamSynchronize" else "read"
    with gdskit.settings.set(mode="bounce", threads=4, chunk_size="256KiB", pinned_alloc="hostalloc"):
        with gdskit.open(str(p), "r+") as f:
            with pytest.raises(CudaError) as ei:
                f.read(buf) if op == "read" else f.write(buf)
    assert ei.value.code == "CUDA_ERROR_OUT_OF_MEMORY"
    fake_cuda.fail.clear()
    assert gdskit.resources().lanes_busy == 0
    gdskit.release_resources()
    assert fake_cuda.live_allocations(CUmemorytype.CU_MEMORYTYPE_HOST) == 0


def test_the_chunks_own_error_is_raised_when_freeing_its_lane_fails_too(tmp_path, fake_cuda):
    """A failed copy often leaves the driver refusing the lane's clean-up as well (a sticky GPU
    error): the copy's error is the one raised, not the clean-up's."""
    p = tmp_path / "e.bin"
    p.write_bytes(os.urandom(2 << 20))
    buf = cuda.DeviceArray(2 << 20)
    gdskit.release_resources()
    before = fake_cuda.allocated()
    fake_cuda.fail["cuEventSynchronize"] = CUresult.CUDA_ERROR_LAUNCH_FAILED
    fake_cuda.fail["cuMemHostUnregister"] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    try:
        with gdskit.settings.set(mode="bounce", threads=4, chunk_size="256KiB"), gdskit.open(str(p)) as f:
            with pytest.raises(CudaError) as ei:
                f.read(buf)
    finally:
        fake_cuda.fail.clear()
    assert ei.value.code == "CUDA_ERROR_LAUNCH_FAILED", ei.value
    assert gdskit.resources().lanes_busy == 0
    gdskit.release_resources()
    # The stages whose unregistration was refused stay registered (and mapped: gdskit unmaps only
    # what CUDA gave back); the test gives them back to the stand-in itself.
    fake_cuda.unregister_host_since(before)
    buf.free()


def test_write_from_device_memory(tmp_path):
    data = np.random.default_rng(5).integers(0, 256, (3 << 20) + 5, dtype=np.uint8)
    buf = cuda.DeviceArray(data.size)
    buf.copy_from_host(data)
    p = tmp_path / "w.bin"
    for policy in ("auto", "always", "never"):
        with gdskit.settings.set(odirect=policy, chunk_size="1MiB"), gdskit.open(str(p), "w", atomic=True) as f:
            f.write(buf, file_offset=4095)
        assert p.read_bytes() == b"\0" * 4095 + data.tobytes()


def test_ledger_names_the_gpu_of_each_bounce_read(tmp_path):
    from gdskit.engine.ledger import ledger

    p = tmp_path / "g.bin"
    p.write_bytes(os.urandom(3 << 20))
    ledger.reset()
    with gdskit.settings.set(mode="bounce", chunk_size="1MiB"), gdskit.open(str(p)) as f:
        assert f.read(cuda.DeviceArray(3 << 20)) == 3 << 20
    per_gpu = ledger.device_snapshot()
    assert list(per_gpu) == [0]
    assert sum(ps.bytes_read for ps in per_gpu[0].values()) == 3 << 20
    assert set(per_gpu[0]) <= {"bounce-cached", "bounce-direct"}


def test_read_batch_into_device_memory(tmp_path):
    data = os.urandom(3 << 20)
    p = tmp_path / "b.bin"
    p.write_bytes(data)
    buf = cuda.DeviceArray(4 * 65536)
    offsets = [0, 1 << 20, 5, len(data) - 65536]
    lat: list[int] = []
    with gdskit.settings.set(mode="bounce", chunk_size="1MiB"), gdskit.open(str(p)) as f:
        assert f.read_batch(buf, offsets, 65536, latencies_ns=lat) == [65536] * 4
    got = buf.to_numpy().tobytes()
    for i, off in enumerate(offsets):
        assert got[i * 65536:(i + 1) * 65536] == data[off:off + 65536]
    assert len(lat) == 4


def test_synchronized_device_views_read_like_the_buffer_itself(tmp_path):
    from gdskit.engine.buffers import synchronized_device_view
    from gdskit.errors import UnsupportedBufferError

    data = os.urandom(3 << 20)
    p = tmp_path / "v.bin"
    p.write_bytes(data)
    dev = cuda.DeviceArray(2 << 20)
    view = synchronized_device_view(dev.ptr + 4096, (2 << 20) - 4096, dev)
    assert view.on_device and view.device == 0 and not view.producer_sync and view.owner is dev
    with gdskit.settings.set(mode="bounce", chunk_size="1MiB"), gdskit.open(str(p)) as f:
        assert f.pread(view, file_offset=12345).result() == (2 << 20) - 4096
    assert dev.to_numpy().tobytes()[4096:] == data[12345:12345 + (2 << 20) - 4096]
    host = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(UnsupportedBufferError):
        synchronized_device_view(host.ctypes.data, 4096, host)


def _mapped_in_a_forked_child(addr: int) -> bool:
    pid = os.fork()
    if pid == 0:  # the child: is addr inside one of its mappings?
        found = False
        with open("/proc/self/maps") as fh:
            for line in fh:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                found = found or lo <= addr < hi
        os._exit(1 if found else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 1


@pytest.mark.parametrize("populate", [True, False])
def test_registered_stage_memory(fake_cuda, monkeypatch, populate):
    """The stage is page-aligned, writable and registered; without MADV_POPULATE_WRITE (kernels
    before 5.14) its pages are faulted in by writing them; free unregisters and unmaps once."""
    seen: list[int] = []

    def madvise(real, addr, n, advice):
        seen.append(advice)
        return -1 if advice == cuda._MADV_POPULATE_WRITE and not populate else real(addr, n, advice)

    _spy_libc(monkeypatch, madvise=madvise)
    before = fake_cuda.live_allocations(CUmemorytype.CU_MEMORYTYPE_HOST)
    n = (3 << 20) + 8192
    stage = cuda.RegisteredHostBuffer(n)
    assert stage.ptr % 4096 == 0 and len(stage.view) == n
    # Populated, and kept out of forked children.
    assert cuda._MADV_POPULATE_WRITE in seen and cuda._MADV_DONTFORK in seen
    if populate:
        assert not _mapped_in_a_forked_child(stage.ptr)
    assert cuda.pointer_info(stage.ptr).kind is cuda.MemoryKind.PINNED
    stage.view[-5:] = b"hello"
    assert bytes(stage.view[-5:]) == b"hello" and bytes(stage.view[:4]) == b"\0\0\0\0"
    stage.free()
    stage.free()
    assert fake_cuda.live_allocations(CUmemorytype.CU_MEMORYTYPE_HOST) == before


def test_refused_registration_unmaps_the_memory(fake_cuda, monkeypatch):
    unmapped: list[int] = []

    def munmap(real, addr, n):
        unmapped.append(n)
        return real(addr, n)

    _spy_libc(monkeypatch, munmap=munmap)
    fake_cuda.fail["cuMemHostRegister"] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(CudaError):
        cuda.RegisteredHostBuffer(1 << 20)
    assert unmapped == [(1 << 20) + (2 << 20)]


def test_warm_up_builds_the_ring_in_the_background_once(fake_cuda):
    from gdskit.engine import start_warm_up

    gdskit.release_resources()
    assert not pool.lanes.holds(0)
    with gdskit.settings.set(mode="bounce", threads=4, chunk_size="1MiB", pinned_alloc="hostalloc"):
        before = fake_cuda.calls.get("cuMemHostAlloc", 0)
        start_warm_up(0, (4 << 20) - 1)()  # too small to use every lane: nothing is set up
        assert not pool.lanes.holds(0)
        start_warm_up(0, 4 << 20)()
        assert pool.lanes.holds(0) and gdskit.resources().lanes == 4
        assert fake_cuda.calls.get("cuMemHostAlloc", 0) == before + 4
        start_warm_up(0, 4 << 20)()  # the ring exists: nothing more is made
        assert fake_cuda.calls.get("cuMemHostAlloc", 0) == before + 4
        gdskit.release_resources()
        start_warm_up(0, (2 << 20) - 1, workers=2)()  # too small for two lanes
        assert not pool.lanes.holds(0)
        start_warm_up(0, 2 << 20, workers=2)()  # the staging of two workers only
        assert gdskit.resources().lanes == 2 and fake_cuda.calls.get("cuMemHostAlloc", 0) == before + 6
        # A refused set-up is left for the read to report, never raised from the warm-up thread.
        gdskit.release_resources()
        fake_cuda.fail["cuMemHostAlloc"] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
        start_warm_up(0, 4 << 20)()
        assert not pool.lanes.holds(0) and gdskit.resources().lanes_busy == 0
    gdskit.release_resources()
    assert fake_cuda.live_allocations(CUmemorytype.CU_MEMORYTYPE_HOST) == 0
