"""Many files read as one engine job (``gdskit.engine.many_files``), the way ``preload`` reads
datasets of many shards: bytes and order against plain reads, short counts only at the end of
a file, errors that name the file and leave no descriptor or thread behind, the open files
bounded, and the device path on the stand-in CUDA driver."""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np
import pytest

import gdskit
from gdskit.engine import cuda
from gdskit.engine.buffers import synchronized_device_view
from gdskit.errors import (BufferTooSmallError, GdskitError, GdskitFileNotFoundError, GdskitIsADirectoryError,
                           InvalidArgumentError, ReadOnlyBufferError)
from gdskit.engine.many_files import FileReads, read_files
from data_files import random_files
from gdskit.engine.residency import CACHED_SAMPLES
from leak_helpers import fd_count

CHUNK = 64 << 10


def _files(tmp_path, sizes, seed=0):
    return random_files(tmp_path, sizes, seed, prefix="f")


def _threads() -> set[str]:
    """Threads other than the engine's on-demand worker pools (which stay for the next job)."""
    return {t.name for t in threading.enumerate() if not t.name.startswith("gdskit-")}


# Small files, files of several chunks (striped across the workers), an empty one, one of a
# chunk exactly and one a byte longer: each read at an offset (an .npy header's) to its end.
SIZES = [1, 100, 4096, 5000, CHUNK, CHUNK + 1, 3 * CHUNK + 777, 0, 200_000, 17] * 3


@pytest.mark.parametrize("threads", [1, 3])
def test_every_file_lands_in_its_buffer_in_order(tmp_path, threads):
    files = _files(tmp_path, SIZES)
    skip = [min(128, len(d)) if i % 2 else 0 for i, (_p, d) in enumerate(files)]
    bufs = [bytearray(len(d) - s + 9) for (_p, d), s in zip(files, skip)]
    jobs = [FileReads(p, [(b, len(d) - s, s, 9)] if len(d) > s else []) for (p, d), s, b in zip(files, skip, bufs)]
    fds, threads_before = fd_count(), _threads()
    with gdskit.settings.set(chunk_size="64KiB", threads=threads):
        counts = read_files(jobs)
    assert counts == [[len(d) - s] if len(d) > s else [] for (_p, d), s in zip(files, skip)]
    for (_p, d), s, b in zip(files, skip, bufs):
        assert bytes(b[9:]) == d[s:]
        assert bytes(b[:9]) == bytes(9)  # nothing before buf_offset was touched
    assert fd_count() == fds and _threads() == threads_before


def test_several_reads_of_a_file_and_reads_past_its_end(tmp_path):
    (path, data), = _files(tmp_path, [300_000])
    a, b, c, d = bytearray(1000), np.zeros(200_000, np.uint8), bytearray(5000), bytearray(10)
    with gdskit.settings.set(chunk_size="64KiB", threads=2):
        got = read_files([FileReads(path, [(a, 1000, 7), (b, 200_000, 90_000), (c, 5000, 298_000),
                                           (d, 10, 300_005)])])
    assert got == [[1000, 200_000, 2000, 0]]  # short only at the end of the file
    assert bytes(a) == data[7:1007] and b.tobytes() == data[90_000:290_000] and bytes(c[:2000]) == data[298_000:]


def test_a_missing_file_is_named_and_nothing_is_left_open(tmp_path):
    files = _files(tmp_path, [CHUNK * 2] * 30)
    jobs = [FileReads(p, [(bytearray(len(d)), len(d), 0)]) for p, d in files]
    gone = str(tmp_path / "gone.bin")
    jobs.insert(17, FileReads(gone, [(bytearray(10), 10, 0)]))
    fds, threads_before = fd_count(), _threads()
    with gdskit.settings.set(chunk_size="64KiB", threads=3):
        with pytest.raises(GdskitFileNotFoundError) as info:
            read_files(jobs)
    assert isinstance(info.value, FileNotFoundError) and info.value.filename == gone
    assert fd_count() == fds and _threads() == threads_before


def test_a_directory_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(GdskitIsADirectoryError) as info:
        read_files([FileReads(tmp_path / "d", [(bytearray(1), 1, 0)])])
    assert isinstance(info.value, IsADirectoryError)


@pytest.mark.parametrize("bad, error", [
    ((bytearray(10), 10), InvalidArgumentError),          # too short an item
    ([bytearray(10), 10, 0], InvalidArgumentError),       # not a tuple
    ((bytearray(10), 11, 0), BufferTooSmallError),
    ((bytearray(10), 5, 0, 6), BufferTooSmallError),
    ((bytearray(10), 10, -1), InvalidArgumentError),
    ((bytearray(10), True, 0), InvalidArgumentError),
    ((bytes(10), 10, 0), ReadOnlyBufferError),
])
def test_bad_reads_fail_before_any_file_is_read(tmp_path, bad, error):
    (path, _data), = _files(tmp_path, [100])
    first = bytearray(100)
    with pytest.raises(error) as info:
        read_files([FileReads(path, [(first, 100, 0)]), FileReads(path, [bad])])
    assert isinstance(info.value, GdskitError)
    assert first == bytearray(100)


