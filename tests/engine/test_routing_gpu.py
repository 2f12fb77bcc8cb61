"""Routed reads on real GPUs: through the other GPU with routing=force where there are two (bytes
exact, peer copies, the ledger's via_gpu rows), and a no-op on one GPU. The stand-in covers the
logic in CI (tests/engine/test_routing_engine.py); this runs where scripts/gpu_test.sh runs."""

from __future__ import annotations

import os

import pytest

import gdskit
from gdskit.engine import cuda, numa, via_gpu, gpu_routing

pytestmark = pytest.mark.gpu


def _file(tmp_path, nbytes: int) -> tuple[str, bytes]:
    p = tmp_path / "routed.bin"
    data = os.urandom(nbytes)
    p.write_bytes(data)
    return str(p), data


def test_one_gpu_never_routes(tmp_path):
    if cuda.device_count() != 1:
        pytest.skip("for a machine with one GPU")
    path, data = _file(tmp_path, 64 << 20)
    buf = cuda.DeviceArray(len(data), 0)
    for policy in ("auto", "force"):
        before = gdskit.stats()
        with gdskit.settings.set(routing=policy), gdskit.open(path) as f:
            assert f.read(buf) == len(data)
        assert (gdskit.stats() - before).routed == ()
    assert buf.to_numpy().tobytes() == data


@pytest.mark.parametrize("target, size, offset", [(0, 200 << 20, 0), (1, (96 << 20) + 123, 4096 + 5)])
def test_force_routes_through_the_other_gpu_exactly(tmp_path, target, size, offset):
    if cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    path, data = _file(tmp_path, size + offset)
    buf = cuda.DeviceArray(size, target)
    before = gdskit.stats()
    with gdskit.settings.set(routing="force"), gdskit.open(path) as f:
        assert f.read(buf, size, offset) == size
    delta = gdskit.stats() - before
    assert buf.to_numpy().tobytes() == data[offset:]
    assert delta.routed_bytes == size
    assert {(r.target_gpu, r.via_gpu) for r in delta.routed} == {(target, 1 - target)}
    gdskit.release_resources()
    assert via_gpu.rings.held() == 0


def test_the_route_facts_of_this_machine():
    if cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    ids = gpu_routing.gpu_bus_ids()
    assert len(ids) == cuda.device_count() and all(len(b.split(":")) == 3 for b in ids)
    link = gpu_routing.peer_link(0, 1)
    assert link.access in (True, False)
    assert numa.place_of(0).node is None or numa.place_of(0).node >= 0
