"""Scattered reads: one read whose bytes land in several separate device allocations."""

from __future__ import annotations

import ctypes
import os

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from data_files import random_file

import gdskit
from gdskit.engine import cuda
from gdskit.engine.buffers import ScatterList, scattered_device_view
from gdskit.errors import DirectPathUnavailable, InvalidArgumentError, UnsupportedBufferError

SIZE = (2 << 20) + 777


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return random_file(tmp_path_factory, "scatter", SIZE, seed=2)


# -- ScatterList on its own -------------------------------------------------------------------

def test_pieces_split_at_target_edges_and_drop_gaps():
    s = ScatterList([(100, 5000, 50), (0, 1000, 10), (20, 3000, 30)])
    assert s.end == 150
    # Bytes 5..125 of the read: the tail of the first target, a 10-byte gap, all of the
    # second, a 50-byte gap, then the head of the third.
    assert s.pieces(5, 120) == [(1005, 0, 5), (3000, 15, 30), (5000, 95, 25)]
    assert s.pieces(10, 10) == []  # inside a gap
    assert s.pieces(149, 100) == [(5049, 0, 1)]
    assert s.pieces(150, 10) == []


def test_empty_targets_are_ignored_and_overlaps_refused():
    assert ScatterList([(0, 1, 0), (0, 2, 4)]).pieces(0, 4) == [(2, 0, 4)]
    assert ScatterList([]).end == 0
    with pytest.raises(UnsupportedBufferError):
        ScatterList([(0, 1000, 10), (9, 2000, 5)])


@given(sizes=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 60)), min_size=1, max_size=12),
       chunk=st.integers(1, 100))
def test_any_chunking_delivers_every_target_byte_once(sizes, chunk):
    """Read in chunks of any size, the pieces cover each target exactly, in place."""
    targets, pos = [], 0
    for i, (gap, n) in enumerate(sizes):
        pos += gap
        targets.append((pos, (i + 1) * 10_000, n))
        pos += n
    s = ScatterList(targets)
    landed: dict[int, int] = {}  # destination address -> read offset it came from
    for start in range(0, pos, chunk):
        for ptr, skip, n in s.pieces(start, min(chunk, pos - start)):
            for k in range(n):
                assert ptr + k not in landed
                landed[ptr + k] = start + skip + k
    want = {ptr + k: off + k for off, ptr, n in targets for k in range(n)}
    assert landed == want


# -- through the engine, on the stand-in GPU --------------------------------------------------

def _targets(arrays, layout):
    """(offset, array) pairs -> a ScatterList over the arrays' device memory."""
    return ScatterList([(off, a.ptr, a.nbytes) for off, a in zip(layout, arrays)])


def _device_bytes(a) -> bytes:
    return ctypes.string_at(a.ptr, a.nbytes)


