"""``File.read_many`` / ``File.pread_many``: many reads as one job give what reads one by one give."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from data_files import random_file

import gdskit
from gdskit.engine import cuda
from gdskit.errors import BufferTooSmallError, GdskitError, InvalidArgumentError, ReadOnlyBufferError, \
    UnsupportedOperationError

SIZE = (3 << 20) + 1234


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return random_file(tmp_path_factory, "many", SIZE, seed=1)


def test_host_buffers_get_the_bytes_and_counts_are_short_only_at_the_end(data_file):
    path, data = data_file
    reads = [(bytearray(5000), 5000, 0), (np.zeros(70_000, np.uint8), 65_536, 4096, 100),
             (bytearray(9000), 9000, SIZE - 3000), (bytearray(10), 10, SIZE + 5), (bytearray(4), 0, 7)]
    with gdskit.open(path) as f:
        counts = f.read_many(reads)
    assert counts == [5000, 65_536, 3000, 0, 0]
    assert bytes(reads[0][0]) == data[:5000]
    assert reads[1][0][100:100 + 65_536].tobytes() == data[4096:4096 + 65_536]
    assert bytes(reads[2][0][:3000]) == data[SIZE - 3000:]


def test_nothing_to_read_is_an_empty_list(data_file):
    with gdskit.open(data_file[0]) as f:
        assert f.read_many([]) == []
        assert f.pread_many(iter([])).result() == []


@pytest.mark.parametrize("bad, error", [
    ([(bytearray(10), 10)], InvalidArgumentError),                 # too short an item
    ([[bytearray(10), 10, 0]], InvalidArgumentError),              # not a tuple
    ([(bytearray(10), None, 0)], InvalidArgumentError),            # size must be given
    ([(bytearray(10), 11, 0)], BufferTooSmallError),
    ([(bytearray(10), 10, -1)], InvalidArgumentError),
    ([(bytes(10), 10, 0)], ReadOnlyBufferError),
])
def test_bad_items_fail_before_anything_is_read(data_file, bad, error):
    path, _ = data_file
    first = bytearray(100)
    with gdskit.open(path) as f:
        with pytest.raises(error) as info:
            f.read_many([(first, 100, 0)] + bad)
        with pytest.raises(error):
            f.pread_many(bad)
    assert isinstance(info.value, GdskitError)
    assert first == bytearray(100)  # validation comes before any read


def test_write_only_file_refuses(tmp_path):
    with gdskit.open(str(tmp_path / "w.bin"), "w") as f, pytest.raises(UnsupportedOperationError):
        f.read_many([(bytearray(4), 4, 0)])


def _overlap_meter(monkeypatch, cls, method) -> dict[str, int]:
    """Wrap ``cls.method`` (a backend's per-piece work) to measure how many calls run at once.

    Each call waits (up to 2 s) for a second one to be running too, so a job that runs its
    pieces side by side shows 2 however fast the pieces are, and one that runs them one
    after another shows 1 (after the waits) instead of hanging."""
    import threading
    cond = threading.Condition()
    meter = {"now": 0, "max": 0}
    original = getattr(cls, method)

    def spy(*a, **k):
        with cond:
            meter["now"] += 1
            meter["max"] = max(meter["max"], meter["now"])
            cond.notify_all()
            cond.wait_for(lambda: meter["max"] >= 2, timeout=2.0)
        try:
            return original(*a, **k)
        finally:
            with cond:
                meter["now"] -= 1

    monkeypatch.setattr(cls, method, spy)
    return meter


def test_host_items_of_one_job_are_read_side_by_side_and_reported_piece_by_piece(data_file, monkeypatch):
    """Items that are one chunk each still share the workers (read one after another, each
    would run alone), and ``on_bytes`` adds up to every byte read."""
    from gdskit.engine.backends.host import HostBackend
    path, data = data_file
    overlap = _overlap_meter(monkeypatch, HostBackend, "_read_chunk")
    offsets = [i * 262_144 + 17 for i in range(8)]
    bufs = [bytearray(200_000) for _ in offsets]
    pieces: list[int] = []
    with gdskit.settings.set(chunk_size="256KiB", threads=4), gdskit.open(path) as f:
        counts = f.read_many([(b, 200_000, off) for b, off in zip(bufs, offsets)], on_bytes=pieces.append)
    assert counts == [200_000] * 8
    assert all(bytes(b) == data[off:off + 200_000] for b, off in zip(bufs, offsets))
    assert sum(pieces) == 8 * 200_000 and len(pieces) >= 8
    assert overlap["max"] >= 2


@pytest.mark.stand_in_gpu
class TestOnStandInGpu:
    """Device buffers through the bounce path's single job (tests/stand_ins/fake_cuda.py; CI has no GPU)."""

    @pytest.mark.parametrize("mode", ["bounce", "auto"])
    def test_device_reads_match_plain_reads_and_are_recorded_per_request(self, data_file, mode):
        path, data = data_file
        spans = [(0, 1 << 20), (1 << 20, 700_001), (5, 300_000), (SIZE - 4096, 8192), (2 << 20, 1 << 20)]
        bufs = [cuda.DeviceArray(n) for _, n in spans]
        before = gdskit.stats()
        with gdskit.settings.set(mode=mode, chunk_size="256KiB", threads=3, pinned_budget="1MiB"), \
                gdskit.open(path) as f:
            counts = f.pread_many([(b, n, off) for b, (off, n) in zip(bufs, spans)]).result()
        want = [len(data[off:off + n]) for off, n in spans]
        assert counts == want
        for b, (off, n), got in zip(bufs, spans, counts):
            assert b.to_numpy().tobytes()[:got] == data[off:off + got]
        delta = gdskit.stats() - before
        assert set(delta.paths) <= {"bounce-cached", "bounce-direct"}
        assert delta.bytes_read == sum(want)
        assert gdskit.resources().pinned_bytes <= 1 << 20

    def test_mixed_host_and_device_items(self, data_file):
        path, data = data_file
        dev = cuda.DeviceArray(1 << 20)
        host = bytearray(1 << 20)
        with gdskit.settings.set(mode="bounce", chunk_size="256KiB"), gdskit.open(path) as f:
            assert f.read_many([(dev, 1 << 20, 4096), (host, 1 << 20, 8192, 0)]) == [1 << 20, 1 << 20]
        assert dev.to_numpy().tobytes() == data[4096:4096 + (1 << 20)]
        assert bytes(host) == data[8192:8192 + (1 << 20)]

    @hsettings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(spans=st.lists(st.tuples(st.integers(0, SIZE + 10), st.integers(0, 600_000)), min_size=1, max_size=8))
    def test_any_set_of_device_reads(self, data_file, spans):
        path, data = data_file
        bufs = [cuda.DeviceArray(max(n, 1)) for _, n in spans]
        with gdskit.settings.set(mode="bounce", chunk_size="64KiB", threads=4, pinned_budget="1MiB"), \
                gdskit.open(path) as f:
            counts = f.read_many([(b, n, off) for b, (off, n) in zip(bufs, spans)])
        for b, (off, n), got in zip(bufs, spans, counts):
            assert got == len(data[off:off + n])
            assert b.to_numpy().tobytes()[:got] == data[off:off + got]

    def test_on_bytes_adds_up_on_the_bounce_ring(self, data_file):
        path, data = data_file
        bufs = [cuda.DeviceArray(1 << 20) for _ in range(3)]
        pieces: list[int] = []
        with gdskit.settings.set(mode="bounce", chunk_size="256KiB", threads=3), gdskit.open(path) as f:
            counts = f.pread_many([(b, 1 << 20, i << 20) for i, b in enumerate(bufs)], on_bytes=pieces.append).result()
        assert counts == [1 << 20] * 3 and sum(pieces) == 3 << 20 and len(pieces) == 12
        assert all(b.to_numpy().tobytes() == data[i << 20:(i + 1) << 20] for i, b in enumerate(bufs))

    def test_cufile_items_of_one_job_are_read_side_by_side(self, data_file, compat_cufile, monkeypatch):
        """cuFile reads of several items share the workers: with one chunk per item, reading
        them one after another would run each alone."""
        path, data = data_file
        overlap = _overlap_meter(monkeypatch, type(compat_cufile), "read")
        bufs = [cuda.DeviceArray(1 << 20) for _ in range(3)]
        pieces: list[int] = []
        before = gdskit.stats()
        with gdskit.settings.set(mode="cufile", chunk_size="1MiB", threads=3), gdskit.open(path) as f:
            counts = f.read_many([(b, 1 << 20, i << 20) for i, b in enumerate(bufs)], on_bytes=pieces.append)
        assert counts == [1 << 20] * 3 and sum(pieces) == 3 << 20
        assert all(b.to_numpy().tobytes() == data[i << 20:(i + 1) << 20] for i, b in enumerate(bufs))
        assert overlap["max"] >= 2
        delta = gdskit.stats() - before
        assert set(delta.paths) == {"cufile-compat"} and delta.bytes_read == 3 << 20


@pytest.mark.gpu
def test_gpu_device_reads_match(data_file):
    path, data = data_file
    spans = [(0, 1 << 20), (1 << 20, 700_001), (5, 300_000), (SIZE - 4096, 8192)]
    bufs = [cuda.DeviceArray(n) for _, n in spans]
    with gdskit.settings.set(mode="bounce"), gdskit.open(path) as f:
        counts = f.read_many([(b, n, off) for b, (off, n) in zip(bufs, spans)])
    for b, (off, n), got in zip(bufs, spans, counts):
        assert got == len(data[off:off + n])
        assert b.to_numpy().tobytes()[:got] == data[off:off + got]

