"""Stream-ordered reads and writes (``File.pread``/``pwrite`` with ``stream=``) on the stand-in
CUDA driver and libcufile: the I/O runs in the caller's stream order, the call never waits for
the stream, errors arrive on the future, nothing is left behind."""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np
import pytest

import gdskit
from gdskit.engine import cuda, stream_ordered
from gdskit.engine import direct_path as dr
from gdskit.engine.backends import base
from gdskit.errors import ClosedFileError, GdskitIOError, InvalidArgumentError, NoSpaceError
from gdskit.vocabulary import Path

from fake_cuda import CUmemorytype, StandInViolation
from fake_cufile import FakeCufile
from fake_stack import use_cufile
from leak_helpers import fd_count

pytestmark = pytest.mark.stand_in_gpu

NVFS_ROUTE = dr.DirectRoute(Path.CUFILE_NVFS, None, True, False, True)
_WAITS = ("cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize")


@pytest.fixture
def stream_cufile(monkeypatch, fake_cuda):
    """libcufile in compat mode whose Stream API queues on the stand-in driver's streams."""
    fake = FakeCufile(route="posix", cuda=fake_cuda)
    lib = use_cufile(monkeypatch, fake)
    yield fake
    lib.close()


@pytest.fixture
def stream(fake_cuda):
    cuda.set_device(0)
    s = cuda.Stream(0)
    yield s
    s.synchronize()
    s.destroy()


def _file(tmp_path, nbytes, name="s.bin"):
    p = tmp_path / name
    data = os.urandom(nbytes)
    p.write_bytes(data)
    return str(p), data


def _waits(fake):
    return {name: fake.calls.get(name, 0) for name in _WAITS}


def _snapshot_kernel(fake, s, buf, nbytes):
    """A stand-in kernel queued on ``s`` that copies ``buf``'s first bytes out when it runs."""
    seen = {}

    def run():
        seen["bytes"] = ctypes.string_at(buf.ptr, nbytes)

    assert fake.queue_stream_work(s.handle, "snapshot kernel", run, reads=(buf.ptr, nbytes)) == 0
    return seen


def _fill_kernel(fake, s, buf, data):
    """A stand-in kernel queued on ``s`` that writes ``data`` into ``buf`` when it runs."""
    def run():
        ctypes.memmove(buf.ptr, data, len(data))

    assert fake.queue_stream_work(s.handle, "fill kernel", run, writes=(buf.ptr, len(data))) == 0


_MODES = [
    pytest.param({"mode": "bounce"}, {"bounce-cached", "bounce-direct"}, id="bounce"),
    pytest.param({"mode": "cufile"}, {"cufile-compat"}, id="cufile"),
]


@pytest.mark.parametrize("overrides, paths", _MODES)
def test_a_read_is_seen_by_the_next_op_on_its_stream_and_the_call_does_not_wait(
        tmp_path, fake_cuda, stream_cufile, stream, overrides, paths):
    path, data = _file(tmp_path, (9 << 20) + 4096 * 3 + 17)
    buf = cuda.DeviceArray(len(data) + 100)
    buf.fill(0x5A)
    before = gdskit.stats()
    with gdskit.settings.set(chunk_size="1MiB", **overrides), gdskit.open(path) as f:
        waits = _waits(fake_cuda)
        fut = f.pread(buf, len(data), 0, 100, stream=stream)
        assert _waits(fake_cuda) == waits, "the call itself waited for the stream"
        assert fake_cuda.pending() > 0 and not fut.done(), "the I/O must wait for the stream, not run in the call"
        seen = _snapshot_kernel(fake_cuda, stream, buf, len(data) + 100)
        stream.synchronize()
        assert fut.result() == len(data)
    assert seen["bytes"][:100] == b"\x5a" * 100 and seen["bytes"][100:] == data
    delta = gdskit.stats() - before
    assert set(delta.paths) <= paths and delta.bytes_read == len(data)


def test_auto_mode_splits_an_unaligned_read_between_cufile_and_the_ring(tmp_path, monkeypatch, fake_cuda,
                                                                         route_is, stream):
    fake = FakeCufile(route="nvfs", cuda=fake_cuda)
    lib = use_cufile(monkeypatch, fake)
    route_is(NVFS_ROUTE)
    path, data = _file(tmp_path, 3 << 20)
    buf = cuda.DeviceArray(len(data))
    size = (2 << 20) + 1000
    before = gdskit.stats()
    with gdskit.settings.set(mode="auto", direct_threshold=0), gdskit.open(path) as f:
        fut = f.pread(buf, size, 123, 123, stream=stream)
        seen = _snapshot_kernel(fake_cuda, stream, buf, len(data))
        stream.synchronize()
        assert fut.result() == size
    assert seen["bytes"][123:123 + size] == data[123:123 + size]
    delta = gdskit.stats() - before
    assert fake.async_calls["read"] >= 1, "the aligned body goes through cuFileReadAsync"
    assert set(delta.paths) == {"cufile-nvfs", "bounce-cached", "bounce-direct"} & set(delta.paths)
    assert "cufile-nvfs" in delta.paths and delta.bytes_read == size
    assert set(delta.reasons) == {"direct", "unaligned"}
    lib.close()


