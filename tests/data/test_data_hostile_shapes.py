"""``.npy`` shapes at the edges, against ``np.load``: Fortran-order rows of every shape, and empty
arrays whose dimensions overflow. gdskit gives what numpy gives, or refuses with a FormatError."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings as hsettings, strategies as st
from numpy.lib import format as npformat

torch = pytest.importorskip("torch")

import gdskit.data as gd  # noqa: E402
from gdskit.formats import npy_format as npy  # noqa: E402
from gdskit.errors import FormatError  # noqa: E402
from test_data_datasets import random_array, same  # noqa: E402

FILE_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                         HealthCheck.too_slow])


def write_npy(path, shape, descr: str, fortran: bool, data: bytes) -> str:
    """A ``.npy`` file whose header says exactly ``shape``, ``descr`` and ``fortran``, then ``data``
    (np.save chooses the order itself: a Fortran-order array that is also C-contiguous is saved as C)."""
    buf = io.BytesIO()
    npformat.write_array_header_1_0(buf, {"descr": descr, "fortran_order": fortran, "shape": tuple(shape)})
    path.write_bytes(buf.getvalue() + data)
    return str(path)


def numpy_loads(path):
    """``np.load``'s array, or None where it refuses the file."""
    try:
        return np.load(path)
    except Exception:  # noqa: BLE001 - any refusal
        return None


# -- Fortran-order rows ---------------------------------------------------------------------------

def rows_are_runs(shape) -> bool:
    """Whether each row of a Fortran-order array of ``shape`` is one run of bytes in the file."""
    return shape[0] <= 1 or math.prod(shape[1:]) <= 1


FORTRAN_SHAPES = st.tuples(st.integers(0, 4), st.lists(st.integers(0, 4), min_size=1, max_size=3)).map(
    lambda t: (t[0], *t[1])) | st.tuples(st.integers(0, 5)) | st.tuples(st.just(1), st.lists(
        st.integers(1, 5), min_size=2, max_size=4)).map(lambda t: (1, *t[1]))


@hsettings(max_examples=120, **FILE_SETTINGS)
@given(shape=FORTRAN_SHAPES, descr=st.sampled_from(["<f4", ">i2", "|u1", "<c8", ">f8", "|b1"]),
       batch=st.integers(1, 3), seed=st.integers(0, 2**16))
@example(shape=(1, 2, 3), descr="<f4", batch=1, seed=0)  # one row: served in the file's order
@example(shape=(1, 3, 1, 2), descr=">i2", batch=2, seed=1)
@example(shape=(4, 1, 1), descr="<f4", batch=3, seed=2)  # rows of one element
@example(shape=(3, 2), descr="<f4", batch=1, seed=3)  # rows scattered through the file: refused
def test_fortran_order_rows_are_numpys_rows_or_refused(tmp_path_factory, shape, descr, batch, seed):
    a = random_array(shape, descr, seed)
    path = write_npy(tmp_path_factory.mktemp("f") / "a.npy", shape, descr, True, a.tobytes(order="F"))
    ref = np.load(path)
    assert np.array_equal(ref, a)
    try:
        ds = gd.NpyDataset(path, rows=True)
    except gd.UnsupportedLayoutError:
        assert not rows_are_runs(shape)  # refused only where a row is not one run of bytes
        return
    assert rows_are_runs(shape) and len(ds) == shape[0]
    for i in range(len(ds)):
        assert same(ds[i], ref[i])
    if not len(ds):
        return
    with gd.Loader(ds, batch, device="cpu", shuffle=True, seed=seed, prefetch=1) as loader:
        for b, idx in zip(loader, loader.batch_indices(0)):
            assert same(b, np.stack([ref[i] for i in idx.tolist()]))


