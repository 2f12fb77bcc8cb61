"""A large safetensors header parsed again in the same process comes from memory, and only when
its bytes and the file's size are exactly those parsed before."""

from __future__ import annotations

import json
import struct

import pytest

from gdskit.errors import FormatError
from gdskit.formats import safetensors_format as fmt
from header_parses import count_parses


@pytest.fixture(autouse=True)
def _empty_memo():
    fmt.forget_headers()
    yield
    fmt.forget_headers()


def _header(n: int, dtype: str = "U8", metadata: dict | None = None) -> tuple[bytes, int]:
    """The header bytes of ``n`` tensors of 4 bytes (large enough to be remembered), and the file size."""
    doc: dict = {"__metadata__": metadata} if metadata else {}
    for i in range(n):
        doc[f"layer.{i}.weight"] = {"dtype": dtype, "shape": [4], "data_offsets": [4 * i, 4 * i + 4]}
    raw = json.dumps(doc).encode()
    assert len(raw) >= fmt.MEMO_MIN_BYTES
    return raw, 8 + len(raw) + 4 * n


def test_the_same_bytes_are_parsed_once(monkeypatch, tmp_path):
    raw, size = _header(2000)
    calls = count_parses(monkeypatch)
    first = fmt.parse_header_json(raw, 8 + len(raw), size)
    again = fmt.parse_header_json(bytes(raw), 8 + len(raw), size)  # another object, the same bytes
    assert len(calls) == 1 and again == first and len(again.entries) == 2000
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4 * 2000))
    assert fmt.read_header_file(path) == first and len(calls) == 1


def test_a_changed_byte_is_parsed_again_and_refused(monkeypatch):
    raw, size = _header(2000)
    fmt.parse_header_json(raw, 8 + len(raw), size)
    calls = count_parses(monkeypatch)
    # Same length, one digit changed: the last tensor now overlaps the one before it.
    i = raw.rindex(b"[7996, 8000]")
    bad = raw[:i] + b"[7995, 8000]" + raw[i + 12:]
    assert len(bad) == len(raw)
    with pytest.raises(fmt.LayoutError):
        fmt.parse_header_json(bad, 8 + len(bad), size)
    assert calls == [len(bad)]
    with pytest.raises(fmt.LayoutError):  # an invalid header is never remembered
        fmt.parse_header_json(bad, 8 + len(bad), size)
    assert len(calls) == 2


def test_the_same_header_in_a_file_of_another_size_is_checked_against_it():
    raw, size = _header(2000)
    fmt.parse_header_json(raw, 8 + len(raw), size)
    with pytest.raises(fmt.TruncatedFileError):
        fmt.parse_header_json(raw, 8 + len(raw), size - 1)
    with pytest.raises(fmt.LayoutError):
        fmt.parse_header_json(raw, 8 + len(raw), size + 1)
    with pytest.raises(FormatError):  # and the remembered answer is not changed by them
        fmt.parse_header_json(raw, 8 + len(raw), size + 4)
    assert len(fmt.parse_header_json(raw, 8 + len(raw), size).entries) == 2000


def test_each_caller_gets_its_own_metadata():
    raw, size = _header(2000, metadata={"format": "pt"})
    first = fmt.parse_header_json(raw, 8 + len(raw), size)
    first.metadata["format"] = "changed"
    first.metadata["extra"] = "x"
    again = fmt.parse_header_json(raw, 8 + len(raw), size)
    assert again.metadata == {"format": "pt"}
    assert again.metadata is not first.metadata


def test_small_headers_are_not_remembered():
    doc = {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}
    raw = json.dumps(doc).encode()
    fmt.parse_header_json(raw, 8 + len(raw), 8 + len(raw) + 4)
    assert not fmt._memo


def test_what_is_remembered_stays_within_its_bounds(monkeypatch):
    monkeypatch.setattr(fmt, "MEMO_ENTRIES", 2)
    headers = [_header(2000, dtype) for dtype in ("U8", "I8", "BOOL")]
    for raw, size in headers:
        fmt.parse_header_json(raw, 8 + len(raw), size)
    assert len(fmt._memo) == 2
    assert fmt._memo_bytes == sum(len(r) for r, _ in fmt._memo.values())
    kept = {r for r, _ in fmt._memo.values()}
    assert headers[0][0] not in kept and {headers[1][0], headers[2][0]} == kept  # the oldest went
    monkeypatch.setattr(fmt, "MEMO_MAX_BYTES", len(headers[0][0]) + 1)
    raw, size = _header(2100)
    fmt.parse_header_json(raw, 8 + len(raw), size)
    assert fmt._memo_bytes <= fmt.MEMO_MAX_BYTES and len(fmt._memo) <= 1


def test_a_checksum_that_collides_is_not_taken_for_the_same_bytes(monkeypatch):
    """The checksum only finds the candidate; the bytes themselves decide (two headers of one
    length whose checksums collide, forced here)."""
    monkeypatch.setattr(fmt.zlib, "crc32", lambda data: 0)
    raw, size = _header(2000)
    fmt.parse_header_json(raw, 8 + len(raw), size)
    i = raw.rindex(b"[7996, 8000]")
    bad = raw[:i] + b"[7995, 8000]" + raw[i + 12:]
    with pytest.raises(fmt.LayoutError):
        fmt.parse_header_json(bad, 8 + len(bad), size)