@pytest.mark.parametrize("overrides", [{"mode": "bounce"}, {"mode": "cufile"}], ids=["bounce", "cufile"])
def test_a_write_after_a_kernel_on_the_same_stream_saves_what_the_kernel_wrote(
        tmp_path, fake_cuda, stream_cufile, stream, overrides):
    data = os.urandom((5 << 20) + 333)
    buf = cuda.DeviceArray(len(data))
    buf.fill(0)
    target = tmp_path / "w.bin"
    with gdskit.settings.set(chunk_size="1MiB", **overrides), gdskit.open(str(target), "w") as f:
        waits = _waits(fake_cuda)
        _fill_kernel(fake_cuda, stream, buf, data)
        fut = f.pwrite(buf, stream=stream)  # no sync between the kernel and the write
        assert _waits(fake_cuda) == waits
        assert fut.result() == len(data)
    assert target.read_bytes() == data


def test_several_streams_at_once_share_the_stages_in_order(tmp_path, fake_cuda, stream):
    n_streams = stream_ordered.STAGE_SETS + 2  # more streams than stage sets: some take turns
    path, data = _file(tmp_path, n_streams << 20)
    streams = [cuda.Stream(0) for _ in range(n_streams)]
    bufs = [cuda.DeviceArray(1 << 20) for _ in range(n_streams)]
    try:
        with gdskit.settings.set(mode="bounce", chunk_size="256KiB"), gdskit.open(path) as f:
            futs = [f.pread(b, 1 << 20, i << 20, stream=s) for i, (b, s) in enumerate(zip(bufs, streams))]
            seen = [_snapshot_kernel(fake_cuda, s, b, 1 << 20) for b, s in zip(bufs, streams)]
            for s in reversed(streams):
                s.synchronize()
            assert [fut.result() for fut in futs] == [1 << 20] * n_streams
        for i, got in enumerate(seen):
            assert got["bytes"] == data[i << 20:(i + 1) << 20]
        out = tmp_path / "many.bin"
        with gdskit.settings.set(mode="bounce", chunk_size="256KiB"), gdskit.open(str(out), "w") as f:
            futs = [f.pwrite(b, 1 << 20, i << 20, stream=s) for i, (b, s) in enumerate(zip(bufs, streams))]
        assert all(fut.done() for fut in futs), "close() waits for the stream-ordered writes"
        assert out.read_bytes() == data
    finally:
        for s in streams:
            s.synchronize()
            s.destroy()


def test_host_memory_is_read_and_written_in_stream_order(tmp_path, fake_cuda, stream):
    path, data = _file(tmp_path, 300_000)
    host = np.zeros(len(data), np.uint8)
    with gdskit.open(path) as f:
        fut = f.pread(host, stream=stream)
        assert not host.any() and fake_cuda.pending() > 0, "host memory too is read in stream order"
        stream.synchronize()
        assert fut.result() == len(data)
    assert host.tobytes() == data
    out = tmp_path / "h.bin"
    with gdskit.open(str(out), "w") as f:
        assert f.pwrite(host, stream=stream.handle).result() == len(data)
    assert out.read_bytes() == data


def test_a_read_past_the_end_is_short_and_leaves_the_rest_untouched(tmp_path, fake_cuda, stream):
    path, data = _file(tmp_path, 100_000)
    buf = cuda.DeviceArray(1 << 20)
    buf.fill(0x77)
    with gdskit.settings.set(mode="bounce"), gdskit.open(path) as f:
        assert f.pread(buf, 1 << 20, 40_000, stream=stream).result() == 60_000
        assert f.pread(buf, 4096, 200_000, stream=stream).result() == 0
    got = buf.to_numpy().tobytes()
    assert got[:60_000] == data[40_000:] and got[60_000:] == b"\x77" * ((1 << 20) - 60_000)


