"""The loader's pinned staging on the stand-in CUDA driver (CI has no GPU): a batch's host reads
into a pinned slot, one copy to device memory on a stream, and a slot refilled only after its
copy out has run. The stand-in poisons a queued copy's pinned source, so a refill too early
is caught, and it runs copies only when something waits for them."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gdskit.data as gd  # noqa: E402
from data_workers import token_files, windows  # noqa: E402
from fake_cuda import CUmemorytype  # noqa: E402
from gdskit.engine import cuda  # noqa: E402
from gdskit.data.read import FileCache, plan_batch, read_now  # noqa: E402
from gdskit.data.staging import Staging  # noqa: E402

pytestmark = pytest.mark.stand_in_gpu

SEQ = 100


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    paths = token_files(tmp_path_factory.mktemp("staging"), [3000, 1100, 2100], "uint16")
    return paths, windows(paths, "uint16", SEQ)


def pinned_live(fake) -> int:
    return fake.live_allocations(CUmemorytype.CU_MEMORYTYPE_HOST)


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_batches_through_a_few_slots_land_whole_and_in_order(fake_cuda, tokens, slots):
    paths, want = tokens
    ds = gd.TokenDataset(paths, dtype="uint16", seq_len=SEQ)
    order = np.random.default_rng(slots).permutation(len(ds))
    batches = [order[i:i + 9] for i in range(0, len(order), 9)]
    cuda.set_device(0)
    stream = cuda.Stream(0)
    staging = Staging(slots)
    dests = []
    try:
        with FileCache() as files:
            for k, idx in enumerate(batches):
                plan = plan_batch(ds, idx)
                slot = staging.slot(k, plan.nbytes)  # waits for the copy out of it, if any
                read_now(files, plan, slot.view)
                dest = cuda.DeviceArray(plan.nbytes)
                slot.copy_to(dest.ptr, plan.nbytes, stream.handle)
                dests.append((dest, idx))
        stream.synchronize()
        for dest, idx in dests:
            got = np.frombuffer(ctypes.string_at(dest.ptr, len(idx) * (SEQ + 1) * 2), dtype=np.uint16)
            assert np.array_equal(got.reshape(len(idx), SEQ + 1), np.stack([want[i] for i in idx]))
    finally:
        staging.close()
        for dest, _ in dests:
            dest.free()
        stream.destroy()


def test_close_waits_for_the_copies_and_frees_memory_and_events(fake_cuda, tokens):
    paths, want = tokens
    ds = gd.TokenDataset(paths, dtype="uint16", seq_len=SEQ)
    cuda.set_device(0)
    stream = cuda.Stream(0)
    pinned, events = pinned_live(fake_cuda), fake_cuda.live_events()
    staging = Staging(3)
    dests = []
    with FileCache() as files:
        for k, size in enumerate([2, 5, 40, 3]):
            plan = plan_batch(ds, np.arange(k, k + size))
            slot = staging.slot(k % 2, plan.nbytes)  # slot 0 and 1 only: slot 0 grows for the third batch
            read_now(files, plan, slot.view)
            dest = cuda.DeviceArray(plan.nbytes)
            slot.copy_to(dest.ptr, plan.nbytes, stream.handle)
            dests.append((dest, np.arange(k, k + size)))
    assert pinned_live(fake_cuda) == pinned + 2 and staging.pinned_bytes >= 40 * (SEQ + 1) * 2
    staging.close()  # copies still queued: waited for, then the memory freed
    assert pinned_live(fake_cuda) == pinned and fake_cuda.live_events() == events and staging.pinned_bytes == 0
    for dest, idx in dests:
        got = np.frombuffer(ctypes.string_at(dest.ptr, len(idx) * (SEQ + 1) * 2), dtype=np.uint16)
        assert np.array_equal(got.reshape(len(idx), SEQ + 1), np.stack([want[i] for i in idx]))
        dest.free()
    stream.destroy()
    # A closed staging makes its slots again when asked.
    slot = staging.slot(0, 10)
    assert pinned_live(fake_cuda) == pinned + 1 and slot.nbytes >= 10
    staging.close()
    assert pinned_live(fake_cuda) == pinned


def test_the_exit_hook_frees_every_live_staging(fake_cuda):
    from gdskit.data import staging as staging_module

    cuda.set_device(0)
    pinned = pinned_live(fake_cuda)
    kept = [Staging(2) for _ in range(3)]
    for s in kept:
        s.slot(0, 1000)
        s.slot(1, 1000)
    assert pinned_live(fake_cuda) == pinned + 6
    staging_module._live.close_all()
    assert pinned_live(fake_cuda) == pinned
