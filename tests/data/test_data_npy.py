"""The ``.npy`` header parser against numpy's own reader: what it accepts, numpy accepts the same way."""

from __future__ import annotations

import io
import os
import struct
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings as hsettings, strategies as st
from numpy.lib import format as npformat

try:  # numpy 2 keeps the reader behind the public module
    from numpy.lib._format_impl import _check_version, _read_array_header
except ImportError:  # numpy 1
    _check_version, _read_array_header = npformat._check_version, npformat._read_array_header

from gdskit.formats import npy_format as npy
from gdskit.data.errors import NpyHeaderError, ObjectDtypeError, UnsupportedDtypeError
from gdskit.errors import FormatError, GdskitError

DTYPES = ["|b1", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8", "<c8", "<c16",
          ">i2", ">i4", ">i8", ">u2", ">u4", ">u8", ">f2", ">f4", ">f8", ">c8", ">c16"]


def numpy_reads(blob: bytes):
    """numpy's verdict on a file's first bytes: (dtype, shape, fortran_order, data offset) or None if refused."""
    fp = io.BytesIO(blob)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            version = npformat.read_magic(fp)
            _check_version(version)
            shape, fortran, dtype = _read_array_header(fp, version)
    except Exception:  # noqa: BLE001 - any refusal
        return None
    return dtype, shape, fortran, fp.tell()


def ours(blob: bytes):
    try:
        h = npy.parse_header(blob)
    except (NpyHeaderError, UnsupportedDtypeError) as exc:
        assert isinstance(exc, GdskitError)
        return exc
    return h


def assert_agrees(blob: bytes) -> None:
    """Accepted here -> accepted by numpy with the same dtype, shape, order and data offset."""
    got = ours(blob)
    if isinstance(got, Exception):
        return
    ref = numpy_reads(blob)
    assert ref is not None, f"accepted a header numpy refuses: {blob[:200]!r}"
    dtype, shape, fortran, offset = ref
    assert (got.dtype, got.shape, got.fortran_order, got.data_offset) == (dtype, shape, fortran, offset)


def saved(arr: np.ndarray, version=None) -> bytes:
    buf = io.BytesIO()
    if version is None:
        np.save(buf, arr)
    else:
        npformat.write_array(buf, arr, version=version)
    return buf.getvalue()


def handmade(text: str, version=(1, 0), pad=True) -> bytes:
    """A file prefix with ``text`` as its header (padded to 64 bytes like numpy's when ``pad``)."""
    fmt = "<H" if version == (1, 0) else "<I"
    enc = "utf8" if version == (3, 0) else "latin1"
    body = text.encode(enc)
    head = 8 + struct.calcsize(fmt)
    if pad:
        body += b" " * ((-(head + len(body) + 1)) % 64) + b"\n"
    return npy.MAGIC + bytes(version) + struct.pack(fmt, len(body)) + body


# -- what numpy writes is read, for every dtype, shape and order -------------------------------

@pytest.mark.parametrize("descr", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 4), (2, 1, 3)])
def test_every_dtype_and_shape_numpy_writes(descr, shape):
    for fortran in (False, True):
        a = np.zeros(shape, dtype=descr)
        a = np.asfortranarray(a) if fortran else a
        blob = saved(a)
        h = npy.parse_header(blob)
        ref = numpy_reads(blob)
        assert ref is not None
        assert (h.dtype, h.shape, h.fortran_order, h.data_offset) == ref
        assert h.nbytes == a.nbytes


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_every_version(version):
    blob = saved(np.arange(6, dtype="<f4").reshape(2, 3), version)
    assert npy.parse_header(blob).version == version
    assert_agrees(blob)


# -- refusals, each with its class ---------------------------------------------------------------

def test_object_arrays_are_refused_without_unpickling():
    blob = saved(np.array([1, "a", None], dtype=object))
    with pytest.raises(ObjectDtypeError):
        npy.parse_header(blob)
    assert issubclass(ObjectDtypeError, TypeError) and issubclass(ObjectDtypeError, UnsupportedDtypeError)


