"""cuFile's batch API on a real GPU and libcufile (run under ``bash scripts/gpu_test.sh``, which
lets libcufile register files in a VM without udev): bytes against a plain read, more entries
than one batch holds, short entries at the end of the file, the path in the ledger."""

from __future__ import annotations

import os

import numpy as np
import pytest

from cufile_probe import cufile_unusable_reason

import gdskit
from gdskit.engine.backends import cufile_batch as cb

pytestmark = pytest.mark.gpu

PAGE = 4096
SIZE = (64 << 20) + 1000  # not a whole number of pages: the last entry is short
CUFILE_PATHS = {"cufile-nvfs", "cufile-p2pdma", "cufile-compat"}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    data = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    path = tmp_path_factory.mktemp("cbatch_gpu") / "data.bin"
    path.write_bytes(data)
    return str(path), data


@pytest.fixture
def cufile_serves(data_file):
    """Skip unless libcufile is usable and can register a file here."""
    from gdskit.engine.backends.cufile import cufile_library

    why = cufile_unusable_reason(os.path.dirname(data_file[0]))
    if why:
        pytest.skip(why)
    return cufile_library()


def _batched_read(path, offsets, size, policy="always"):
    from devbuf import DeviceBuffer

    buf = DeviceBuffer(len(offsets) * size)
    buf.poison()
    before, activity = gdskit.stats(), cb.activity()
    with gdskit.settings.set(mode="cufile", cufile_batch=policy), gdskit.open(path) as f:
        counts = f.read_batch(buf, offsets, size)
    return counts, buf.to_bytes(), gdskit.stats() - before, cb.activity() - activity


@pytest.mark.parametrize("size", [4 << 10, 16 << 10, 64 << 10])
def test_random_reads_through_batches_match_a_plain_read(data_file, cufile_serves, size):
    path, data = data_file
    rng = np.random.default_rng(size)
    offsets = (rng.integers(0, SIZE // PAGE - size // PAGE, 300) * PAGE).tolist()  # > io_batchsize (128)
    counts, got, delta, activity = _batched_read(path, offsets, size)
    assert counts == [size] * len(offsets)
    for i, off in enumerate(offsets):
        assert got[i * size:(i + 1) * size] == data[off:off + size], f"read {i} at {off}"
    support = cb.batch_support(cufile_serves)
    if support.refused is not None:
        pytest.skip(f"libcufile refused batches (one call per read was used, bytes checked): {support.refused}")
    assert activity.entries == len(offsets) and activity.submits >= -(-len(offsets) // support.limit)
    assert set(delta.paths) <= CUFILE_PATHS and delta.bytes_read == sum(counts)


def test_short_entries_at_the_end_of_the_file(data_file, cufile_serves):
    path, data = data_file
    last = SIZE // PAGE * PAGE
    offsets = [0, last - 2 * PAGE, last, last + PAGE, 8 * PAGE]
    size = 4 * PAGE
    counts, got, _delta, _activity = _batched_read(path, offsets, size)
    assert counts == [size, 2 * PAGE + 1000, 1000, 0, size]
    for i, (off, n) in enumerate(zip(offsets, counts)):
        assert got[i * size:i * size + n] == data[off:off + n]


def test_batches_and_one_call_each_agree(data_file, cufile_serves):
    path, data = data_file
    offsets = [(i * 997 % (SIZE // PAGE - 1)) * PAGE for i in range(200)]
    a = _batched_read(path, offsets, PAGE, "always")
    b = _batched_read(path, offsets, PAGE, "never")
    assert a[0] == b[0] == [PAGE] * 200 and a[1] == b[1]
    assert set(a[2].paths) == set(b[2].paths), "the batch's path evidence names what one call each names"
