"""Which samples each rank reads in each epoch: pure index arithmetic, no I/O.

The semantics are ``torch.utils.data.DistributedSampler``'s, to the index: with ``shuffle``
the epoch's order is ``torch.randperm(n)`` from a generator seeded with ``seed + epoch``;
without ``drop_last`` the order is padded by repeating its start until every rank has as
many samples, with it the tail that does not divide among the ranks is dropped; rank ``r``
takes every ``world_size``-th sample from ``r``. The rank's samples are then cut in batches,
the last one smaller unless ``drop_last`` drops it. Every rank thus gets the same number of
batches, of the same sizes.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from gdskit.data.errors import DatasetTooSmallError
from gdskit.errors import InvalidArgumentError


#: The largest seed torch's generator takes (``manual_seed``: 64 bits): an epoch's order comes
#: from ``seed + epoch``, as DistributedSampler's does, so the two together stay at most this.
SEED_LIMIT = 2**64 - 1


def _int(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r:.40}") from None
    if n < low:
        raise InvalidArgumentError(f"{name} must be >= {low}, got {n}")
    if high is not None and n > high:
        raise InvalidArgumentError(f"{name} must be <= {high}, got {n}")
    return n


def epoch_of(epoch: Any, seed: int) -> int:
    """``epoch`` checked: a whole number from 0 whose order ``seed + epoch`` torch can seed."""
    return _int("epoch", epoch, 0, SEED_LIMIT - seed)


def permutation(n: int, seed: int) -> np.ndarray:
    """``torch.randperm(n)`` from a generator seeded with ``seed`` (DistributedSampler's shuffle)."""
    import torch

    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randperm(n, generator=g).numpy()


@dataclass(frozen=True)
class Shards:
    """One rank's share of ``n`` samples, in batches."""

    n: int
    batch_size: int
    world_size: int = 1
    rank: int = 0
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = False

    def __post_init__(self) -> None:
        _int("batch_size", self.batch_size, 1)
        _int("world_size", self.world_size, 1)
        _int("rank", self.rank, 0)
        _int("seed", self.seed, 0, SEED_LIMIT)
        if self.rank >= self.world_size:
            raise InvalidArgumentError(f"rank {self.rank} is not below world_size {self.world_size}")
        if self.n <= 0:
            raise DatasetTooSmallError("the dataset has no sample")
        if self.num_batches == 0:
            raise DatasetTooSmallError(
                f"{self.n} samples over {self.world_size} ranks give each {self.num_samples}, fewer than one "
                f"batch of {self.batch_size}; with drop_last every batch would be dropped")

    @property
    def num_samples(self) -> int:
        """Samples of each rank per epoch (padding included)."""
        if self.drop_last and self.n % self.world_size:
            return self.n // self.world_size
        return math.ceil(self.n / self.world_size)

    @property
    def num_batches(self) -> int:
        """Batches of each rank per epoch."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """Every rank's samples of ``epoch`` before they are dealt out (padded or cut to a multiple of the ranks)."""
        epoch_of(epoch, self.seed)
        base = permutation(self.n, self.seed + epoch) if self.shuffle else np.arange(self.n, dtype=np.int64)
        total = self.num_samples * self.world_size
        if total <= self.n:
            return base[:total]
        reps = math.ceil(total / self.n)
        return np.tile(base, reps)[:total]

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's samples of ``epoch``, in order (``DistributedSampler``'s list)."""
        return self.order(epoch)[self.rank::self.world_size]

    def batches(self, epoch: int, start: int = 0) -> list[np.ndarray]:
        """This rank's batches of ``epoch`` from batch ``start`` on: arrays of sample indices."""
        mine = self.indices(epoch)
        bs = self.batch_size
        return [mine[j * bs:(j + 1) * bs] for j in range(start, self.num_batches)]