@pytest.mark.stand_in_gpu
class TestOnStandInGpu:
    """Scattered reads through the bounce path on the stand-in driver (CI has no GPU)."""

    @pytest.mark.parametrize("mode", ["bounce", "auto"])
    def test_every_target_gets_its_bytes_across_chunk_edges(self, data_file, mode):
        path, data = data_file
        sizes = [70_000, 1, 300_000, 4096, 99_999, 250_000]
        gaps = [0, 13, 0, 5000, 1, 0]
        arrays = [cuda.DeviceArray(n) for n in sizes]
        layout, pos = [], 0
        for g, n in zip(gaps, sizes):
            pos += g
            layout.append(pos)
            pos += n
        base = 12_345
        view = scattered_device_view(_targets(arrays, layout), pos, 0, arrays)
        before = gdskit.stats()
        with gdskit.settings.set(mode=mode, chunk_size="64KiB", threads=3, pinned_budget="1MiB"), \
                gdskit.open(path) as f:
            assert f.read(view, pos, file_offset=base) == pos
        for a, off in zip(arrays, layout):
            assert _device_bytes(a) == data[base + off:base + off + a.nbytes]
        delta = gdskit.stats() - before
        assert set(delta.paths) <= {"bounce-cached", "bounce-direct"} and delta.bytes_read == pos

    @pytest.mark.parametrize("batches", [True, False])
    def test_copies_are_batched_where_the_driver_can_and_one_by_one_where_not(self, data_file, fake_cuda,
                                                                                batches, monkeypatch):
        path, data = data_file
        if not batches:  # a driver older than CUDA 12.8
            monkeypatch.setitem(fake_cuda.fail, "cuMemcpyBatchAsync", fake_cuda.CUresult.CUDA_ERROR_NOT_SUPPORTED)
        with cuda.use_driver(fake_cuda):  # the driver afresh: batching not tried yet
            assert cuda.copies_batched() is None
            arrays = [cuda.DeviceArray(1000) for _ in range(40)]
            view = scattered_device_view(_targets(arrays, range(0, 80_000, 2000)), 80_000, 0, arrays)
            before = dict(fake_cuda.calls)
            with gdskit.settings.set(mode="bounce", chunk_size="64KiB", threads=2), gdskit.open(path) as f:
                assert f.read(view, 80_000) == 80_000
            assert all(_device_bytes(a) == data[i * 2000:i * 2000 + 1000] for i, a in enumerate(arrays))
            assert cuda.copies_batched() is batches
        calls = {k: v - before.get(k, 0) for k, v in fake_cuda.calls.items()}
        # A batch per chunk, or (after one refused batch) a call per copy.
        if batches:
            assert calls["cuMemcpyBatchAsync"] >= 2 and calls.get("cuMemcpyHtoDAsync", 0) == 0
        else:
            assert calls["cuMemcpyBatchAsync"] == 1 and calls["cuMemcpyHtoDAsync"] == 40

    @pytest.mark.parametrize("held", [True, False])
    def test_a_hot_scattered_job_takes_few_workers_and_a_cold_one_all(self, data_file, monkeypatch, held):
        from gdskit.engine.backends import bounce
        from gdskit.engine.residency import Residency

        path, data = data_file
        monkeypatch.setattr(bounce, "file_residency", lambda *a: Residency.ALL if held else Residency.SOME)
        asked: list[int] = []
        real = bounce.run_requests
        monkeypatch.setattr(bounce, "run_requests", lambda *a, **k: asked.append(k["max_lanes"]) or real(*a, **k))
        arrays = [cuda.DeviceArray(4000) for _ in range(100)]
        view = scattered_device_view(_targets(arrays, range(0, 1_000_000, 10_000)), 1_000_000, 0, arrays)
        with gdskit.settings.set(mode="bounce", chunk_size="64KiB", threads=8), gdskit.open(path) as f:
            assert f.read(view, 1_000_000) == 1_000_000
            assert f.read(cuda.DeviceArray(1_000_000), 1_000_000) == 1_000_000  # not scattered: every worker
        assert all(_device_bytes(a) == data[i * 10_000:i * 10_000 + 4000] for i, a in enumerate(arrays))
        assert asked == [bounce.SCATTERED_HOT_WORKERS if held else 8, 8]

    @pytest.mark.parametrize("told", [True, False])
    def test_the_callers_answer_about_the_page_cache_stands(self, data_file, monkeypatch, told):
        # A loader asks once whether the page cache holds all its groups and says so in each
        # scattered view: the engine takes that answer for every job instead of asking again.
        from gdskit.engine.backends import bounce

        path, data = data_file
        asked_cache: list[tuple[int, int]] = []
        real_residency = bounce.file_residency
        monkeypatch.setattr(bounce, "file_residency",
                            lambda f, pos, n: asked_cache.append((pos, n)) or real_residency(f, pos, n))
        lanes: list[int] = []
        real = bounce.run_requests
        monkeypatch.setattr(bounce, "run_requests", lambda *a, **k: lanes.append(k["max_lanes"]) or real(*a, **k))
        arrays = [cuda.DeviceArray(4000) for _ in range(100)]
        view = scattered_device_view(_targets(arrays, range(0, 1_000_000, 10_000)), 1_000_000, 0, arrays,
                                     source_cached=told)
        with gdskit.settings.set(mode="bounce", chunk_size="64KiB", threads=8), gdskit.open(path) as f:
            assert f.read(view, 1_000_000) == 1_000_000
        assert all(_device_bytes(a) == data[i * 10_000:i * 10_000 + 4000] for i, a in enumerate(arrays))
        assert lanes == [bounce.SCATTERED_HOT_WORKERS if told else 8]
        assert asked_cache == []  # the job's bytes are not asked about again, held or not

    @pytest.mark.parametrize("told", [True, None])
    def test_chunks_of_a_job_told_cached_are_not_asked_about(self, data_file, monkeypatch, told):
        # The loader's answer covers every chunk: the O_DIRECT policy does not ask the page cache
        # again for each (a system call a chunk); a job told nothing is asked about chunk by chunk.
        from gdskit.engine.backends import staged

        path, data = data_file
        asked: list[tuple[int, int]] = []
        real = staged.file_residency
        monkeypatch.setattr(staged, "file_residency", lambda f, pos, n: asked.append((pos, n)) or real(f, pos, n))
        arrays = [cuda.DeviceArray(4000) for _ in range(100)]
        view = scattered_device_view(_targets(arrays, range(0, 1_000_000, 10_000)), 1_000_000, 0, arrays,
                                     source_cached=told)
        with gdskit.settings.set(mode="bounce", chunk_size="64KiB", threads=8, odirect="auto"), \
                gdskit.open(path) as f:
            assert f.read(view, 1_000_000) == 1_000_000
        assert all(_device_bytes(a) == data[i * 10_000:i * 10_000 + 4000] for i, a in enumerate(arrays))
        chunks_asked = [q for q in asked if q[1] <= 64 * 1024]
        assert (chunks_asked == []) if told else len(chunks_asked) >= 1_000_000 // (64 * 1024)

    @pytest.mark.parametrize("busy", [True, None, False])
    def test_a_hot_job_whose_caller_only_waits_gets_every_worker(self, data_file, monkeypatch, busy):
        # Few workers serve a cached scattered job only while its caller makes destinations beside
        # it (the interpreter is shared); a caller that made them all first (load_into) gets all.
        from gdskit.engine.backends import bounce

        path, data = data_file
        lanes: list[int] = []
        real = bounce.run_requests
        monkeypatch.setattr(bounce, "run_requests", lambda *a, **k: lanes.append(k["max_lanes"]) or real(*a, **k))
        arrays = [cuda.DeviceArray(4000) for _ in range(100)]
        view = scattered_device_view(_targets(arrays, range(0, 1_000_000, 10_000)), 1_000_000, 0, arrays,
                                     source_cached=True, caller_busy=busy)
        with gdskit.settings.set(mode="bounce", chunk_size="64KiB", threads=8), gdskit.open(path) as f:
            assert f.read(view, 1_000_000) == 1_000_000
        assert all(_device_bytes(a) == data[i * 10_000:i * 10_000 + 4000] for i, a in enumerate(arrays))
        assert lanes == [8 if busy is False else bounce.SCATTERED_HOT_WORKERS]

    def test_short_at_end_of_file_and_later_targets_untouched(self, data_file):
        path, data = data_file
        arrays = [cuda.DeviceArray(1000), cuda.DeviceArray(1000)]
        for a in arrays:
            ctypes.memset(a.ptr, 0xAB, a.nbytes)
        view = scattered_device_view(_targets(arrays, [0, 1500]), 2500, 0, arrays)
        with gdskit.settings.set(mode="bounce", chunk_size="64KiB"), gdskit.open(path) as f:
            assert f.pread(view, 2500, file_offset=SIZE - 1200).result() == 1200
        assert _device_bytes(arrays[0]) == data[SIZE - 1200:SIZE - 200]
        assert _device_bytes(arrays[1]) == b"\xab" * 1000

    def test_misuse_is_refused(self, data_file):
        path, _ = data_file
        arrays = [cuda.DeviceArray(100)]
        with pytest.raises(UnsupportedBufferError):
            scattered_device_view(_targets(arrays, [50]), 100, 0, arrays)  # runs past the read
        view = scattered_device_view(_targets(arrays, [0]), 100, 0, arrays)
        with gdskit.settings.set(mode="cufile"), gdskit.open(path) as f:
            with pytest.raises(DirectPathUnavailable):
                f.read(view, 100)
        with gdskit.open(os.path.join(os.path.dirname(path), "out.bin"), "w") as f:
            with pytest.raises(InvalidArgumentError):
                f.write(view, 100)


