"""Whole small files into GPU memory (``gdskit.engine.whole_files``), on the stand-in CUDA driver: each
file's bytes against the file, in one batched copy a stage; page cache or O_DIRECT by the
policy and the cache; errors named, the first in list order, nothing left open."""

from __future__ import annotations

import ctypes
import os

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

import gdskit
from backend_conformance import drop_cache
from gdskit.engine import cuda
from gdskit.engine import whole_files as wf
from gdskit.errors import GdskitError, GdskitFileNotFoundError, InvalidArgumentError
from data_files import random_files
from leak_helpers import file_fd_count as fd_count

pytestmark = pytest.mark.stand_in_gpu

CHUNK = 64 << 10
SIZES = [1, 100, 4095, 4096, 4097, 9000, 20_000, 0, 30_001] * 12 + [CHUNK]


def _files(tmp_path, sizes, seed=0):
    return random_files(tmp_path, sizes, seed, prefix="w")


class _Landing:
    """A ``place`` that lands each file, less its first ``skip`` bytes, in device memory of its own."""

    def __init__(self, files, skip=0):
        self.files, self.skip = files, skip
        self.dest: dict[int, cuda.DeviceArray] = {}
        self.seen: dict[int, int] = {}

    def __call__(self, i, data):
        self.seen[i] = len(data)
        n = max(0, len(data) - self.skip)
        a = self.dest[i] = cuda.DeviceArray(max(1, n))
        return [(a.ptr, self.skip, n)] if n else []

    def landed(self, i):
        return ctypes.string_at(self.dest[i].ptr, max(0, len(self.files[i][1]) - self.skip))


def _read(files, place, **kw):
    wf.read_whole_files([p for p, _d in files], [len(d) for _p, d in files], 0, place, **kw)


@pytest.mark.parametrize("odirect", ["auto", "always", "never"])
@pytest.mark.parametrize("io_uring", ["auto", "never"])
def test_every_file_lands_whole_with_one_copy_call_a_stage(tmp_path, fake_cuda, odirect, io_uring):
    files = _files(tmp_path, SIZES)
    place = _Landing(files, skip=7)
    before, calls = gdskit.stats(), dict(fake_cuda.calls)
    fds, landed = fd_count(), []
    with gdskit.settings.set(mode="bounce", chunk_size="64KiB", threads=4, odirect=odirect, io_uring=io_uring):
        _read(files, place, on_bytes=landed.append)
    assert place.seen == {i: len(d) for i, (_p, d) in enumerate(files)}
    assert all(place.landed(i) == d[7:] for i, (_p, d) in enumerate(files))
    delta = gdskit.stats() - before
    assert delta.bytes_read == sum(len(d) for _p, d in files)  # the files' bytes read, header and all
    assert sum(landed) == delta.bytes_read  # progress counts what the ledger does
    assert set(delta.paths) == ({"bounce-direct"} if odirect == "always" else {"bounce-cached"})
    assert {str(r) for r in delta.reasons} == {"forced_by_setting"}
    copies = {k: fake_cuda.calls.get(k, 0) - calls.get(k, 0) for k in ("cuMemcpyBatchAsync", "cuMemcpyHtoDAsync")}
    assert 0 < copies["cuMemcpyBatchAsync"] + copies["cuMemcpyHtoDAsync"] < len(files) // 4, copies
    assert fd_count() == fds


def _spy_workers(monkeypatch):
    """The worker counts ``read_whole_files`` asks ``run_chunks`` for."""
    asked = []
    real = wf.run_chunks

    def spy(units, work, *, threads, **kw):
        asked.append(threads)
        return real(units, work, threads=threads, **kw)

    monkeypatch.setattr(wf, "run_chunks", spy)
    return asked


