"""The one chunk reader of the CPU paths (gdskit.engine.backends.staged): which descriptor serves a
chunk, and the bytes it reads into a staging buffer or the caller's memory, checked against
a plain read for every policy, page-cache answer and alignment."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import numpy as np
import pytest

from gdskit.engine.backends import staged
from gdskit.engine.backends.base import OpenFile, RWF_NOWAIT
from gdskit.engine.backends.staged import MemoryTarget, StageTarget, Via, choose, read_chunk
from gdskit.engine.plan import align_down
from gdskit.engine.residency import Residency
from gdskit.vocabulary import ODirectPolicy

A = 4096
SIZE = 300_000  # not a multiple of 4 KiB: the last chunk ends in a ragged, short read
POLICIES = list(ODirectPolicy)
ANSWERS = [Residency.ALL, Residency.SOME, Residency.FEW, Residency.NONE, None]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    data = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    path = tmp_path_factory.mktemp("chunks") / "data.bin"
    path.write_bytes(data)
    return str(path), data


@pytest.fixture
def of(data_file):
    path, _ = data_file
    f = OpenFile(path, os.open(path, os.O_RDONLY), os.O_RDONLY)
    if f.direct_fd() is None:
        f.close()
        pytest.skip("this filesystem refuses O_DIRECT")
    yield f
    f.close()


class _Stage:
    """Page-aligned memory, as the pool's host stages (``skew`` bytes in: misaligned on purpose)."""

    def __init__(self, nbytes: int, skew: int = 0) -> None:
        self._map = mmap.mmap(-1, nbytes + A, flags=mmap.MAP_PRIVATE)
        self.view = memoryview(self._map)[skew:skew + nbytes]
        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self._map)) + skew

    def close(self) -> None:
        self.view.release()


def _answer(monkeypatch, where):
    monkeypatch.setattr(staged, "file_residency", lambda f, pos, n: where)


