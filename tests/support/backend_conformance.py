"""One conformance suite for every path. Subclass ``BackendTests`` per backend.

A subclass says how to make a buffer of that backend's memory kind, how to read
it back as bytes, which settings force its path, and which ledger paths its
bytes may be recorded under.
"""

from __future__ import annotations

import os
import threading
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from data_files import random_file

import gdskit

_HSET = hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.differing_executors])


def aligned_array(nbytes: int) -> np.ndarray:
    """A zeroed uint8 numpy array whose data starts on a 4 KiB boundary (as O_DIRECT needs)."""
    raw = np.zeros(nbytes + 4096, dtype=np.uint8)
    start = (-raw.ctypes.data) % 4096
    return raw[start:start + nbytes]


def drop_cache(path: str) -> None:
    """Evict the file's pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class BackendTests:
    settings_overrides: ClassVar[dict[str, Any]] = {}
    expected_paths: ClassVar[set[str]] = set()

    # -- to be provided by subclasses -----------------------------------
    def make_buffer(self, nbytes: int) -> Any:
        raise NotImplementedError

    def buffer_bytes(self, buf: Any) -> bytes:
        raise NotImplementedError

    def fill_buffer(self, buf: Any, data: bytes) -> None:
        raise NotImplementedError

    # -- helpers ----------------------------------------------------------
    @pytest.fixture(autouse=True)
    def _forced_settings(self):
        with gdskit.settings.set(**self.settings_overrides):
            yield

    @pytest.fixture(scope="class")
    @classmethod
    def data_file(cls, tmp_path_factory):
        return random_file(tmp_path_factory, "conf", 3 * 2**20 + 12345, seed=1234)

    def _read(self, path: str, size: int, file_offset: int, buf_offset: int = 0, extra: int = 0) -> tuple[int, bytes]:
        buf = self.make_buffer(buf_offset + size + extra)
        self.fill_buffer(buf, b"\x5a" * (buf_offset + size + extra))
        with gdskit.open(path) as f:
            n = f.read(buf, size, file_offset, buf_offset)
        return n, self.buffer_bytes(buf)

    # -- the suite --------------------------------------------------------
    def test_whole_file(self, data_file):
        path, data = data_file
        before = gdskit.stats()
        n, got = self._read(path, len(data), 0)
        assert n == len(data)
        assert got == data
        delta = gdskit.stats() - before
        assert delta.bytes_read == len(data)
        assert set(delta.paths) <= self.expected_paths, delta.paths

    @_HSET
    @given(off=st.integers(0, 3 * 2**20 + 12345), size=st.integers(0, 2**20 + 7), boff=st.integers(0, 5000))
    def test_random_ranges(self, data_file, off, size, boff):
        path, data = data_file
        n, got = self._read(path, size, off, boff, extra=3)
        want = data[off:off + size]
        assert n == len(want)
        assert got[boff:boff + n] == want
        assert got[:boff] == b"\x5a" * boff, "bytes before buf_offset were touched"
        assert got[boff + size:] == b"\x5a" * 3, "bytes past the request were touched"

    def test_zero_and_one_byte(self, data_file):
        path, data = data_file
        assert self._read(path, 0, 10)[0] == 0
        n, got = self._read(path, 1, 4097)
        assert n == 1 and got == data[4097:4098]

    def test_short_read_at_eof(self, data_file):
        path, data = data_file
        n, got = self._read(path, 10000, len(data) - 100)
        assert n == 100
        assert got[:100] == data[-100:]
        assert self._read(path, 10, len(data) + 5)[0] == 0

    def test_many_reads_as_one_job(self, data_file):
        """``File.read_many``: every item gets the bytes a plain read gives, the counts are
        short only at the end of the file, and ``on_bytes`` adds up to every byte read."""
        path, data = data_file
        spans = [(0, 1 << 20), (1 << 20, 700_001), (5, 300_000), (len(data) - 4096, 8192), (2 << 20, 1 << 20)]
        bufs = [self.make_buffer(n) for _, n in spans]
        pieces: list[int] = []
        before = gdskit.stats()
        with gdskit.open(path) as f:
            counts = f.read_many([(b, n, off) for b, (off, n) in zip(bufs, spans)], on_bytes=pieces.append)
        want = [len(data[off:off + n]) for off, n in spans]
        assert counts == want and sum(pieces) == sum(want)
        for b, (off, _n), got in zip(bufs, spans, counts):
            assert self.buffer_bytes(b)[:got] == data[off:off + got]
        delta = gdskit.stats() - before
        assert delta.bytes_read == sum(want)
        assert set(delta.paths) <= self.expected_paths, delta.paths

    def test_many_reads_stop_when_on_bytes_raises(self, data_file):
        """An exception from ``on_bytes`` abandons the job: no piece is started after it, the
        pieces under way finish, and the exception reaches the caller. The file stays usable."""
        path, data = data_file

        class Abandon(Exception):
            pass
        calls: list[int] = []

        def on_bytes(n: int) -> None:  # raises once: later calls would be pieces started after it
            calls.append(n)
            if len(calls) == 1:
                raise Abandon

        size = 64 << 10
        spans = [(i * size, size) for i in range(len(data) // size)]  # 48 pieces of one chunk each
        bufs = [self.make_buffer(size) for _ in spans]
        with gdskit.settings.set(chunk_size=size), gdskit.open(path) as f:
            with pytest.raises(Abandon):
                f.read_many([(b, n, off) for b, (off, n) in zip(bufs, spans)], on_bytes=on_bytes)
            # The first call raised; each other worker may finish the piece it holds, no more.
            assert 1 <= len(calls) <= min(gdskit.settings.threads, len(spans) - 1)
            again = self.make_buffer(1000)
            assert f.read(again, 1000, 5) == 1000 and self.buffer_bytes(again) == data[5:1005]

    @pytest.mark.parametrize("policy", ["auto", "always", "never"])
    def test_odirect_policies_cold_and_hot(self, data_file, policy):
        path, data = data_file
        drop_cache(path)
        with gdskit.settings.set(odirect=policy):
            for _ in range(2):  # cold, then (partly) hot
                n, got = self._read(path, len(data) - 777, 777)
                assert n == len(data) - 777 and got == data[777:]

    def test_many_threads_one_file(self, data_file):
        path, data = data_file
        pieces = [(i * 100_003 % (len(data) - 70_000), 65_537 + i) for i in range(24)]
        with gdskit.open(path) as f:
            bufs = [self.make_buffer(sz) for _, sz in pieces]
            futs = [f.pread(b, sz, off) for b, (off, sz) in zip(bufs, pieces)]
            errors: list[BaseException] = []

            def blocking(off: int, sz: int) -> None:
                try:
                    b = self.make_buffer(sz)
                    assert f.read(b, sz, off) == sz
                    assert self.buffer_bytes(b) == data[off:off + sz]
                except BaseException as exc:  # reported below
                    errors.append(exc)

            threads = [threading.Thread(target=blocking, args=p) for p in pieces[:8]]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors, errors
            for fut, b, (off, sz) in zip(futs, bufs, pieces):
                assert fut.result() == sz
                assert self.buffer_bytes(b) == data[off:off + sz]

    @_HSET
    @given(off=st.integers(0, 2**20), size=st.integers(1, 2**20), boff=st.integers(0, 4099))
    def test_write_then_read_back(self, tmp_path, off, size, boff):
        path = str(tmp_path / "w.bin")
        base = b"\x11" * (off + size + 100)
        with open(path, "wb") as fh:
            fh.write(base)
        payload = np.random.default_rng(off ^ size).integers(0, 256, size, dtype=np.uint8).tobytes()
        buf = self.make_buffer(boff + size)
        self.fill_buffer(buf, b"\0" * boff + payload)
        with gdskit.open(path, "r+") as f:
            assert f.write(buf, size, off, boff) == size
        with open(path, "rb") as fh:
            got = fh.read()
        assert got == base[:off] + payload + base[off + size:]

    @pytest.mark.parametrize("policy", ["auto", "always"])
    def test_write_unaligned_with_policy(self, tmp_path, policy):
        path = str(tmp_path / "u.bin")
        payload = os.urandom(3 * 2**20 + 1001)
        buf = self.make_buffer(len(payload))
        self.fill_buffer(buf, payload)
        with gdskit.settings.set(odirect=policy), gdskit.open(path, "w") as f:
            f.write(buf, file_offset=4095)
        with open(path, "rb") as fh:
            assert fh.read() == b"\0" * 4095 + payload

    def test_sparse_file_past_4gib(self, tmp_path):
        path = str(tmp_path / "sparse.bin")
        off = 5 * 2**30 + 4093
        payload = os.urandom(70_000)
        buf = self.make_buffer(len(payload))
        self.fill_buffer(buf, payload)
        with gdskit.open(path, "w") as f:
            f.write(buf, file_offset=off)
            assert f.size == off + len(payload)
        n, got = self._read(path, len(payload) + 10, off - 10)
        assert n == len(payload) + 10
        assert got == b"\0" * 10 + payload
        with open(path, "rb") as fh:
            fh.seek(off)
            assert fh.read() == payload

    def test_append_mode(self, tmp_path):
        path = str(tmp_path / "a.bin")
        with open(path, "wb") as fh:
            fh.write(b"head")
        parts = [os.urandom(n) for n in (10, 70_000, 3)]
        with gdskit.open(path, "a") as f:
            for p in parts:
                buf = self.make_buffer(len(p))
                self.fill_buffer(buf, p)
                assert f.write(buf) == len(p)
        with open(path, "rb") as fh:
            assert fh.read() == b"head" + b"".join(parts)

    def test_no_lane_left_busy(self, data_file):
        path, data = data_file
        self._read(path, len(data), 0)
        assert gdskit.resources().lanes_busy == 0
        assert gdskit.resources().pinned_bytes <= gdskit.settings.pinned_budget
