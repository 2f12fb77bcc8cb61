"""Routed reads on the stand-in driver with two devices placed as in a captured tree (two root
complexes, the drive beside GPU 1): the route taken, the peer copies issued, bytes exact against
a plain read, the ledger's via_gpu rows; gpu_routing off, no peer access, one GPU."""

from __future__ import annotations

import os

import numpy as np
import pytest

import gdskit
from gdskit.engine import cuda, direct_path as dr, via_gpu, gpu_routing
from gdskit.engine.buffers import ScatterList, scattered_device_view
from gdskit.machine.storage import FixtureFacts
from gdskit.vocabulary import Path

from check_helpers import fixture_root
from fake_cuda import FakeDriver
from fake_cufile import FakeCufile
from fake_stack import use_cufile

pytestmark = pytest.mark.stand_in_gpu

BUS_IDS = ["0000:03:00.0", "0000:83:00.0"]   # GPU 0 on socket 0, GPU 1 beside the drive (two-gpus-nvlink)
NVFS_ROUTE = dr.DirectRoute(Path.CUFILE_NVFS, None, True, False, True)
SMALL = {"chunk_size": "64KiB", "threads": 4, "direct_threshold": 0}


@pytest.fixture
def machine(request, stand_in_gpus):
    """Two stand-in GPUs, the drive under GPU 1's switch; ``peers``: which GPUs reach each other."""
    opts = getattr(request, "param", {})
    devices = opts.get("devices", 2)
    fake = stand_in_gpus(FakeDriver(devices=devices, bus_ids=BUS_IDS[:devices], peers=opts.get("peers")))
    with gpu_routing.use_facts(FixtureFacts(fixture_root("two-gpus-nvlink"), 259, 1)):
        yield fake
        gdskit.release_resources()


@pytest.fixture
def direct(machine, monkeypatch, route_is):
    """cuFile with a direct route (nvidia-fs), counting each GPU's reads as libcufile does."""
    fake = FakeCufile(route="nvfs", gpu_of=lambda ptr: machine.device_of(ptr) or 0)
    lib = use_cufile(monkeypatch, fake)
    route_is(NVFS_ROUTE)
    yield fake
    lib.close()


def _file(tmp_path, nbytes: int) -> tuple[str, bytes]:
    p = tmp_path / "weights.bin"
    data = os.urandom(nbytes)
    p.write_bytes(data)
    return str(p), data


def _read(path: str, device: int, size: int, file_offset: int = 0, **cfg) -> tuple[bytes, gdskit.Stats, int]:
    buf = cuda.DeviceArray(size, device)
    before = gdskit.stats()
    with gdskit.settings.set(**(SMALL | cfg)), gdskit.open(path) as f:
        n = f.read(buf, size, file_offset)
    return buf.to_numpy(n).tobytes(), gdskit.stats() - before, n


def test_the_far_gpu_reads_through_the_near_one_on_the_direct_path(tmp_path, direct, machine):
    path, data = _file(tmp_path, 3 << 20)
    got, delta, n = _read(path, 0, len(data))
    assert n == len(data) and got == data
    assert {r.via_gpu for r in delta.routed} == {1} and {r.target_gpu for r in delta.routed} == {0}
    assert delta.routed_bytes == len(data) and {r.path for r in delta.routed} == {"cufile-nvfs"}
    assert delta.direct_bytes == len(data) and set(delta.reasons) == {"direct"}
    # The bytes came in through GPU 1's cuFile counters and reached GPU 0 by peer copies.
    assert sum(direct.other_gpus[1].values()) > 0 and direct.counters["n_nvfs_reads"] == 0
    copies = machine.peer_copies
    assert copies and all(c[:2] == (1, 0) and c[3] for c in copies), "peer to peer, GPU 1 to GPU 0"
    assert sum(c[2] for c in copies) == len(data)
    assert len(copies) > 2, "a read larger than a slot is pipelined through both slots"
    per_gpu = gdskit.engine.ledger.ledger.device_snapshot()
    assert per_gpu[0]["cufile-nvfs"].bytes_read >= len(data) and 1 not in per_gpu


def test_the_near_gpu_reads_straight(tmp_path, direct, machine):
    path, data = _file(tmp_path, 1 << 20)
    got, delta, _ = _read(path, 1, len(data))
    assert got == data and delta.routed == () and machine.peer_copies == []
    assert delta.direct_bytes == len(data)


def test_routing_off_never_routes(tmp_path, direct, machine):
    path, data = _file(tmp_path, 1 << 20)
    got, delta, _ = _read(path, 0, len(data), routing="off")
    assert got == data and delta.routed == () and machine.peer_copies == []
    assert machine.calls.get("cuDeviceCanAccessPeer", 0) == 0