# (pos, n): aligned, ragged start, ragged end, ragged both, one byte, past the end of the file
SPANS = [(0, 65536), (100, 65536), (8192, 5000), (4097, 70_001), (12_345, 1), (SIZE - 5000, 65536)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("where", ANSWERS)
@pytest.mark.parametrize("nowait", [True, False])
def test_the_descriptor_each_policy_and_page_cache_answer_takes(of, monkeypatch, policy, where, nowait):
    _answer(monkeypatch, where)
    of.nowait_supported = nowait and bool(RWF_NOWAIT)
    via, told = choose(of, policy, 0, 65536)
    if policy is ODirectPolicy.NEVER:
        assert via is Via.BUFFERED
    elif policy is ODirectPolicy.ALWAYS:
        assert via is Via.DIRECT
    elif where is Residency.NONE:
        assert via is Via.DIRECT
    elif where is None and of.nowait_supported:
        assert via is Via.PROBE
    else:
        assert via is Via.BUFFERED  # the page cache holds all or some of it, or cannot say and cannot be probed
    assert told is (where if policy is ODirectPolicy.AUTO else staged.UNKNOWN)
    of.direct_refused = True
    assert choose(of, policy, 0, 65536)[0] is Via.BUFFERED  # after a refusal: buffered, whatever the policy


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("where", ANSWERS)
@pytest.mark.parametrize("pos,n", SPANS)
def test_into_a_stage_every_byte_lands_by_the_layout_rule(of, data_file, monkeypatch, policy, where, pos, n):
    _, data = data_file
    _answer(monkeypatch, where)
    stage = _Stage(n + 2 * A)
    try:
        res = read_chunk(of, StageTarget(stage.view, pos, A), pos, n, policy)
        want = data[pos:pos + n]
        assert res.nbytes == len(want) and 0 <= res.cached <= res.nbytes
        head = pos - align_down(pos, A)
        assert bytes(stage.view[head:head + res.nbytes]) == want
    finally:
        stage.close()
    assert not of.direct_refused


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("where", ANSWERS)
@pytest.mark.parametrize("pos,n", SPANS)
@pytest.mark.parametrize("skew", [0, 1, 512])  # the caller's memory: aligned, or not
def test_into_the_callers_memory_every_byte_lands(of, data_file, monkeypatch, policy, where, pos, n, skew):
    _, data = data_file
    _answer(monkeypatch, where)
    memory = _Stage(n, skew)  # the caller's buffer
    stages: list[_Stage] = []

    def stage():
        stages.append(_Stage(n + 2 * A))
        return stages[-1]

    try:
        res = read_chunk(of, MemoryTarget(memory.view, memory.ptr, pos, A, stage), pos, n, policy)
        want = data[pos:pos + n]
        assert res.nbytes == len(want) and bytes(memory.view[:res.nbytes]) == want
        assert len(stages) <= 1
    finally:
        memory.close()
        for st in stages:
            st.close()


@pytest.mark.parametrize("skew", [0, 1])
def test_a_refused_direct_read_turns_the_file_buffered_with_the_same_bytes(of, data_file, skew):
    # O_DIRECT into memory that is not aligned is refused (EINVAL), as a filesystem that wants
    # another alignment refuses it: the chunk is read buffered, and so is the file from then on.
    _, data = data_file
    pos, n = 8192, 65536
    stage = _Stage(n + 2 * A, skew=1)  # misaligned: every O_DIRECT read into it fails
    memory = _Stage(n, skew)
    try:
        target = (StageTarget(stage.view, pos, A) if skew == 0
                  else MemoryTarget(memory.view, memory.ptr, pos, A, lambda: stage))
        res = read_chunk(of, target, pos, n, ODirectPolicy.ALWAYS)
        got = bytes(target.view(pos, n))
    finally:
        stage.close()
        memory.close()
    assert got == data[pos:pos + n] and res.nbytes == n and res.cached == n
    assert of.direct_refused


def test_a_refused_nowait_probe_reads_buffered_and_is_not_tried_again(of, data_file, monkeypatch):
    _, data = data_file
    _answer(monkeypatch, None)  # neither cachestat nor mincore: the probe decides
    of.nowait_supported = True
    probes = []
    real = staged.pread_full

    def refusing(fd, view, offset, path=None, flags=0, alignment=1):
        if flags:
            probes.append(offset)
            raise OSError(errno.EOPNOTSUPP, "RWF_NOWAIT not supported")
        return real(fd, view, offset, path, flags, alignment)

    monkeypatch.setattr(staged, "pread_full", refusing)
    stage = _Stage(65536 + 2 * A)
    try:
        for pos in (0, 100):
            res = read_chunk(of, StageTarget(stage.view, pos, A), pos, 65536, ODirectPolicy.AUTO)
            assert bytes(stage.view[pos % A:pos % A + 65536]) == data[pos:pos + 65536]
            assert res.nbytes == res.cached == 65536  # buffered
    finally:
        stage.close()
    assert probes == [0] and not of.nowait_supported


def test_a_probe_takes_what_is_cached_and_reads_the_rest_direct(of, data_file, monkeypatch):
    if not RWF_NOWAIT:
        pytest.skip("no RWF_NOWAIT here")
    _, data = data_file
    _answer(monkeypatch, None)
    of.nowait_supported = True
    with open(of.path, "rb") as fh:  # the page cache now holds the file
        fh.read()
    stage = _Stage(65536 + 2 * A)
    try:
        res = read_chunk(of, StageTarget(stage.view, 4096, A), 4096, 65536, ODirectPolicy.AUTO)
        assert bytes(stage.view[:65536]) == data[4096:4096 + 65536] and res.nbytes == 65536
        assert res.cached == 65536  # all of it came from the page cache
    finally:
        stage.close()


def test_a_large_range_the_page_cache_holds_little_of_is_read_with_o_direct(tmp_path):
    """A header read leaves a file's first pages cached (readahead): the rest of a large read
    still goes O_DIRECT, where buffered it would be a cold read through the cache."""
    from gdskit.engine.residency import residency

    path = tmp_path / "shard.bin"
    path.write_bytes(np.random.default_rng(9).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes())
    from backend_conformance import drop_cache

    drop_cache(str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # exactly the pages asked for, no readahead
        os.pread(fd, 64 << 10, 0)
    finally:
        os.close(fd)
    f = OpenFile(str(path), os.open(path, os.O_RDONLY), os.O_RDONLY)
    try:
        if f.direct_fd() is None:
            pytest.skip("this filesystem refuses O_DIRECT")
        where = residency(f.fd, 0, 8 << 20)
        if where is None:
            pytest.skip("the kernel cannot say what the page cache holds")
        assert where is Residency.FEW  # 64 KiB of 8 MiB
        assert choose(f, ODirectPolicy.AUTO, 0, 8 << 20)[0] is Via.DIRECT
        assert choose(f, ODirectPolicy.AUTO, 100, (8 << 20) - 100)[0] is Via.DIRECT  # an .npy array after its header
        assert residency(f.fd, 0, 256 << 10) is Residency.SOME  # a quarter
        assert choose(f, ODirectPolicy.AUTO, 0, 256 << 10)[0] is Via.BUFFERED
        assert choose(f, ODirectPolicy.AUTO, 0, 640 << 10)[0] is Via.BUFFERED  # an eighth, but under 1 MiB
        assert residency(f.fd, 0, 64 << 10) is Residency.ALL
    finally:
        f.close()