def test_an_io_error_in_a_host_function_is_the_futures_and_later_chunks_skip(tmp_path, monkeypatch, fake_cuda,
                                                                            stream):
    path, data = _file(tmp_path, 4 << 20)
    buf = cuda.DeviceArray(len(data))
    calls = {"n": 0}
    real = os.preadv

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.EIO, "Input/output error")
        return real(*args, **kwargs)

    monkeypatch.setattr(base.os, "preadv", failing)
    before = gdskit.stats()
    with gdskit.settings.set(mode="bounce", odirect="never", chunk_size="1MiB"), gdskit.open(path) as f:
        fut = f.pread(buf, stream=stream)
        err = fut.exception()
    assert type(err) is GdskitIOError and err.errno == errno.EIO
    assert calls["n"] == 2, "the chunks after the failed one must not be read"
    assert (gdskit.stats() - before).bytes_read == 0, "a failed request claims no bytes"
    assert stream_ordered.in_flight() == 0 and cuda.host_funcs_pending() == 0


@pytest.mark.parametrize("op, failure, want", [
    ("read", {"errno": errno.EIO}, GdskitIOError),
    ("read", {"returns": -5044}, GdskitIOError),        # -CUfileOpError
    ("write", {"returns": -errno.ENOSPC}, NoSpaceError),
])
def test_a_failed_cufile_stream_io_is_the_futures(tmp_path, fake_cuda, stream_cufile, stream, op, failure, want):
    path, data = _file(tmp_path, 1 << 20)
    buf = cuda.DeviceArray(len(data))
    stream_cufile.fail_io(op, **failure)
    with gdskit.settings.set(mode="cufile"), gdskit.open(path, "r+") as f:
        fut = f.pread(buf, stream=stream) if op == "read" else f.pwrite(buf, stream=stream)
        err = fut.exception()
    assert type(err) is want
    assert stream_ordered.in_flight() == 0


def test_a_refused_cufile_submission_is_the_futures(tmp_path, monkeypatch, fake_cuda, stream):
    lib = use_cufile(monkeypatch, FakeCufile(route="posix"))  # no driver: the Stream API refuses
    path, _ = _file(tmp_path, 1 << 20)
    buf = cuda.DeviceArray(1 << 20)
    with gdskit.settings.set(mode="cufile"), gdskit.open(path) as f:
        err = f.pread(buf, stream=stream).exception()
    assert type(err) is GdskitIOError and err.errno == errno.EIO
    lib.close()


@pytest.mark.parametrize("bad", ["abc", object(), -1, True, 1.5, None.__class__])
def test_a_bad_stream_object_is_an_error_on_the_future(tmp_path, fake_cuda, bad):
    path, _ = _file(tmp_path, 4096)
    with gdskit.open(path) as f:
        fut = f.pread(cuda.DeviceArray(4096), stream=bad)
        assert isinstance(fut.exception(), InvalidArgumentError) and isinstance(fut.exception(), ValueError)


def test_a_closed_file_and_bad_arguments_are_errors_on_the_future(tmp_path, fake_cuda, stream):
    path, _ = _file(tmp_path, 4096)
    f = gdskit.open(path)
    buf = cuda.DeviceArray(4096)
    assert isinstance(f.pread(buf, 8192, stream=stream).exception(), InvalidArgumentError)
    assert isinstance(f.pwrite(buf, stream=stream).exception(), OSError)  # mode "r" is not writable
    f.close()
    assert type(f.pread(buf, stream=stream).exception()) is ClosedFileError


def test_stream_accepts_objects_with_the_stream_protocols(fake_cuda, stream):
    class TorchLike:
        cuda_stream = stream.handle

    class ProtocolLike:
        def __cuda_stream__(self):
            return (0, stream.handle)

    assert cuda.stream_handle(TorchLike()) == stream.handle
    assert cuda.stream_handle(ProtocolLike()) == stream.handle
    assert cuda.stream_handle(stream.handle) == stream.handle
    assert cuda.stream_handle(0) == 0


def test_close_waits_for_stream_ordered_requests_in_flight(tmp_path, fake_cuda, stream):
    data = os.urandom(3 << 20)
    buf = cuda.DeviceArray(len(data))
    buf.copy_from_host(data)
    target = tmp_path / "c.bin"
    f = gdskit.open(str(target), "w", atomic=True)
    fut = f.pwrite(buf, stream=stream)
    assert not fut.done()
    f.close()  # no sync by the caller
    assert fut.done() and fut.result() == len(data)
    assert target.read_bytes() == data


