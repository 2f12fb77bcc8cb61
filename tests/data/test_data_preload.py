"""gdskit.data.preload on the CPU: tensors against numpy and the files' bytes; keys; bad input."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gdskit  # noqa: E402
import gdskit.data as gd  # noqa: E402
from gdskit.errors import GdskitFileNotFoundError  # noqa: E402
from backend_conformance import drop_cache  # noqa: E402
from leak_helpers import fd_count  # noqa: E402
from test_data_datasets import NUMERIC, random_array, same  # noqa: E402


def test_a_directory_of_arrays_and_other_files(tmp_path):
    want = {}
    for k, descr in enumerate(NUMERIC):
        a = random_array((3, 5), descr, k)
        if k % 2:
            a = np.asfortranarray(a)
        name = f"arrays/{k:02d}.npy"
        (tmp_path / name).parent.mkdir(exist_ok=True)
        np.save(tmp_path / name, a)
        want[name] = np.load(tmp_path / name)
    np.save(tmp_path / "arrays" / "empty.npy", np.zeros((0, 4), dtype=np.float32))
    want["arrays/empty.npy"] = np.zeros((0, 4), dtype=np.float32)
    raw = os.urandom(100_003)
    (tmp_path / "blob.bin").write_bytes(raw)
    (tmp_path / "nothing.txt").write_bytes(b"")
    got, stats = gd.preload(tmp_path, device="cpu", return_stats=True)
    assert set(got) == set(want) | {"blob.bin", "nothing.txt"}
    for name, a in want.items():
        assert same(got[name], a), name
    assert got["blob.bin"].dtype == torch.uint8 and bytes(got["blob.bin"].numpy()) == raw
    assert got["nothing.txt"].numel() == 0
    assert stats.bytes_read == sum(a.nbytes for a in want.values()) + len(raw)


def test_many_small_files_by_glob_and_list_with_progress(tmp_path):
    datas = [os.urandom(1000 + 37 * k) for k in range(300)]
    for k, d in enumerate(datas):
        (tmp_path / f"s{k:03d}.bin").write_bytes(d)
    seen = []
    fds = fd_count()
    got = gd.preload(str(tmp_path / "s*.bin"), device="cpu", progress=lambda done, total: seen.append((done, total)))
    assert fd_count() == fds
    assert list(got) == sorted(str(p) for p in tmp_path.glob("s*.bin"))
    assert all(bytes(got[str(tmp_path / f"s{k:03d}.bin")].numpy()) == d for k, d in enumerate(datas))
    total = sum(map(len, datas))
    assert seen[-1] == (total, total)
    listed = gd.preload([tmp_path / "s001.bin", str(tmp_path / "s000.bin")], device="cpu")
    assert list(listed) == [str(tmp_path / "s001.bin"), str(tmp_path / "s000.bin")]


def test_bad_files_leave_nothing_behind(tmp_path):
    np.save(tmp_path / "good.npy", np.arange(10))
    fds = fd_count()
    with pytest.raises(GdskitFileNotFoundError) as info:
        gd.preload([tmp_path / "good.npy", tmp_path / "gone.npy"], device="cpu")
    assert info.value.filename == str(tmp_path / "gone.npy")
    np.save(tmp_path / "obj.npy", np.array([None, 1], dtype=object), allow_pickle=True)
    with pytest.raises(gd.ObjectDtypeError):
        gd.preload(tmp_path, device="cpu")
    os.unlink(tmp_path / "obj.npy")
    (tmp_path / "bad.npy").write_bytes(b"\x93NUMPY\x01\x00\x08\x00{}      ")
    with pytest.raises(gd.NpyHeaderError):
        gd.preload(tmp_path, device="cpu")
    os.unlink(tmp_path / "bad.npy")
    np.save(tmp_path / "short.npy", np.zeros(1000))
    os.truncate(tmp_path / "short.npy", 2000)
    with pytest.raises(gd.TruncatedFileError):
        gd.preload(tmp_path, device="cpu")
    assert fd_count() == fds


def _evict(paths):
    """Drop the files' pages from the page cache."""
    for p in paths:
        drop_cache(p)