@pytest.mark.parametrize("machine", [{"peers": set()}], indirect=True)
def test_without_peer_access_the_far_gpu_reads_straight(tmp_path, direct, machine):
    path, data = _file(tmp_path, 1 << 20)
    got, delta, _ = _read(path, 0, len(data))
    assert got == data and delta.routed == () and machine.peer_copies == []


def test_without_a_direct_path_auto_does_not_route_and_force_does(tmp_path, machine):
    path, data = _file(tmp_path, 1 << 20)
    got, delta, _ = _read(path, 0, len(data))
    assert got == data and delta.routed == ()
    got, delta, _ = _read(path, 0, len(data), routing="force")
    assert got == data and delta.routed_bytes == len(data)
    assert {(r.via_gpu, r.target_gpu) for r in delta.routed} == {(1, 0)}
    assert {r.path for r in delta.routed} <= {"bounce-cached", "bounce-direct"}
    # force takes the other GPU even for the one nearest the drive.
    got, delta, _ = _read(path, 1, len(data), routing="force")
    assert got == data and {(r.via_gpu, r.target_gpu) for r in delta.routed} == {(0, 1)}


@pytest.mark.parametrize("offset, size, routes", [
    (8192, 300_001, True),     # an aligned body on the direct path and a ragged tail: all via_gpu
    (12288, 1 << 20, True),
    (1, 4096, False),          # no byte of it could take the direct path: auto leaves it alone
    (0, 100, False),
])
def test_unaligned_and_small_reads_are_exact(tmp_path, direct, machine, offset, size, routes):
    path, data = _file(tmp_path, 2 << 20)
    got, delta, n = _read(path, 0, size, offset)
    assert got == data[offset:offset + size] and n == size
    assert delta.routed_bytes == (size if routes else 0)
    got, delta, n = _read(path, 0, size, offset, routing="force")
    assert got == data[offset:offset + size] and n == size and delta.routed_bytes == size


def test_a_read_past_the_end_is_as_short_as_a_plain_read(tmp_path, direct, machine):
    path, data = _file(tmp_path, (1 << 20) + 123)
    size = 2 << 20
    got, delta, n = _read(path, 0, size, 4096)
    plain, _, n_plain = _read(path, 1, size, 4096)
    assert n == n_plain == len(data) - 4096 and got == plain == data[4096:]
    assert delta.routed_bytes == n


