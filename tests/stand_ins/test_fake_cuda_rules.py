"""The stand-in CUDA driver keeps CUDA's ordering rules (tests/stand_ins/fake_cuda.py): what the GPU-path
tests on CI rely on to catch a missing wait. Each test drives the stand-in directly."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from fake_cuda import CUresult, FakeDriver, StandInViolation

N = 64 << 10
NON_BLOCKING = 1


@pytest.fixture
def drv():
    fake = FakeDriver()
    assert fake.cuCtxSetCurrent(1000) == (CUresult.CUDA_SUCCESS,)
    yield fake
    fake.take_violations()


def _ok(result):
    assert int(result[0]) == 0, result
    return result[1] if len(result) == 2 else None


def _pinned(drv, data: bytes) -> int:
    ptr = _ok(drv.cuMemHostAlloc(len(data), 1))
    ctypes.memmove(ptr, data, len(data))
    return ptr


def _peek(ptr: int, n: int) -> bytes:
    """Memory as it is, bypassing the driver (what the host would see)."""
    return ctypes.string_at(ptr, n)


def test_an_event_waits_for_exactly_the_work_queued_before_it(drv):
    a, b = os.urandom(N), os.urandom(N)
    src_a, src_b = _pinned(drv, a), _pinned(drv, b)
    dev = _ok(drv.cuMemAlloc(2 * N))
    s = _ok(drv.cuStreamCreate(NON_BLOCKING))
    ev = _ok(drv.cuEventCreate(0))
    _ok(drv.cuMemcpyHtoDAsync(dev, src_a, N, s))
    _ok(drv.cuEventRecord(ev, s))
    _ok(drv.cuMemcpyHtoDAsync(dev + N, src_b, N, s))
    assert _peek(dev, N) != a, "a copy runs only when something waits for it"
    _ok(drv.cuEventSynchronize(ev))
    assert _peek(dev, N) == a and _peek(src_a, N) == a
    assert drv.pending() == 1 and _peek(dev + N, N) != b and _peek(src_b, N) != b, "the later copy has not run"
    _ok(drv.cuStreamSynchronize(s))
    assert drv.pending() == 0 and _peek(dev + N, N) == b and _peek(src_b, N) == b
    assert drv.violations == []


@pytest.mark.parametrize("rewrite", ["other bytes", "the same bytes", "one byte"])
def test_a_host_write_into_the_source_of_a_queued_copy_is_caught(drv, rewrite):
    data = os.urandom(N)
    src = _pinned(drv, data)
    dev = _ok(drv.cuMemAlloc(N))
    s = _ok(drv.cuStreamCreate(NON_BLOCKING))
    _ok(drv.cuMemcpyHtoDAsync(dev, src, N, s))
    if rewrite == "one byte":
        ctypes.memmove(src + 100, data[100:101], 1)
    else:
        new = data if rewrite == "the same bytes" else os.urandom(N)
        ctypes.memmove(src, new, N)  # as a pread into the stage would
    with pytest.raises(StandInViolation):
        drv.cuStreamSynchronize(s)
    assert len(drv.take_violations()) == 1


def test_freeing_memory_a_queued_copy_uses_is_caught(drv):
    src = _pinned(drv, os.urandom(N))
    dev = _ok(drv.cuMemAlloc(N))
    s = _ok(drv.cuStreamCreate(NON_BLOCKING))
    _ok(drv.cuMemcpyHtoDAsync(dev, src, N, s))
    with pytest.raises(StandInViolation):
        drv.cuMemFreeHost(src)
    drv.take_violations()
    _ok(drv.cuStreamSynchronize(s))  # the cancelled copy touches nothing
    assert drv.pending() == 0 and drv.violations == []


def test_a_device_to_host_destination_holds_poison_until_its_copy_runs(drv):
    data = os.urandom(N)
    dev = _ok(drv.cuMemAlloc(N))
    _ok(drv.cuMemcpy(dev, np.frombuffer(data, np.uint8).ctypes.data, N))
    dst = _pinned(drv, bytes(N))
    s = _ok(drv.cuStreamCreate(NON_BLOCKING))
    _ok(drv.cuMemcpyDtoHAsync(dst, dev, N, s))
    early = _peek(dst, N)
    assert early != data and early != bytes(N), "a host read before the copy ran sees neither old nor new bytes"
    _ok(drv.cuStreamSynchronize(s))
    assert _peek(dst, N) == data
    _ok(drv.cuMemcpyDtoHAsync(dst, dev, N, s))
    ctypes.memset(dst, 0, 1)  # the host writes into the destination before the copy ran
    with pytest.raises(StandInViolation):
        drv.cuStreamSynchronize(s)


def test_streams_touching_the_same_bytes_race_unless_an_event_orders_them(drv):
    a, b = os.urandom(N), os.urandom(N)
    src_a, src_b = _pinned(drv, a), _pinned(drv, b)
    dev = _ok(drv.cuMemAlloc(N))
    back = _pinned(drv, bytes(N))
    s1, s2 = _ok(drv.cuStreamCreate(NON_BLOCKING)), _ok(drv.cuStreamCreate(NON_BLOCKING))
    _ok(drv.cuMemcpyHtoDAsync(dev, src_a, N, s1))
    with pytest.raises(StandInViolation):
        drv.cuMemcpyHtoDAsync(dev, src_b, N, s2)  # a write-write race
    drv.take_violations()
    _ok(drv.cuCtxSynchronize())
    # Ordered: s2 waits for s1's copy, then reads what it wrote.
    ev = _ok(drv.cuEventCreate(0))
    _ok(drv.cuMemcpyHtoDAsync(dev, src_b, N, s1))
    _ok(drv.cuEventRecord(ev, s1))
    _ok(drv.cuStreamWaitEvent(s2, ev, 0))
    _ok(drv.cuMemcpyDtoHAsync(back, dev, N, s2))
    _ok(drv.cuStreamSynchronize(s2))  # runs s1's copy first, as the wait demands
    assert _peek(back, N) == b and drv.pending() == 0 and drv.violations == []


def test_a_blocking_copy_waits_for_blocking_streams_only(drv):
    data = os.urandom(N)
    src = _pinned(drv, data)
    dev = _ok(drv.cuMemAlloc(N))
    out = np.zeros(N, np.uint8)
    blocking = _ok(drv.cuStreamCreate(0))
    _ok(drv.cuMemcpyHtoDAsync(dev, src, N, blocking))
    _ok(drv.cuMemcpy(out.ctypes.data, dev, N))  # the legacy stream waits for a blocking stream
    assert out.tobytes() == data
    non_blocking = _ok(drv.cuStreamCreate(NON_BLOCKING))
    _ok(drv.cuMemcpyHtoDAsync(dev, src, N, non_blocking))
    with pytest.raises(StandInViolation):
        drv.cuMemcpy(out.ctypes.data, dev, N)  # reading bytes a queued copy still writes


def test_pageable_memory_is_taken_during_the_call(drv):
    data = np.frombuffer(os.urandom(N), np.uint8).copy()
    dev = _ok(drv.cuMemAlloc(N))
    s = _ok(drv.cuStreamCreate(NON_BLOCKING))
    _ok(drv.cuMemcpyHtoDAsync(dev, data.ctypes.data, N, s))
    want = data.tobytes()
    data[:] = 0  # allowed: the driver staged the bytes before returning
    _ok(drv.cuStreamSynchronize(s))
    assert _peek(dev, N) == want and drv.violations == []
    out = np.zeros(N, np.uint8)
    _ok(drv.cuMemcpyDtoHAsync(out.ctypes.data, dev, N, s))
    assert out.tobytes() == want, "a copy into pageable memory returns once done"


def test_streams_a_wait_needs_run_in_a_seeded_order(drv):
    def order(seed: int) -> list[tuple[int, int]]:
        fake = FakeDriver(seed=seed)
        fake.cuCtxSetCurrent(1000)
        dev = _ok(fake.cuMemAlloc(8 * N))
        src = _pinned(fake, os.urandom(N))
        streams = [_ok(fake.cuStreamCreate(NON_BLOCKING)) for _ in range(3)]
        for i, s in enumerate(streams[:2]):
            for k in range(3):
                _ok(fake.cuMemcpyHtoDAsync(dev + (4 * i + k) * N, src, N, s))
            ev = _ok(fake.cuEventCreate(0))
            _ok(fake.cuEventRecord(ev, s))
            _ok(fake.cuStreamWaitEvent(streams[2], ev, 0))
        _ok(fake.cuStreamSynchronize(streams[2]))
        assert fake.pending() == 0 and fake.violations == []
        ran = [r for r in fake.ran if r[0] != streams[2]]
        for s in streams[:2]:
            assert [seq for h, seq in ran if h == s] == [0, 1, 2], "each stream keeps its order"
        return [h - streams[0] for h, _ in ran]

    assert order(7) == order(7)
    assert len({tuple(order(seed)) for seed in range(8)}) > 1, "the order of independent streams varies by seed"


def test_a_thread_with_no_context_is_answered_as_the_driver_answers_it(drv):
    """What an H200's driver (580) did for a thread with no current context (benchmarks/RESULTS.md,
    "Which driver calls a thread with no context may make"): calls on objects that name their
    context work; the null stream's wait, allocations, registration and blocking copies are refused."""
    import threading

    stream = _ok(drv.cuStreamCreate(NON_BLOCKING))
    dst = _ok(drv.cuMemAlloc(N))
    src = _pinned(drv, os.urandom(N))
    extra = _ok(drv.cuMemAlloc(N))
    seen = {}

    def bare():
        seen["copy"] = drv.cuMemcpyHtoDAsync(dst, src, N, stream)[0]
        seen["wait"] = drv.cuStreamSynchronize(stream)[0]
        seen["free"] = drv.cuMemFree(extra)[0]
        seen["null stream"] = drv.cuStreamSynchronize(0)[0]
        seen["alloc"] = drv.cuMemAlloc(N)[0]
        seen["blocking copy"] = drv.cuMemcpy(dst, src, N)[0]
        seen["context sync"] = drv.cuCtxSynchronize()[0]

    t = threading.Thread(target=bare)
    t.start()
    t.join()
    ok, refused = CUresult.CUDA_SUCCESS, CUresult.CUDA_ERROR_INVALID_CONTEXT
    assert seen == {"copy": ok, "wait": ok, "free": ok, "null stream": refused, "alloc": refused,
                    "blocking copy": refused, "context sync": refused}
    back = ctypes.create_string_buffer(N)
    _ok(drv.cuMemcpy(ctypes.addressof(back), dst, N))
    assert back.raw == _peek(src, N)