def test_a_single_row_fortran_array_among_c_order_shards(tmp_path):
    """Rows of one Fortran-order array of one row and of C-order arrays: the same rows, in one
    loader; where the orders do differ the rows are refused as a mismatch, never mixed up."""
    f = np.asfortranarray(random_array((1, 3, 4), "<f4", 1))
    c = random_array((5, 3, 4), "<f4", 2)
    write_npy(tmp_path / "f.npy", f.shape, "<f4", True, f.tobytes(order="F"))
    np.save(tmp_path / "c.npy", c)
    with pytest.raises(gd.SampleMismatchError):
        gd.NpyDataset([tmp_path / "f.npy", tmp_path / "c.npy"], rows=True)
    ds = gd.NpyDataset(tmp_path / "f.npy", rows=True)
    assert same(ds[0], f[0]) and ds[0].stride() == tuple(s // 4 for s in f[0].strides)
    line = np.asfortranarray(random_array((1, 1, 6), "<f4", 3))  # C and Fortran order lay it out alike
    write_npy(tmp_path / "line.npy", line.shape, "<f4", True, line.tobytes(order="F"))
    np.save(tmp_path / "more.npy", random_array((4, 1, 6), "<f4", 4))
    mixed = gd.NpyDataset([tmp_path / "line.npy", tmp_path / "more.npy"], rows=True)
    want = np.concatenate([np.load(tmp_path / "line.npy"), np.load(tmp_path / "more.npy")])
    with gd.Loader(mixed, 2, device="cpu") as loader:
        got = torch.cat(list(loader))
    assert same(got, want)


# -- empty arrays whose dimensions overflow ---------------------------------------------------------

EDGE_DIMS = [0, 0, 1, 2, 3, 5, 2**31, 2**32, 2**40, 2**61, 2**62 - 1, 2**62, 2**63 - 1]
EDGE_SHAPES = st.lists(st.sampled_from(EDGE_DIMS) | st.integers(0, 6), min_size=1, max_size=4).map(tuple)


def crafted(tmp_path_factory, shape, descr, fortran) -> str:
    """A file with ``shape`` in its header and the array's bytes when they are few (else a few
    bytes only: numpy and gdskit both find it short)."""
    nbytes = math.prod(shape) * np.dtype(descr).itemsize
    if nbytes == 0:  # numpy may refuse to make the array: no bytes to make
        data = b""
    elif nbytes <= 4096:
        data = random_array(shape, descr).tobytes(order="F" if fortran else "C")
    else:
        data = b"\x00" * 16
    return write_npy(tmp_path_factory.mktemp("e") / "a.npy", shape, descr, fortran, data)


def accepted_or_format_error(fn):
    """``fn()``'s result, or the FormatError it raised (anything else fails the test)."""
    try:
        return fn()
    except FormatError as exc:
        return exc


@hsettings(max_examples=300, **FILE_SETTINGS)
@given(shape=EDGE_SHAPES, descr=st.sampled_from(["|u1", "<f4", ">i2", "<c16", "|b1"]), fortran=st.booleans())
@example(shape=(0, 2**63 - 1, 2), descr="<f4", fortran=False)  # torch's stride calculation overflowed
@example(shape=(0, 2**62, 2**62), descr="|u1", fortran=False)  # numpy: too big
@example(shape=(0, 2**63 - 1), descr="|u1", fortran=True)  # numpy takes it
@example(shape=(2**62, 2**62, 0), descr="|u1", fortran=True)  # C order overflows before the 0, Fortran not
@example(shape=(2**62, 2**62, 0), descr="|u1", fortran=False)
@example(shape=(0, 2**61, 2), descr="|u1", fortran=True)
def test_empty_shapes_are_taken_exactly_where_numpy_takes_them(tmp_path_factory, shape, descr, fortran):
    path = crafted(tmp_path_factory, shape, descr, fortran)
    ref = numpy_loads(path)
    header = accepted_or_format_error(lambda: npy.read_header(path))
    if math.prod(shape) * np.dtype(descr).itemsize <= 4096:  # the whole array is there: the header decides
        assert isinstance(header, FormatError) == (ref is None)
    arrays = accepted_or_format_error(lambda: gd.preload(path, device="cpu"))
    whole = accepted_or_format_error(lambda: gd.NpyDataset(path, rows=False))
    if ref is None:
        assert isinstance(arrays, FormatError) and isinstance(whole, FormatError)
        return
    (t,) = arrays.values()
    assert same(t, ref) and same(whole[0], ref)
    with gd.Loader(whole, 1, device="cpu", prefetch=0) as loader:
        (b,) = list(loader)
    assert same(b[0], ref)
    rows = accepted_or_format_error(lambda: gd.NpyDataset(path, rows=True))
    if isinstance(rows, FormatError):
        assert isinstance(rows, gd.UnsupportedLayoutError) and fortran and not rows_are_runs(shape)
        return
    assert len(rows) == shape[0]
    for i in range(min(len(rows), 3)):
        assert same(rows[i], ref[i])


def test_empty_rows_past_what_a_dataset_can_number(tmp_path):
    """Each file's count of empty rows is numpy's, but together they overflow int64."""
    for k in range(2):
        write_npy(tmp_path / f"e{k}.npy", (2**62, 0), "|u1", False, b"")
        assert np.load(tmp_path / f"e{k}.npy").shape == (2**62, 0)
    one = gd.NpyDataset(tmp_path / "e0.npy", rows=True)
    assert len(one) == 2**62 and one[2**62 - 1].shape == (0,)
    with pytest.raises(gd.UnsupportedLayoutError):
        gd.NpyDataset([tmp_path / "e0.npy", tmp_path / "e1.npy"], rows=True)
