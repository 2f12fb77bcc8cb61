"""A batch's scattered reads into device memory, on the stand-in CUDA driver (CI has no GPU):
the loader's read plan through the engine's device paths, bytes against numpy."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gdskit  # noqa: E402
import gdskit.data as gd  # noqa: E402
from data_workers import token_files, windows  # noqa: E402
from gdskit.engine import cuda  # noqa: E402
from gdskit.engine.buffers import synchronized_device_view  # noqa: E402
from gdskit.data.read import FileCache, plan_batch, submit, wait  # noqa: E402

pytestmark = pytest.mark.stand_in_gpu


@pytest.mark.parametrize("mode", ["auto", "bounce"])
def test_a_shuffled_batch_lands_in_device_rows(tmp_path, mode):
    paths = token_files(tmp_path, [3000, 1100, 2100], "uint16")
    ds = gd.TokenDataset(paths, dtype="uint16", seq_len=100)
    want = windows(paths, "uint16", 100)
    indices = np.random.default_rng(0).permutation(len(ds))[:17]
    plan = plan_batch(ds, indices)
    dest = cuda.DeviceArray(plan.nbytes)
    ctypes.memset(dest.ptr, 0xAB, plan.nbytes)
    before = gdskit.stats()
    with gdskit.settings.set(mode=mode, chunk_size="64KiB", threads=3), FileCache() as files:
        wait(submit(files, plan, synchronized_device_view(dest.ptr, plan.nbytes, dest)))
    got = np.frombuffer(ctypes.string_at(dest.ptr, plan.nbytes), dtype=np.uint16).reshape(17, 101)
    assert np.array_equal(got, np.stack([want[i] for i in indices]))
    delta = gdskit.stats() - before
    assert delta.bytes_read == plan.nbytes and set(delta.paths) <= {"bounce-cached", "bounce-direct"}


def test_a_short_device_read_is_a_truncated_file(tmp_path):
    a = np.arange(4000, dtype=np.int32)
    a.tofile(tmp_path / "r.bin")
    ds = gd.RecordDataset(tmp_path / "r.bin", dtype="int32", shape=(100,))
    plan = plan_batch(ds, np.array([39, 0, 38]))
    import os
    os.truncate(tmp_path / "r.bin", 39 * 400 + 10)
    dest = cuda.DeviceArray(plan.nbytes)
    with gdskit.settings.set(mode="bounce", chunk_size="64KiB"), FileCache() as files:
        with pytest.raises(gd.TruncatedFileError):
            wait(submit(files, plan, synchronized_device_view(dest.ptr, plan.nbytes, dest)))