def test_a_callback_error_abandons_the_job(tmp_path):
    files = _files(tmp_path, [CHUNK] * 40)
    jobs = [FileReads(p, [(bytearray(len(d)), len(d), 0)]) for p, d in files]
    seen = []

    def on_bytes(n):
        seen.append(n)
        if len(seen) == 5:
            raise KeyboardInterrupt

    fds = fd_count()
    with gdskit.settings.set(chunk_size="64KiB", threads=3):
        with pytest.raises(KeyboardInterrupt):
            read_files(jobs, on_bytes=on_bytes)
    assert len(seen) < 40 and fd_count() == fds


def test_files_are_open_only_while_they_are_read(tmp_path):
    """The job opens a file when a worker first needs it and closes it after its last chunk:
    a dataset of many files never holds them all open."""
    files = _files(tmp_path, [5000] * 200)
    jobs = [FileReads(p, [(bytearray(len(d)), len(d), 0)]) for p, d in files]
    base = fd_count()
    most = [0]

    def on_bytes(_n):
        most[0] = max(most[0], fd_count() - base)

    with gdskit.settings.set(threads=3):
        read_files(jobs, on_bytes=on_bytes)
    # Each open file may hold a buffered and an O_DIRECT descriptor; a worker may have opened
    # its next file while another finishes.
    assert 0 < most[0] <= 2 * (3 + 1)


def test_the_ledger_counts_every_byte_on_the_host_path(tmp_path):
    files = _files(tmp_path, [5000, 300_000, 10])
    before = gdskit.stats()
    with gdskit.settings.set(chunk_size="64KiB", threads=2):
        read_files([FileReads(p, [(bytearray(len(d)), len(d), 0)]) for p, d in files])
    delta = gdskit.stats() - before
    assert delta.bytes_read == sum(len(d) for _p, d in files) and set(delta.paths) == {"host"}


@pytest.mark.stand_in_gpu
@pytest.mark.parametrize("mode", ["auto", "bounce"])
def test_device_memory_takes_the_bounce_ring_and_the_ledger_counts_it(tmp_path, mode):
    files = _files(tmp_path, [1, 5000, CHUNK, CHUNK + 129, 3 * CHUNK + 5, 0, 70_000] * 2)
    skip = [128 if len(d) > 128 and i % 3 == 0 else 0 for i, (_p, d) in enumerate(files)]
    dests = [cuda.DeviceArray(max(1, len(d) - s)) for (_p, d), s in zip(files, skip)]
    for dest in dests:
        ctypes.memset(dest.ptr, 0xAB, dest.nbytes)
    jobs = [FileReads(p, [(synchronized_device_view(a.ptr, a.nbytes, a), len(d) - s, s)] if len(d) > s else [])
            for (p, d), s, a in zip(files, skip, dests)]
    before = gdskit.stats()
    fds = fd_count()
    with gdskit.settings.set(mode=mode, chunk_size="64KiB", threads=3):
        counts = read_files(jobs)
    assert counts == [[len(d) - s] if len(d) > s else [] for (_p, d), s in zip(files, skip)]
    for (_p, d), s, a in zip(files, skip, dests):
        if len(d) > s:
            assert ctypes.string_at(a.ptr, len(d) - s) == d[s:]
    delta = gdskit.stats() - before
    assert delta.bytes_read == sum(c for cs in counts for c in cs)
    assert set(delta.paths) <= {"bounce-cached", "bounce-direct"}
    assert fd_count() == fds


