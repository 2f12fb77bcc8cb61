"""Small reads into GPU memory on a real GPU: the caller's-thread bounce path against plain reads."""

from __future__ import annotations

import os

import numpy as np
import pytest

import gdskit
from gdskit.engine import cuda

from backend_conformance import drop_cache

pytestmark = pytest.mark.gpu

SIZE = (8 << 20) + 1234


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    data = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    path = tmp_path_factory.mktemp("small_gpu") / "data.bin"
    path.write_bytes(data)
    return str(path), data


@pytest.mark.parametrize("policy", ["auto", "always", "never"])
@pytest.mark.parametrize("cold", [False, True])
def test_small_reads_and_batches_match_plain_reads(data_file, policy, cold):
    path, data = data_file
    if cold:
        drop_cache(path)
    cases = [(0, 4096), (4097, 5000), (SIZE - 100, 4096), (SIZE + 3, 10), (1 << 20, 1 << 20), (123, 1)]
    buf = cuda.DeviceArray(2 << 20)
    try:
        with gdskit.settings.set(mode="bounce", odirect=policy), gdskit.open(path) as f:
            for off, n in cases:
                got = f.read(buf, n, off)
                want = data[off:off + n]
                assert got == len(want) and buf.to_numpy(got).tobytes() == want
            offsets = [4096 * i for i in range(0, 400, 7)]
            before = gdskit.stats()
            assert f.read_batch(buf, offsets, 4096) == [4096] * len(offsets)
            delta = gdskit.stats() - before
        host = buf.to_numpy(4096 * len(offsets))
        for i, off in enumerate(offsets):
            assert host[i * 4096:(i + 1) * 4096].tobytes() == data[off:off + 4096]
    finally:
        buf.free()
    assert delta.bytes_read == 4096 * len(offsets) and delta.requests == len(offsets)
    assert set(delta.paths) <= {"bounce-cached", "bounce-direct"}
    if policy == "always":
        assert set(delta.paths) == {"bounce-direct"}
    if policy == "never":
        assert set(delta.paths) == {"bounce-cached"}
