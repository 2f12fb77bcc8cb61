"""gdskit.data on a real GPU: batches equal the CPU target's, the ledger's bytes equal the bytes
delivered, the caller's stream is ordered after each batch without a device-wide sync, and GPU
memory stays within the read-ahead."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gdskit  # noqa: E402
import gdskit.data as gd  # noqa: E402
from data_workers import token_files  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return token_files(tmp_path_factory.mktemp("gpu_tokens"), [300_000, 120_001, 77_777], "uint16")


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_equal_the_cpu_targets_and_the_ledger_counts_them(tokens, workers):
    ds = gd.TokenDataset(tokens, dtype="uint16", seq_len=1024)
    kw = dict(shuffle=True, seed=5, prefetch=3)
    with gd.Loader(ds, 16, device="cpu", **kw) as cpu:
        ref = list(cpu)
    # The ledger is process-wide: the GPU loader is made after the CPU pass, so its delta
    # holds its own reads alone.
    with gd.Loader(ds, 16, device="cuda:0", workers=workers, **kw) as gpu:
        got = list(gpu)
        delta = gpu.stats()
    assert len(got) == len(ref) and all(g.is_cuda for g in got)
    assert all(torch.equal(g.cpu(), r) for g, r in zip(got, ref))
    delivered = sum(g.numel() * g.element_size() for g in got)
    assert delta.bytes_read == delivered
    # Small reads are staged: read on the host path into the loader's pinned memory, then copied.
    assert set(delta.paths) == {"host"} and set(delta.reasons) == {"host_memory"}
    assert gdskit.resources().pinned_bytes <= gdskit.settings.pinned_budget
    assert gpu._reader.staging.pinned_bytes == 0  # freed at close


def test_large_samples_take_the_engines_device_paths(tmp_path):
    a = np.random.default_rng(1).integers(0, 1 << 30, (6, 1 << 19), dtype=np.int32)  # 2 MiB records
    a.tofile(tmp_path / "big.bin")
    ds = gd.RecordDataset(tmp_path / "big.bin", dtype="int32", shape=(1 << 19,))
    with gd.Loader(ds, 2, device="cuda:0", shuffle=True, seed=3) as gpu:
        got = [b.cpu().numpy() for b in gpu]
        order = gpu.batch_indices(0)
        delta = gpu.stats()
    assert all(np.array_equal(g, a[idx]) for g, idx in zip(got, order))
    assert "host" not in delta.paths


def test_npy_samples_in_both_orders_and_byte_orders(tmp_path):
    rng = np.random.default_rng(0)
    for k in range(6):
        a = rng.random((8, 5)).astype(">f4" if k % 2 else "<f8") if k < 2 else rng.random((8, 5))
        np.save(tmp_path / f"a{k}.npy", np.asfortranarray(a) if k % 3 == 0 else a)
    files = sorted(str(p) for p in tmp_path.glob("*.npy"))
    ds = gd.NpyDataset(files)
    with gd.Loader(ds, 1, device="cuda:0") as gpu:
        for b, f in zip(gpu, files):
            assert np.array_equal(b[0].cpu().numpy(), np.load(f))
    got = gd.preload(tmp_path, device="cuda:0")
    for f in files:
        t = got[f.rsplit("/", 1)[1]]
        assert t.is_cuda and np.array_equal(t.cpu().numpy(), np.load(f))


@pytest.mark.parametrize("workers", [0, 2])
def test_the_callers_stream_waits_for_each_batch_without_a_device_sync(tokens, monkeypatch, workers):
    ds = gd.TokenDataset(tokens, dtype="uint16", seq_len=1024)
    with gd.Loader(ds, 8, device="cpu", shuffle=True) as cpu:
        want = [int(b.to(torch.int64).sum()) for b in cpu]
    syncs = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(a) or real(*a, **k))
    side = torch.cuda.Stream()
    sums = []
    with gd.Loader(ds, 8, device="cuda:0", shuffle=True, prefetch=2, workers=workers) as loader, \
            torch.cuda.stream(side):
        for b in loader:
            torch.cuda._sleep(1_000_000)  # a long kernel queued before the use: the batch must still be whole
            sums.append(b.to(torch.int64).sum())
    monkeypatch.undo()
    side.synchronize()
    assert [int(s) for s in sums] == want
    assert syncs == []


@pytest.mark.parametrize("prefetch,workers", [(1, 0), (3, 0), (3, 2)])
def test_gpu_memory_stays_within_the_read_ahead(tokens, prefetch, workers):
    ds = gd.TokenDataset(tokens, dtype="uint16", seq_len=4096)
    batch_bytes = 4 * 4097 * 2
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with gd.Loader(ds, 4, device="cuda:0", prefetch=prefetch, workers=workers) as loader:
        for b in loader:
            b.float().sum()
            del b
    peak = torch.cuda.max_memory_allocated() - base
    round_up = lambda n: -(-n // 512) * 512  # noqa: E731 - torch's allocator's granule
    # The read-ahead waits in pinned host memory: on the GPU only the batch handed over (and,
    # for a caller that keeps the last one, that one), its float copy (4 bytes a token) and its sum
    assert peak <= 2 * round_up(batch_bytes) + round_up(4 * 4097 * 4) + 2 * 512


def test_many_shards_preload_as_one_job_into_their_tensors(tmp_path):
    """Many one-chunk shards (an .npy header's offset each) and a few striped ones: every tensor
    equals np.load of its file, and the ledger counts exactly the arrays' bytes."""
    rng = np.random.default_rng(1)
    arrays = {f"s{i:03d}.npy": rng.random((int(rng.integers(1, 300)), 257), dtype=np.float32) for i in range(150)}
    arrays["big.npy"] = rng.random((3 << 20) // 4, dtype=np.float32)
    for name, a in arrays.items():
        np.save(tmp_path / name, a)
    with gdskit.settings.set(chunk_size="1MiB"):
        got, delta = gd.preload(tmp_path, device="cuda:0", return_stats=True)
    assert list(got) == sorted(arrays)
    for name, a in arrays.items():
        assert got[name].is_cuda and np.array_equal(got[name].cpu().numpy(), a)
    # Files of at most 1 MiB are read whole, header and all; the larger one's array alone.
    whole = [n for n in arrays if os.path.getsize(tmp_path / n) <= 1 << 20]
    assert len(whole) == 150
    assert delta.bytes_read == (sum(os.path.getsize(tmp_path / n) for n in whole) + arrays["big.npy"].nbytes)
    assert "host" not in delta.paths


def test_small_files_cold_and_hot_with_raw_and_empty_files_equal_np_load(tmp_path):
    """Small files read whole (the header parsed from the bytes read), from the disk with O_DIRECT
    and from the page cache, beside larger files read by the many-file job."""
    from backend_conformance import drop_cache

    rng = np.random.default_rng(2)
    arrays = {f"s{i:03d}.npy": rng.random((int(rng.integers(0, 60)), 33)).astype(">i2" if i % 5 == 0 else "<f4")
              for i in range(400)}
    arrays["fortran.npy"] = np.asfortranarray(rng.random((30, 7)))
    arrays["large.npy"] = rng.random((2 << 20) // 8)
    for name, a in arrays.items():
        np.save(tmp_path / name, a)
    (tmp_path / "raw.bin").write_bytes(b"\x01\x02\x03")
    (tmp_path / "empty.bin").write_bytes(b"")
    paths = sorted(str(p) for p in tmp_path.iterdir())
    for p in paths[::2]:
        drop_cache(p)
    for round_ in ("part cold", "hot"):
        got, delta = gd.preload(tmp_path, device="cuda:0", return_stats=True)
        assert list(got) == sorted(list(arrays) + ["raw.bin", "empty.bin"])
        for name, a in arrays.items():
            t = got[name].cpu().numpy()
            assert got[name].is_cuda and t.dtype == a.dtype.newbyteorder("=") and np.array_equal(t, a), (round_, name)
        assert bytes(got["raw.bin"].cpu().numpy()) == b"\x01\x02\x03" and got["empty.bin"].numel() == 0
        assert set(delta.paths) <= {"bounce-cached", "bounce-direct"}, delta.paths
        if round_ == "hot":
            assert "bounce-direct" not in delta.paths, delta.paths
        for p in paths:  # into the page cache (O_DIRECT reads leave nothing there)
            with open(p, "rb") as f:
                f.read()


def test_files_sharing_a_header_and_files_that_only_look_alike_equal_np_load(tmp_path):
    """A small file whose first bytes are the header of the .npy file placed before it takes that
    header's layout, parsed once; a file that only starts alike (another byte order, memory order
    or dtype, or no .npy at all) gets its own, and a shared header over a short array is named."""
    rng = np.random.default_rng(4)
    a = rng.random((16, 8)).astype("<f4")
    want = {f"{k:03d}a.npy": a + k for k in range(50)}
    want["020b.npy"] = (a * 3).astype(">f4")
    want["030b.npy"] = np.asfortranarray(a + 1)
    want["040b.npy"] = rng.integers(0, 9, (16, 8)).astype("<i4")
    for name, arr in want.items():
        np.save(tmp_path / name, arr)
    header = (tmp_path / "000a.npy").read_bytes()[:128]
    raw = header + b"\x05" * 300
    (tmp_path / "025b.bin").write_bytes(raw)  # the shared header's bytes, but no .npy file
    got = gd.preload(tmp_path, device="cuda:0")
    assert sorted(got) == sorted([*want, "025b.bin"])
    for name, arr in want.items():
        t = got[name].cpu().numpy()
        assert t.dtype == arr.dtype.newbyteorder("=") and t.shape == arr.shape and np.array_equal(t, arr), name
        assert got[name].is_contiguous() == (not np.isfortran(arr)), name
    assert got["025b.bin"].dtype == torch.uint8 and bytes(got["025b.bin"].cpu().numpy()) == raw
    (tmp_path / "045b.npy").write_bytes(header + bytes(100))  # the shared header, the array cut short
    with pytest.raises(gd.TruncatedFileError, match="045b.npy"):
        gd.preload(tmp_path, device="cuda:0")


def test_the_first_bad_file_in_order_is_named_whether_read_whole_or_not(tmp_path):
    from leak_helpers import fd_count

    for k in range(60):
        np.save(tmp_path / f"{k:03d}.npy", np.arange(k + 1))
    np.save(tmp_path / "030.npy", np.zeros(3 << 20, dtype=np.uint8))   # read by the many-file job
    np.save(tmp_path / "050.npy", np.zeros(3 << 20, dtype=np.uint8))
    files = [str(tmp_path / f"{k:03d}.npy") for k in range(60)]
    bad_small = b"\x93NUMPY\x01\x00\x08\x00{}      "
    (tmp_path / "040.npy").write_bytes(bad_small)
    fds = fd_count()
    with pytest.raises(gd.NpyHeaderError, match="040.npy"):
        gd.preload(files, device="cuda:0")
    with open(files[50], "r+b") as f:
        f.write(b"junk")  # the large file's header broken: found before anything is read
    with pytest.raises(gd.NpyHeaderError, match="040.npy"):
        gd.preload(files, device="cuda:0")   # the small one comes first in the list
    with pytest.raises(gd.NpyHeaderError, match="050.npy"):
        gd.preload(files[41:], device="cuda:0")
    os.truncate(files[20], 200)  # the header whole, the array short
    with pytest.raises(gd.TruncatedFileError, match="020.npy"):
        gd.preload(files, device="cuda:0")
    assert fd_count() == fds


def test_a_file_missing_from_a_long_list_is_named_and_progress_counts_every_byte(tmp_path):
    from leak_helpers import file_fd_count

    a = np.arange(1000, dtype=np.int32)
    files = []
    for k in range(3000):
        np.save(tmp_path / f"{k:04d}.npy", a + k)
        files.append(str(tmp_path / f"{k:04d}.npy"))
    fds = file_fd_count()
    seen = []
    with pytest.raises(gdskit.errors.GdskitFileNotFoundError, match="gone.npy"):
        gd.preload(files[:2900] + [str(tmp_path / "gone.npy")] + files[2900:], device="cuda:0")
    assert file_fd_count() == fds
    got = gd.preload(files, device="cuda:0", progress=lambda done, total: seen.append((done, total)))
    assert all(np.array_equal(got[f].cpu().numpy(), a + k) for k, f in enumerate(files))
    assert seen[-1][0] == seen[-1][1] == sum(os.path.getsize(f) for f in files)
