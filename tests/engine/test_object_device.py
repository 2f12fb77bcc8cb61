"""s3:// objects into and out of GPU memory on the stand-in CUDA driver (tests/stand_ins/fake_cuda.py):
each GET's body goes through the engine's pinned lanes and asynchronous copies, which the
stand-in completes only when they are waited for (a missing wait shows as wrong bytes)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

import gdskit
from gdskit.engine import cuda, pool
from gdskit.errors import InvalidArgumentError, ObjectStoreError

from fake_cuda import CUmemorytype
from object_server import fault_proxy, moto_endpoint, s3  # noqa: F401 - fixtures

pytestmark = pytest.mark.skipif(cuda.device_count() > 0, reason="a real GPU is present")

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _fake(fake_cuda):
    fake_cuda.fail.clear()
    pool.lanes.forget_register_error()
    with gdskit.settings.set(s3_part_size="5MiB", s3_concurrency=3, chunk_size="1MiB", threads=4,
                             pinned_budget="4MiB", s3_backoff=0.001):
        yield fake_cuda
    pool.lanes.forget_register_error()


def _object(s3, key: str, n: int, seed: int = 0) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    s3.put(key, data.tobytes())
    return data


def test_object_into_device_memory_through_pinned_lanes(s3, fake_cuda):
    data = _object(s3, "d.bin", 11 * MiB + 321)
    buf = cuda.DeviceArray(data.size + 100)
    before = gdskit.stats()
    with gdskit.open(s3.url("d.bin")) as f:
        assert f.read(buf, data.size - 5, 5, 100) == data.size - 5
    assert np.array_equal(buf.to_numpy()[100:100 + data.size - 5], data[5:])
    delta = gdskit.stats() - before
    assert set(delta.paths) == {"object"} and set(delta.reasons) == {"object_store"}
    assert delta.bytes_read == data.size - 5
    assert gdskit.resources().pinned_bytes <= gdskit.settings.pinned_budget


def test_many_reads_into_device_and_host_at_once(s3):
    data = _object(s3, "m.bin", 7 * MiB)
    dev, host = cuda.DeviceArray(6 * MiB), np.zeros(MiB, np.uint8)
    before = gdskit.stats()
    with gdskit.open(s3.url("m.bin")) as f:
        assert f.read_many([(dev, 6 * MiB, 0), (host, MiB, 6 * MiB)]) == [6 * MiB, MiB]
        batch = cuda.DeviceArray(30)
        assert f.read_batch(batch, [3, 7 * MiB - 10, 7 * MiB], 10) == [10, 10, 0]
    assert np.array_equal(dev.to_numpy(), data[:6 * MiB]) and np.array_equal(host, data[6 * MiB:])
    assert np.array_equal(batch.to_numpy()[:20], np.concatenate([data[3:13], data[-10:]]))
    assert set((gdskit.stats() - before).reasons) == {"object_store", "host_memory"}  # the stand-in is a GPU machine


def _gets(before) -> int:
    return sum(o.ops for o in (gdskit.stats() - before).objects if o.op == "read")


def test_reads_into_device_memory_near_each_other_share_a_get(s3):
    """Tensors of a checkpoint each into their own GPU memory: neighbours in the object share one
    ranged GET of at most ``s3_part_size`` (5 MiB here), as host reads do; each buffer gets its bytes."""
    data = _object(s3, "n.bin", 8 * MiB)
    bufs = [cuda.DeviceArray(MiB) for _ in range(8)]
    before = gdskit.stats()
    with gdskit.settings.set(s3_coalesce_gap=0), gdskit.open(s3.url("n.bin")) as f:
        assert f.read_many([(b, MiB, i * MiB) for i, b in enumerate(bufs)]) == [MiB] * 8
    for i, b in enumerate(bufs):
        assert np.array_equal(b.to_numpy(), data[i * MiB:(i + 1) * MiB]), i
    assert _gets(before) == 2  # 5 MiB, then 3


@hsettings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reads=st.lists(st.tuples(st.integers(0, 9 * MiB), st.integers(0, 3 * MiB)), min_size=1, max_size=8),
       gap=st.sampled_from([0, 4096, MiB]), host=st.lists(st.booleans(), min_size=8, max_size=8))
def test_any_reads_into_device_and_host_memory_give_the_objects_bytes(s3, reads, gap, host):
    """Reads of any offsets and sizes (overlapping, touching, past the end), each into device or
    host memory: every buffer holds the object's bytes, and nothing else changes."""
    key = "any.bin"
    if key not in s3.keys():
        _object(s3, key, 8 * MiB + 77, seed=3)
    data = s3.get(key)
    size = len(data)
    bufs = [np.full(n + 16, 7, np.uint8) if on_host else cuda.DeviceArray(n + 16)
            for (_off, n), on_host in zip(reads, host)]
    for b in bufs:
        if not isinstance(b, np.ndarray):
            b.copy_from_host(np.full(b.nbytes, 7, np.uint8))
    with gdskit.settings.set(s3_coalesce_gap=gap), gdskit.open(s3.url(key)) as f:
        counts = f.read_many([(b, n, off, 8) for b, (off, n) in zip(bufs, reads)])
    for b, (off, n), got in zip(bufs, reads, counts):
        want = max(0, min(n, size - off))
        assert got == want
        out = b if isinstance(b, np.ndarray) else b.to_numpy()
        assert out[8:8 + got].tobytes() == data[off:off + got]
        assert (out[:8] == 7).all() and (out[8 + got:] == 7).all()


def test_cut_bodies_into_device_memory_are_retried(s3, fault_proxy):
    data = _object(s3, "c.bin", 10 * MiB)
    fault_proxy.cut_mid_body = 2
    buf = cuda.DeviceArray(data.size)
    with gdskit.open(s3.url("c.bin")) as f:
        assert f.read(buf) == data.size
    assert np.array_equal(buf.to_numpy(), data)


def test_failed_device_read_leaks_no_pinned_memory(s3, fault_proxy, fake_cuda):
    _object(s3, "f.bin", 10 * MiB)
    fault_proxy.cut_mid_body = 100
    buf = cuda.DeviceArray(10 * MiB)
    with gdskit.settings.set(s3_max_retries=1), gdskit.open(s3.url("f.bin")) as f:
        with pytest.raises(ObjectStoreError):
            f.read(buf)
    gdskit.release_resources()
    assert fake_cuda.live_allocations(CUmemorytype.CU_MEMORYTYPE_HOST) == 0, "pinned buffers leaked"


def test_write_from_device_memory(s3):
    data = np.random.default_rng(9).integers(0, 256, 6 * MiB + 3, dtype=np.uint8)
    buf = cuda.DeviceArray(data.size)
    buf.copy_from_host(data)
    with gdskit.open(s3.url("w.bin"), "w") as f:
        f.write(buf)
    assert s3.get("w.bin") == data.tobytes()


def test_host_mode_refuses_device_memory(s3):
    _object(s3, "h.bin", 100)
    with gdskit.settings.set(mode="host"), gdskit.open(s3.url("h.bin")) as f:
        with pytest.raises(InvalidArgumentError):
            f.read(cuda.DeviceArray(100))