def _header_threads(monkeypatch):
    """The names of the threads that read each header, in the order read."""
    import importlib
    import threading

    module = importlib.import_module("gdskit.data.preload")  # the module, not the function of its name
    seen = []
    real = module._layout_and_offset

    def spy(src, *args):
        seen.append(threading.current_thread().name)
        return real(src, *args)

    monkeypatch.setattr(module, "_layout_and_offset", spy)
    return seen


def test_headers_on_the_disk_are_read_on_threads_and_cached_ones_in_order(tmp_path, monkeypatch):
    from gdskit.engine import first_page_cached

    arrays = {f"{k:03d}.npy": random_array((7, k % 5 + 1), NUMERIC[k % len(NUMERIC)], k) for k in range(200)}
    for name, a in arrays.items():
        np.save(tmp_path / name, a)
    (tmp_path / "raw.bin").write_bytes(b"xyz")
    paths = sorted(str(p) for p in tmp_path.iterdir())
    seen = _header_threads(monkeypatch)
    with gdskit.settings.set(threads=4):
        _evict(paths)
        if first_page_cached(paths[0]) is not False:
            pytest.skip("this system cannot drop a file's pages from the page cache")
        cold = gd.preload(tmp_path, device="cpu")
        assert {n for n in seen if n.startswith("gdskit-headers")} and "MainThread" not in seen
        seen.clear()
        hot = gd.preload(tmp_path, device="cpu")
        assert set(seen) == {"MainThread"}
        _evict(paths[8:])  # the first headers cached, the rest not: the sample is spread over the list
        seen.clear()
        gd.preload(tmp_path, device="cpu")
        assert {n for n in seen if n.startswith("gdskit-headers")}
    for got in (cold, hot):
        assert set(got) == set(arrays) | {"raw.bin"}
        assert all(same(got[n], a) for n, a in arrays.items())
        assert bytes(got["raw.bin"].numpy()) == b"xyz"


def test_small_files_from_the_disk_come_whole_with_their_headers(tmp_path):
    """From the disk, a small file is asked into the page cache whole as its header is read (one
    request, not two); a large one only its header (its array is read with O_DIRECT)."""
    import importlib
    import time

    from gdskit.data.sources import resolve
    from gdskit.engine import open_file

    module = importlib.import_module("gdskit.data.preload")
    for k in range(40):
        np.save(tmp_path / f"{k:02d}.npy", np.arange(30_000 + k, dtype=np.float32))  # 120 KiB each
    (tmp_path / "raw.bin").write_bytes(os.urandom(50_000))
    np.save(tmp_path / "big.npy", np.zeros(3 << 20, dtype=np.uint8))
    paths = sorted(str(p) for p in tmp_path.iterdir())
    _evict(paths)
    with gdskit.settings.set(threads=4):
        module._layouts(resolve(paths))

    def held(p):
        with open_file(p) as f:
            return f.cached()

    small = [p for p in paths if not p.endswith("big.npy")]
    deadline = time.monotonic() + 10
    while not all(held(p) for p in small) and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel's reads were queued, not waited for
    assert all(held(p) for p in small)
    assert not held(str(tmp_path / "big.npy"))


def test_headers_read_on_threads_report_the_first_bad_file_in_order(tmp_path):
    for k in range(100):
        np.save(tmp_path / f"{k:03d}.npy", np.arange(k + 1))
    (tmp_path / "040.npy").write_bytes(b"\x93NUMPY\x01\x00\x08\x00{}      ")
    np.save(tmp_path / "090.npy", np.array([None], dtype=object), allow_pickle=True)
    np.save(tmp_path / "095.npy", np.array([None], dtype=object), allow_pickle=True)
    files = [str(tmp_path / f"{k:03d}.npy") for k in range(100)]
    fds = fd_count()
    with gdskit.settings.set(threads=8):
        _evict(files)
        with pytest.raises(gd.NpyHeaderError, match="040.npy"):
            gd.preload(files, device="cpu")
        _evict(files)
        with pytest.raises(gd.ObjectDtypeError, match="090.npy"):
            gd.preload(files[41:], device="cpu")
    assert fd_count() == fds