@pytest.mark.parametrize("policy, page", [("auto", 4096), ("force", 1)])
def test_many_reads_share_slots_and_land_exactly(tmp_path, direct, machine, policy, page):
    path, data = _file(tmp_path, 4 << 20)
    rng = np.random.default_rng(5)
    sizes = [int(s) for s in rng.integers(1, 300_000, 24)]
    offsets = [int(o) // page * page for o in rng.integers(0, len(data) - 300_000, 24)]
    bufs = [cuda.DeviceArray(s, 0) for s in sizes]
    near = cuda.DeviceArray(1 << 20, 1)
    seen: list[int] = []
    with gdskit.settings.set(**SMALL, routing=policy), gdskit.open(path) as f:
        counts = f.read_many([(b, s, o) for b, s, o in zip(bufs, sizes, offsets)] + [(near, 1 << 20, 0)],
                             on_bytes=seen.append)
    assert counts == sizes + [1 << 20]
    for b, s, o in zip(bufs, sizes, offsets):
        assert b.to_numpy().tobytes() == data[o:o + s]
    assert near.to_numpy().tobytes() == data[:1 << 20]
    assert sum(seen) == sum(counts)
    # auto: the reads with a direct part (a whole aligned page); force: all, GPU 1's too.
    routed_here = sum(sizes) + (1 << 20) if policy == "force" else sum(s for s in sizes if s >= 4096)
    assert sum(c[2] for c in machine.peer_copies) == routed_here


def test_a_scattered_destination_is_routed_piece_by_piece(tmp_path, direct, machine):
    # auto sends scattered reads to the bounce ring (never via_gpu); force routes them.
    path, data = _file(tmp_path, 1 << 20)
    parts = [cuda.DeviceArray(n, 0) for n in (1000, 70_000, 5)]
    targets = ScatterList([(100, parts[0].ptr, 1000), (5000, parts[1].ptr, 70_000), (80_000, parts[2].ptr, 5)])
    view = scattered_device_view(targets, 90_000, 0, parts)
    before = gdskit.stats()
    with gdskit.settings.set(**SMALL, routing="force"), gdskit.open(path) as f:
        assert f.read_many([(view, 90_000, 8192)]) == [90_000]
    assert parts[0].to_numpy().tobytes() == data[8192 + 100:8192 + 1100]
    assert parts[1].to_numpy().tobytes() == data[8192 + 5000:8192 + 75_000]
    assert parts[2].to_numpy().tobytes() == data[8192 + 80_000:8192 + 80_005]
    assert (gdskit.stats() - before).routed_bytes == 90_000


def test_a_failing_progress_callback_stops_the_routed_read(tmp_path, direct, machine):
    path, data = _file(tmp_path, 3 << 20)
    buf = cuda.DeviceArray(len(data), 0)

    class Stop(Exception):
        pass

    def stop(_n: int) -> None:
        raise Stop

    with gdskit.settings.set(**SMALL), gdskit.open(path) as f:
        with pytest.raises(Stop):
            f.read_many([(buf, len(data), 0)], on_bytes=stop)
        assert f.read(buf) == len(data)  # the file and the GPUs still work
    assert buf.to_numpy().tobytes() == data
    assert machine.pending() == 0


def test_the_callers_context_is_kept_and_staging_is_freed(tmp_path, direct, machine):
    path, data = _file(tmp_path, 1 << 20)
    buf = cuda.DeviceArray(len(data), 0)
    baseline = machine.live_allocations()
    cuda.set_device(0)
    with gdskit.settings.set(**SMALL), gdskit.open(path) as f:
        f.read(buf)
    assert int(machine.cuCtxGetCurrent()[1]) == 1000, "the caller's current device stays GPU 0"
    assert via_gpu.rings.held() == 1 and machine.live_allocations() > baseline
    gdskit.release_resources()
    assert via_gpu.rings.held() == 0 and machine.live_allocations() == baseline
    assert buf.to_numpy().tobytes() == data


@pytest.mark.parametrize("machine", [{"devices": 1}], indirect=True)
def test_one_gpu_is_a_no_op_that_asks_the_driver_nothing(tmp_path, direct, machine):
    path, data = _file(tmp_path, 1 << 20)
    for policy in ("auto", "force"):
        got, delta, _ = _read(path, 0, len(data), routing=policy)
        assert got == data and delta.routed == ()
    assert machine.peer_copies == []
    assert machine.calls.get("cuDeviceCanAccessPeer", 0) == 0 and machine.calls.get("cuCtxEnablePeerAccess", 0) == 0


def test_managed_memory_is_never_routed(tmp_path, direct, machine):
    path, data = _file(tmp_path, 1 << 20)
    buf = cuda.DeviceArray(len(data), 0, managed=True)
    before = gdskit.stats()
    with gdskit.settings.set(**SMALL, routing="force"), gdskit.open(path) as f:
        assert f.read(buf) == len(data)
    assert buf.to_numpy().tobytes() == data and (gdskit.stats() - before).routed == ()
    assert machine.peer_copies == []


def test_a_driver_that_cannot_name_the_gpus_addresses_leaves_reads_unrouted(tmp_path, direct, machine):
    from fake_cuda import CUresult

    machine.fail["cuDeviceGetPCIBusId"] = CUresult.CUDA_ERROR_INVALID_VALUE
    path, data = _file(tmp_path, 1 << 20)
    got, delta, _ = _read(path, 0, len(data))
    assert got == data and delta.routed == () and machine.calls["cuDeviceGetPCIBusId"] == 2


def test_one_route_carries_the_backends_and_the_gpu_the_read_goes_through(tmp_path, direct, machine):
    """``read_route.route_read`` is the one question: the far GPU's read is routed through GPU 1
    with its direct pieces; the near GPU's read and a write are not routed; the answer is frozen."""
    import dataclasses

    from gdskit.engine import read_route
    from gdskit.engine.buffers import adapt
    from gdskit.engine.read_route import BackendKind

    path, data = _file(tmp_path, 1 << 20)
    bufs = [cuda.DeviceArray(len(data), g) for g in (0, 1)]
    with gdskit.settings.set(**SMALL), gdskit.open(path) as f:
        cfg = gdskit.settings.snapshot()
        far, near = (read_route.route_read(f._of, adapt(b), len(data), 0, 0, cfg) for b in bufs)
        write = read_route.route_read(f._of, adapt(bufs[0]), len(data), 0, 0, cfg, other_gpu=False)
    assert far.through_other_gpu and far.via.via == 1 and far.via.target == 0
    assert near.via is None and write.via is None
    for route in (far, near, write):
        assert [p.backend for p in route.pieces] == [BackendKind.CUFILE] and route.uses_cufile
        assert route.bounce_reason is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        far.via = None  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        far.pieces[0].size = 0  # type: ignore[misc]
