"""s3:// objects into a real GPU's memory (moto's S3 server on localhost): neighbouring reads
share a GET through a pinned lane, overlapping reads each get their bytes, and a safetensors
checkpoint loads from the server with the same tensors as from the local file."""

from __future__ import annotations

import numpy as np
import pytest

import gdskit
from gdskit.engine import cuda

from object_server import moto_endpoint, s3  # noqa: F401 - fixtures

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _gets(before) -> int:
    return sum(o.ops for o in (gdskit.stats() - before).objects if o.op == "read")


def test_neighbouring_and_overlapping_reads_into_gpu_memory(s3):
    data = np.random.default_rng(4).integers(0, 256, 9 * MiB + 5, dtype=np.uint8)
    s3.put("g.bin", data.tobytes())
    reads = [(i * MiB, MiB) for i in range(8)] + [(MiB // 2, 3 * MiB), (9 * MiB - 7, 100)]
    bufs = [cuda.DeviceArray(n) for _off, n in reads]
    before = gdskit.stats()
    with gdskit.settings.set(s3_part_size="8MiB", s3_coalesce_gap=0), gdskit.open(s3.url("g.bin")) as f:
        counts = f.read_many([(b, n, off) for b, (off, n) in zip(bufs, reads)])
    for b, (off, n), got in zip(bufs, reads, counts):
        assert got == min(n, data.size - off)
        assert np.array_equal(b.to_numpy()[:got], data[off:off + got]), off
    assert _gets(before) == 2  # the first 8 MiB (nine reads), then the tail


def test_a_checkpoint_from_the_server_equals_the_local_load(s3, tmp_path):
    torch = pytest.importorskip("torch")
    import gdskit.safetensors as gs

    g = torch.Generator().manual_seed(2)
    tensors = {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(6)}
    tensors.update({f"s{i}": torch.randn(1000 + i, generator=g).half() for i in range(50)})
    path = tmp_path / "m.safetensors"
    gs.save_file(tensors, path)
    s3.put("m.safetensors", path.read_bytes())
    local = gs.load_file(path, device="cuda:0")
    remote = gs.load_file(s3.url("m.safetensors"), device="cuda:0")
    assert local.keys() == remote.keys()
    for k in local:
        assert remote[k].device.type == "cuda" and torch.equal(local[k].cpu(), remote[k].cpu()), k