def test_a_cold_job_runs_on_one_worker_asking_each_stage_into_the_page_cache_ahead(tmp_path, fake_cuda,
                                                                                  monkeypatch):
    from gdskit.engine import first_page_cached
    from gdskit.engine.residency import Residency, path_residency

    files = _files(tmp_path, [5000, 8192, 20_000 - 1] * 20 + [3])
    for p, _d in files:
        drop_cache(p)
    if first_page_cached(files[0][0]) is not False:
        pytest.skip("this system cannot drop a file's pages from the page cache")
    asked = _spy_workers(monkeypatch)
    place = _Landing(files)
    before, fds = gdskit.stats(), fd_count()
    with gdskit.settings.set(mode="bounce", chunk_size="64KiB", odirect="auto"):
        _read(files, place)
        assert all(place.landed(i) == d for i, (_p, d) in enumerate(files))
        assert set((gdskit.stats() - before).paths) == {"bounce-cached"}
        # each file asked into the page cache, then read
        assert all(path_residency(p, 0, len(d)) is Residency.ALL for p, d in files)
        _read(files, place)  # now cached: the hot workers
    assert asked == [1, wf.HOT_WORKERS]
    assert fd_count() == fds


def test_a_cold_job_that_fails_half_way_closes_the_next_stages_files(tmp_path, fake_cuda):
    files = _files(tmp_path, [30_000] * 40)
    for p, _d in files:
        drop_cache(p)
    place = _Landing(files)

    def fussy(i, data):
        if i == 7:
            raise gdskit.errors.InvalidArgumentError("file 7 is not wanted")
        return place(i, data)

    fds = fd_count()
    with gdskit.settings.set(mode="bounce", chunk_size="64KiB", odirect="auto"):
        with pytest.raises(InvalidArgumentError, match="file 7 "):
            _read(files, fussy)
    assert fd_count() == fds and 39 not in place.seen


def test_a_cold_jobs_next_stage_is_opened_beside_the_worker_by_a_thread_that_does_not_outlive_it(
        tmp_path, fake_cuda, monkeypatch):
    """The worker reads, places and copies one stage while a helper thread opens the next stage's
    files (and so asks them into the page cache); the helper is gone when the job ends, whether
    it ends well, on a file's error or on an interrupt."""
    import threading

    files = _files(tmp_path, [30_000] * 40)
    opened_by, placed_by = [], set()
    real_open = wf.open_file_fd

    def spy(path, flags):
        opened_by.append((path, threading.current_thread().name))
        return real_open(path, flags)

    monkeypatch.setattr(wf, "open_file_fd", spy)
    place = _Landing(files)

    def placing(i, data):
        placed_by.add(threading.current_thread().name)
        return place(i, data)

    def helpers():
        return [t for t in threading.enumerate() if t.name.startswith("gdskit-ahead")]

    fds = fd_count()
    with gdskit.settings.set(mode="bounce", chunk_size="64KiB", odirect="auto"):
        for p, _d in files:
            drop_cache(p)
        _read(files, placing)
        assert all(place.landed(i) == d for i, (_p, d) in enumerate(files))
        assert [p for p, _t in opened_by] == [p for p, _d in files]  # each file opened once, in order
        assert {t for _p, t in opened_by} == {next(t for _p, t in opened_by)} and placed_by.isdisjoint(
            t for _p, t in opened_by)
        assert not helpers()

        def fussy(i, data):
            if i == 9:
                raise InvalidArgumentError("file 9 is not wanted")
            return place(i, data)

        for p, _d in files:
            drop_cache(p)
        with pytest.raises(InvalidArgumentError, match="file 9 "):
            _read(files, fussy)
        assert not helpers()
        for p, _d in files:
            drop_cache(p)
        with pytest.raises(KeyboardInterrupt):
            _read(files, place, on_bytes=lambda n: (_ for _ in ()).throw(KeyboardInterrupt))
        assert not helpers()
    assert fd_count() == fds


