"""gdskit.data datasets and file resolution: samples against numpy reading the same files; bad input."""

from __future__ import annotations

import os
import stat
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

torch = pytest.importorskip("torch")

import gdskit.data as gd  # noqa: E402
from data_workers import FILE_STRIDE, token_files, windows  # noqa: E402
from gdskit.data.sources import resolve  # noqa: E402
from gdskit.errors import GdskitFileNotFoundError, GdskitIsADirectoryError, InvalidArgumentError  # noqa: E402

NUMERIC = ["|b1", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8", "<c8", "<c16",
           ">i4", ">f8", ">c8", ">u2"]


def random_array(shape, descr, seed=0):
    rng = np.random.default_rng(seed)
    dt = np.dtype(descr)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(dt)
    raw = rng.integers(0, 256, int(np.prod(shape, dtype=np.int64)) * dt.itemsize, dtype=np.uint8)
    a = raw.view(dt).reshape(shape)
    if dt.kind in "fc":
        a = np.nan_to_num(a)  # NaN payloads compare unequal
    return a


def same(t: torch.Tensor, a: np.ndarray) -> bool:
    return t.shape == a.shape and np.array_equal(t.numpy(), a.astype(a.dtype.newbyteorder("="), copy=False))


# -- token files ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["uint16", "uint32", "int32", "int64"])
def test_token_windows_are_numpys_and_never_cross_files(tmp_path, dtype):
    paths = token_files(tmp_path, [1000, 129, 128, 0, 700], dtype)
    ds = gd.TokenDataset(paths, dtype=dtype, seq_len=64)
    want = windows(paths, dtype, 64)
    assert len(ds) == len(want) == 15 + 2 + 1 + 0 + 10
    for i in (0, 14, 15, 16, 17, 18, 27, -1):
        assert same(ds[i], want[i])
    if dtype in ("uint32", "int32", "int64"):  # each window stays in its file
        firsts = [int(ds[i][0]) // FILE_STRIDE for i in range(len(ds))]
        lasts = [int(ds[i][-1]) // FILE_STRIDE for i in range(len(ds))]
        assert firsts == lasts


def test_token_bad_input(tmp_path):
    p = tmp_path / "odd.bin"
    p.write_bytes(b"\0" * 1001)
    with pytest.raises(gd.FileSizeError):
        gd.TokenDataset(p, dtype="uint16", seq_len=8)  # 1001 bytes is no whole number of uint16
    for seq in (0, -3, 2.5, True, None):
        with pytest.raises(InvalidArgumentError):
            gd.TokenDataset(p, dtype="uint8", seq_len=seq)
    with pytest.raises(InvalidArgumentError):
        gd.TokenDataset(p, dtype="float32", seq_len=8)
    with pytest.raises(InvalidArgumentError):
        gd.TokenDataset(p, dtype="not-a-dtype", seq_len=8)
    with pytest.raises(GdskitFileNotFoundError) as info:
        gd.TokenDataset([p, tmp_path / "missing.bin"], dtype="uint8", seq_len=8)
    assert info.value.filename == str(tmp_path / "missing.bin")
    with pytest.raises(IndexError):
        gd.TokenDataset(p, dtype="uint8", seq_len=8)[1000]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_file_is_named(tmp_path):
    p = tmp_path / "locked.bin"
    p.write_bytes(b"\0" * 64)
    p.chmod(0)
    with pytest.raises(PermissionError) as info:
        gd.TokenDataset(p, dtype="uint8", seq_len=8)
    assert info.value.filename == str(p)


# -- records --------------------------------------------------------------------------------------

def test_records_every_way_of_saying_their_size(tmp_path):
    a = random_array((40, 3, 5), "<f4", 1)
    p = tmp_path / "rec.bin"
    a.tofile(p)
    by_shape = gd.RecordDataset(p, dtype="float32", shape=(3, 5))
    assert len(by_shape) == 40 and same(by_shape[7], a[7])
    by_bytes = gd.RecordDataset(p, record_bytes=60)
    assert by_bytes.layout == gd.Layout(torch.uint8, (60,)) and same(by_bytes[39], a[39].view(np.uint8).ravel())
    flat = gd.RecordDataset(p, record_bytes=60, dtype=np.float32)
    assert same(flat[3], a[3].ravel())
    one = gd.RecordDataset(p, dtype=torch.float32)
    assert len(one) == 600 and one[5].item() == a.ravel()[5]
    assert gd.RecordDataset(p, record_bytes=60, dtype="float32", shape=[3, 5]).layout == by_shape.layout


def test_record_bad_input(tmp_path):
    p = tmp_path / "rec.bin"
    p.write_bytes(b"\0" * 100)
    with pytest.raises(gd.FileSizeError):
        gd.RecordDataset(p, record_bytes=30)
    bad = [dict(), dict(record_bytes=0), dict(record_bytes=-4), dict(record_bytes=10, dtype="float32"),
           dict(record_bytes=12, dtype="float32", shape=(2,)), dict(dtype="float32", shape=(0, 2)),
           dict(dtype="float32", shape="ab"), dict(dtype=object)]
    for kw in bad:
        with pytest.raises((InvalidArgumentError, gd.UnsupportedDtypeError)):
            gd.RecordDataset(p, **kw)
    with pytest.raises(InvalidArgumentError):
        gd.RecordDataset(p, record_bytes=4, dtype=">f4")  # files are in this machine's byte order


# -- .npy -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("descr", NUMERIC)
def test_npy_samples_of_every_numeric_dtype_in_both_orders(tmp_path, descr):
    arrays = []
    for k, fortran in enumerate((False, True, False)):
        a = random_array((3, 4, 2), descr, k)
        a = np.asfortranarray(a) if fortran else a
        np.save(tmp_path / f"a{k}.npy", a)
        arrays.append(a)
    ds = gd.NpyDataset(sorted(str(p) for p in tmp_path.glob("*.npy")))
    assert len(ds) == 3 and ds.layout is None  # C and Fortran order: two layouts
    for k, a in enumerate(arrays):
        t = ds[k]
        assert same(t, np.load(tmp_path / f"a{k}.npy"))
        assert t.stride() == tuple(s // a.itemsize for s in a.strides)  # Fortran strides where numpy has them


def test_npy_rows_of_one_file_and_of_shards(tmp_path):
    a = random_array((50, 6), "<i2", 3)
    np.save(tmp_path / "one.npy", a)
    rows = gd.NpyDataset(tmp_path / "one.npy")
    assert rows.rows and len(rows) == 50 and same(rows[17], a[17])
    b = random_array((7, 6), "<i2", 4)
    np.save(tmp_path / "two.npy", b)
    both = gd.NpyDataset([tmp_path / "one.npy", tmp_path / "two.npy"], rows=True)
    assert len(both) == 57 and same(both[50], b[0]) and same(both[56], b[6])
    whole = gd.NpyDataset(tmp_path / "one.npy", rows=False)
    assert len(whole) == 1 and same(whole[0], a)
    vec = tmp_path / "vec.npy"
    np.save(vec, np.arange(9, dtype=">f8"))
    assert gd.NpyDataset(vec)[4].item() == 4.0  # rows of a 1-d array: scalars, byte-swapped


def test_npy_bad_input(tmp_path):
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(gd.ObjectDtypeError):
        gd.NpyDataset(tmp_path / "obj.npy")
    (tmp_path / "bad.npy").write_bytes(b"\x93NUMPY\x01\x00\x10\x00{'descr': 3}   \n")
    with pytest.raises(gd.NpyHeaderError) as info:
        gd.NpyDataset(tmp_path / "bad.npy")
    assert str(tmp_path / "bad.npy") in str(info.value)
    np.save(tmp_path / "short.npy", np.zeros((10, 10)))
    with open(tmp_path / "short.npy", "r+b") as f:
        f.truncate(300)
    with pytest.raises(gd.TruncatedFileError):
        gd.NpyDataset(tmp_path / "short.npy")
    np.save(tmp_path / "scalar.npy", np.float32(3))
    with pytest.raises(gd.UnsupportedLayoutError):
        gd.NpyDataset(tmp_path / "scalar.npy", rows=True)
    np.save(tmp_path / "fort.npy", np.asfortranarray(np.zeros((4, 3))))
    with pytest.raises(gd.UnsupportedLayoutError):
        gd.NpyDataset(tmp_path / "fort.npy", rows=True)
    np.save(tmp_path / "r1.npy", np.zeros((4, 3), dtype="<f4"))
    np.save(tmp_path / "r2.npy", np.zeros((4, 2), dtype="<f4"))
    with pytest.raises(gd.SampleMismatchError):
        gd.NpyDataset([tmp_path / "r1.npy", tmp_path / "r2.npy"], rows=True)
    for cls in (gd.NpyHeaderError, gd.TruncatedFileError, gd.SampleMismatchError, gd.UnsupportedLayoutError,
                gd.FileSizeError):
        assert issubclass(cls, ValueError)


# -- which files --------------------------------------------------------------------------------

def test_directories_globs_and_lists(tmp_path):
    for name in ("b/2.bin", "a.bin", "b/1.bin", "b/c/3.bin", ".hidden", "b/.tmp.bin"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * len(name))
    assert [s.key for s in resolve(tmp_path)] == ["a.bin", "b/1.bin", "b/2.bin", "b/c/3.bin"]
    assert [s.size for s in resolve(tmp_path)] == [5, 7, 7, 9]
    pattern = str(tmp_path / "b" / "*.bin")
    assert [s.key for s in resolve(pattern)] == [str(tmp_path / "b" / "1.bin"), str(tmp_path / "b" / "2.bin")]
    assert len(resolve(str(tmp_path / "**" / "*.bin"))) == 4
    listed = resolve([tmp_path / "b" / "2.bin", str(tmp_path / "a.bin")])
    assert [s.key for s in listed] == [str(tmp_path / "b" / "2.bin"), str(tmp_path / "a.bin")]
    with pytest.raises(InvalidArgumentError):
        resolve([tmp_path / "a.bin", str(tmp_path / "a.bin")])
    with pytest.raises(GdskitFileNotFoundError):
        resolve(str(tmp_path / "*.npy"))
    with pytest.raises(InvalidArgumentError):
        resolve([])
    with pytest.raises(InvalidArgumentError):
        resolve(b"/tmp")
    (tmp_path / "empty").mkdir()
    with pytest.raises(GdskitFileNotFoundError):
        resolve(tmp_path / "empty")
    assert not issubclass(GdskitIsADirectoryError, InvalidArgumentError)


def test_a_list_mixing_files_directories_and_globs_resolves_as_each_item_alone(tmp_path):
    """A list's plain files take a short way (one stat each); everything else in it resolves
    as that item would alone, in the list's order, and its errors are the item's."""
    import pathlib

    for name in ("d/1.bin", "d/2.bin", "g/x.bin", "g/y.bin", "f.bin", "h.bin"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * len(name))
    items = [str(tmp_path / "f.bin"), tmp_path / "d", str(tmp_path / "g" / "*.bin"), pathlib.Path(tmp_path / "h.bin")]
    alone = [s for item in items for s in resolve(item)]
    assert resolve(items) == alone
    assert [s.key for s in alone] == [str(tmp_path / "f.bin"), "1.bin", "2.bin", str(tmp_path / "g" / "x.bin"),
                                      str(tmp_path / "g" / "y.bin"), str(tmp_path / "h.bin")]
    assert [s.size for s in alone] == [5, 7, 7, 7, 7, 5]
    with pytest.raises(InvalidArgumentError, match="1.bin"):  # a directory's key named twice
        resolve([tmp_path / "d", tmp_path / "d"])
    with pytest.raises(GdskitFileNotFoundError, match="gone.bin"):
        resolve([str(tmp_path / "f.bin"), str(tmp_path / "gone.bin")])
    with pytest.raises(InvalidArgumentError, match="not a path"):
        resolve([str(tmp_path / "f.bin"), 3])

    class BytesPath:
        def __fspath__(self):
            return os.fsencode(tmp_path / "f.bin")

    with pytest.raises(InvalidArgumentError, match="bytes"):
        resolve([BytesPath()])
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "pipe")
        with pytest.raises(InvalidArgumentError, match="not a regular file"):
            resolve([str(tmp_path / "f.bin"), str(tmp_path / "pipe")])


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(picks=st.lists(st.sampled_from(["f0", "f1", "f2", "d", "d/a.bin", "g*", "gone", "pipe", "d/*.bin"]),
                      min_size=1, max_size=8))
def test_any_list_resolves_as_its_items_one_by_one(tmp_path_factory, picks):
    """Whatever a list mixes (files, a directory, globs, a file inside that directory, a missing
    name, a FIFO, repeats), it resolves to its items' own resolutions in order, or raises what the
    first failing item raises, or refuses a key named twice."""
    top = tmp_path_factory.mktemp("mix")
    for name in ("f0", "f1", "f2", "d/a.bin", "d/b.bin", "g1", "g2"):
        (top / name).parent.mkdir(parents=True, exist_ok=True)
        (top / name).write_bytes(b"x" * (len(name) + 3))
    if hasattr(os, "mkfifo"):
        os.mkfifo(top / "pipe")
    items = [str(top / p) for p in picks]
    want: list = []
    error: type | None = None
    keys: set = set()
    for item in items:
        try:
            part = resolve(item)
        except (GdskitFileNotFoundError, InvalidArgumentError) as exc:
            error = type(exc)
            break
        if any(s.key in keys for s in part):
            error = InvalidArgumentError
            break
        keys.update(s.key for s in part)
        want.extend(part)
    if error is None:
        assert resolve(items) == want
    else:
        with pytest.raises(error):
            resolve(items)


def _reference_walk(top):
    """The directory's files as a plain os.walk sees them (the rules resolve documents)."""
    found = []
    for root, dirs, names in os.walk(top):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for n in sorted(names):
            path = os.path.join(root, n)
            if not n.startswith(".") and stat.S_ISREG(os.stat(path).st_mode):
                found.append((os.path.relpath(path, top).replace(os.sep, "/"), path, os.stat(path).st_size))
    return sorted(found)


def test_a_directory_is_listed_as_os_walk_lists_it(tmp_path, monkeypatch):
    """Keys relative to the directory however it was written, links to files in and links to
    directories not followed, hidden names and what is not a regular file left out; a link that
    leads nowhere is an error that names it."""
    top = tmp_path / "data"
    for name in ("z.bin", "a/b/c/deep.bin", "a/one.bin", "a b/space.bin", "a/.hid/x.bin", "é/ü.bin", "a/b/two.bin"):
        (top / name).parent.mkdir(parents=True, exist_ok=True)
        (top / name).write_bytes(b"x" * (len(name) * 3))
    (top / "link.bin").symlink_to(top / "a" / "one.bin")
    (top / "dirlink").symlink_to(top / "a", target_is_directory=True)
    os.mkfifo(top / "a" / "pipe")
    monkeypatch.chdir(tmp_path)
    for given in (top, str(top) + "/", "data", "./data/", "data/../data"):
        got = [(s.key, s.path, s.size) for s in resolve(given)]
        assert got == _reference_walk(os.fspath(given)), given
    assert [k for k, _p, _s in _reference_walk("data")] == [
        "a b/space.bin", "a/b/c/deep.bin", "a/b/two.bin", "a/one.bin", "link.bin", "z.bin", "é/ü.bin"]
    (top / "a" / "gone.bin").symlink_to(tmp_path / "nowhere")
    with pytest.raises(GdskitFileNotFoundError, match="gone.bin"):
        resolve(top)


def test_fingerprint_follows_the_samples_not_the_place(tmp_path):
    paths = token_files(tmp_path / "x", [300, 400], "uint16")
    ds = gd.TokenDataset(paths, dtype="uint16", seq_len=16)
    shutil.copytree(tmp_path / "x", tmp_path / "y")
    moved = gd.TokenDataset(sorted(str(p) for p in (tmp_path / "y").iterdir()), dtype="uint16", seq_len=16)
    assert ds.fingerprint() == moved.fingerprint()
    assert ds.fingerprint() != gd.TokenDataset(paths, dtype="uint16", seq_len=17).fingerprint()
    with open(paths[1], "ab") as f:
        f.write(b"\0\0")
    assert ds.fingerprint() != gd.TokenDataset(paths, dtype="uint16", seq_len=16).fingerprint()
