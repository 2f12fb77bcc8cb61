"""File.read_batch: many small reads in one call, against plain reads of the same bytes."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from backend_conformance import aligned_array, drop_cache
from data_files import random_file

import gdskit
from gdskit.errors import (
    BufferTooSmallError,
    ClosedFileError,
    InvalidArgumentError,
    ReadOnlyBufferError,
    UnsupportedOperationError,
)

SIZE = (1 << 20) + 3000


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return random_file(tmp_path_factory, "batch", SIZE, seed=3)




@pytest.mark.parametrize("policy", ["auto", "always", "never"])
@pytest.mark.parametrize("cold", [True, False])
def test_aligned_random_reads_match_and_are_counted(data_file, policy, cold):
    path, data = data_file
    if cold:
        drop_cache(path)
    rng = np.random.default_rng(7)
    offsets = (rng.integers(0, SIZE // 4096 - 1, 200) * 4096).tolist()
    buf = aligned_array(200 * 4096)
    lat: list[int] = []
    before = gdskit.stats()
    with gdskit.settings.set(mode="host", odirect=policy), gdskit.open(path) as f:
        counts = f.read_batch(buf, offsets, 4096, latencies_ns=lat)
    delta = gdskit.stats() - before
    assert counts == [4096] * 200 and len(lat) == 200 and all(t > 0 for t in lat)
    for i, off in enumerate(offsets):
        assert bytes(buf[i * 4096:(i + 1) * 4096]) == data[off:off + 4096]
    host = delta.paths["host"]
    assert host.bytes_read == 200 * 4096 and host.requests == 200


def test_unaligned_places_and_the_end_of_the_file(data_file):
    path, data = data_file
    buf = np.zeros(5 * 5000 + 7, dtype=np.uint8)
    offsets = [1, 4097, SIZE - 100, SIZE + 10, 12345]
    places = [7, 5007, 10007, 15007, 20007]
    with gdskit.settings.set(mode="host", odirect="always"), gdskit.open(path) as f:
        counts = f.read_batch(buf, offsets, 5000, places)
    assert counts == [5000, 5000, 100, 0, 5000]
    for off, bo, n in zip(offsets, places, counts):
        assert bytes(buf[bo:bo + n]) == data[off:off + n]


@hsettings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(0, 70_000), offsets=st.lists(st.integers(0, SIZE + 5000), max_size=12),
       policy=st.sampled_from(["auto", "always", "never"]))
def test_any_batch_reads_what_plain_reads_read(data_file, size, offsets, policy):
    path, data = data_file
    buf = np.zeros(max(1, size * len(offsets)), dtype=np.uint8)
    with gdskit.settings.set(mode="host", odirect=policy), gdskit.open(path) as f:
        counts = f.read_batch(buf, np.array(offsets, dtype=np.int64), size)
    for i, (off, n) in enumerate(zip(offsets, counts)):
        want = data[off:off + size]
        assert n == len(want) and bytes(buf[i * size:i * size + n]) == want


def test_bad_arguments_get_clear_errors(data_file, tmp_path):
    path, _ = data_file
    buf = np.zeros(8192, dtype=np.uint8)
    with gdskit.open(path) as f:
        with pytest.raises(InvalidArgumentError):
            f.read_batch(buf, [0, 4096], 4096, [0])
        with pytest.raises(InvalidArgumentError):
            f.read_batch(buf, [0, -4096], 4096)
        with pytest.raises(InvalidArgumentError):
            f.read_batch(buf, [True], 4096)
        with pytest.raises(InvalidArgumentError):
            f.read_batch(buf, [0.5], 4096)
        with pytest.raises(BufferTooSmallError):
            f.read_batch(buf, [0, 4096, 8192], 4096)
        ro = np.zeros(4096, dtype=np.uint8)
        ro.flags.writeable = False
        with pytest.raises(ReadOnlyBufferError):
            f.read_batch(ro, [0], 4096)
        assert f.read_batch(buf, [], 4096) == [] and f.read_batch(buf, [0, 5], 0) == [0, 0]
    with pytest.raises(ClosedFileError):
        f.read_batch(buf, [0], 4096)
    with gdskit.open(tmp_path / "w.bin", "w") as w, pytest.raises(UnsupportedOperationError):
        w.read_batch(buf, [0], 4096)


@pytest.mark.parametrize("policy", ["auto", "always", "never"])
def test_a_failing_read_raises_the_io_error_not_a_count(data_file, monkeypatch, policy):
    import errno
    import os

    from gdskit.errors import GdskitError

    path, _ = data_file
    buf = aligned_array(3 * 4096)
    real = os.preadv
    calls = []

    def failing(fd, iov, off, *flags):
        calls.append(off)
        if off == 4096:
            raise OSError(errno.EIO, "injected I/O error")
        return real(fd, iov, off, *flags)

    with gdskit.settings.set(mode="host", odirect=policy), gdskit.open(path) as f:
        monkeypatch.setattr(os, "preadv", failing)
        with pytest.raises(GdskitError) as info:
            f.read_batch(buf, [0, 4096, 8192], 4096)
    assert isinstance(info.value, OSError) and info.value.errno == errno.EIO
    assert 4096 in calls


@pytest.mark.parametrize("policy", ["always", "never"])
@pytest.mark.parametrize("timed", [True, False])
def test_one_place_for_every_read(data_file, policy, timed):
    """A benchmark's pattern: every read into the same place. A short read at the end of the
    file in the middle of the batch is counted as such, and the reads after it still happen."""
    path, data = data_file
    buf = aligned_array(4096)
    offsets = [0, 8192, SIZE - 1000, 4096, 12288]
    lat: list[int] | None = [] if timed else None
    with gdskit.settings.set(mode="host", odirect=policy), gdskit.open(path) as f:
        counts = f.read_batch(buf, offsets, 4096, [0] * 5, latencies_ns=lat)
        assert counts == [4096, 4096, 1000, 4096, 4096]
        assert bytes(buf) == data[12288:12288 + 4096]  # the last read's bytes
        assert lat is None or len(lat) == 5
        assert f.read_batch(buf, [SIZE - 1000], 4096, [0]) == [1000]
        assert bytes(buf[:1000]) == data[SIZE - 1000:]


@pytest.mark.parametrize("unaligned", [False, True])
def test_a_cached_batch_under_auto_asks_the_page_cache_a_few_times_not_once_per_read(data_file, monkeypatch,
                                                                                       unaligned):
    # Asking the page cache about every 4 KiB read cost more than the read itself (token
    # windows: ~4 µs of interpreter time each); a batch whose sampled reads are all cached is read
    # buffered in the tight loop.
    from gdskit.engine.backends import staged

    path, data = data_file
    with open(path, "rb") as fh:
        fh.read()
    size = 4098 if unaligned else 4096
    rng = np.random.default_rng(11)
    offsets = (rng.integers(0, (SIZE - size) // 4096, 300) * 4096 + (2 if unaligned else 0)).tolist()
    asked = []
    real = staged.file_residency
    monkeypatch.setattr(staged, "file_residency", lambda f, pos, n: asked.append(pos) or real(f, pos, n))
    buf = aligned_array(300 * size)
    before = gdskit.stats()
    with gdskit.settings.set(mode="host", odirect="auto"), gdskit.open(path) as f:
        assert f.read_batch(buf, offsets, size) == [size] * 300
    delta = gdskit.stats() - before
    for i, off in enumerate(offsets):
        assert bytes(buf[i * size:(i + 1) * size]) == data[off:off + size]
    assert 1 <= len(asked) <= 3
    assert delta.paths["host"].requests == 300 and delta.paths["host"].bytes_read == 300 * size


@pytest.mark.parametrize("last_answer", ["none", "unknown"])
def test_a_partly_cached_batch_is_read_buffered_at_once_and_an_unknown_one_read_by_read(data_file, monkeypatch,
                                                                                       last_answer):
    # Read by read, the uncached reads of a partly cached batch were O_DIRECT reads through a
    # stage, each waited for before the next: 4-5x slower for token windows. Where the kernel
    # cannot say what it holds, each read still decides alone.
    from gdskit.engine.backends import staged
    from gdskit.engine.residency import Residency

    path, data = data_file
    offsets = [4096 * k for k in range(0, 200, 2)]
    asked = []
    odd = Residency.NONE if last_answer == "none" else None
    monkeypatch.setattr(staged, "file_residency",
                        lambda f, pos, n: asked.append(pos) or (odd if pos == offsets[-1] else Residency.ALL))
    buf = aligned_array(len(offsets) * 4096)
    with gdskit.settings.set(mode="host", odirect="auto"), gdskit.open(path) as f:
        assert f.read_batch(buf, offsets, 4096) == [4096] * len(offsets)
    for i, off in enumerate(offsets):
        assert bytes(buf[i * 4096:(i + 1) * 4096]) == data[off:off + 4096]
    if last_answer == "none":
        assert len(asked) <= 3, "one decision for the batch"
    else:
        assert len(asked) >= len(offsets), "each read asked on its own"