def test_the_first_bad_file_in_list_order_is_raised_and_nothing_is_left_open(tmp_path, fake_cuda):
    files = _files(tmp_path, [3000] * 300)
    os.unlink(files[250][0])
    place = _Landing(files)

    def fussy(i, data):
        if i in (180, 40):
            raise gdskit.errors.InvalidArgumentError(f"file {i} is not wanted")
        return place(i, data)

    fds = fd_count()
    with gdskit.settings.set(mode="bounce", chunk_size="64KiB", threads=4):
        with pytest.raises(InvalidArgumentError, match="file 40 "):
            _read(files, fussy)
        with pytest.raises(GdskitFileNotFoundError, match=r"w0250\.bin"):
            _read(files[200:], place)
    assert fd_count() == fds


def test_a_file_that_shrank_is_handed_over_short(tmp_path, fake_cuda):
    files = _files(tmp_path, [10_000, 10_000, 10_000])
    os.truncate(files[1][0], 4000)
    place = _Landing(files)
    with gdskit.settings.set(mode="bounce", chunk_size="64KiB"):
        _read(files, place)
    assert place.seen == {0: 10_000, 1: 4000, 2: 10_000}


def test_a_file_that_grew_is_read_to_its_listed_size(tmp_path, fake_cuda):
    files = _files(tmp_path, [10_000, 5000])
    with open(files[0][0], "ab") as f:
        f.write(b"x" * 3000)
    place = _Landing(files)
    with gdskit.settings.set(mode="bounce", chunk_size="64KiB", odirect="always"):
        _read(files, place)
    assert place.seen == {0: 10_000, 1: 5000} and place.landed(0) == files[0][1]


def test_a_copy_outside_the_files_bytes_is_refused(tmp_path, fake_cuda):
    files = _files(tmp_path, [1000])
    a = cuda.DeviceArray(2000)
    with gdskit.settings.set(mode="bounce", chunk_size="64KiB"):
        with pytest.raises(InvalidArgumentError, match="outside"):
            _read(files, lambda i, data: [(a.ptr, 10, 995)])


def test_files_larger_than_a_stage_are_refused(tmp_path, fake_cuda):
    files = _files(tmp_path, [CHUNK + 1])
    with gdskit.settings.set(mode="bounce", chunk_size="64KiB"):
        assert wf.limit(0) == CHUNK
        with pytest.raises(InvalidArgumentError, match="larger than a stage"):
            _read(files, _Landing(files))


def test_where_cufile_may_serve_a_file_the_job_is_refused(tmp_path, fake_cuda, route_is):
    from gdskit.engine import direct_path as dr
    from gdskit.vocabulary import Path

    route_is(dr.DirectRoute(Path.CUFILE_NVFS, None, True, False, True))
    files = _files(tmp_path, [100])
    with gdskit.settings.set(mode="auto"):
        assert wf.limit(0) == 0
        with pytest.raises(GdskitError, match="file by file"):
            _read(files, _Landing(files))
    with gdskit.settings.set(mode="cufile"):
        assert wf.limit(0) == 0
    with gdskit.settings.set(mode="bounce"):
        assert wf.limit(0) > 0


def test_a_file_swapped_for_a_fifo_after_listing_is_refused_at_once(tmp_path, fake_cuda):
    from gdskit.errors import NotAFileError

    files = _files(tmp_path, [3000] * 10)
    os.unlink(files[4][0])
    os.mkfifo(files[4][0])  # no writer: an open that waited for one would never return
    place = _Landing(files)
    fds = fd_count()
    with gdskit.settings.set(mode="bounce", chunk_size="64KiB"):
        with pytest.raises(NotAFileError, match=r"w0004\.bin"):
            _read(files, place)
    assert fd_count() == fds and 4 not in place.seen


def test_no_files_or_only_empty_ones(tmp_path, fake_cuda):
    with gdskit.settings.set(mode="bounce", chunk_size="64KiB"):
        wf.read_whole_files([], [], 0, _Landing([]))
        files = _files(tmp_path, [0, 0, 0])
        for p, _d in files:
            drop_cache(p)
        place = _Landing(files)
        _read(files, place)
    assert place.seen == {0: 0, 1: 0, 2: 0}


