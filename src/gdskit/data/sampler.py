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
    import torch  # noqa: PLC0415 - optional dependency (torch)

    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randperm(n, generator=g).numpy()


def flag(name: str, value: Any) -> bool:
    """``value`` as a bool: True, False (numpy's too), or the integers 1 and 0; else :class:`InvalidArgumentError`."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    try:
        n = operator.index(value)
    except TypeError:
        n = None
    if n not in (0, 1):
        raise InvalidArgumentError(f"{name} must be True or False, got {value!r:.40}")
    return bool(n)


def dealt(start: int, step: int, count: int, n: int) -> np.ndarray:
    """``(start + k * step) % n`` for ``k`` in ``range(count)``, where ``start < n`` and
    ``(count - 1) * step < n``: the places of a rank's samples in an order repeated as often as
    the ranks need, with no number beyond ``2 * n`` ever formed (int64 holds them all)."""
    offsets = np.arange(count, dtype=np.int64)
    if count > 1:  # one sample a rank: step may be any size, and is not needed
        offsets *= step
    wrap = n - start
    return np.where(offsets < wrap, offsets + start, offsets - wrap)


@dataclass(frozen=True)
class Shards:
    """One rank's share of ``n`` samples, in batches.

    Only the rank's share is ever made: its samples' places in the padded order are found by
    arithmetic, so memory and time follow the share (and ``n``, with ``shuffle``), never
    ``world_size``.
    """

    n: int
    batch_size: int
    world_size: int = 1
    rank: int = 0
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = False

    def __post_init__(self) -> None:
        # Kept as Python values: numpy integers would wrap in the arithmetic below.
        checked = {"n": _int("n", self.n, 0), "batch_size": _int("batch_size", self.batch_size, 1),
                   "world_size": _int("world_size", self.world_size, 1), "rank": _int("rank", self.rank, 0),
                   "seed": _int("seed", self.seed, 0, SEED_LIMIT), "shuffle": flag("shuffle", self.shuffle),
                   "drop_last": flag("drop_last", self.drop_last)}
        for name, value in checked.items():
            object.__setattr__(self, name, value)
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
        return -(-self.n // self.world_size)

    @property
    def num_batches(self) -> int:
        """Batches of each rank per epoch."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's samples of ``epoch``, in order (``DistributedSampler``'s list).

        Every rank's order is the epoch's order, repeated from its start (padding) or cut to
        ``num_samples * world_size``; the rank takes every ``world_size``-th from ``rank``:
        places ``rank + k * world_size`` of the repeated order, ``(rank + k * world_size) % n``
        of the epoch's (the cut keeps only places below ``n``).
        """
        epoch_of(epoch, self.seed)
        places = dealt(self.rank % self.n, self.world_size, self.num_samples, self.n)
        if not self.shuffle:
            return places
        return permutation(self.n, self.seed + epoch)[places].astype(np.int64, copy=False)

    def batches(self, epoch: int, start: int = 0) -> list[np.ndarray]:
        """This rank's batches of ``epoch`` from batch ``start`` on: arrays of sample indices."""
        mine = self.indices(epoch)
        bs = self.batch_size
        return [mine[j * bs:(j + 1) * bs] for j in range(start, self.num_batches)]
