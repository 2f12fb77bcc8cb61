"""The fan-out plan (gdskit.group.plan): every wanted byte read by exactly one rank, balanced,
windows bounded, the same plan from the same inputs; and the small pure pieces around it."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings, strategies as st

from gdskit.errors import GdskitError, GroupError, InvalidArgumentError
from gdskit.group import Options, options
from gdskit.group.config import current
from gdskit.group.plan import FanOutPlan, Part, Segment, Unit, _fill_targets, plan

PIECE = 4096
WINDOW = 3 * 4096
MAX_UNIT = 1024


@st.composite
def checkpoints(draw):
    """Segments of up to three files laid end to end (sometimes with gaps) and who wants each."""
    world = draw(st.integers(1, 6))
    segments, wanted = [], []
    for f in range(draw(st.integers(1, 3))):
        pos = draw(st.integers(0, 100))
        for i in range(draw(st.integers(0, 12))):
            n = draw(st.one_of(st.integers(0, 300), st.integers(300, 3 * PIECE)))
            segments.append(Segment(f"f{f}.t{i}", f, pos, n))
            kind = draw(st.sampled_from(["all", "none", "one", "some"]))
            if kind == "all":
                who = frozenset(range(world))
            elif kind == "none":
                who = frozenset()
            elif kind == "one":
                who = frozenset({draw(st.integers(0, world - 1))})
            else:
                who = frozenset(draw(st.sets(st.integers(0, world - 1), min_size=1)))
            wanted.append(who)
            pos += n + draw(st.sampled_from([0, 0, 0, 8]))
    return world, segments, wanted


def _plan(world, segments, wanted) -> FanOutPlan:
    return plan(segments, wanted, world, piece_bytes=PIECE, window_bytes=WINDOW, small_bytes=512,
                max_unit_bytes=MAX_UNIT)


@settings(max_examples=150, deadline=None)
@given(checkpoints())
def test_every_wanted_byte_is_read_once_and_lands_where_it_belongs(case):
    world, segments, wanted = case
    p = _plan(world, segments, wanted)
    by_key = {s.key: (s, w) for s, w in zip(segments, wanted)}
    covered: dict[object, list[tuple[int, int]]] = defaultdict(list)
    for u in p.units():
        assert 0 <= u.owner < world
        assert 0 < u.nbytes <= PIECE
        assert sum(part.nbytes for part in u.parts) == u.nbytes  # no gap bytes are read
        if not u.shared:
            assert u.wanted_by == frozenset({u.owner})  # a range one rank wants, that rank reads
        for part in u.parts:
            seg, who = by_key[part.key]
            assert u.wanted_by == who and u.file == seg.file
            assert u.file_offset + part.unit_offset == seg.file_offset + part.key_offset
            covered[part.key].append((part.key_offset, part.nbytes))
    for s, w in zip(segments, wanted):
        if w and s.nbytes:
            ranges = sorted(covered.pop(s.key))
            pos = 0
            for off, n in ranges:
                assert off == pos
                pos += n
            assert pos == s.nbytes
    assert not covered  # nothing nobody wants, nothing empty
    assert sum(p.read_bytes(r) for r in range(world)) == sum(s.nbytes for s, w in zip(segments, wanted) if w)


@settings(max_examples=150, deadline=None)
@given(checkpoints())
def test_reads_are_balanced_and_windows_bounded(case):
    world, segments, wanted = case
    p = _plan(world, segments, wanted)
    reads = [p.read_bytes(r) for r in range(world)]
    sharing = {u.owner for u in p.units() if u.shared}
    for r in sharing:  # a rank given shared bytes ends up no more than two units above the least loaded
        assert reads[r] <= min(reads) + 2 * MAX_UNIT + 1
    for w in p.windows:
        assert sum(u.nbytes for u in w.broadcasts) <= WINDOW + world * MAX_UNIT
        assert [u.owner for u in w.units] == sorted(u.owner for u in w.units)
    for r in range(world):
        assert p.staging_bytes(r) <= WINDOW + world * MAX_UNIT
    assert p == _plan(world, segments, wanted)  # the same on every rank


def test_replicated_large_tensors_split_evenly():
    segments = [Segment(f"t{i}", 0, i * 10_000, 10_000) for i in range(7)]
    for world in (2, 3, 4, 8):
        p = plan(segments, [frozenset(range(world))] * 7, world, piece_bytes=4096, window_bytes=16384)
        reads = [p.read_bytes(r) for r in range(world)]
        assert max(reads) - min(reads) <= 1 and sum(reads) == 70_000
        assert all(u.shared for u in p.units())
        assert p.received_bytes(0) == 70_000 - reads[0]
        assert p.staging_bytes(0) == 0  # every unit is one range of one tensor every rank wants


def test_one_rank_loading_alone_sends_nothing():
    segments = [Segment("a", 0, 0, 5000), Segment("b", 0, 5000, 7000)]
    p = plan(segments, [frozenset({1})] * 2, 3)
    assert p.read_bytes(1) == 12_000 and p.read_bytes(0) == p.read_bytes(2) == 0
    assert not any(u.shared for u in p.units())


def test_shared_bytes_go_to_the_ranks_with_less_of_their_own():
    segments = [Segment("mine", 0, 0, 9000), Segment("shared", 0, 9000, 3000)]
    p = plan(segments, [frozenset({0}), frozenset({0, 1})], 2)
    assert p.read_bytes(0) == 9000 and p.read_bytes(1) == 3000


def test_small_neighbours_travel_as_one_unit():
    segments = [Segment(f"s{i}", 0, i * 100, 100) for i in range(10)]
    p = plan(segments, [frozenset({0, 1})] * 10, 2, max_unit_bytes=500)
    units = list(p.units())
    assert len(units) == 2 and all(len(u.parts) == 5 for u in units)
    assert units[0].parts[1] == Part("s1", 0, 100, 100) and {u.owner for u in units} == {0, 1}
    assert not units[0].lands_whole(0) and p.staging_bytes(1) == 1000


@pytest.mark.parametrize("loads,extra", [([0, 0, 0], 10), ([10, 0, 0], 10), ([100, 0, 0], 10), ([5, 3, 0], 4),
                                         ([5, 3, 0], 100), ([7], 3), ([0, 0], 0)])
def test_fill_targets_evens_the_totals(loads, extra):
    shares = _fill_targets(loads, extra)
    assert sum(shares) == extra and min(shares) >= 0
    totals = [a + b for a, b in zip(loads, shares)]
    lifted = [t for t, s in zip(totals, shares) if s]
    assert not lifted or max(lifted) - min(totals) <= 1


def test_bad_arguments():
    seg = [Segment("a", 0, 0, 10)]
    with pytest.raises(ValueError):
        plan(seg, [frozenset({0})], 0)
    with pytest.raises(ValueError):
        plan(seg, [], 1)
    with pytest.raises(ValueError):
        plan(seg, [frozenset({2})], 2)
    with pytest.raises(ValueError):
        plan(seg, [frozenset({0})], 1, window_bytes=0)
    with pytest.raises(ValueError):
        Unit(0, 0, 0, 10, (Part("a", 0, 0, 5), Part("b", 0, 5, 5)), frozenset({0})).split(5)


def test_options_context():
    assert current() == Options()
    with options(window="1MiB", piece=4096, timeout=5) as o:
        assert o == Options(1 << 20, 4096, 5.0) and current() == o
        with options(timeout=7):
            assert current() == Options(1 << 20, 4096, 7.0)
    assert current() == Options()
    for bad in ({"window": 0}, {"piece": "lots"}, {"timeout": 0}, {"timeout": True}, {"timeout": "5"}):
        with pytest.raises(InvalidArgumentError):
            with options(**bad):
                pass
    assert current() == Options()


def test_group_error_is_a_runtime_error():
    err = GroupError("rank 1 failed", (1,))
    assert isinstance(err, GdskitError) and isinstance(err, RuntimeError) and err.ranks == (1,)


def test_backend_map():
    pytest.importorskip("torch.distributed")
    from gdskit.group.exchange import backend_map

    assert backend_map("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert backend_map("nccl") == {"cuda": "nccl"}
    assert backend_map("gloo") == {"cpu": "gloo", "cuda": "gloo"}


def test_a_load_needs_an_initialised_group():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    import gdskit.safetensors

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(InvalidArgumentError):
        gdskit.safetensors.load_file("x.safetensors", "cpu", process_group=object())
    del torch


@given(st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 50_000)), max_size=20),
       st.integers(1, 20), st.integers(1, 8192))
@settings(max_examples=300, deadline=None)
def test_fingerprint_samples_lie_within_the_ranges(ranges, blocks, block_bytes):
    """The contents fingerprint reads at most ``blocks`` samples, each inside one range, no larger
    than ``block_bytes``, the first at the first byte; nothing where there are no bytes."""
    pytest.importorskip("torch")
    from gdskit.group.load import sample_extents

    got = sample_extents(ranges, blocks, block_bytes)
    nonempty = [r for r in ranges if r[1] > 0]
    if not nonempty:
        assert got == []
        return
    assert 1 <= len(got) <= blocks
    assert (nonempty[0][0], min(block_bytes, nonempty[0][1])) in got
    for offset, n in got:
        assert 0 < n <= block_bytes
        assert any(o <= offset and offset + n <= o + size for o, size in nonempty)


def test_fingerprint_samples_spread_over_the_whole_run():
    pytest.importorskip("torch")
    from gdskit.group.load import sample_extents

    # Four ranges of 100 bytes, eight samples: two in each range, 50 bytes apart.
    got = sample_extents([(1000, 100), (0, 100), (5000, 100), (300, 100)], 8, 10)
    assert got == sorted([(1000, 10), (1050, 10), (0, 10), (50, 10), (5000, 10), (5050, 10), (300, 10), (350, 10)])
