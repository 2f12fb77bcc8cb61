"""The conformance suite on the host path (runs everywhere)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from backend_conformance import BackendTests, aligned_array, drop_cache

import gdskit


class TestHostBackendNumpy(BackendTests):
    settings_overrides = {"mode": "auto", "chunk_size": "256KiB"}
    expected_paths = {"host"}

    def make_buffer(self, nbytes):
        return np.empty(nbytes, dtype=np.uint8)

    def buffer_bytes(self, buf):
        return buf.tobytes()

    def fill_buffer(self, buf, data):
        buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)


class TestHostBackendBytearray(TestHostBackendNumpy):
    settings_overrides = {"mode": "host", "threads": 3, "chunk_size": "64KiB"}

    def make_buffer(self, nbytes):
        return bytearray(nbytes)

    def buffer_bytes(self, buf):
        return bytes(buf)

    def fill_buffer(self, buf, data):
        buf[: len(data)] = data



@pytest.fixture
def small_io_file(tmp_path):
    data = np.random.default_rng(11).integers(0, 256, (1 << 20) + 1000, dtype=np.uint8).tobytes()
    path = tmp_path / "small-io.bin"
    path.write_bytes(data)
    return str(path), data



@pytest.mark.parametrize("policy", ["auto", "always", "never"])
@pytest.mark.parametrize("size", [4096, 16384, 65536])
def test_small_aligned_reads_cold_hot_and_at_the_end(small_io_file, policy, size):
    path, data = small_io_file
    drop_cache(path)
    buf = aligned_array(size)
    with gdskit.settings.set(mode="host", odirect=policy), gdskit.open(path) as f:
        for off in (0, 8 * size, 0, len(data) - len(data) % 4096, len(data) - len(data) % 4096 - size):
            n = f.read(buf, size, off)
            want = data[off:off + size]
            assert n == len(want) and bytes(buf[:n]) == want, (policy, size, off)


def _residency(path: str, nbytes: int):
    """The file's page-cache residency, by ``cachestat`` or else ``mincore`` (which every Linux has)."""
    from gdskit.engine.residency import new_mapping, residency

    mapping = new_mapping()
    fd = os.open(path, os.O_RDONLY)
    try:
        where = residency(fd, 0, nbytes, mapping)
    finally:
        mapping.close()
        os.close(fd)
    assert where is not None, "neither cachestat nor mincore answered"
    return where


def _dropped(path: str, nbytes: int) -> bool:
    """Drop the file from the page cache; whether it left (tmpfs, for one, keeps every file cached)."""
    from gdskit.engine.residency import Residency

    drop_cache(path)
    return _residency(path, nbytes) is Residency.NONE


def test_small_cold_read_under_auto_leaves_the_page_cache_alone(small_io_file):
    from gdskit.engine.residency import Residency

    path, data = small_io_file
    if not _dropped(path, len(data)):
        pytest.skip("this filesystem keeps the file cached")  # nothing to leave alone
    buf = aligned_array(4096)
    with gdskit.settings.set(mode="host", odirect="auto"), gdskit.open(path) as f:
        assert f.read(buf, 4096, 256 << 10) == 4096
    assert bytes(buf) == data[256 << 10:(256 << 10) + 4096]
    # O_DIRECT, and no readahead started around it.
    assert _residency(path, len(data)) is Residency.NONE


def test_small_read_of_a_partly_cached_range(small_io_file):
    path, data = small_io_file
    drop_cache(path)
    with open(path, "rb") as fh:  # cache the first page only
        fh.read(4096)
    buf = aligned_array(16384)
    with gdskit.settings.set(mode="host", odirect="auto"), gdskit.open(path) as f:
        assert f.read(buf, 16384, 0) == 16384
    assert bytes(buf) == data[:16384]


@pytest.mark.parametrize("how", ["read", "read_batch"])
def test_a_small_unaligned_miss_asks_the_page_cache_once(small_io_file, monkeypatch, how):
    """The one-call check asks for the range's residency; the general path it hands over to uses
    that answer instead of asking again."""
    from gdskit.engine.backends import staged
    from gdskit.engine.residency import Residency

    path, data = small_io_file
    asked = []

    def not_cached(f, pos, n):
        asked.append((pos, n))
        return Residency.NONE

    monkeypatch.setattr(staged, "file_residency", not_cached)  # where every CPU-path read asks
    buf = bytearray(1000)
    with gdskit.settings.set(mode="host", odirect="auto"), gdskit.open(path) as f:
        if how == "read":
            assert f.read(buf, 1000, 4097) == 1000
        else:
            assert f.read_batch(buf, [4097], 1000, [0]) == [1000]
    assert bytes(buf) == data[4097:5097]
    assert asked == [(4097, 1000)]


