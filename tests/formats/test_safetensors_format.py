"""The pure-Python safetensors header parser, layout and read planner (no torch)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gdskit.errors import FormatError, GdskitError
from gdskit.formats import read_plan
from gdskit.formats import safetensors_format as fmt


def make_file(doc: object, data: bytes = b"", *, raw: bytes | None = None, length: int | None = None) -> bytes:
    body = raw if raw is not None else json.dumps(doc).encode()
    n = len(body) if length is None else length
    return struct.pack("<Q", n) + body + data


def one(dtype: str = "U8", shape: list[int] | None = None, offsets: list[int] | None = None) -> dict:
    return {"dtype": dtype, "shape": [4] if shape is None else shape,
            "data_offsets": [0, 4] if offsets is None else offsets}


# -- valid files ----------------------------------------------------------------

def test_parse_minimal_file() -> None:
    h = fmt.parse_bytes(make_file({"a": one(), "__metadata__": {"k": "v"}}, bytes(4)))
    assert h.names() == ["a"]
    assert h.entry("a") == fmt.TensorEntry("a", "U8", (4,), 0, 4)
    assert h.metadata == {"k": "v"}
    assert h.file_size == h.data_start + 4


def test_entries_come_back_in_data_order() -> None:
    doc = {"b": one(offsets=[4, 8]), "a": one(offsets=[0, 4])}
    assert fmt.parse_bytes(make_file(doc, bytes(8))).names() == ["a", "b"]


def test_empty_and_scalar_tensors() -> None:
    doc = {"e": one("F32", [0, 3], [0, 0]), "s": one("F64", [], [0, 8])}
    h = fmt.parse_bytes(make_file(doc, bytes(8)))
    assert h.entry("e").nbytes == 0 and h.entry("s").shape == ()


def test_sub_byte_dtypes_count_bits() -> None:
    assert fmt.nbytes_of("F4", [2, 4]) == 4
    assert fmt.nbytes_of("F6_E2M3", [4]) == 3
    with pytest.raises(fmt.LayoutError):
        fmt.nbytes_of("F4", [3])


def test_header_padding_with_spaces_is_accepted() -> None:
    body = json.dumps({"a": one()}).encode() + b" " * 100
    assert fmt.parse_bytes(make_file(None, bytes(4), raw=body)).data_start == 8 + len(body)


# -- bad files ------------------------------------------------------------------

BAD_FILES = {
    "empty file": (b"", fmt.TruncatedFileError),
    "shorter than length": (b"\x10\x00\x00", fmt.TruncatedFileError),
    "length past end": (make_file({"a": one()}, bytes(4), length=10_000), fmt.TruncatedFileError),
    "absurd length": (struct.pack("<Q", 2**63) + b"{}", fmt.HeaderError),
    "not json": (make_file(None, raw=b"{not json}"), fmt.HeaderError),
    "not utf-8": (make_file(None, raw=b'{"\xff": 1}'), fmt.HeaderError),
    "json list": (make_file([1, 2]), fmt.HeaderError),
    "entry not object": (make_file({"a": 3}), fmt.HeaderError),
    "unknown dtype": (make_file({"a": one("I4")}, bytes(4)), fmt.UnknownDtypeError),
    "dtype missing": (make_file({"a": {"shape": [4], "data_offsets": [0, 4]}}, bytes(4)), fmt.HeaderError),
    "negative shape": (make_file({"a": one(shape=[-4])}, bytes(4)), fmt.HeaderError),
    "float shape": (make_file({"a": one(shape=[4.0])}, bytes(4)), fmt.HeaderError),
    "bool offsets": (make_file({"a": one(offsets=[False, 4])}, bytes(4)), fmt.HeaderError),
    "three offsets": (make_file({"a": one(offsets=[0, 4, 8])}, bytes(4)), fmt.HeaderError),
    "end before begin": (make_file({"a": one(offsets=[4, 0])}, bytes(4)), fmt.LayoutError),
    "shape vs bytes": (make_file({"a": one("F32", [4], [0, 4])}, bytes(4)), fmt.LayoutError),
    "hole": (make_file({"a": one(), "b": one(offsets=[8, 12])}, bytes(12)), fmt.LayoutError),
    "overlap": (make_file({"a": one(), "b": one(offsets=[2, 6])}, bytes(6)), fmt.LayoutError),
    "first not at zero": (make_file({"a": one(offsets=[4, 8])}, bytes(8)), fmt.LayoutError),
    "trailing bytes": (make_file({"a": one()}, bytes(8)), fmt.LayoutError),
    "data truncated": (make_file({"a": one()}, bytes(2)), fmt.TruncatedFileError),
    "offsets past end": (make_file({"a": one(offsets=[0, 4]), "b": one(offsets=[4, 8])}, bytes(4)),
                         fmt.TruncatedFileError),
    "duplicate names": (make_file(None, bytes(8), raw=b'{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
                                                      b'"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}'),
                        fmt.HeaderError),
    "metadata not strings": (make_file({"__metadata__": {"k": 1}, "a": one()}, bytes(4)), fmt.HeaderError),
    "deep nesting": (make_file(None, raw=b"[" * 100000 + b"]" * 100000), fmt.HeaderError),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_files_raise_the_right_error(case: str) -> None:
    data, cls = BAD_FILES[case]
    with pytest.raises(cls) as info:
        fmt.parse_bytes(data)
    assert isinstance(info.value, FormatError) and isinstance(info.value, ValueError)


def test_read_header_file_missing_is_gdskit_file_not_found(tmp_path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        fmt.read_header_file(tmp_path / "nope.safetensors")
    assert isinstance(info.value, GdskitError)


# -- fuzzing --------------------------------------------------------------------

@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_fuzz_random_bytes_parse_or_format_error(data: bytes) -> None:
    try:
        fmt.parse_bytes(data)
    except FormatError:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**65) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=12)
entry_like = st.fixed_dictionaries(
    {"dtype": st.sampled_from(sorted(fmt.DTYPE_BITS) + ["X", 3]),
     "shape": st.lists(st.integers(-1, 6), max_size=3) | json_values,
     "data_offsets": st.lists(st.integers(-1, 300), min_size=0, max_size=3) | json_values})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=6), entry_like | json_values, max_size=5), st.integers(0, 300))
def test_fuzz_structured_headers(doc: dict, data_len: int) -> None:
    data = make_file(doc, bytes(data_len))
    try:
        h = fmt.parse_bytes(data)
    except FormatError:
        return
    # Whatever is accepted is internally consistent: contiguous cover of the data section.
    pos = 0
    for e in h.entries:
        assert e.start == pos and e.nbytes == fmt.nbytes_of(e.dtype, e.shape)
        pos = e.end
    assert h.file_size == len(data)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=8, max_size=120), st.integers(0, 119))
def test_fuzz_truncated_valid_file(extra: bytes, cut: int) -> None:
    good = make_file({"a": one("U8", [len(extra)], [0, len(extra)])}, extra)
    assert fmt.parse_bytes(good).entry("a").nbytes == len(extra)
    if cut < len(good):
        with pytest.raises(FormatError):
            fmt.parse_bytes(good[:cut])


# -- layout ---------------------------------------------------------------------

specs_strategy = st.lists(
    st.tuples(st.sampled_from(["U8", "F16", "BF16", "F32", "I64", "F64", "BOOL", "F8_E4M3"]),
              st.lists(st.integers(0, 40), max_size=3)),
    max_size=8)


@settings(max_examples=150, deadline=None)
@given(specs_strategy, st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2))
def test_layout_round_trips_through_the_parser(raw_specs: list, metadata: dict) -> None:
    specs = [fmt.TensorSpec(f"t{i}", dt, tuple(shape)) for i, (dt, shape) in enumerate(raw_specs)]
    lay = fmt.layout(specs, metadata)
    assert lay.data_start % fmt.DEFAULT_ALIGNMENT == 0
    data = lay.header + bytes(lay.file_size - lay.data_start)
    h = fmt.parse_bytes(data)
    assert h.data_start == lay.data_start
    assert sorted(h.entries, key=lambda e: e.name) == sorted(lay.entries, key=lambda e: e.name)
    assert (h.metadata or {}) == metadata
    # Every tensor whose size is a multiple of 4 KiB starts aligned.
    for e in lay.entries:
        if e.nbytes % 4096 == 0:
            assert lay.file_offset(e) % 4096 == 0


def test_layout_is_read_by_the_reference_library(tmp_path) -> None:
    safetensors = pytest.importorskip("safetensors")
    specs = [fmt.TensorSpec("odd", "U8", (5,)), fmt.TensorSpec("page", "F32", (1024,)),
             fmt.TensorSpec("e", "F32", (0,))]
    lay = fmt.layout(specs, {"format": "pt"})
    arrays = {"odd": np.arange(5, dtype=np.uint8), "page": np.arange(1024, dtype=np.float32),
              "e": np.zeros(0, np.float32)}
    buf = bytearray(lay.header) + bytearray(lay.file_size - lay.data_start)
    for e in lay.entries:
        buf[lay.file_offset(e):lay.file_offset(e) + e.nbytes] = arrays[e.name].tobytes()
    path = tmp_path / "x.safetensors"
    path.write_bytes(bytes(buf))
    with safetensors.safe_open(str(path), framework="np") as f:
        assert f.metadata() == {"format": "pt"}
        for name, arr in arrays.items():
            np.testing.assert_array_equal(f.get_tensor(name), arr)
    page = next(e for e in lay.entries if e.name == "page")
    assert lay.file_offset(page) % 4096 == 0


@pytest.mark.parametrize("specs", [
    [fmt.TensorSpec("a", "U8", (1,)), fmt.TensorSpec("a", "U8", (1,))],
    [fmt.TensorSpec("__metadata__", "U8", (1,))],
    [fmt.TensorSpec("a", "Q8", (1,))],
])
def test_layout_rejects_bad_specs(specs: list) -> None:
    with pytest.raises(FormatError):
        fmt.layout(specs)


def test_layout_rejects_non_string_metadata() -> None:
    with pytest.raises(FormatError):
        fmt.layout([], {"k": 1})  # type: ignore[dict-item]


# -- read planning --------------------------------------------------------------

extents_strategy = st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 3000)), max_size=30)


@settings(max_examples=300, deadline=None)
@given(extents_strategy, st.integers(1, 2048), st.integers(1, 8192), st.integers(0, 512))
def test_plan_covers_every_extent_once(raw: list, small: int, max_group: int, max_gap: int) -> None:
    # Non-overlapping extents laid out with random gaps.
    extents, pos = [], 0
    for i, (gap, size) in enumerate(raw):
        pos += gap
        extents.append(read_plan.Extent(i, pos, size))
        pos += size
    p = read_plan.plan(extents, small=small, max_group=max_group, max_gap=max_gap)
    seen = [e.key for e in p.direct] + [e.key for e in p.empty] + [m.key for g in p.groups for m in g.members]
    assert sorted(seen) == list(range(len(extents)))
    assert all(e.nbytes >= small for e in p.direct)
    assert all(e.nbytes == 0 for e in p.empty)
    for g in p.groups:
        assert g.file_offset == g.members[0].file_offset
        assert g.file_offset + g.nbytes == g.members[-1].end
        assert len(g.members) == 1 or g.nbytes <= max_group
        for a, b in zip(g.members, g.members[1:]):
            assert 0 <= b.file_offset - a.end <= max_gap
        assert all(0 < m.nbytes < small for m in g.members)
    assert p.payload_bytes == sum(e.nbytes for e in extents)
    assert p.direct_bytes == sum(e.nbytes for e in p.direct)
    assert p.read_bytes == p.direct_bytes + p.group_bytes >= p.payload_bytes
    assert p.read_bytes >= p.payload_bytes


def test_plan_without_gaps_reads_only_requested_bytes() -> None:
    ex = [read_plan.Extent("a", 0, 10), read_plan.Extent("c", 20, 10), read_plan.Extent("b", 10, 10)]
    p = read_plan.plan(ex, small=100, max_group=1000, max_gap=0)
    assert len(p.groups) == 1 and p.read_bytes == 30
    p = read_plan.plan([ex[0], ex[1]], small=100, max_group=1000, max_gap=0)
    assert len(p.groups) == 2 and p.read_bytes == 20


# -- sharded checkpoints --------------------------------------------------------

def test_resolve_directory_index_and_list(tmp_path) -> None:
    for n in ("m-1.safetensors", "m-2.safetensors"):
        (tmp_path / n).write_bytes(b"")
    assert fmt.resolve_checkpoint(tmp_path).files == (str(tmp_path / "m-1.safetensors"),
                                                      str(tmp_path / "m-2.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": "m-2.safetensors", "b": "m-1.safetensors", "c": "m-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    s = fmt.resolve_checkpoint(tmp_path)
    assert s.files == (str(tmp_path / "m-2.safetensors"), str(tmp_path / "m-1.safetensors"))
    assert s.weight_map is not None and s.weight_map["b"] == str(tmp_path / "m-1.safetensors")
    assert fmt.resolve_checkpoint(tmp_path / "model.safetensors.index.json") == s
    assert fmt.resolve_checkpoint(["x", "y"]).files == ("x", "y")


@pytest.mark.parametrize("index", [
    "not json", json.dumps({"weight_map": [1]}), json.dumps({"weight_map": {"a": "../evil.safetensors"}}),
    json.dumps({"weight_map": {"a": "/abs.safetensors"}}),
])
def test_bad_index_files(tmp_path, index: str) -> None:
    p = tmp_path / "model.safetensors.index.json"
    p.write_text(index)
    with pytest.raises(FormatError):
        fmt.resolve_checkpoint(p)


def test_empty_directory_is_a_format_error(tmp_path) -> None:
    with pytest.raises(FormatError):
        fmt.resolve_checkpoint(tmp_path)
