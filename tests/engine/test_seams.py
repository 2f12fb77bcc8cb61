"""The engine's explicit test seams: ``cuda.use_driver`` and ``direct_path.override``."""

from __future__ import annotations

import pytest

import gdskit
from gdskit.engine import cuda, direct_path, pool
from gdskit.engine.backends import cufile as cufile_backend
from gdskit.vocabulary import Path, Reason

from fake_cuda import FakeDriver

NVFS = direct_path.DirectRoute(Path.CUFILE_NVFS, None, True, False, True)
NONE = direct_path.DirectRoute(None, Reason.NVIDIA_FS_MISSING, False, False, True)


def test_an_override_holds_for_every_part_of_gdskit_until_it_ends():
    machine = direct_path.direct_route()
    with direct_path.override(NVFS) as route:
        assert route is NVFS
        # The router and the cuFile backend ask the same question and get the same answer.
        assert gdskit.engine.read_route.direct_route() is NVFS and cufile_backend.direct_route() is NVFS
        with direct_path.override(NONE):
            assert direct_path.direct_route() is NONE
        assert direct_path.direct_route() is NVFS
    assert direct_path.direct_route() is machine


def test_an_override_without_with_stays_and_outlives_an_earlier_one_ending():
    machine = direct_path.direct_route()
    outer = direct_path.override(NVFS)
    kept = direct_path.override(NONE)  # as fault injection does: for the rest of the process
    try:
        outer.__exit__(None, None, None)
        assert direct_path.direct_route() is NONE
    finally:
        kept.__exit__(None, None, None)
    assert direct_path.direct_route() is machine


def test_an_override_takes_a_route_only():
    with pytest.raises(TypeError):
        direct_path.override(Path.CUFILE_NVFS)  # type: ignore[arg-type]


@pytest.mark.skipif(cuda.device_count() > 0, reason="a real GPU is present")
def test_use_driver_switches_every_call_and_restores_the_driver_before():
    assert cuda.device_count() == 0  # no GPU here
    seen: list[int] = []
    stop = cuda.on_driver_change(lambda: seen.append(cuda.device_count()))
    fake = FakeDriver()
    try:
        _switch_and_back(fake)
    finally:
        stop()
    assert cuda.device_count() == 0
    # The hooks ran before each switch, while the driver being left was still in place.
    assert seen == [0, 1, 1, 1]
    assert fake.take_violations() == [] and fake.pending() == 0


def _switch_and_back(fake: FakeDriver) -> None:
    with cuda.use_driver(fake) as drv:
        assert drv is fake and cuda.device_count() == 1 and cuda.available()
        assert cuda.copies_batched() is None
        a = cuda.DeviceArray(4096)
        a.fill(7)
        assert a.to_numpy().tobytes() == b"\7" * 4096
        with pytest.raises(RuntimeError, match="inside"):
            with cuda.use_driver(FakeDriver()):
                assert cuda.pointer_info(a.ptr).kind is cuda.MemoryKind.HOST  # another driver: not its memory
                raise RuntimeError("inside")
        assert cuda.pointer_info(a.ptr).kind is cuda.MemoryKind.DEVICE  # this driver again
        a.free()


@pytest.mark.skipif(cuda.device_count() > 0, reason="a real GPU is present")
def test_leaving_a_driver_frees_what_the_pool_made_on_it(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * (1 << 20))
    fake = FakeDriver()
    with cuda.use_driver(fake):
        buf = cuda.DeviceArray(1 << 20)
        with gdskit.settings.set(mode="bounce"), gdskit.open(path) as f:
            assert f.read(buf) == 1 << 20
        assert pool.lanes.holds(0)
        buf.free()
    assert not pool.lanes.holds(0)
    assert fake.take_violations() == [] and fake.pending() == 0