# -- on a real GPU ----------------------------------------------------------------------------

@pytest.mark.gpu
@hsettings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 200_000)), min_size=1, max_size=20))
def test_gpu_scattered_reads_match_plain_reads(data_file, sizes):
    path, data = data_file
    arrays, layout, pos = [], [], 0
    for gap, n in sizes:
        pos += gap
        layout.append(pos)
        arrays.append(cuda.DeviceArray(n))
        pos += n
    pos = min(pos, SIZE)
    keep = [(a, off) for a, off in zip(arrays, layout) if off + a.nbytes <= pos]
    view = scattered_device_view(ScatterList([(off, a.ptr, a.nbytes) for a, off in keep]), pos, 0, arrays)
    with gdskit.settings.set(mode="bounce", chunk_size="128KiB"), gdskit.open(path) as f:
        assert f.read(view, pos) == pos
    for a, off in keep:
        assert a.to_numpy().tobytes() == data[off:off + a.nbytes]


# -- the loaders' group reads (gdskit.formats.torch_io), on the stand-in GPU --------------------

class _StandInTensor:
    """What _scatter_groups needs of a destination tensor: its device address."""

    def __init__(self, nbytes: int) -> None:
        self.array = cuda.DeviceArray(max(nbytes, 1))

    def data_ptr(self) -> int:
        return self.array.ptr


