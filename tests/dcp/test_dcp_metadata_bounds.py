"""A ``.metadata`` pickle costs what its size allows: crafted streams that ask the unpickler for
far more memory than they hold (a huge memo index, a declared length past the end, one container
copied by call after call or build after build, a key nested a million deep) are refused with a
FormatError, each in a capped child that must stay small."""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from memory_cap import run_capped

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

import gdskit.dcp  # noqa: E402
import gdskit.errors  # noqa: E402

#: The child may reserve this much before it is stopped (the old reader asked for gigabytes)...
CAP = 768 << 20
#: ...and must stay this small to have been cheap: a few times the largest crafted file.
CHEAP = 32 << 20

_PROTO = b"\x80\x02"
_META = b"torch.distributed.checkpoint.metadata"


def _global(module: bytes, name: bytes) -> bytes:
    return b"c" + module + b"\n" + name + b"\n"


def _put(i: int) -> bytes:
    return b"r" + struct.pack("<I", i)


def _get(i: int) -> bytes:
    return b"j" + struct.pack("<I", i)


def _ints(n: int) -> bytes:
    return b"(" + b"K\x01" * n + b"t"


def huge_memo_index() -> bytes:
    """One LONG_BINPUT naming index 2**24: the C unpickler zeroes a 256 MiB memo for it."""
    return _PROTO + b"N" + _put(1 << 24) + b"."


def declared_bytes_past_the_end() -> bytes:
    """BINBYTES8 and BYTEARRAY8 declaring 400 MB, with ten bytes behind them."""
    return b"\x80\x05\x8e" + struct.pack("<Q", 400 << 20) + b"x" * 10 + b"."


def bytearray_past_the_end() -> bytes:
    return b"\x80\x05\x96" + struct.pack("<Q", 400 << 20) + b"x" * 10 + b"."


def size_copied_by_every_call() -> bytes:
    """torch.Size over one memoized 20,000-int tuple, called 10,000 times (1.6 GB of copies)."""
    head = _PROTO + b"]" + _put(0) + _global(b"torch", b"Size") + _put(1) + b"0" + _ints(20_000) + b"\x85" + _put(2)
    return head + b"0" + b"(" + (_get(1) + _get(2) + b"R") * 10_000 + b"e."


def state_copied_by_every_build() -> bytes:
    """A 5,000-entry state dict built into 5,000 new metadata objects (1.5 GB of dicts)."""
    keys = b"".join(b"X" + struct.pack("<I", len(k)) + k + b"N" for k in (f"k{i}".encode() for i in range(5_000)))
    head = _PROTO + b"]" + _put(0) + _global(_META, b"ChunkStorageMetadata") + _put(1) + b"0"
    head += b"}" + b"(" + keys + b"u" + _put(2) + b"0"
    return head + b"(" + (_get(1) + b")\x81" + _get(2) + b"b") * 5_000 + b"e."


def path_joined_from_one_string() -> bytes:
    """PurePosixPath of 1,000 references to one 100 KB string, ten times (1 GB of joins)."""
    part = b"p" * 100_000
    head = _PROTO + b"]" + _put(0) + _global(b"pathlib", b"PurePosixPath") + _put(1) + b"0"
    head += b"X" + struct.pack("<I", len(part)) + part + _put(2) + b"0"
    call = _get(1) + b"(" + _get(2) * 1_000 + b"tR"
    return head + b"(" + call * 10 + b"e."


def _nested(depth: int) -> bytes:
    return b"N" + b"\x85" * depth  # TUPLE1 over and over: a tuple inside a tuple, a million deep


def nested_key() -> bytes:
    """A dict whose key is a tuple nested a million deep: hashing it overflows the C stack."""
    return _PROTO + b"}(" + _nested(1_000_000) + b"Nu."


def nested_enum_argument() -> bytes:
    """An allowed enum looked up by a nested value: the lookup hashes it, as above."""
    return _PROTO + _global(_META, b"_MEM_FORMAT_ENCODING") + _nested(1_000_000) + b"\x85R."


def appended_references() -> bytes:
    """A list of a million references (DUP, APPENDS): grows with the file, so it is only refused
    as not being metadata, cheaply."""
    return _PROTO + b"](N" + b"2" * 1_000_000 + b"e."


def wrong_size_shown_whole() -> bytes:
    """Real metadata whose tensor size is a list of 100,000 references to one 10 KB string: an
    error message that shows the size whole first makes a gigabyte of text."""
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                       TensorStorageMetadata)

    item = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2]),
                                 [ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))])
    item.size = ["x" * 10_000] * 100_000
    return pickle.dumps(Metadata(state_dict_metadata={"w": item}))


CASES: dict[str, Callable[[], bytes]] = {f.__name__: f for f in (
    huge_memo_index, wrong_size_shown_whole, declared_bytes_past_the_end, bytearray_past_the_end, size_copied_by_every_call,
    state_copied_by_every_build, path_joined_from_one_string, nested_key, nested_enum_argument,
    appended_references)}


def _read(directory: str) -> None:
    gdskit.dcp.StorageReader(directory).read_metadata()


@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_metadata_is_refused_cheaply(tmp_path: Path, case: str) -> None:
    (tmp_path / ".metadata").write_bytes(CASES[case]())
    outcome = run_capped(_read, str(tmp_path), cap_bytes=CAP, timeout_s=120)
    assert outcome.status == "raised" and outcome.error == "FormatError", outcome
    assert outcome.peak_rss_growth is not None and outcome.peak_rss_growth < CHEAP, outcome


def test_real_metadata_reads_the_same_as_torch_reads_it(tmp_path: Path) -> None:
    """The bounded reader gives exactly what pickle gives for metadata torch wrote, sharded
    items, bytes items, paths and all."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(3)
    sd = {f"layer{i}.w": torch.randn(3, 5, generator=g) for i in range(50)}
    sd["step"] = 7
    sd["blob"] = __import__("io").BytesIO(b"abc")
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "c")), no_dist=True)
    raw = (tmp_path / "c" / ".metadata").read_bytes()
    got = gdskit.dcp.StorageReader(tmp_path / "c").read_metadata()
    want = pickle.loads(raw)
    assert got.state_dict_metadata == want.state_dict_metadata
    assert got.storage_data == want.storage_data
    assert got.planner_data == want.planner_data


def test_planner_data_of_nested_paths_is_refused(tmp_path: Path) -> None:
    """torch's planners use each path's parts as keys: a part nested deep would crash the hash."""
    from torch.distributed.checkpoint.metadata import Metadata

    deep: object = "a"
    for _ in range(5):
        deep = (deep,)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={}, planner_data={"w": (deep,)})))
    with pytest.raises(gdskit.errors.FormatError):
        _read(str(tmp_path))
