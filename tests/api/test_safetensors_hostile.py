"""Hostile safetensors files: gdskit decides as the safetensors library does.

Differential tests against the reference: ``safetensors.deserialize`` (the Rust header
parser alone) for :mod:`gdskit.formats.safetensors_format`, ``safetensors.torch.load_file``
for :func:`gdskit.safetensors.load_file`. Where the reference refuses a file, gdskit refuses it
with a :class:`~gdskit.errors.FormatError`; where both accept it, the tensors are identical.
gdskit is stricter in one documented way only: a tensor name or metadata key that appears
twice (the reference keeps the last) raises ``DuplicateNameError``.

The mutation fuzz runs each batch in a child process with a timeout (``python
tests/api/test_safetensors_hostile.py worker DIR SEED COUNT``): a crash or a hang fails the test
instead of the test run.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys

import pytest

from memory_cap import cap_address_space
from repo_paths import child_pythonpath
from hypothesis import HealthCheck, given, settings, strategies as st

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")
st_torch = pytest.importorskip("safetensors.torch")

import gdskit.safetensors as gs  # noqa: E402
from gdskit.errors import DeviceUnavailableError, FormatError, GdskitError, GdskitFileNotFoundError  # noqa: E402
from gdskit.formats import safetensors_format as fmt  # noqa: E402

pytestmark = pytest.mark.torch

U64 = 2**64 - 1
I64 = 2**63 - 1


def mk(raw: bytes | str | dict, data: bytes = b"") -> bytes:
    """A safetensors file: ``raw`` is the header (JSON text, or a document to dump)."""
    if isinstance(raw, dict):
        raw = json.dumps(raw)
    if isinstance(raw, str):
        raw = raw.encode()
    return struct.pack("<Q", len(raw)) + raw + data


def tensor(dtype: str = "U8", shape: list[int] | None = None, offsets: list[int] | None = None) -> dict:
    return {"dtype": dtype, "shape": [1] if shape is None else shape,
            "data_offsets": [0, 1] if offsets is None else offsets}


ONE = '{"dtype":"U8","shape":[1],"data_offsets":[0,1]'   # an entry missing its closing brace


# -- what the reference decides, and what gdskit must -----------------------------

def reference_load(path: str) -> dict | BaseException:
    try:
        return st_torch.load_file(path)
    except Exception as exc:  # noqa: BLE001 - the reference refuses with several types
        return exc


def gdskit_load(path: str) -> dict | GdskitError:
    """gdskit's answer; anything but a GdskitError escapes and fails the test."""
    try:
        return gs.load_file(path, device="cpu")
    except GdskitError as exc:
        return exc


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].stride() == b[k].stride()
        and raw_bytes(a[k]) == raw_bytes(b[k]) for k in a)


def check_same_decision(path: str) -> str:
    """Assert gdskit decides as the reference; return 'ok', 'refused' or 'stricter'."""
    ref, ours = reference_load(path), gdskit_load(path)
    if isinstance(ref, BaseException):
        assert isinstance(ours, FormatError), f"the reference refuses ({ref!r}), gdskit gave {ours!r:.200}"
        return "refused"
    if isinstance(ours, BaseException):
        assert isinstance(ours, fmt.DuplicateNameError), f"the reference accepts, gdskit refuses: {ours!r}"
        return "stricter"
    assert same_tensors(ref, ours)
    return "ok"


Z = {"dtype": "F32", "data_offsets": [0, 0]}