@pytest.mark.stand_in_gpu
@pytest.mark.torch
class TestLoaderGroupsOnStandInGpu:
    """torch_io's scattered group reads, batch by batch, with the engine on the stand-in driver."""

    def _groups(self, spans):
        from gdskit.formats import read_plan
        extents = [read_plan.Extent(f"t{i}", off, n) for i, (off, n) in enumerate(spans)]
        return read_plan.plan(extents, small=1 << 20, max_group=256 << 10, max_gap=64).groups

    def _run(self, path, groups, monkeypatch, batch_bytes, jobs_at_once=1 << 20):
        pytest.importorskip("torch")
        from gdskit.formats import torch_io
        monkeypatch.setattr(torch_io, "SCATTER_BATCH_BYTES", batch_bytes)
        made: dict[str, _StandInTensor] = {}
        pieces: list[int] = []

        def dest_for(e):
            made[e.key] = _StandInTensor(e.nbytes)
            return made[e.key]

        futures: list = []
        with gdskit.settings.set(mode="bounce", chunk_size="64KiB", threads=3), gdskit.open(path) as f:
            try:
                torch_io._scatter_groups(f, groups, dest_for, 0, pieces.append, futures, jobs_at_once)
            finally:
                for fut in futures:
                    fut.exception()  # every read ends before the destinations may go
        return made, pieces

    @pytest.mark.parametrize("batch_bytes", [1, 300_000, 1 << 30])
    @pytest.mark.parametrize("jobs_at_once", [1, 2, 1 << 20])
    def test_every_tensor_gets_its_bytes_whatever_the_batching(self, data_file, monkeypatch, batch_bytes,
                                                               jobs_at_once):
        path, data = data_file
        spans, pos = [], 100
        for i in range(60):
            n = 1000 + 997 * i
            spans.append((pos, n))
            pos += n + (i % 3) * 17  # small gaps, read and dropped
        groups = self._groups(spans)
        assert len(groups) > 3
        made, pieces = self._run(path, groups, monkeypatch, batch_bytes, jobs_at_once)
        for i, (off, n) in enumerate(spans):
            assert _device_bytes(made[f"t{i}"].array)[:n] == data[off:off + n], i
        assert sum(pieces) == sum(g.nbytes for g in groups)

    def test_a_group_past_the_end_of_the_file_is_a_truncated_file(self, data_file, monkeypatch):
        from gdskit.formats.safetensors_format import TruncatedFileError
        path, _ = data_file
        groups = self._groups([(SIZE - 5000, 3000), (SIZE - 2000, 3000)])  # the second runs 1000 bytes past the end
        with pytest.raises(TruncatedFileError, match="short read"):
            self._run(path, groups, monkeypatch, 1 << 30)