def test_a_failed_stream_write_keeps_an_atomic_target(tmp_path, monkeypatch, fake_cuda, stream):
    target = tmp_path / "ckpt.bin"
    target.write_bytes(b"previous")
    buf = cuda.DeviceArray(1 << 20)

    def failing(fd, data, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(base.os, "pwrite", failing)
    with gdskit.settings.set(mode="bounce", odirect="never"):
        f = gdskit.open(str(target), "w", atomic=True)
        fut = f.pwrite(buf, stream=stream)
        with pytest.raises(GdskitIOError):
            f.close()
    assert type(fut.exception()) is GdskitIOError
    assert target.read_bytes() == b"previous"
    assert [p for p in os.listdir(tmp_path) if p.endswith(".gdskit-tmp")] == []


def _eio(*args, **kwargs):
    raise OSError(errno.EIO, "Input/output error")


def test_nothing_leaks_on_success_and_error(tmp_path, monkeypatch, fake_cuda, stream_cufile, stream):
    path, data = _file(tmp_path, 2 << 20)
    buf = cuda.DeviceArray(len(data))
    with gdskit.settings.set(mode="bounce"), gdskit.open(path) as f:  # the stages exist from here on
        f.pread(buf, stream=stream).result()
    fds, events = fd_count(), fake_cuda.live_events()
    pinned = fake_cuda.live_allocations(CUmemorytype.CU_MEMORYTYPE_HOST)
    for mode in ("bounce", "cufile"):
        with gdskit.settings.set(mode=mode):
            for _ in range(3):
                with gdskit.open(path, "r+") as f:
                    f.pread(buf, stream=stream).result()
                    f.pwrite(buf, stream=stream).result()
                    f.pread(buf, stream="bad").exception()
                with monkeypatch.context() as mp, gdskit.settings.set(odirect="never"):
                    mp.setattr(base.os, "preadv", _eio)
                    stream_cufile.fail_io("read", errno=errno.EIO)
                    with gdskit.open(path) as f:
                        assert type(f.pread(buf, stream=stream).exception()) is GdskitIOError
                    stream_cufile._io_failure.clear()
    assert fd_count() == fds and fake_cuda.live_events() == events
    assert fake_cuda.live_allocations(CUmemorytype.CU_MEMORYTYPE_HOST) == pinned
    assert stream_ordered.in_flight() == 0 and cuda.host_funcs_pending() == 0
    gdskit.release_resources()
    assert stream_ordered.stages.pinned_bytes() == 0
    assert fake_cuda.live_allocations(CUmemorytype.CU_MEMORYTYPE_HOST) < pinned


# -- the stand-in keeps CUDA's rules for host functions and cuFile's Stream API ---------------------------

def test_stand_in_host_functions_run_in_stream_order_and_may_not_call_cuda(fake_cuda, stream):
    order = []
    src = cuda.PinnedBuffer(4096)
    dst = cuda.DeviceArray(4096)
    ctypes.memset(src.ptr, 1, 4096)

    def fill():
        order.append("fill")
        ctypes.memset(src.ptr, 2, 4096)  # fills the stage the next copy takes

    cuda.launch_host_func(stream.handle, fill)
    stream.copy_h2d(dst.ptr, src.ptr, 4096)
    cuda.launch_host_func(stream.handle, lambda: order.append("after"))
    assert order == [], "nothing runs before the stream is waited for"
    stream.synchronize()
    assert order == ["fill", "after"]
    assert dst.to_numpy().tobytes() == b"\x02" * 4096, "a copy behind a host function takes its bytes when it runs"
    cuda.launch_host_func(stream.handle, lambda: fake_cuda.cuCtxGetCurrent())
    with pytest.raises(StandInViolation):
        stream.synchronize()
    broken = fake_cuda.take_violations()
    assert len(broken) == 1 and "cuCtxGetCurrent" in broken[0], "a CUDA call from a host function is a breach"
    src.free()
    dst.free()


def test_stand_in_cufile_reads_its_parameters_when_the_io_runs(tmp_path, fake_cuda, stream):
    path, data = _file(tmp_path, 64 << 10)
    fake = FakeCufile(cuda=fake_cuda)
    descr = fake.Descr()
    fd = os.open(path, os.O_RDONLY)
    try:
        descr.handle.fd = fd
        fh = fake.handle_register(descr.ptr)
        buf = cuda.DeviceArray(64 << 10)
        vals = (ctypes.c_size_t * 1)(4096), (ctypes.c_int64 * 1)(0), (ctypes.c_int64 * 1)(0), (ctypes.c_ssize_t * 1)(0)
        fake.read_async(fh, buf.ptr, *(ctypes.addressof(v) for v in vals), stream.handle)
        vals[0][0], vals[1][0] = 8192, 4096  # changed after queueing: the I/O uses these
        assert vals[3][0] == 0, "nothing is read before the stream runs"
        stream.synchronize()
        assert vals[3][0] == 8192
        assert buf.to_numpy(8192).tobytes() == data[4096:4096 + 8192]
        fake.handle_deregister(fh)
    finally:
        os.close(fd)