def test_a_file_that_shrank_since_it_was_listed(tmp_path):
    from gdskit.data.preload import read_files
    from gdskit.data.read import FileReads, engine_view
    from gdskit.data.sources import resolve

    (tmp_path / "a.bin").write_bytes(b"a" * 5000)
    (src,) = resolve(tmp_path / "a.bin")
    os.truncate(tmp_path / "a.bin", 3000)
    dest = torch.zeros(5000, dtype=torch.uint8)
    with pytest.raises(gd.TruncatedFileError):
        read_files([(FileReads(src, ((5000, 0, 0),)), engine_view(dest))])


def test_many_shards_of_every_size_equal_np_load(tmp_path):
    rng = np.random.default_rng(3)
    arrays = {f"{i:03d}.npy": rng.random((int(rng.integers(0, 90)), 33)).astype("<f4" if i % 3 else ">i2")
              for i in range(120)}
    arrays["striped.npy"] = rng.random(100_000)  # several chunks at 64 KiB
    for name, a in arrays.items():
        np.save(tmp_path / name, a)
    (tmp_path / "raw.bin").write_bytes(b"\x01\x02" * 40_000)
    fds = fd_count()
    with gdskit.settings.set(chunk_size="64KiB", threads=3):
        got = gd.preload(tmp_path, device="cpu")
    assert list(got) == sorted([*arrays, "raw.bin"])
    for name, a in arrays.items():
        assert np.array_equal(got[name].numpy(), a) and got[name].shape == a.shape
    assert got["raw.bin"].numpy().tobytes() == b"\x01\x02" * 40_000
    assert fd_count() == fds


def test_a_small_file_read_whole_gets_its_layout_from_the_bytes_read(tmp_path):
    """Into GPU memory a small file is read whole and its header parsed from those bytes
    (``_layout_in``, run by the engine's workers as each file lands)."""
    from gdskit.data.layout import from_numpy
    from gdskit.data.preload import _layout_in
    from gdskit.data.sources import Source

    a = np.asfortranarray(np.arange(12, dtype=">i4").reshape(3, 4))
    np.save(tmp_path / "a.npy", a)
    data = (tmp_path / "a.npy").read_bytes()
    src = Source("a.npy", str(tmp_path / "a.npy"), len(data))
    lay, off = _layout_in(src, memoryview(data))
    assert (lay, off) == (from_numpy(a.dtype, a.shape, True), len(data) - a.nbytes)
    with pytest.raises(gd.TruncatedFileError, match="shorter than when it was listed"):
        _layout_in(src, memoryview(data[:-1]))
    short = Source("a.npy", src.path, len(data) - 1)
    with pytest.raises(gd.TruncatedFileError, match="header describes"):
        _layout_in(short, memoryview(data[:-1]))
    for bad in (b"\x93NUMPY\x01\x00\x08\x00{}      ", data[:20], b""):
        with pytest.raises(gd.NpyHeaderError, match="a.npy"):
            _layout_in(Source("a.npy", src.path, len(bad)), memoryview(bad))
    raw = Source("r.bin", str(tmp_path / "r.bin"), 5)
    lay, off = _layout_in(raw, memoryview(b"12345"))
    assert (lay.nbytes, off) == (5, 0) and lay.dtype == torch.uint8


@pytest.mark.parametrize("dtype", ["<f4", ">i2", "<c8", ">c16", "|u1", "?"])
@pytest.mark.parametrize("fortran", [False, True])
def test_a_samples_view_of_its_bytes_equals_numpys_array(dtype, fortran):
    from gdskit.data.layout import from_numpy, sample_view

    rng = np.random.default_rng(5)
    a = (rng.random((3, 4, 5)) * 100).astype(dtype)
    if fortran:
        a = np.asfortranarray(a)
    raw = torch.frombuffer(bytearray(a.tobytes(order="F" if fortran else "C")), dtype=torch.uint8)
    t = sample_view(raw, from_numpy(a.dtype, a.shape, fortran))
    assert t.shape == a.shape and np.array_equal(t.numpy(), a)
    if fortran:
        assert t.stride() == tuple(s // a.itemsize for s in a.strides)
