"""The stand-in driver's several devices (tests/stand_ins/fake_cuda.py): peer access as the driver grants
it, peer copies ordered like every other copy, events bound to their context; and gdskit.engine.cuda's
calls over them."""

from __future__ import annotations

import ctypes
import os

import pytest

from gdskit.engine import cuda

from fake_cuda import CUresult, FakeDriver, StandInViolation

N = 64 << 10
NON_BLOCKING = 1


@pytest.fixture
def drv():
    fake = FakeDriver(devices=3, bus_ids=["0000:03:00.0", "0000:83:00.0", "0001:c4:00.0"], peers={(0, 1), (1, 0)})
    yield fake
    fake.take_violations()


def _ok(result):
    assert int(result[0]) == 0, result
    return result[1] if len(result) == 2 else None


def _on(drv, device: int) -> None:
    _ok(drv.cuCtxSetCurrent(1000 + device))


def _device_memory(drv, device: int, data: bytes | None = None) -> int:
    _on(drv, device)
    ptr = _ok(drv.cuMemAlloc(N))
    if data is not None:
        host = ctypes.create_string_buffer(data, N)
        _ok(drv.cuMemcpy(ptr, ctypes.addressof(host), N))
    return ptr


def test_peer_access_as_the_driver_grants_it(drv):
    assert _ok(drv.cuDeviceCanAccessPeer(0, 1)) == 1 and _ok(drv.cuDeviceCanAccessPeer(1, 0)) == 1
    assert _ok(drv.cuDeviceCanAccessPeer(0, 2)) == 0 and _ok(drv.cuDeviceCanAccessPeer(0, 0)) == 0
    assert drv.cuDeviceCanAccessPeer(0, 7)[0] == CUresult.CUDA_ERROR_INVALID_DEVICE
    assert drv.cuCtxEnablePeerAccess(1001, 0)[0] == CUresult.CUDA_ERROR_INVALID_CONTEXT  # no current context
    _on(drv, 0)
    assert drv.cuCtxEnablePeerAccess(1000, 0)[0] == CUresult.CUDA_ERROR_INVALID_DEVICE
    assert drv.cuCtxEnablePeerAccess(1002, 0)[0] == CUresult.CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
    assert drv.cuCtxEnablePeerAccess(1001, 1)[0] == CUresult.CUDA_ERROR_INVALID_VALUE
    _ok(drv.cuCtxEnablePeerAccess(1001, 0))
    assert drv.cuCtxEnablePeerAccess(1001, 0)[0] == CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED


def test_a_peer_copy_runs_when_waited_for_and_says_whether_it_went_peer_to_peer(drv):
    data = os.urandom(N)
    src = _device_memory(drv, 1, data)
    dst = _device_memory(drv, 0)
    _on(drv, 1)
    s = _ok(drv.cuStreamCreate(NON_BLOCKING))
    _ok(drv.cuMemcpyPeerAsync(dst, 1000, src, 1001, N, s))
    assert ctypes.string_at(dst, N) != data, "a copy runs only when something waits for it"
    _ok(drv.cuStreamSynchronize(s))
    assert ctypes.string_at(dst, N) == data
    _ok(drv.cuCtxEnablePeerAccess(1000, 0))  # device 1 opens the way to device 0's memory
    _ok(drv.cuMemcpyPeerAsync(dst, 1000, src, 1001, N, s))
    _ok(drv.cuStreamSynchronize(s))
    assert drv.peer_copies == [(1, 0, N, False), (1, 0, N, True)]
    assert drv.violations == []