ODD_FILES: dict[str, bytes] = {
    # zero-size tensors whose dimensions overflow: the reference's running product is checked
    "overflow before the zero": mk({"a": {**Z, "shape": [2**62, 4, 0]}}),
    "overflow 2**32 * 2**32": mk({"a": {**Z, "shape": [2**32, 2**32, 0]}}),
    "overflow 2**31 * 2**31 * 4": mk({"a": {**Z, "shape": [2**31, 2**31, 4, 0]}}),
    "no overflow 2**32 * (2**32-1)": mk({"a": {**Z, "shape": [2**32, 2**32 - 1, 0]}}),
    "dimension above int64": mk({"a": {**Z, "shape": [0, 2**63]}}),
    "dimension u64 max": mk({"a": {**Z, "shape": [0, U64]}}),
    "dimension above u64": mk({"a": {**Z, "shape": [0, 2**64]}}),
    "dimension above int64 first": mk({"a": {**Z, "shape": [2**63, 0]}}),
    "zero then two int64 max": mk({"a": {**Z, "shape": [0, I64, I64]}}),
    "int64 max then 2 then 0": mk({"a": {**Z, "shape": [I64, 2, 0]}}),
    "zero then 2**62": mk({"a": {**Z, "shape": [0, 2**62]}}),
    "zero then int64 max": mk({"a": {"dtype": "U8", "shape": [0, I64], "data_offsets": [0, 0]}}),
    "F4 zero then u64 max - 1": mk({"a": {"dtype": "F4", "shape": [0, U64 - 1], "data_offsets": [0, 0]}}),
    "F4 zero then int64 max": mk({"a": {"dtype": "F4", "shape": [0, I64], "data_offsets": [0, 0]}}),
    "F4 odd last dimension": mk({"a": tensor("F4", [2, 3], [0, 3])}, bytes(3)),
    "F4 zero-d": mk({"a": tensor("F4", [], [0, 0])}),
    "F6 has no torch dtype": mk({"a": tensor("F6_E2M3", [4], [0, 3])}, bytes(3)),
    "offsets above u64": mk({"a": {"dtype": "U8", "shape": [0], "data_offsets": [2**64, 2**64]}}),
    # names
    "empty name": mk({"": tensor()}, b"x"),
    "name with NUL": mk({"a\0b": tensor()}, b"x"),
    "name non-UTF-8": mk(b'{"\xff":' + ONE.encode() + b"}}", b"x"),
    "name lone high surrogate": mk('{"\\ud800":' + ONE + "}}", b"x"),
    "name lone low surrogate": mk('{"\\udc00":' + ONE + "}}", b"x"),
    "name surrogate pair": mk('{"\\ud83d\\ude00":' + ONE + "}}", b"x"),
    "name escaped slash": mk('{"a\\/b":' + ONE + "}}", b"x"),
    "name bad escape": mk('{"a\\qb":' + ONE + "}}", b"x"),
    "name control character": mk(b'{"a\x01":' + ONE.encode() + b"}}", b"x"),
    "name __metadata__ only": mk({"__metadata__": {"k": "v"}}),
    # duplicates
    "duplicate name, same entry": mk('{"a":' + ONE + '},"a":' + ONE + "}}", b"x"),
    "duplicate name, other dtype": mk('{"a":' + ONE + '},"a":{"dtype":"I8","shape":[1],"data_offsets":[0,1]}}',
                                      b"x"),
    "duplicate name leaving a hole": mk('{"a":' + ONE + '},"a":{"dtype":"I8","shape":[1],"data_offsets":[1,2]}}',
                                        b"xy"),
    "duplicate __metadata__": mk('{"__metadata__":{"k":"v"},"__metadata__":{"k":"w"},"a":' + ONE + "}}", b"x"),
    "duplicate metadata key": mk('{"__metadata__":{"k":"v","k":"w"},"a":' + ONE + "}}", b"x"),
    "duplicate dtype field": mk('{"a":{"dtype":"U8","dtype":"I8","shape":[1],"data_offsets":[0,1]}}', b"x"),
    "duplicate shape field": mk('{"a":{"dtype":"U8","shape":[1],"shape":[1],"data_offsets":[0,1]}}', b"x"),
    "duplicate unknown field": mk('{"a":' + ONE + ',"x":1,"x":2}}', b"x"),
    "duplicate key inside an unknown field": mk('{"a":' + ONE + ',"x":{"y":1,"y":2}}}', b"x"),
    # metadata
    "metadata null": mk('{"__metadata__":null,"a":' + ONE + "}}", b"x"),
    "metadata integer value": mk('{"__metadata__":{"k":1},"a":' + ONE + "}}", b"x"),
    "metadata list": mk('{"__metadata__":[],"a":' + ONE + "}}", b"x"),
    "metadata nested": mk('{"__metadata__":{"k":{"j":"v"}},"a":' + ONE + "}}", b"x"),
    "metadata lone surrogate": mk('{"__metadata__":{"k":"\\udc00"},"a":' + ONE + "}}", b"x"),
    "metadata empty": mk('{"__metadata__":{},"a":' + ONE + "}}", b"x"),
    # JSON the Rust parser refuses and Python's accepts
    "NaN in an unknown field": mk('{"a":' + ONE + ',"x":NaN}}', b"x"),
    "Infinity in an unknown field": mk('{"a":' + ONE + ',"x":-Infinity}}', b"x"),
    "float out of range in an unknown field": mk('{"a":' + ONE + ',"x":1e400}}', b"x"),
    "integer out of range in an unknown field": mk('{"a":' + ONE + ',"x":' + "9" * 400 + "}}", b"x"),
    "big integer in an unknown field": mk('{"a":' + ONE + ',"x":' + "9" * 30 + "}}", b"x"),
    "lone surrogate in an unknown field": mk('{"a":' + ONE + ',"x":"\\ud800"}}', b"x"),
    "nesting 127 deep": mk('{"a":' + ONE + ',"x":' + "[" * 125 + "]" * 125 + "}}", b"x"),
    "nesting 128 deep": mk('{"a":' + ONE + ',"x":' + "[" * 126 + "]" * 126 + "}}", b"x"),
    "nesting 128 deep in objects": mk('{"a":' + ONE + ',"x":' + '{"k":' * 126 + "1" + "}" * 126 + "}}", b"x"),
    "nesting 3000 deep": mk('{"a":' + ONE + ',"x":' + "[" * 3000 + "]" * 3000 + "}}", b"x"),
    "minus zero shape": mk('{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}'),
    "minus zero offset": mk('{"a":{"dtype":"U8","shape":[0],"data_offsets":[-0,0]}}'),
    "minus zero in an unknown field": mk('{"a":' + ONE + ',"x":-0}}', b"x"),
    "minus zero in a name": mk('{"a-0":' + ONE + "}}", b"x"),
    "float shape": mk('{"a":{"dtype":"U8","shape":[1.0],"data_offsets":[0,1]}}', b"x"),
    "exponent shape": mk('{"a":{"dtype":"U8","shape":[1e0],"data_offsets":[0,1]}}', b"x"),
    "bool shape": mk('{"a":{"dtype":"U8","shape":[true],"data_offsets":[0,1]}}', b"x"),
    "string offsets": mk('{"a":{"dtype":"U8","shape":[1],"data_offsets":["0","1"]}}', b"x"),
    "one offset": mk('{"a":{"dtype":"U8","shape":[1],"data_offsets":[1]}}', b"x"),
    "lower-case dtype": mk('{"a":{"dtype":"u8","shape":[1],"data_offsets":[0,1]}}', b"x"),
    "unknown dtype": mk('{"a":{"dtype":"C128","shape":[1],"data_offsets":[0,16]}}', bytes(16)),
    "missing shape": mk('{"a":{"dtype":"U8","data_offsets":[0,1]}}', b"x"),
    "null entry": mk('{"a":null}'),
    "number at top level": mk('{"a":' + ONE + '},"b":5}', b"x"),
    "top-level list": mk("[]"),
    "unknown field": mk('{"a":' + ONE + ',"x":{"y":[1,2,"z"]}}}', b"x"),
    # whitespace and framing
    "leading space": mk(" " + '{"a":' + ONE + "}}", b"x"),
    "trailing tab, CR, LF": mk('{"a":' + ONE + "}}\t\r\n", b"x"),
    "trailing form feed": mk('{"a":' + ONE + "}}\x0c", b"x"),
    "trailing NUL": mk('{"a":' + ONE + "}}\0", b"x"),
    "trailing no-break space": mk(('{"a":' + ONE + "}}").encode() + b"\xc2\xa0", b"x"),
    "byte order mark": mk(b"\xef\xbb\xbf" + ('{"a":' + ONE + "}}").encode(), b"x"),
    "header length 0": struct.pack("<Q", 0),
    "header length 1": struct.pack("<Q", 1) + b"{",
    "empty header, no data": mk("{}"),
    "empty header with data": mk("{}", b"xx"),
    # layout
    "zero-size tensors overlapping": mk({"a": tensor("U8", [0], [1, 1]), "b": tensor()}, b"x"),
    "two zero-size at one place": mk({"a": tensor("U8", [0], [0, 0]), "b": tensor("U8", [0], [0, 0])}),
    "bytes after the last tensor": mk({"a": tensor()}, b"xy"),
    "hole": mk({"a": tensor(), "b": tensor("U8", [1], [2, 3])}, b"xyz"),
    "every dtype of 8 bytes' worth": mk({dt: tensor(dt, [64 // fmt.DTYPE_BITS[dt]], [i * 8, i * 8 + 8])
                                         for i, dt in enumerate(d for d in fmt.DTYPE_BITS if 64 % fmt.DTYPE_BITS[d] == 0
                                                                and d != "F4")},
                                        bytes(range(8 * 19))),
}

STRICTER = {"duplicate name, same entry", "duplicate name, other dtype", "duplicate metadata key"}


@pytest.mark.parametrize("case", list(ODD_FILES))
def test_odd_files_decided_as_the_reference_decides(tmp_path, case: str) -> None:
    path = str(tmp_path / "odd.safetensors")
    with open(path, "wb") as fh:
        fh.write(ODD_FILES[case])
    decision = check_same_decision(path)
    assert (decision == "stricter") == (case in STRICTER)
    # The format layer alone against the Rust parser alone (no torch on either side).
    try:
        safetensors.deserialize(ODD_FILES[case])
        rust_accepts = True
    except Exception:  # noqa: BLE001
        rust_accepts = False
    try:
        fmt.parse_bytes(ODD_FILES[case])
        ours = None
    except FormatError as exc:
        ours = exc
    if not rust_accepts:
        assert ours is not None, "the Rust parser refuses this header, gdskit's parser accepts it"
    elif ours is not None:
        assert isinstance(ours, fmt.DuplicateNameError) and case in STRICTER, repr(ours)


@pytest.mark.parametrize("shape", [[2**62, 4, 0], [0, 2**63], [0, 2**64], [2**32, 2**32, 0]])
def test_zero_size_tensors_with_overflowing_dimensions_are_format_errors(tmp_path, shape) -> None:
    path = tmp_path / "z.safetensors"
    path.write_bytes(mk({"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}))
    with pytest.raises(FormatError):
        gs.load_file(path, device="cpu")


def test_zero_size_tensor_with_huge_dimensions_loads_like_the_reference(tmp_path) -> None:
    path = tmp_path / "z.safetensors"
    path.write_bytes(mk({"a": {"dtype": "F32", "shape": [0, I64, I64], "data_offsets": [0, 0]},
                         "b": tensor("U8", [2], [0, 2])}, b"hi"))
    got = gs.load_file(path, device="cpu")
    assert got["a"].shape == (0, I64, I64) and same_tensors(got, st_torch.load_file(str(path)))


# -- names when saving ---------------------------------------------------------------

@pytest.mark.parametrize("tensors, metadata", [
    ({"\ud800": 1}, None),
    ({"ok": 1, "bad\udfff": 1}, None),
    ({"ok": 1}, {"k": "\ud800"}),
    ({"ok": 1}, {"\udc00": "v"}),
])
def test_save_file_with_names_that_are_not_utf8_writes_nothing(tmp_path, tensors, metadata) -> None:
    path = tmp_path / "x.safetensors"
    with pytest.raises(fmt.UnencodableNameError) as info:
        gs.save_file({k: torch.zeros(3) for k in tensors}, path, metadata)
    assert isinstance(info.value, GdskitError) and isinstance(info.value, UnicodeError)
    assert isinstance(info.value, ValueError)
    assert os.listdir(tmp_path) == []


def test_save_file_odd_but_valid_names_round_trip_through_the_reference(tmp_path) -> None:
    tensors = {"": torch.arange(3), "a\0b": torch.ones(2), "😀": torch.zeros(1), "a/b": torch.ones(1)}
    path = tmp_path / "x.safetensors"
    gs.save_file(tensors, path, {"": "\0", "k": "😀"})
    ref = st_torch.load_file(str(path))
    assert same_tensors(ref, tensors)
    with safetensors.safe_open(str(path), "pt") as f:
        assert f.metadata() == {"": "\0", "k": "😀"}


# -- errors name the file at fault ---------------------------------------------------

def _good(path) -> None:
    st_torch.save_file({f"t{os.path.basename(str(path))}": torch.ones(4)}, str(path))


def _bad(path) -> None:
    with open(path, "wb") as fh:
        fh.write(mk({"x": tensor()}, b"xy"))   # bytes after the last tensor


@pytest.mark.parametrize("how", ["directory", "index", "index file", "list"])
def test_a_bad_shard_is_named_in_the_error(tmp_path, how: str) -> None:
    good, bad = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    _good(good)
    _bad(bad)
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(json.dumps({"weight_map": {"ta.safetensors": "a.safetensors", "x": "b.safetensors"}}).encode())
    arg = {"directory": tmp_path, "index": tmp_path, "index file": index, "list": [good, bad]}[how]
    if how == "directory":
        index.unlink()
    with pytest.raises(FormatError) as info:
        gs.load_file(arg, device="cpu")
    assert os.path.samefile(info.value.path, bad)
    assert str(bad) in str(info.value)


def test_a_bad_index_is_named_in_the_error(tmp_path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(b'{"weight_map": 3}')
    with pytest.raises(FormatError) as info:
        gs.load_file(tmp_path, device="cpu")
    assert os.path.samefile(info.value.path, index)


def test_an_index_naming_a_tensor_its_shard_lacks_is_named(tmp_path) -> None:
    _good(tmp_path / "a.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(json.dumps({"weight_map": {"missing": "a.safetensors"}}).encode())
    with pytest.raises(FormatError) as info:
        gs.load_file(tmp_path, device="cpu")
    assert os.path.samefile(info.value.path, index)


def test_a_missing_shard_or_index_is_named(tmp_path) -> None:
    _good(tmp_path / "a.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(json.dumps({"weight_map": {"ta.safetensors": "a.safetensors", "y": "gone.safetensors"}}).encode())
    with pytest.raises(GdskitFileNotFoundError) as info:
        gs.load_file(tmp_path, device="cpu")
    assert info.value.filename == str(tmp_path / "gone.safetensors")
    with pytest.raises(GdskitFileNotFoundError) as info:
        gs.load_file(tmp_path / "nothere.safetensors.index.json", device="cpu")
    assert info.value.filename == str(tmp_path / "nothere.safetensors.index.json")


def _index_naming(directory, shard_name: str):
    _good(directory / "a.safetensors")
    index = directory / "model.safetensors.index.json"
    index.write_bytes(json.dumps({"weight_map": {"ta.safetensors": "a.safetensors", "y": shard_name}}).encode())
    return index


def _every_loader(path) -> list:
    """What each safetensors loader of gdskit raised on ``path`` (None where it loaded)."""
    outcomes = []
    for load in (lambda: gs.load_file(path, device="cpu"),
                 lambda: gs.load_into({"ta.safetensors": torch.empty(4)}, path, strict=False),
                 lambda: list(gs.iter_tensors(path, device="cpu"))):
        try:
            load()
            outcomes.append(None)
        except Exception as exc:  # noqa: BLE001 - the class is what is checked
            outcomes.append(exc)
    return outcomes


@pytest.mark.parametrize("shard_name", ["b\0.safetensors", "\0", "a.safetensors\0x"])
def test_a_shard_name_with_a_nul_byte_is_a_format_error_naming_the_index(tmp_path, shard_name: str) -> None:
    index = _index_naming(tmp_path, shard_name)
    for exc in _every_loader(tmp_path):
        assert isinstance(exc, FormatError), repr(exc)
        assert os.path.samefile(exc.path, index)


_SHARD_NAMES = st.one_of(
    st.text(min_size=1, max_size=40),
    st.text(max_size=20).map(lambda s: "/" + s),                                   # absolute
    st.lists(st.sampled_from(["..", ".", "a", "", "b.safetensors"]), min_size=1, max_size=5).map("/".join),
    st.text(max_size=10).map(lambda s: s + "\0" + s),                              # NUL inside
    st.integers(256, 5000).map(lambda n: "x" * n),                                  # too long for a name or a path
    st.lists(st.sampled_from(["..", "a", "\\"]), min_size=1, max_size=4).map("\\".join),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shard_name=_SHARD_NAMES)
def test_hypothesis_shard_names_are_refused_as_gdskit_errors_or_loaded(tmp_path_factory, shard_name: str) -> None:
    directory = tmp_path_factory.mktemp("shards")
    index = _index_naming(directory, shard_name)
    parts = shard_name.replace("\\", "/").split("/")
    leaves = os.path.isabs(shard_name) or ".." in parts or "\0" in shard_name
    for exc in _every_loader(directory):
        assert exc is not None                     # tensor "y" is in no shard: never a silent load
        assert isinstance(exc, GdskitError), repr(exc)
        if leaves:
            assert isinstance(exc, FormatError) and os.path.samefile(exc.path, index), repr(exc)


def test_a_shard_with_a_dtype_torch_lacks_is_named(tmp_path) -> None:
    _good(tmp_path / "a.safetensors")
    bad = tmp_path / "b.safetensors"
    bad.write_bytes(mk({"f6": tensor("F6_E2M3", [4], [0, 3])}, bytes(3)))
    with pytest.raises(gs.UnsupportedDtypeError) as info:
        gs.load_file(tmp_path, device="cpu")
    assert os.path.samefile(info.value.path, bad)


# -- the device ------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda", 1)])
def test_cuda_device_without_cuda_is_device_unavailable(tmp_path, device) -> None:
    path = tmp_path / "a.safetensors"
    _good(path)
    with pytest.raises(DeviceUnavailableError) as info:
        gs.load_file(path, device=device)
    assert isinstance(info.value, RuntimeError)
    assert gs.DeviceUnavailableError is DeviceUnavailableError


@pytest.mark.parametrize("device", ["nonsense", "meta", True])
def test_devices_the_engine_cannot_fill_are_refused(tmp_path, device) -> None:
    path = tmp_path / "a.safetensors"
    _good(path)
    with pytest.raises(GdskitError):
        gs.load_file(path, device=device)


@pytest.mark.gpu
def test_gpu_zero_size_tensors_load_like_the_reference(tmp_path) -> None:
    path = tmp_path / "z.safetensors"
    path.write_bytes(mk({"a": {"dtype": "F32", "shape": [0, I64, I64], "data_offsets": [0, 0]},
                         "e": tensor("BF16", [3, 0], [0, 0]), "b": tensor("U8", [2], [0, 2])}, b"hi"))
    got = gs.load_file(path, device="cuda:0")
    assert all(t.device == torch.device("cuda", 0) for t in got.values())
    assert same_tensors({k: t.cpu() for k, t in got.items()}, st_torch.load_file(str(path)))


@pytest.mark.gpu
def test_gpu_index_past_the_last_gpu_is_device_unavailable(tmp_path) -> None:
    path = tmp_path / "a.safetensors"
    _good(path)
    with pytest.raises(DeviceUnavailableError):
        gs.load_file(path, device=torch.cuda.device_count())
    with pytest.raises(DeviceUnavailableError):
        gs.load_file(path, device=f"cuda:{torch.cuda.device_count()}")


# -- hypothesis: the header's offset and size arithmetic against the Rust parser --------

_DIMS = st.one_of(st.integers(0, 6), st.sampled_from([0, 1, 2, 2**31, 2**32, 2**32 - 1, 2**62, I64, 2**63,
                                                      U64, 2**64, 2**65]))
_OFFSET_NUDGE = st.sampled_from([0, 0, 0, 0, 1, -1, 2**64, -(2**64)])


@st.composite
def _headers(draw) -> tuple[bytes, int]:
    n = draw(st.integers(0, 4))
    doc: dict = {}
    pos = 0
    for i in range(n):
        dtype = draw(st.sampled_from(sorted(fmt.DTYPE_BITS)))
        shape = draw(st.lists(_DIMS, max_size=4))
        elements = 1
        for d in shape:
            elements *= d
        nbytes = elements * fmt.DTYPE_BITS[dtype] // 8
        nbytes = nbytes if nbytes <= 64 else draw(st.integers(0, 64))  # keep the file small
        start = max(0, pos + draw(_OFFSET_NUDGE)) if draw(st.booleans()) else pos
        end = max(0, start + nbytes + draw(_OFFSET_NUDGE))
        doc[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}
        pos = max(pos, end) if end < 2**20 else pos
    data_len = pos + draw(st.sampled_from([0, 0, 0, 1, -1]))
    return mk(doc, bytes(max(0, data_len))), 0


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_headers())
def test_hypothesis_header_arithmetic_decided_as_the_rust_parser(case) -> None:
    data, _ = case
    try:
        safetensors.deserialize(data)
        rust_accepts = True
    except Exception:  # noqa: BLE001
        rust_accepts = False
    try:
        h = fmt.parse_bytes(data)
    except FormatError:
        assert not rust_accepts, "gdskit refuses a header the Rust parser accepts"
        return
    assert rust_accepts, "gdskit accepts a header the Rust parser refuses"
    assert h.file_size == len(data)


# -- mutation fuzz of real files, each batch in a child process -------------------------

BATCHES = 2
PER_BATCH = 250
BATCH_TIMEOUT_S = 120


def _base_files(directory: str) -> list[str]:
    """Real files: written by the reference library and by gdskit, several dtypes, metadata."""
    g = torch.Generator().manual_seed(7)
    tensors = {
        "w": torch.randn(3, 5, generator=g), "idx": torch.arange(7), "h": torch.randn(2, 2, 2).to(torch.bfloat16),
        "empty": torch.zeros(0, 3, dtype=torch.uint8), "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(1.5, dtype=torch.float16), "f8": torch.randn(4).to(torch.float8_e4m3fn),
    }
    paths = [os.path.join(directory, "reference.safetensors"), os.path.join(directory, "gdskit.safetensors")]
    st_torch.save_file(tensors, paths[0], metadata={"format": "pt", "k": "v"})
    gs.save_file(tensors, paths[1], metadata={"format": "pt"})
    return paths


_JSON_BYTES = b'0123456789"[]{},: -.eE\\u'


def _mutate(data: bytes, rng: random.Random) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    b = bytearray(data)
    kind = rng.choice(["header byte", "header byte", "json byte", "json byte", "number", "number",
                       "length", "data", "truncate", "extend", "insert"])
    if kind == "header byte":
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(8, 8 + n)] ^= 1 << rng.randrange(8)
    elif kind == "json byte":
        b[rng.randrange(8, 8 + n)] = rng.choice(_JSON_BYTES)
    elif kind == "number":   # rewrite one number of the header: shapes and offsets
        text = b[8:8 + n].decode("utf-8", "replace")
        digits = [i for i, c in enumerate(text) if c.isdigit() and (i == 0 or not text[i - 1].isdigit())]
        if digits:
            i = rng.choice(digits)
            j = i
            while j < len(text) and text[j].isdigit():
                j += 1
            new = str(rng.choice([0, 1, 2, int(text[i:j]) + 1, max(0, int(text[i:j]) - 1), 2**31, 2**32, 2**63,
                                  U64, 2**64]))
            header = (text[:i] + new + text[j:]).encode()
            b = bytearray(struct.pack("<Q", len(header)) + header + bytes(b[8 + n:]))
    elif kind == "length":
        b[rng.randrange(0, 8)] ^= 1 << rng.randrange(8)
    elif kind == "data" and len(b) > 8 + n:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(8 + n, len(b))] = rng.randrange(256)
    elif kind == "truncate":
        del b[rng.randrange(0, len(b)):]
    elif kind == "extend":
        b += bytes(rng.randint(1, 9))
    elif kind == "insert":
        i = rng.randrange(8, len(b))
        b[i:i] = bytes([rng.choice(_JSON_BYTES)])
    return bytes(b)


def _worker(directory: str, seed: int, count: int) -> None:
    """The child: mutate, decide both ways, report each case as one JSON line."""
    rng = random.Random(seed)
    bases = [open(p, "rb").read() for p in _base_files(directory)]
    path = os.path.join(directory, "mutant.safetensors")
    for i in range(count):
        data = _mutate(rng.choice(bases), rng)
        with open(path, "wb") as fh:
            fh.write(data)
        try:
            verdict, problem = check_same_decision(path), ""
        except AssertionError as exc:
            verdict, problem = "mismatch", str(exc)[:300]
        except BaseException as exc:  # noqa: BLE001 - not a GdskitError: a defect
            verdict, problem = "escaped", f"{type(exc).__name__}: {exc}"[:300]
        if verdict in ("mismatch", "escaped"):
            keep = os.path.join(directory, f"case-{seed}-{i}.safetensors")
            with open(keep, "wb") as fh:
                fh.write(data)
        print(json.dumps({"i": i, "verdict": verdict, "problem": problem}), flush=True)


@pytest.mark.parametrize("batch", range(BATCHES))
def test_mutated_real_files_in_a_child_process(tmp_path, batch: int) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = child_pythonpath(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "worker", str(tmp_path), str(1000 + batch),
                           str(PER_BATCH)], capture_output=True, text=True, timeout=BATCH_TIMEOUT_S, env=env,
                          preexec_fn=cap_address_space)
    assert proc.returncode == 0, f"the child died ({proc.returncode}): {proc.stderr[-2000:]}"
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == PER_BATCH
    bad = [line for line in lines if line["verdict"] in ("mismatch", "escaped")]
    assert not bad, bad[:5]
    verdicts = {line["verdict"] for line in lines}
    assert {"ok", "refused"} <= verdicts, "the mutations should give both accepted and refused files"


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "worker":
    _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
