"""Which samples each rank reads: DistributedSampler's lists, to the index, then cut in batches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings as hsettings, strategies as st

torch = pytest.importorskip("torch")
from torch.utils.data import DistributedSampler  # noqa: E402

from gdskit.data.errors import DatasetTooSmallError  # noqa: E402
from gdskit.data.sampler import Shards  # noqa: E402
from gdskit.errors import InvalidArgumentError  # noqa: E402


def shards_or_none(**kw):
    try:
        return Shards(**kw)
    except DatasetTooSmallError:
        return None


@hsettings(max_examples=150, deadline=None)
@given(n=st.integers(1, 60), world=st.integers(1, 5), bs=st.integers(1, 9), shuffle=st.booleans(),
       drop_last=st.booleans(), seed=st.integers(0, 2**32), epoch=st.integers(0, 50))
def test_each_rank_gets_distributed_samplers_list(n, world, bs, shuffle, drop_last, seed, epoch):
    for rank in range(world):
        s = shards_or_none(n=n, batch_size=bs, world_size=world, rank=rank, shuffle=shuffle, seed=seed,
                           drop_last=drop_last)
        ref = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
        ref.set_epoch(epoch)
        want = list(ref)
        if s is None:  # refused: every batch would be dropped (or nothing to read)
            assert drop_last and len(want) // bs == 0
            continue
        assert s.indices(epoch).tolist() == want
        batches = s.batches(epoch)
        assert len(batches) == s.num_batches
        flat = [i for b in batches for i in b.tolist()]
        if drop_last:
            assert all(len(b) == bs for b in batches) and flat == want[:len(batches) * bs]
        else:
            assert flat == want and all(len(b) == bs for b in batches[:-1])


@pytest.mark.parametrize("n,world", [(17, 1), (17, 2), (17, 4), (16, 4), (3, 4)])
def test_every_sample_exactly_once_across_ranks_with_equal_counts(n, world):
    for drop_last in (False, True):
        per_rank = [shards_or_none(n=n, batch_size=2, world_size=world, rank=r, shuffle=True, seed=5,
                                   drop_last=drop_last) for r in range(world)]
        if drop_last and n // world < 2:
            assert all(s is None for s in per_rank)
            continue
        got = [np.concatenate(s.batches(3)) for s in per_rank]
        assert len({len(g) for g in got}) == 1  # every rank the same count
        assert len({len(s.batches(3)) for s in per_rank}) == 1
        every = np.concatenate(got)
        counts = np.bincount(every, minlength=n)
        if drop_last:  # the tail that does not divide is dropped, the rest once (batches whole)
            assert counts.max() == 1
        else:  # all once, the padding repeats the order's start
            assert counts.min() >= 1 and counts.sum() - n == per_rank[0].num_samples * world - n


def test_orders_differ_by_epoch_and_repeat_by_seed():
    a = Shards(n=1000, batch_size=10, shuffle=True, seed=1)
    assert not np.array_equal(a.indices(0), a.indices(1))
    assert np.array_equal(a.indices(7), Shards(n=1000, batch_size=10, shuffle=True, seed=1).indices(7))
    assert not np.array_equal(a.indices(0), Shards(n=1000, batch_size=10, shuffle=True, seed=2).indices(0))
    assert np.array_equal(Shards(n=50, batch_size=10).indices(4), np.arange(50))


def test_batches_from_a_position_are_the_tail():
    s = Shards(n=95, batch_size=8, world_size=3, rank=1, shuffle=True, seed=9)
    full = s.batches(2)
    for k in range(len(full) + 1):
        tail = s.batches(2, k)
        assert len(tail) == len(full) - k and all(np.array_equal(x, y) for x, y in zip(tail, full[k:]))


@pytest.mark.parametrize("kw", [dict(batch_size=0), dict(batch_size=-1), dict(batch_size=True),
                                dict(batch_size=2.0), dict(world_size=0), dict(rank=2, world_size=2),
                                dict(rank=-1), dict(seed=-1)])
def test_bad_arguments(kw):
    args = dict(n=10, batch_size=2) | kw
    with pytest.raises(InvalidArgumentError):
        Shards(**args)


def test_too_small_with_drop_last_and_empty():
    with pytest.raises(DatasetTooSmallError):
        Shards(n=7, batch_size=4, world_size=2, drop_last=True)
    assert Shards(n=7, batch_size=4, world_size=2).num_batches == 1
    with pytest.raises(DatasetTooSmallError):
        Shards(n=0, batch_size=1)
    assert issubclass(DatasetTooSmallError, ValueError)


def tiled_reference(n, batch_size, world_size, rank, shuffle, seed, drop_last, epoch):
    """The rank's indices as the sampler planned them before: the whole padded order of every
    rank (``world_size`` times the share), then every ``world_size``-th from ``rank``."""
    base = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).numpy() if shuffle \
        else np.arange(n)
    per = n // world_size if drop_last and n % world_size else -(-n // world_size)
    total = per * world_size
    order = base[:total] if total <= n else np.tile(base, -(-total // n))[:total]
    return order[rank::world_size]


@hsettings(max_examples=200, deadline=None)
@given(n=st.integers(1, 3000), world=st.integers(1, 400), bs=st.integers(1, 40), shuffle=st.booleans(),
       drop_last=st.booleans(), seed=st.integers(0, 2**40), epoch=st.integers(0, 9), data=st.data())
def test_the_same_indices_as_the_whole_order_dealt_out(n, world, bs, shuffle, drop_last, seed, epoch, data):
    rank = data.draw(st.integers(0, world - 1))
    s = shards_or_none(n=n, batch_size=bs, world_size=world, rank=rank, shuffle=shuffle, seed=seed,
                       drop_last=drop_last)
    want = tiled_reference(n, bs, world, rank, shuffle, seed, drop_last, epoch)
    if s is None:
        assert drop_last and len(want) < bs
        return
    got = s.indices(epoch)
    assert got.dtype == np.int64 and got.tolist() == want.tolist()


@pytest.mark.parametrize("world,rank", [(2**40, 0), (2**40, 2**40 - 1), (2**63, 12345), (2**100, 2**100 - 1),
                                        (2**24, 2**23 + 7)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_huge_world_sizes_cost_only_the_ranks_share(world, rank, shuffle):
    """Each rank's plan is its share: a rank of a world far larger than the dataset gets its one
    sample (padding), without arrays of world_size entries."""
    import tracemalloc

    n = 1000
    tracemalloc.start()
    try:
        s = Shards(n=n, batch_size=1, world_size=world, rank=rank, shuffle=shuffle, seed=3)
        batches = s.batches(5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    base = torch.randperm(n, generator=torch.Generator().manual_seed(8)).numpy() if shuffle else np.arange(n)
    assert s.num_samples == 1 and [b.tolist() for b in batches] == [[int(base[rank % n])]]
    assert peak < 1 << 20


def test_a_share_of_many_samples_in_a_large_world():
    n, world = 10**6 + 3, 999
    for rank in (0, 17, world - 1):
        s = Shards(n=n, batch_size=64, world_size=world, rank=rank)
        assert s.indices(0).tolist() == [(rank + k * world) % n for k in range(s.num_samples)]


@pytest.mark.parametrize("kw", [dict(world_size=2.0), dict(world_size="2"), dict(world_size=True),
                                dict(world_size=None), dict(rank=1.0), dict(rank=True), dict(rank=None),
                                dict(rank=2**40, world_size=2**40), dict(world_size=-(2**40)),
                                dict(shuffle="yes"), dict(shuffle=2), dict(shuffle=np.array([1, 0])),
                                dict(drop_last="no"), dict(drop_last=None), dict(seed=2**64),
                                dict(n=-1), dict(n=2.0)])
def test_more_bad_arguments(kw):
    args = dict(n=10, batch_size=2) | kw
    with pytest.raises(InvalidArgumentError):
        Shards(**args)


def test_arguments_of_numpy_types_are_taken_as_python_values():
    s = Shards(n=np.int64(10), batch_size=np.int32(3), world_size=np.uint64(2**63), rank=np.uint64(2**63 - 1),
               shuffle=np.bool_(False), drop_last=0)
    assert type(s.world_size) is int and s.world_size == 2**63 and type(s.shuffle) is bool
    assert s.indices(0).tolist() == [(2**63 - 1) % 10]