@pytest.mark.stand_in_gpu
@pytest.mark.parametrize("cached", [True, False, "half"])
def test_cached_small_files_into_device_memory_take_one_worker(tmp_path, monkeypatch, cached):
    """Cached small files are Python per file: one worker reads them (more only take turns at
    the interpreter); from the disk, or into host memory, every worker stays."""
    import gdskit.engine.many_files as mf

    files = _files(tmp_path, [5000 + i for i in range(30)])
    if cached is not True:  # all evicted, or all but the first, middle and last
        from backend_conformance import drop_cache

        for k, (p, _d) in enumerate(files):
            if cached is False or k not in (0, len(files) // 2, len(files) - 1):
                drop_cache(p)
        from gdskit.engine import first_page_cached

        if first_page_cached(files[1][0]) is not False:
            pytest.skip("this system cannot drop a file's pages from the page cache")
    asked = []
    real = mf.run_chunks
    monkeypatch.setattr(mf, "run_chunks", lambda *a, **kw: asked.append((kw["device"], kw["threads"])) or real(*a, **kw))
    dests = [cuda.DeviceArray(len(d)) for _p, d in files]
    host = [bytearray(len(d)) for _p, d in files]
    with gdskit.settings.set(threads=4):
        read_files([FileReads(p, [(synchronized_device_view(a.ptr, a.nbytes, a), len(d), 0)])
                    for (p, d), a in zip(files, dests)])
        read_files([FileReads(p, [(b, len(d), 0)]) for (p, d), b in zip(files, host)])
    assert [ctypes.string_at(a.ptr, a.nbytes) for a in dests] == [d for _p, d in files]
    assert [bytes(b) for b in host] == [d for _p, d in files]
    assert asked == [(0, mf.HOT_SMALL_FILES_WORKERS if cached is True else 4), (None, 4)]


@pytest.mark.stand_in_gpu
@pytest.mark.parametrize("odirect", ["auto", "always", "never"])
def test_cached_small_files_are_packed_into_stages_with_one_copy_call_each(tmp_path, fake_cuda, odirect):
    """Each file's bytes land in the next slot of a stage; a full stage goes in one batched copy.
    The stand-in checks no stage is written while a copy from it is queued; here, 200 files share
    stages of 64 KiB, so each stage is filled, copied and refilled many times."""
    sizes = [1, 4095, 4096, 4097, 9000, 20_000, 30_001] * 28 + [0] * 4
    files = _files(tmp_path, sizes, seed=3)
    skip = [128 if len(d) > 200 and i % 2 else 0 for i, (_p, d) in enumerate(files)]
    dests = [cuda.DeviceArray(max(1, len(d) - s)) for (_p, d), s in zip(files, skip)]
    jobs = [FileReads(p, [(synchronized_device_view(a.ptr, a.nbytes, a), len(d) - s, s)] if len(d) > s else [])
            for (p, d), s, a in zip(files, skip, dests)]
    before, calls = gdskit.stats(), dict(fake_cuda.calls)
    fds = fd_count()
    landed = []
    with gdskit.settings.set(chunk_size="64KiB", threads=4, odirect=odirect):
        counts = read_files(jobs, on_bytes=landed.append)
    assert counts == [[len(d) - s] if len(d) > s else [] for (_p, d), s in zip(files, skip)]
    for (_p, d), s, a in zip(files, skip, dests):
        if len(d) > s:
            assert ctypes.string_at(a.ptr, len(d) - s) == d[s:]
    delta = gdskit.stats() - before
    assert delta.bytes_read == sum(len(d) - s for (_p, d), s in zip(files, skip)) == sum(landed)
    assert set(delta.paths) == ({"bounce-direct"} if odirect == "always" else {"bounce-cached"})
    copies = {k: fake_cuda.calls.get(k, 0) - calls.get(k, 0) for k in ("cuMemcpyBatchAsync", "cuMemcpyHtoDAsync")}
    assert 0 < copies["cuMemcpyBatchAsync"] + copies["cuMemcpyHtoDAsync"] < len(files) // 4, copies
    assert fd_count() == fds


@pytest.mark.stand_in_gpu
def test_packed_files_and_general_ones_share_the_lane_without_overwriting_a_stage(tmp_path, fake_cuda, monkeypatch):
    """Every third file takes the general path (its read split in two routes) between packed
    ones: both take the lane's stages in turn, and the stand-in checks no stage is refilled
    while a copy from it is queued."""
    import gdskit.engine.read_route as read_route
    from gdskit.engine.read_route import BackendChoice, BackendKind

    real = read_route.choose_backends
    calls = []

    def split_every_third(f, view, size, file_offset, buf_offset, cfg):
        routes = real(f, view, size, file_offset, buf_offset, cfg)
        calls.append(f.path)
        if len(calls) % 3 or size < 2:
            return routes
        half = size // 2
        return [BackendChoice(BackendKind.BOUNCE, routes[0].reason, file_offset, buf_offset, half),
                BackendChoice(BackendKind.BOUNCE, routes[0].reason, file_offset + half, buf_offset + half, size - half)]

    monkeypatch.setattr(read_route, "choose_backends", split_every_third)
    files = _files(tmp_path, [3000 + 977 * (i % 23) for i in range(120)], seed=5)
    dests = [cuda.DeviceArray(len(d)) for _p, d in files]
    with gdskit.settings.set(chunk_size="64KiB", threads=4):
        counts = read_files([FileReads(p, [(synchronized_device_view(a.ptr, a.nbytes, a), len(d), 0)])
                             for (p, d), a in zip(files, dests)])
    assert counts == [[len(d)] for _p, d in files]
    assert [ctypes.string_at(a.ptr, a.nbytes) for a in dests] == [d for _p, d in files]


@pytest.mark.stand_in_gpu
def test_a_file_gone_from_a_packed_job_is_named_and_nothing_is_left_open(tmp_path, fake_cuda, monkeypatch):
    import gdskit.engine.many_files as mf

    packed = []
    real = mf._packed
    monkeypatch.setattr(mf, "_packed", lambda *a: packed.append(1) or real(*a))
    files = _files(tmp_path, [6000 + i for i in range(100)], seed=8)
    gone = files[50][0]  # not one of the files sampled for the page cache: the job is packed
    assert 50 not in {k * 99 // (CACHED_SAMPLES - 1) for k in range(CACHED_SAMPLES)}
    os.unlink(gone)
    dests = [cuda.DeviceArray(len(d)) for _p, d in files]
    fds, threads = fd_count(), _threads()
    with pytest.raises(GdskitFileNotFoundError) as info:
        read_files([FileReads(p, [(synchronized_device_view(a.ptr, a.nbytes, a), len(d), 0)])
                    for (p, d), a in zip(files, dests)])
    assert info.value.filename == gone and packed
    assert fd_count() == fds and _threads() == threads
    counts = read_files([FileReads(p, [(synchronized_device_view(a.ptr, a.nbytes, a), len(d), 0)])
                         for (p, d), a in zip(files[:40], dests)])  # the lane taken back is sound
    assert counts == [[len(d)] for _p, d in files[:40]]
    assert [ctypes.string_at(a.ptr, a.nbytes) for a in dests[:40]] == [d for _p, d in files[:40]]


@pytest.mark.stand_in_gpu
def test_a_device_read_of_a_file_that_shrank_is_short(tmp_path):
    (path, data), = _files(tmp_path, [3 * CHUNK])
    os.truncate(path, CHUNK + 10)
    dest = cuda.DeviceArray(len(data))
    with gdskit.settings.set(mode="bounce", chunk_size="64KiB", threads=2):
        got = read_files([FileReads(path, [(synchronized_device_view(dest.ptr, len(data), dest), len(data), 0)])])
    assert got == [[CHUNK + 10]]
    assert ctypes.string_at(dest.ptr, CHUNK + 10) == data[:CHUNK + 10]


@pytest.mark.stand_in_gpu
def test_host_and_device_destinations_in_one_job(tmp_path):
    files = _files(tmp_path, [70_000, 9000, 200_000])
    host = bytearray(70_000)
    dev = [cuda.DeviceArray(9000), cuda.DeviceArray(200_000)]
    jobs = [FileReads(files[0][0], [(host, 70_000, 0)])] + [
        FileReads(p, [(synchronized_device_view(a.ptr, a.nbytes, a), len(d), 0)]) for (p, d), a in zip(files[1:], dev)]
    with gdskit.settings.set(chunk_size="64KiB", threads=2):
        assert read_files(jobs) == [[70_000], [9000], [200_000]]
    assert bytes(host) == files[0][1]
    assert all(ctypes.string_at(a.ptr, a.nbytes) == d for (_p, d), a in zip(files[1:], dev))


@pytest.mark.stand_in_gpu
def test_where_a_direct_route_exists_the_aligned_bodies_take_cufile(tmp_path, monkeypatch, route_is):
    from fake_cufile import FakeCufile
    from fake_stack import use_cufile
    from gdskit.engine import direct_path as dr
    from gdskit.vocabulary import Path

    fake = FakeCufile(route="nvfs")
    lib = use_cufile(monkeypatch, fake)
    route_is(dr.DirectRoute(Path.CUFILE_NVFS, None, True, False, True))
    files = _files(tmp_path, [3 * CHUNK + 300, 2 * 4096, 5000] * 3)
    skip = [128 if i % 2 else 0 for i in range(len(files))]  # an .npy header's offset: ragged edges
    dests = [cuda.DeviceArray(len(d) - s) for (_p, d), s in zip(files, skip)]
    jobs = [FileReads(p, [(synchronized_device_view(a.ptr, a.nbytes, a), a.nbytes, s)])
            for (p, _d), s, a in zip(files, skip, dests)]
    before = gdskit.stats()
    with gdskit.settings.set(mode="auto", direct_threshold=0, chunk_size="64KiB", threads=3):
        counts = read_files(jobs)
    assert counts == [[a.nbytes] for a in dests]
    assert all(ctypes.string_at(a.ptr, a.nbytes) == d[s:] for (_p, d), s, a in zip(files, skip, dests))
    delta = gdskit.stats() - before
    assert delta.bytes_read == sum(a.nbytes for a in dests)
    assert "cufile-nvfs" in delta.paths and set(delta.paths) <= {"cufile-nvfs", "bounce-cached", "bounce-direct"}
    assert fake.handles == {}, "every file's handle is deregistered when the job closes it"
    lib.close()
