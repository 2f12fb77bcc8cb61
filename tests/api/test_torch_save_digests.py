"""``gdskit.torch.save(obj, path, digests=True)``: the manifest it writes is hashed from the memory
each byte is written from, in file order, and equals what ``gdskit digest`` computes from the
file; the file is never read back; a save that fails leaves no file and no manifest."""

from __future__ import annotations

import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")
blake3 = pytest.importorskip("blake3")

import gdskit.torch as gt  # noqa: E402
from gdskit.formats import digest_scan  # noqa: E402
from gdskit.verify import DEFAULT_CHUNK_BYTES, MANIFEST_SUFFIX, read_manifest  # noqa: E402

pytestmark = pytest.mark.torch


def _several() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(300, 70, generator=g), "b": torch.randn(70, generator=g).to(torch.bfloat16),
            "ids": torch.randint(0, 1 << 40, (1234,), generator=g), "flag": torch.tensor(True),
            "i8": torch.randint(-128, 127, (4097,), generator=g, dtype=torch.int8)}


def _shared() -> dict[str, Any]:
    base = torch.arange(10_000, dtype=torch.float32)
    w = torch.randn(64, 64)
    return {"head": base[:100], "tail": base[9000:], "strided": base[::7], "all": base,
            "w": w, "w_again": w, "w_t": w.t(), "list": [w[3], base[5:6]]}


def _empty() -> dict[str, Any]:
    return {"empty": torch.empty(0, 5), "also_empty": torch.zeros(0, dtype=torch.int64), "one": torch.ones(3),
            "empty_view": torch.arange(10)[4:4]}


def _large() -> dict[str, Any]:
    """More than one 64 MiB chunk of file, a storage across the chunk boundary, small ones around."""
    g = torch.Generator().manual_seed(2)
    return {"small": torch.arange(10), "big": torch.randn(9 << 20, generator=g),  # 36 MiB
            "big2": torch.randn(9 << 20, generator=g).to(torch.float64),  # 72 MiB: across a chunk boundary
            "odd": torch.randint(0, 255, (3 << 20 | 7,), generator=g, dtype=torch.uint8)}


def _bytes_read_by_this_process() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


@pytest.fixture(scope="module")
def large_saved(tmp_path_factory) -> tuple[str, dict[str, Any], int]:
    """The large object saved with digests: its path, the object, and the bytes this process read
    while saving it (after a first save, whose imports read files of their own)."""
    folder = tmp_path_factory.mktemp("large")
    obj = _large()
    gt.save(_several(), str(folder / "warm-up.pt"), digests=True)
    before = _bytes_read_by_this_process()
    gt.save(obj, str(folder / "large.pt"), digests=True)
    return str(folder / "large.pt"), obj, _bytes_read_by_this_process() - before


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want))
    return got == want


@pytest.mark.parametrize("case", ["several", "shared", "empty", "large"])
def test_the_manifest_is_what_gdskit_digest_computes_and_the_file_loads(case, large_saved, tmp_path):
    if case == "large":
        path, obj, _read = large_saved
    else:
        obj = {"several": _several, "shared": _shared, "empty": _empty}[case]()
        path = str(tmp_path / "m.pt")
        gt.save(obj, path, digests=True)
    written = read_manifest(path + MANIFEST_SUFFIX)
    records = {k for k in written.files[os.path.basename(path)].tensors}
    assert records and all(k.startswith("data/") for k in records)
    digest_scan.make_manifests([path])  # `gdskit digest PATH`, over the save's own manifest
    computed = read_manifest(path + MANIFEST_SUFFIX)
    assert written == computed  # chunk size, and the file's size, mtime, digest, chunks, records
    if case == "large":
        assert len(written.files["large.pt"].chunks) >= 2
    assert _same(torch.load(path, weights_only=True), obj)
    assert _same(gt.load(path, verify=True), obj)


def test_each_record_digest_is_its_storage_bytes(tmp_path):
    """Against the blake3 package directly: the whole file's bytes, and each storage's own bytes."""
    obj = _shared()
    path = tmp_path / "s.pt"
    gt.save(obj, str(path), digests=True)
    entry = read_manifest(str(path) + MANIFEST_SUFFIX).files["s.pt"]
    data = path.read_bytes()
    assert entry.digest == blake3.blake3(data).hexdigest() and entry.size == len(data)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in [*obj.values(), *obj["list"]]
                if isinstance(t, torch.Tensor)}
    as_bytes = [torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),), (1,)).numpy() for s in storages.values()]
    want = sorted(blake3.blake3(b).hexdigest() for b in as_bytes)
    assert sorted(t.digest for t in entry.tensors.values()) == want


def test_the_file_is_never_read_back(large_saved):
    path, _obj, read = large_saved
    size = os.path.getsize(path)
    assert size > DEFAULT_CHUNK_BYTES
    assert read < size // 20


class _Refuses:
    """Pickled after the tensors before it: the save fails half-way through pickling."""

    def __reduce__(self):
        raise RuntimeError("this object cannot be saved")


def test_a_save_that_fails_while_pickling_leaves_no_file_and_no_manifest(tmp_path):
    path = tmp_path / "x.pt"
    with pytest.raises(RuntimeError):
        gt.save({"a": torch.randn(1000), "b": _Refuses(), "c": torch.ones(5)}, str(path), digests=True)
    assert os.listdir(tmp_path) == []


def test_a_failed_save_keeps_the_previous_file_and_its_manifest(tmp_path):
    path = tmp_path / "x.pt"
    old = {"old": torch.arange(50)}
    gt.save(old, str(path), digests=True)
    before = read_manifest(str(path) + MANIFEST_SUFFIX)
    with pytest.raises(RuntimeError):
        gt.save({"new": torch.randn(1000), "b": _Refuses()}, str(path), digests=True)
    assert sorted(os.listdir(tmp_path)) == ["x.pt", "x.pt" + MANIFEST_SUFFIX]
    assert read_manifest(str(path) + MANIFEST_SUFFIX) == before
    assert _same(gt.load(str(path), verify=True), old)


@pytest.mark.gpu
def test_device_storages_are_digested_on_their_gpu_as_gdskit_digest_computes(tmp_path):
    """Device storages (their record digests from the GPU kernel, their bytes fed through host
    copies, one across a chunk boundary and over one 64 MiB piece), beside host ones."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(5000, generator=g).cuda()
    obj = {"big": torch.randn(9 << 20, generator=g).to(torch.float64).cuda(),  # 72 MiB
           "head": base[:10], "tail": base[4000:], "empty": torch.empty(0, device="cuda"),
           "host": torch.arange(1000), "half": torch.randn(33, 7, generator=g).half().cuda()}
    path = str(tmp_path / "gpu.pt")
    gt.save(obj, path, digests=True)
    written = read_manifest(path + MANIFEST_SUFFIX)
    digest_scan.make_manifests([path])
    assert written == read_manifest(path + MANIFEST_SUFFIX)
    assert len(written.files["gpu.pt"].chunks) >= 2
    assert _same(torch.load(path, weights_only=True), obj)
    assert _same(gt.load(path, verify=True), obj)