def test_peer_copies_must_name_their_memory_and_a_stream_of_either_device(drv):
    a = _device_memory(drv, 0)
    b = _device_memory(drv, 1)
    _on(drv, 2)
    elsewhere = _ok(drv.cuStreamCreate(NON_BLOCKING))
    _on(drv, 1)
    s = _ok(drv.cuStreamCreate(NON_BLOCKING))
    with pytest.raises(StandInViolation):
        drv.cuMemcpyPeerAsync(a, 1001, b, 1000, N, s)  # the contexts swapped
    drv.cuStreamSynchronize(s)
    with pytest.raises(StandInViolation):
        drv.cuMemcpyPeerAsync(a, 1000, b, 1001, N, elsewhere)
    drv.cuStreamSynchronize(elsewhere)
    host = ctypes.create_string_buffer(N)
    with pytest.raises(StandInViolation):
        drv.cuMemcpyPeerAsync(a, 1000, ctypes.addressof(host), 1001, N, s)
    drv.cuStreamSynchronize(s)
    assert len(drv.take_violations()) == 4  # the swapped pair breaks two rules


def test_a_peer_copy_racing_another_streams_copy_is_caught(drv):
    src = _device_memory(drv, 1, os.urandom(N))
    dst = _device_memory(drv, 0)
    pinned = _ok(drv.cuMemHostAlloc(N, 1))
    s0 = _ok(drv.cuStreamCreate(NON_BLOCKING))
    _on(drv, 1)
    s1 = _ok(drv.cuStreamCreate(NON_BLOCKING))
    _ok(drv.cuMemcpyHtoDAsync(src, pinned, N, s1))      # refills the source on another stream...
    _on(drv, 0)
    with pytest.raises(StandInViolation):               # ...while the peer copy reads it, unordered
        drv.cuMemcpyPeerAsync(dst, 1000, src, 1001, N, s0)
    drv.cuCtxSynchronize()
    _on(drv, 1)
    drv.cuCtxSynchronize()
    assert len(drv.take_violations()) == 1
    # Ordered by an event, the same pair is fine.
    ev = _ok(drv.cuEventCreate(0))
    _ok(drv.cuMemcpyHtoDAsync(src, pinned, N, s1))
    _ok(drv.cuEventRecord(ev, s1))
    _ok(drv.cuStreamWaitEvent(s0, ev, 0))
    _ok(drv.cuMemcpyPeerAsync(dst, 1000, src, 1001, N, s0))
    _ok(drv.cuStreamSynchronize(s0))
    assert drv.violations == [] and drv.pending() == 0


def test_an_event_is_recorded_only_on_a_stream_of_its_own_context(drv):
    _on(drv, 0)
    ev = _ok(drv.cuEventCreate(0))
    _on(drv, 1)
    s = _ok(drv.cuStreamCreate(NON_BLOCKING))
    assert drv.cuEventRecord(ev, s)[0] == CUresult.CUDA_ERROR_INVALID_HANDLE
    mine = _ok(drv.cuEventCreate(0))
    _ok(drv.cuEventRecord(mine, s))


def test_gdskit_cuda_over_several_devices(drv, stand_in_gpus):
    stand_in_gpus(drv)
    assert [cuda.device_pci_bus_id(d) for d in range(3)] == ["0000:03:00.0", "0000:83:00.0", "0001:c4:00.0"]
    assert cuda.can_access_peer(0, 1) and not cuda.can_access_peer(0, 2) and not cuda.can_access_peer(1, 1)
    # Another library (torch) opened the pair already: that counts as open.
    _on(drv, 1)
    _ok(drv.cuCtxEnablePeerAccess(1000, 0))
    cuda.enable_peer_access(1, 0)
    cuda.enable_peer_access(0, 1)
    cuda.enable_peer_access(0, 1)  # once per process
    assert drv.calls["cuCtxEnablePeerAccess"] == 3
    with pytest.raises(cuda.CudaError):
        cuda.enable_peer_access(0, 2)
    # The caller's context is back as it was, even none at all.
    drv._tls.ctx = None
    with cuda.on_device(2):
        assert int(drv.cuCtxGetCurrent()[1]) == 1002
    assert int(drv.cuCtxGetCurrent()[1]) == 0