@pytest.mark.parametrize("arr", [np.zeros(3, dtype=[("a", "<f4"), ("b", "<i2")]), np.array(["ab", "c"]),
                                 np.array([b"ab"]), np.zeros(2, dtype="M8[ns]"), np.zeros(2, dtype="V4"),
                                 np.zeros(2, dtype=np.longdouble)])
def test_dtypes_without_tensor_types_are_refused(arr):
    with pytest.raises(UnsupportedDtypeError):
        npy.parse_header(saved(arr))


@pytest.mark.parametrize("blob", [
    b"", b"\x93NUMPY", b"\x93NUMPZ\x01\x00", b"\x93NUMPY\x04\x00\x10\x00{}",
    b"\x93NUMPY\x01\x00\xff\xff" + b" " * 100,          # header longer than the file
    b"\x93NUMPY\x01\x00\x20\x4e" + b" " * 20000,        # 20,000 bytes: over numpy's limit
    b"\x93NUMPY\x03\x00\x04\x00\x00\x00\xff\xfe\xfd\n",  # not UTF-8
])
def test_broken_prefixes_are_header_errors(blob):
    with pytest.raises(NpyHeaderError):
        npy.parse_header(blob)
    assert issubclass(NpyHeaderError, FormatError) and issubclass(NpyHeaderError, ValueError)
    assert numpy_reads(blob) is None


@pytest.mark.parametrize("text", [
    "{'descr': '<f4', 'fortran_order': False}",                                  # no shape
    "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), 'extra': 1}",
    "{'descr': '<f4', 'fortran_order': 0, 'shape': (3,)}",                      # not a bool
    "{'descr': '<f4', 'fortran_order': False, 'shape': (3)}",                   # not a tuple
    "{'descr': '<f4', 'fortran_order': False, 'shape': [3]}",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (3.0,)}",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (03,)}",
    "{'descr': '<f4', 'fortran_order': Falsey, 'shape': (3,)}",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (3,)} x",
    "['descr', '<f4']",
    "{'descr': '<f4' 'fortran_order': False, 'shape': (3,)}",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (,)}",
])
def test_malformed_dictionaries_are_refused_as_numpy_refuses_them(text):
    blob = handmade(text)
    assert numpy_reads(blob) is None
    with pytest.raises(NpyHeaderError):
        npy.parse_header(blob)


@pytest.mark.parametrize("text", [
    "{'descr': '<f4', 'fortran_order': False, 'shape': (3L,)}",               # Python 2 long: numpy filters it
    "{'descr': '<f4', 'fortran_order': False, 'shape': (True, 2)}",           # a bool is an int to numpy
    "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (3,)}",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (-3,)}",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (3,)} # comment",
    "{'descr': u'<f4', 'fortran_order': False, 'shape': (3,)}",
    "{'descr': 'float32', 'fortran_order': False, 'shape': (3,)}",
])
def test_headers_numpy_takes_but_outside_the_plain_subset_are_refused(text):
    blob = handmade(text)
    assert numpy_reads(blob) is not None
    with pytest.raises((NpyHeaderError, UnsupportedDtypeError)):
        npy.parse_header(blob)


@pytest.mark.parametrize("text", [
    '{"descr": "<f4", "fortran_order": False, "shape": (3, 4)}',
    "{'shape': (3, 4), 'fortran_order': True, 'descr': '>i2'}",
    "  {'descr':'<f4','fortran_order':False,'shape':(3,4,),}",
    "{\n 'descr': '<f4',\r\n 'fortran_order': False,\t'shape': ( 3 , 4 ) }\n",
    "\t {'descr': '<f4', 'fortran_order': False, 'shape': (3,)}  \t",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (0, 00)}",
    "{'descr': '<f4', 'fortran_order': False, 'shape': ()}",
])
def test_other_writers_spellings_are_read(text):
    blob = handmade(text)
    h = npy.parse_header(blob)
    assert_agrees(blob)
    assert h.data_offset == len(blob)