def test_a_forked_child_reads_through_the_lanes_it_inherited(small_io_file):
    """Host stages stay mapped in a forked child (a data-loader worker): an unaligned O_DIRECT
    read there goes through a stage made before the fork."""
    path, data = small_io_file
    with gdskit.settings.set(mode="host", odirect="always"), gdskit.open(path) as f:
        buf = bytearray(5000)
        assert f.read(buf, 5000, 4097) == 5000  # makes (and keeps) a lane with a stage
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            ok = 0
            try:
                out = bytearray(5000)
                ok = int(f.read(out, 5000, 8193) == 5000 and bytes(out) == data[8193:13193])
            finally:
                os.write(w, bytes([ok]))
                os._exit(0)
        os.close(w)
        got = os.read(r, 1)
        os.close(r)
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and got == b"\x01", (status, got)


def test_cached_says_whether_the_page_cache_holds_a_range(small_io_file):
    from gdskit.errors import ClosedFileError, InvalidArgumentError

    path, data = small_io_file
    evictable = _dropped(path, len(data))
    with gdskit.open(path) as f:
        if evictable:
            assert not f.cached() and not f.cached(8192, 4096)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past what is read
            os.pread(fd, 65536, 0)  # the first 64 KiB only
        finally:
            os.close(fd)
        assert f.cached(0, 65536) and f.cached(4096, 100)
        if evictable:
            assert not f.cached(), "the rest of the file was never read"
        with open(path, "rb") as fh:
            fh.read()
        assert f.cached() and f.cached(len(data) - 10) and f.cached(0, 0)
        with pytest.raises(InvalidArgumentError):
            f.cached(-1)
    with pytest.raises(ClosedFileError):
        f.cached()


def _o_direct_opens(monkeypatch) -> list[str]:
    """Every O_DIRECT open from now on, by path."""
    seen: list[str] = []
    real = os.open

    def counting(path, flags, *a, **k):
        if flags & getattr(os, "O_DIRECT", 0):
            seen.append(str(path))
        return real(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", counting)
    return seen


def test_a_cached_file_read_under_auto_never_opens_an_o_direct_descriptor(tmp_path, monkeypatch):
    """Many small files read hot (a dataset's preload): a second descriptor per file would cost
    an open and a close each, for reads the page cache serves."""
    from gdskit.engine.many_files import FileReads, read_files

    rng = np.random.default_rng(3)
    files = []
    for i in range(20):
        data = rng.integers(0, 256, 65536 + 128, dtype=np.uint8).tobytes()
        (tmp_path / f"f{i}.npy").write_bytes(data)
        files.append((str(tmp_path / f"f{i}.npy"), data))
    for p, _ in files:
        with open(p, "rb") as fh:
            fh.read()  # in the page cache now
    if _residency(files[0][0], len(files[0][1])).name != "ALL":
        pytest.skip("this filesystem does not say what it caches")
    opened = _o_direct_opens(monkeypatch)
    bufs = [bytearray(len(d)) for _p, d in files]
    with gdskit.settings.set(mode="host", odirect="auto", threads=3):
        counts = read_files([FileReads(p, [(b, len(d), 0, 0)]) for (p, d), b in zip(files, bufs)])
        with gdskit.open(files[0][0]) as f:
            buf = aligned_array(65536)
            assert f.read(buf, 65536, 0) == 65536
            batch = aligned_array(16 * 4096)
            assert f.read_batch(batch, [k * 4096 for k in range(16)], 4096) == [4096] * 16
    assert bytes(batch) == files[0][1][:16 * 4096]
    assert counts == [[len(d)] for _p, d in files]
    assert all(bytes(b) == d for b, (_p, d) in zip(bufs, files))
    assert bytes(buf) == files[0][1][:65536]
    assert opened == []


@pytest.mark.parametrize("how", ["read", "read_batch"])
def test_a_cold_file_under_auto_still_reads_with_o_direct(small_io_file, monkeypatch, how):
    from gdskit.engine.residency import Residency

    path, data = small_io_file
    if not _dropped(path, len(data)):
        pytest.skip("this filesystem keeps the file cached")
    opened = _o_direct_opens(monkeypatch)
    buf = aligned_array(65536)
    with gdskit.settings.set(mode="host", odirect="auto"), gdskit.open(path) as f:
        if how == "read":
            assert f.read(buf, 65536, 128 << 10) == 65536
        else:
            assert f.read_batch(buf, [(128 << 10) + k * 4096 for k in range(16)], 4096) == [4096] * 16
    assert bytes(buf) == data[128 << 10:(128 << 10) + 65536]
    assert len(opened) == 1
    assert _residency(path, len(data)) is Residency.NONE  # read past the page cache
