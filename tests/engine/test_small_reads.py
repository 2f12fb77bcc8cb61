"""Small reads into GPU memory on the stand-in driver: a read of one chunk (and each read of
``File.read_batch``) runs in the calling thread with one copy and one event, and keeps every
rule the workers' path keeps: the bytes of a plain read, the ledger's paths, the O_DIRECT policy,
the pinned budget, thread safety, no leaks."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

import gdskit
from gdskit.engine import cuda
from gdskit.engine.cuda import MemoryKind
from gdskit.errors import CudaError, GdskitIOError, UnsupportedBufferError

from backend_conformance import drop_cache
from data_files import random_file
from fake_cuda import CUresult
from leak_helpers import fd_count

pytestmark = [pytest.mark.stand_in_gpu,
              pytest.mark.skipif(cuda.device_count() > 0, reason="a real GPU is present: test_bench_gpu covers it")]

SIZE = (3 << 20) + 1234  # not a multiple of 4 KiB: the last read ends short
BLOCKING_SYNC = 1        # the stand-in's CU_EVENT_BLOCKING_SYNC


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return random_file(tmp_path_factory, "small", SIZE, seed=11)


@pytest.fixture(autouse=True)
def _clean(fake_cuda):
    fake_cuda.fail.clear()
    yield
    fake_cuda.fail.clear()


def _warm(path: str) -> None:
    with open(path, "rb") as fh:
        while fh.read(1 << 20):
            pass


def _delta_rows(before: gdskit.Stats) -> dict[str, tuple[int, int, int]]:
    """Per path: (bytes, ops, requests) read since ``before``."""
    delta = gdskit.stats() - before
    return {p: (ps.bytes_read, ps.ops_read, ps.requests) for p, ps in delta.paths.items() if ps.requests}


def _calls(fake, before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in fake.calls.items() if v - before.get(k, 0)}


# -- bytes -------------------------------------------------------------------------------------
@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offset=st.integers(0, SIZE + 100), size=st.integers(1, 300_000), shift=st.integers(0, 5000),
       policy=st.sampled_from(["auto", "always", "never"]))
def test_a_small_read_gives_the_bytes_of_a_plain_read(data_file, offset, size, shift, policy):
    path, data = data_file
    buf = cuda.DeviceArray(size + shift)
    try:
        buf.fill(0xA5)
        with gdskit.settings.set(mode="bounce", odirect=policy), gdskit.open(path) as f:
            n = f.read(buf, size, offset, shift)
        want = data[offset:offset + size]
        assert n == len(want)
        got = buf.to_numpy()
        assert got[shift:shift + n].tobytes() == want
        assert (got[:shift] == 0xA5).all() and (got[shift + n:] == 0xA5).all(), "nothing else written"
    finally:
        buf.free()


@hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(1, 70_000), offsets=st.lists(st.integers(0, SIZE + 10), min_size=1, max_size=12),
       policy=st.sampled_from(["auto", "always", "never"]))
def test_a_batch_reads_what_plain_reads_read(data_file, size, offsets, policy):
    path, data = data_file
    buf = cuda.DeviceArray(len(offsets) * size)
    try:
        lat: list[int] = []
        with gdskit.settings.set(mode="bounce", odirect=policy), gdskit.open(path) as f:
            counts = f.read_batch(buf, offsets, size, latencies_ns=lat)
        got = buf.to_numpy()
        assert len(lat) == len(offsets)
        for i, (off, n) in enumerate(zip(offsets, counts)):
            want = data[off:off + size]
            assert n == len(want)
            assert got[i * size:i * size + n].tobytes() == want
    finally:
        buf.free()


def test_a_batch_of_reads_larger_than_a_chunk_takes_the_workers(data_file):
    path, data = data_file
    buf = cuda.DeviceArray(3 * 300_000)
    try:
        with gdskit.settings.set(mode="bounce", chunk_size="64KiB", threads=3), gdskit.open(path) as f:
            assert f.read_batch(buf, [5, SIZE - 1000, 70_000], 300_000) == [300_000, 1000, 300_000]
        got = buf.to_numpy()
        assert got[:300_000].tobytes() == data[5:300_005]
        assert got[300_000:301_000].tobytes() == data[SIZE - 1000:]
        assert got[600_000:].tobytes() == data[70_000:370_000]
    finally:
        buf.free()


# -- what the driver is asked ------------------------------------------------------------------
def test_a_hot_4k_read_is_one_copy_one_event_and_no_stream_sync(data_file, fake_cuda):
    path, data = data_file
    _warm(path)
    buf = cuda.DeviceArray(4096)
    try:
        with gdskit.settings.set(mode="bounce"), gdskit.open(path) as f:
            f.read(buf, 4096, 0)  # the lane is made here
            before = dict(fake_cuda.calls)
            assert f.read(buf, 4096, 8192) == 4096
            calls = _calls(fake_cuda, before)
            waited = fake_cuda.waited_events[-1]
            before = dict(fake_cuda.calls)
            assert f.read_batch(buf, [4096 * i for i in range(5)], 4096, [0] * 5) == [4096] * 5
            batch = _calls(fake_cuda, before)
        assert buf.to_numpy().tobytes() == data[16384:20480]
    finally:
        buf.free()
    assert calls.get("cuMemcpyHtoDAsync") == 1 and calls.get("cuEventRecord") == 1
    assert calls.get("cuEventSynchronize") == 1 and "cuStreamSynchronize" not in calls
    assert "cuPointerGetAttributes" not in calls, "gdskit's own device memory is described without asking the driver"
    assert calls.get("cuCtxGetCurrent", 0) + calls.get("cuCtxSetCurrent", 0) <= 1, \
        "the device's context already current: asked about once, and not changed"
    assert not fake_cuda.event_flags[waited] & BLOCKING_SYNC, "a short copy is waited for without sleeping"
    # A batch: one copy, one record and one wait per read, the device made current once.
    assert batch.get("cuMemcpyHtoDAsync") == 5 and batch.get("cuEventRecord") == 5
    assert batch.get("cuEventSynchronize") == 5 and "cuStreamSynchronize" not in batch
    assert batch.get("cuCtxGetCurrent", 0) + batch.get("cuCtxSetCurrent", 0) <= 1


def test_large_chunks_still_wait_on_sleeping_events(data_file, fake_cuda):
    path, data = data_file
    buf = cuda.DeviceArray(SIZE)
    try:
        with gdskit.settings.set(mode="bounce", chunk_size="256KiB", threads=2), gdskit.open(path) as f:
            start = len(fake_cuda.waited_events)
            assert f.read(buf) == SIZE
            waited = list(fake_cuda.waited_events)[start:]
        assert buf.to_numpy().tobytes() == data
    finally:
        buf.free()
    assert waited and all(fake_cuda.event_flags[e] & BLOCKING_SYNC for e in waited if e in fake_cuda.event_flags)


# -- the ledger and the O_DIRECT policy ---------------------------------------------------------
@pytest.mark.parametrize("policy,cold,path_taken", [
    ("auto", False, "bounce-cached"), ("auto", True, "bounce-direct"),
    ("always", False, "bounce-direct"), ("never", True, "bounce-cached"),
])
def test_small_reads_take_the_policys_descriptor_and_say_so(data_file, policy, cold, path_taken):
    path, data = data_file
    if cold:
        drop_cache(path)
    else:
        _warm(path)
    offsets = [0, 4096 * 7, 4096 * 100, 4096 * 300]
    buf = cuda.DeviceArray(4096)
    many = cuda.DeviceArray(4096 * len(offsets))
    try:
        with gdskit.settings.set(mode="bounce", odirect=policy), gdskit.open(path) as f:
            before = gdskit.stats()
            for off in offsets:
                assert f.read(buf, 4096, off) == 4096
            one_by_one = _delta_rows(before)
            if cold:
                drop_cache(path)
            before = gdskit.stats()
            assert f.read_batch(many, offsets, 4096) == [4096] * len(offsets)
            batched = _delta_rows(before)
        assert buf.to_numpy().tobytes() == data[offsets[-1]:offsets[-1] + 4096]
        got = many.to_numpy()
        for i, off in enumerate(offsets):
            assert got[i * 4096:(i + 1) * 4096].tobytes() == data[off:off + 4096]
    finally:
        buf.free()
        many.free()
    k = len(offsets)
    assert one_by_one == {path_taken: (k * 4096, k, k)}
    assert batched == one_by_one, "a batch is counted as its reads one by one"


def test_an_unaligned_cold_read_goes_direct_through_the_stage(data_file):
    path, data = data_file
    drop_cache(path)
    buf = cuda.DeviceArray(5000)
    try:
        with gdskit.settings.set(mode="bounce", odirect="always"), gdskit.open(path) as f:
            before = gdskit.stats()
            assert f.read(buf, 5000, 4097) == 5000
            rows = _delta_rows(before)
        assert buf.to_numpy().tobytes() == data[4097:9097]
    finally:
        buf.free()
    assert rows == {"bounce-direct": (5000, 1, 1)}


def test_the_end_of_the_file_is_counted_once(data_file):
    path, data = data_file
    buf = cuda.DeviceArray(8192)
    try:
        with gdskit.settings.set(mode="bounce", odirect="never"), gdskit.open(path) as f:
            before = gdskit.stats()
            assert f.read(buf, 8192, SIZE - 100) == 100
            assert f.read(buf, 8192, SIZE + 5) == 0
            rows = _delta_rows(before)
        assert buf.to_numpy()[:100].tobytes() == data[-100:]
    finally:
        buf.free()
    assert rows == {"bounce-cached": (100, 2, 2)}


# -- several threads, the pinned budget, failures, leaks ----------------------------------------
def test_threads_reading_small_pieces_at_once_each_get_their_bytes(data_file):
    path, data = data_file
    _warm(path)
    n_threads, per_thread = 6, 40
    errors: list[BaseException] = []
    bufs = [cuda.DeviceArray(per_thread * 4096) for _ in range(n_threads)]
    start = threading.Barrier(n_threads)
    before = gdskit.stats()
    try:
        # Fewer lanes than threads (a budget of two stages): the others wait for one.
        with gdskit.settings.set(mode="bounce", threads=2, chunk_size="512KiB", pinned_budget="1MiB"), \
                gdskit.open(path) as f:

            def reader(t: int) -> None:
                try:
                    cuda.set_device(0)
                    start.wait(timeout=30)
                    rng = np.random.default_rng(t)
                    offs = (rng.integers(0, SIZE // 4096 - 1, per_thread) * 4096).tolist()
                    for i, off in enumerate(offs[:per_thread // 2]):
                        assert f.read(bufs[t], 4096, off, i * 4096) == 4096
                    half = per_thread // 2
                    assert f.read_batch(bufs[t], offs[half:], 4096, [i * 4096 for i in range(half, per_thread)]) \
                        == [4096] * (per_thread - half)
                    got = bufs[t].to_numpy()
                    for i, off in enumerate(offs):
                        assert got[i * 4096:(i + 1) * 4096].tobytes() == data[off:off + 4096], (t, i)
                except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                    errors.append(exc)

            threads = [threading.Thread(target=reader, args=(t,)) for t in range(n_threads)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            usage = gdskit.resources()
    finally:
        for b in bufs:
            b.free()
    assert not errors, errors[0]
    assert usage.lanes_busy == 0 and usage.pinned_bytes <= 1 << 20 and usage.lanes <= 2
    delta = gdskit.stats() - before
    assert delta.bytes_read == n_threads * per_thread * 4096
    assert delta.requests == n_threads * per_thread


def test_a_failed_read_gives_its_lane_back_and_a_failed_wait_drops_it(data_file, fake_cuda):
    path, data = data_file
    buf = cuda.DeviceArray(4096)
    fds = fd_count()
    try:
        with gdskit.settings.set(mode="bounce"), gdskit.open(path) as f:
            assert f.read(buf, 4096, 0) == 4096
            lanes_before = gdskit.resources().lanes
            fake_cuda.fail["cuEventSynchronize"] = CUresult.CUDA_ERROR_INVALID_VALUE
            with pytest.raises(CudaError):
                f.read(buf, 4096, 4096)
            with pytest.raises(CudaError):
                f.read_batch(buf, [0, 4096], 2048)
            fake_cuda.fail.clear()
            usage = gdskit.resources()
            assert usage.lanes_busy == 0 and usage.lanes == lanes_before - 1, "a lane in doubt is not kept"
            assert f.read(buf, 4096, 8192) == 4096  # a new lane, and a good read
            assert buf.to_numpy().tobytes() == data[8192:12288]
        # An I/O error before any copy (/proc/self/mem has nothing at address 0): the lane is
        # clean, and goes back to the pool as it is.
        lanes_now = gdskit.resources().lanes
        with gdskit.settings.set(mode="bounce", odirect="never"), gdskit.open("/proc/self/mem") as m:
            with pytest.raises(GdskitIOError):
                m.read(buf, 4096, 0)
        usage = gdskit.resources()
        assert usage.lanes == lanes_now and usage.lanes_busy == 0
    finally:
        buf.free()
    gdskit.release_resources()
    assert fd_count() == fds


def test_a_freed_device_array_is_refused_and_a_managed_one_known(data_file, fake_cuda):
    from gdskit.engine.buffers import adapt

    path, _data = data_file
    managed = cuda.DeviceArray(4096, managed=True)
    try:
        assert adapt(managed).kind is MemoryKind.MANAGED and adapt(managed).device == 0
    finally:
        managed.free()
    buf = cuda.DeviceArray(4096)
    buf.free()
    with pytest.raises(UnsupportedBufferError, match="freed"):
        adapt(buf)
    with gdskit.open(path) as f, pytest.raises(UnsupportedBufferError, match="freed"):
        f.read(buf, 4096, 0)
    assert buf.__cuda_array_interface__["shape"] == (0,) and buf.__cuda_array_interface__["data"][0] == 0, \
        "other consumers of the interface are not handed the freed pointer either"



def test_a_read_in_the_callers_thread_leaves_the_threads_device_as_it_was(data_file, stand_in_gpus):
    """A small read into one GPU's memory from a thread whose current device is another (or that
    has none) makes the copy in the memory's context and then puts the thread's own back: torch
    reads its current device from the driver, so a changed one would send the caller's next
    tensors to the wrong GPU. The lane made by the first read is made the same way."""
    from fake_cuda import FakeDriver

    path, data = data_file
    fake = stand_in_gpus(FakeDriver(devices=2))
    errors: list[BaseException] = []

    def reads(expect_device: int | None) -> None:
        try:
            buf = cuda.DeviceArray(3 * 4096, device=0)
            try:
                assert fake._context() == expect_device, "making device memory changed the thread's device"
                with gdskit.settings.set(mode="bounce"), gdskit.open(path) as f:
                    assert f.read(buf, 4096, 0) == 4096  # the first read makes the lane here
                    assert fake._context() == expect_device
                    assert f.read_batch(buf, [4096, 8192], 4096, [4096, 8192]) == [4096, 4096]
                    assert fake._context() == expect_device
                assert buf.to_numpy().tobytes() == data[:3 * 4096]
            finally:
                buf.free()
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            errors.append(exc)

    cuda.set_device(1)
    reads(1)
    th = threading.Thread(target=reads, args=(None,))  # a thread with no context at all keeps none
    th.start()
    th.join()
    assert not errors, errors[0]


def test_a_failed_small_read_raises_its_own_error_when_its_lane_cannot_be_freed(data_file, fake_cuda):
    """A failed copy often leaves the driver refusing the clean-up as well (a sticky GPU error):
    the read's own error is the one raised, not the clean-up's."""
    path, _data = data_file
    buf = cuda.DeviceArray(4096)
    before = fake_cuda.allocated()
    try:
        with gdskit.settings.set(mode="bounce"), gdskit.open(path) as f:
            fake_cuda.fail["cuEventSynchronize"] = CUresult.CUDA_ERROR_LAUNCH_FAILED
            fake_cuda.fail["cuMemHostUnregister"] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
            with pytest.raises(CudaError) as ei:
                f.read(buf, 4096, 0)
            fake_cuda.fail.clear()
        assert ei.value.code == "CUDA_ERROR_LAUNCH_FAILED", ei.value
        assert gdskit.resources().lanes_busy == 0
    finally:
        fake_cuda.fail.clear()
        buf.free()
        gdskit.release_resources()
        # The stage whose unregistration was refused stays registered: give it back to the stand-in.
        fake_cuda.unregister_host_since(before)