# -- hostile input: fuzzing, mutation, differential ---------------------------------------------

GOOD_WS = " \t\n\r\x0c"
VALID_SHAPES = st.lists(st.integers(0, 2**14), max_size=4).map(
    lambda dims: "(" + ", ".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")")
BAD_SHAPES = st.sampled_from(["(3)", "[3]", "(-1,)", "(1.5,)", "(True,)", "(0x10,)", "(1_0,)", "(3,,)", "(3 4)"])
BAD_DESCRS = st.sampled_from(["|O", "O", "<U3", "|V4", "<f16", "float32", "<f3", "<i16", "|b2", "<M8[ns]", "<f4 "])


@st.composite
def dict_texts(draw) -> tuple[str, bool]:
    """Header dictionaries near the valid ones, and whether the text keeps to the plain subset
    (the three keys once each, a plain numeric typestr, a bool, a tuple of decimal integers,
    Python's whitespace): any key order, spacing, quoting and trailing comma, or else values of
    the wrong type, missing, repeated or extra keys, other whitespace."""
    plain = True

    def pick(good, bad):
        nonlocal plain
        if draw(st.integers(0, 24)) == 0:
            plain = False
            return draw(bad)
        return draw(good)

    q = draw(st.sampled_from(["'", '"']))
    ws = lambda: pick(st.text(alphabet=GOOD_WS, max_size=3), st.sampled_from(["\x0b", "\\", "#", "\x00"]))  # noqa: E731
    values = {
        "descr": f"{q}{pick(st.sampled_from(DTYPES), BAD_DESCRS)}{q}",
        "fortran_order": pick(st.sampled_from(["True", "False"]), st.sampled_from(["0", "1", "None", "'False'"])),
        "shape": pick(VALID_SHAPES, BAD_SHAPES),
    }
    keys = list(draw(st.permutations(["descr", "fortran_order", "shape"])))
    keys = pick(st.just(keys), st.sampled_from([keys[:2], keys + [keys[0]], keys + ["extra"], ["Shape", *keys[1:]]]))
    parts = [f"{ws()}{q}{k}{q}{ws()}:{ws()}{values.get(k, '1')}" for k in keys]
    body = ",".join(parts) + draw(st.sampled_from(["", ",", ", "]))
    lead = pick(st.text(alphabet=" \t", max_size=3), st.sampled_from(["\n", " \n", "\n ", "\x0c", "\r"]))
    tail = pick(st.sampled_from(["", " ", " \t\n", "\n", "   \n"]), st.sampled_from(["\n ", "\r", "\n\n", "\x0c"]))
    return f"{lead}{{{body}{ws()}}}{tail}", plain


@hsettings(max_examples=int(os.environ.get("GDSKIT_FUZZ_EXAMPLES", 300)), deadline=None,
           suppress_health_check=[HealthCheck.too_slow])
@given(case=dict_texts(), version=st.sampled_from([(1, 0), (2, 0), (3, 0)]), pad=st.booleans())
@example(case=("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", True), version=(1, 0), pad=True)
def test_generated_headers_agree_with_numpy(case, version, pad):
    text, plain = case
    blob = handmade(text, version, pad)
    assert_agrees(blob)
    if plain:  # inside the subset: numpy and this parser both read it
        assert numpy_reads(blob) is not None
        assert not isinstance(ours(blob), Exception)


@hsettings(max_examples=int(os.environ.get("GDSKIT_FUZZ_EXAMPLES", 200)), deadline=None)
@given(data=st.data(), descr=st.sampled_from(DTYPES),
       shape=st.lists(st.integers(0, 5), max_size=3).map(tuple), fortran=st.booleans())
def test_mutated_files_never_crash_and_never_disagree(data, descr, shape, fortran):
    """Byte flips, insertions, deletions and truncations of real files: a GdskitError or numpy's reading."""
    a = np.zeros(shape, dtype=descr)
    blob = bytearray(saved(np.asfortranarray(a) if fortran else a))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        pos = data.draw(st.integers(0, max(len(blob) - 1, 0)))
        if op == "flip" and blob:
            blob[pos] = data.draw(st.integers(0, 255))
        elif op == "insert":
            blob[pos:pos] = bytes([data.draw(st.integers(0, 255))])
        elif op == "delete" and blob:
            del blob[pos]
        else:
            del blob[pos:]
    assert_agrees(bytes(blob))