@pytest.mark.parametrize("io_uring", ["auto", "never"])
def test_a_read_that_fails_is_the_files_error(tmp_path, fake_cuda, io_uring):
    """Reading address 0 of this process's own memory file fails (EIO): through the ring, its
    result is an error the plain read then raises, named."""
    from gdskit.errors import GdskitIOError

    files = _files(tmp_path, [5000, 5000])
    place = _Landing(files + [("/proc/self/mem", b"")])
    with gdskit.settings.set(mode="bounce", chunk_size="64KiB", io_uring=io_uring):
        with pytest.raises(GdskitIOError, match="/proc/self/mem"):
            wf.read_whole_files([files[0][0], "/proc/self/mem", files[1][0]], [5000, 4096, 5000], 0, place)
    assert 1 not in place.seen


def test_a_progress_callback_that_raises_abandons_a_cold_job_and_closes_what_it_opened_ahead(tmp_path, fake_cuda):
    files = _files(tmp_path, [30_000] * 40)
    for p, _d in files:
        drop_cache(p)
    calls = []

    def on_bytes(n):
        calls.append(n)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a user's Ctrl-C inside a progress callback

    fds = fd_count()
    with gdskit.settings.set(mode="bounce", chunk_size="64KiB", odirect="auto"):
        with pytest.raises(KeyboardInterrupt):
            _read(files, _Landing(files), on_bytes=on_bytes)
    assert fd_count() == fds and len(calls) == 3


@given(sizes=st.lists(st.integers(0, CHUNK), min_size=1, max_size=60), align=st.sampled_from([512, 4096]),
       seed=st.integers(0, 9))
@hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_sizes_fill_stages_without_overlap_and_land_whole(tmp_path_factory, fake_cuda, sizes, align, seed):
    """Files of any sizes up to a stage: each stage's slots are aligned, side by side, within the
    stage and a ring; every file lands whole, its bytes against the file."""
    from gdskit.engine.backends.uring import RING_ENTRIES
    from gdskit.engine.plan import align_up

    stage = CHUNK + 2 * align
    groups = wf._groups(sizes, stage, align)
    assert [i for a, b in groups for i in range(a, b)] == list(range(len(sizes)))
    for a, b in groups:
        assert b - a <= RING_ENTRIES and sum(align_up(s, align) for s in sizes[a:b]) <= stage
    files = _files(tmp_path_factory.mktemp("any"), sizes, seed)
    place = _Landing(files)
    with gdskit.settings.set(mode="bounce", chunk_size="64KiB", alignment=align):
        _read(files, place)
    assert all(place.landed(i) == d for i, (_p, d) in enumerate(files))


def test_under_always_a_filesystem_that_refuses_o_direct_is_read_through_the_page_cache(tmp_path, fake_cuda,
                                                                                        monkeypatch):
    """A filesystem without O_DIRECT refuses the open itself (EINVAL, as open(2) says; this
    machine's filesystems all take it, so the refusal is made here, as the kernel makes it): the
    job opens the file again buffered, asks no more O_DIRECT opens, and the ledger says so."""
    import errno

    from gdskit.errors import from_os_error

    real, asked = wf.open_file_fd, []

    def refusing(path, flags, mode=0o666):
        asked.append(bool(flags & os.O_DIRECT))
        if flags & os.O_DIRECT:
            raise from_os_error(OSError(errno.EINVAL, "Invalid argument"), path)
        return real(path, flags, mode)

    monkeypatch.setattr(wf, "open_file_fd", refusing)
    files = _files(tmp_path, [5000, 100, 63_000] * 3)
    place = _Landing(files)
    before, fds = gdskit.stats(), fd_count()
    with gdskit.settings.set(mode="bounce", chunk_size="64KiB", odirect="always"):
        _read(files, place)
    assert all(place.landed(i) == data for i, (_p, data) in enumerate(files))
    assert set((gdskit.stats() - before).paths) == {"bounce-cached"} and fd_count() == fds
    assert asked[:2] == [True, False] and not any(asked[2:])