@hsettings(max_examples=100, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_after_the_magic(tail):
    for version in ((1, 0), (2, 0), (3, 0)):
        assert_agrees(npy.MAGIC + bytes(version) + tail)


def test_hostile_sizes_cost_nothing():
    """A header that claims huge dimensions, deep nesting or maximal length is refused or read
    without allocating anything of that size."""
    big = "{'descr': '<f8', 'fortran_order': False, 'shape': (%s,)}" % ", ".join(["9" * 19] * 30)
    with pytest.raises(NpyHeaderError):
        npy.parse_header(handmade(big))
    huge = "{'descr': '<f8', 'fortran_order': False, 'shape': (%s,)}" % ("9" * 5000)
    with pytest.raises(NpyHeaderError):
        npy.parse_header(handmade(huge, (2, 0)))
    deep = "{'descr': '<f8', 'fortran_order': False, 'shape': " + "(" * 4000 + ")" * 4000 + "}"
    with pytest.raises(NpyHeaderError):
        npy.parse_header(handmade(deep, (2, 0)))
    h = npy.parse_header(handmade("{'descr': '<u1', 'fortran_order': False, 'shape': (1000000000, 1000000000)}"))
    assert h.nbytes == 10**18  # a count, not an allocation


def test_read_header_names_the_file(tmp_path):
    p = tmp_path / "bad.npy"
    p.write_bytes(b"not an array at all")
    with pytest.raises(NpyHeaderError) as info:
        npy.read_header(p)
    assert str(p) in str(info.value)
    from gdskit.errors import GdskitFileNotFoundError, GdskitIsADirectoryError
    with pytest.raises(GdskitFileNotFoundError) as missing:
        npy.read_header(tmp_path / "missing.npy")
    assert missing.value.filename == str(tmp_path / "missing.npy")
    with pytest.raises(GdskitIsADirectoryError):
        npy.read_header(tmp_path)


def test_large_header_takes_a_second_read(tmp_path):
    """A header past the first 4 KiB (numpy pads long shapes' headers too) is read whole."""
    text = "{'descr': '<u1', 'fortran_order': False, 'shape': (%s,), }" % ", ".join(["1"] * 40) + " " * 6000
    p = tmp_path / "long.npy"
    p.write_bytes(handmade(text, (2, 0)) + b"\x07")
    h, size = npy.read_header(p)
    assert h.shape == (1,) * 40 and size == h.data_offset + 1


def test_shards_that_share_a_header_are_each_read_and_checked(tmp_path):
    """A header many shards share is parsed once; each file's size and validity are its own."""
    np.save(tmp_path / "a.npy", np.zeros((4, 8), np.float32))
    np.save(tmp_path / "b.npy", np.ones((4, 8), np.float32))
    np.save(tmp_path / "c.npy", np.ones((5, 8), np.float32))
    os.truncate(tmp_path / "b.npy", 140)  # its header is the same as a's; most of its data is gone
    (ha, size_a), (hb, size_b), (hc, _size_c) = (npy.read_header(tmp_path / n) for n in ("a.npy", "b.npy", "c.npy"))
    assert ha == hb and (ha.shape, hc.shape) == ((4, 8), (5, 8))
    assert size_a == os.path.getsize(tmp_path / "a.npy") and size_b == 140
    data = bytearray((tmp_path / "a.npy").read_bytes())
    data[10:14] = b"{'de"[::-1]  # the same length, a broken dictionary
    (tmp_path / "d.npy").write_bytes(bytes(data))
    for _ in range(2):  # refused every time, not remembered as good
        with pytest.raises(NpyHeaderError):
            npy.read_header(tmp_path / "d.npy")
