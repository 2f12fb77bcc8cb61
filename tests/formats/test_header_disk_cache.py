"""Large safetensors headers, once parsed, are kept for later processes in this user's cache
folder: a fresh process finds the parse done, and only for the very bytes it was made from. A
kept file that is damaged, copied to another header's name, or reachable by another user is
never believed: the header is parsed again."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gdskit.errors import FormatError
from gdskit.formats import safetensors_format as fmt
from header_parses import count_parses


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    home = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    fmt.forget_headers()
    yield home
    fmt.forget_headers()


def _header(n: int, *, metadata: dict | None = None, width: int = 4, prefix: str = "block") -> tuple[bytes, int]:
    """Header bytes of ``n`` tensors of ``width`` bytes named ``prefix.i.w`` (large enough to be
    kept), and the file size."""
    doc: dict = {"__metadata__": metadata} if metadata else {}
    for i in range(n):
        doc[f"{prefix}.{i}.w"] = {"dtype": "U8", "shape": [width], "data_offsets": [width * i, width * (i + 1)]}
    raw = json.dumps(doc).encode()
    assert len(raw) >= fmt.MEMO_MIN_BYTES
    return raw, 8 + len(raw) + width * n


def _kept(home) -> list:
    folder = home / "gdskit" / "headers"
    return sorted(p for p in folder.iterdir() if p.name.startswith("st-")) if folder.exists() else []


def test_a_header_parsed_once_is_found_by_the_next_process(cache_home, tmp_path):
    raw, size = _header(2000, metadata={"format": "pt"})
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(size - 8 - len(raw)))
    parsed = fmt.read_header_file(path)
    (kept,) = _kept(cache_home)
    assert oct(kept.stat().st_mode & 0o777) == "0o600"
    assert oct(kept.parent.stat().st_mode & 0o777) == "0o700"
    probe = ("import sys, json; from gdskit.formats import safetensors_format as fmt\n"
             "def refuse(*a): raise SystemExit('parsed again')\n"
             "fmt._parse_header_json = refuse\n"
             "h = fmt.read_header_file(sys.argv[1])\n"
             "print(json.dumps([h.metadata, h.entries, h.data_start]))\n")
    out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "XDG_CACHE_HOME": str(cache_home)})
    assert out.returncode == 0, out.stderr
    metadata, entries, data_start = json.loads(out.stdout)
    assert metadata == parsed.metadata and data_start == parsed.data_start
    assert [tuple(e[:2]) + (tuple(e[2]),) + tuple(e[3:]) for e in entries] == list(parsed.entries)


def test_a_kept_header_equals_a_fresh_parse_and_its_metadata_is_the_callers_own(monkeypatch):
    raw, size = _header(2000, metadata={"a": "b"})
    first = fmt.parse_header_json(raw, 8 + len(raw), size)
    fmt.forget_headers()
    calls = count_parses(monkeypatch)
    again = fmt.parse_header_json(raw, 8 + len(raw), size)
    assert calls == [] and again == first
    again.metadata["a"] = "changed"
    fmt.forget_headers()
    assert fmt.parse_header_json(raw, 8 + len(raw), size).metadata == {"a": "b"}


def test_the_same_bytes_with_another_file_size_or_start_are_parsed_again(monkeypatch):
    raw, size = _header(2000)
    fmt.parse_header_json(raw, 8 + len(raw), size)
    fmt.forget_headers()
    calls = count_parses(monkeypatch)
    with pytest.raises(FormatError):  # bytes after the last tensor: refused, not answered from the kept parse
        fmt.parse_header_json(raw, 8 + len(raw), size + 4)
    assert len(calls) == 1
    fmt.parse_header_json(raw, 8 + len(raw), None)
    assert len(calls) == 2


def test_an_invalid_header_is_not_kept(cache_home):
    raw, size = _header(2000)
    bad = raw.replace(b'"U8"', b'"Q9"', 1)
    with pytest.raises(fmt.UnknownDtypeError):
        fmt.parse_header_json(bad, 8 + len(bad), size)
    assert _kept(cache_home) == []


@pytest.mark.parametrize("damage", ["flip a byte", "cut short", "empty", "old format", "other header's file"])
def test_a_damaged_or_misplaced_kept_file_is_parsed_again_and_rewritten(cache_home, monkeypatch, damage):
    raw, size = _header(2000)
    want = fmt.parse_header_json(raw, 8 + len(raw), size)
    (kept,) = _kept(cache_home)
    data = kept.read_bytes()
    if damage == "flip a byte":
        data = data[:-10] + bytes([data[-10] ^ 1]) + data[-9:]
    elif damage == "cut short":
        data = data[:len(data) // 2]
    elif damage == "empty":
        data = b""
    elif damage == "old format":
        data = b"gdskit safetensors header 0\n" + data[len(fmt.DISK_FORMAT):]
    else:  # a whole file kept for another header of the same size and layout, put at this one's name
        other_raw, other_size = _header(2000, prefix="brick")
        assert (len(other_raw), other_size) == (len(raw), size)
        fmt.parse_header_json(other_raw, 8 + len(other_raw), other_size)
        (other,) = [p for p in _kept(cache_home) if p != kept]
        data = other.read_bytes()
    kept.write_bytes(data)
    fmt.forget_headers()
    calls = count_parses(monkeypatch)
    assert fmt.parse_header_json(raw, 8 + len(raw), size) == want
    assert len(calls) == 1
    fmt.forget_headers()
    assert fmt.parse_header_json(raw, 8 + len(raw), size) == want and len(calls) == 1  # rewritten whole


def test_a_kept_file_others_could_write_or_a_link_is_never_believed(cache_home, monkeypatch, tmp_path):
    raw, size = _header(2000)
    fmt.parse_header_json(raw, 8 + len(raw), size)
    (kept,) = _kept(cache_home)
    calls = count_parses(monkeypatch)
    kept.chmod(0o620)  # writable by its group
    fmt.forget_headers()
    fmt.parse_header_json(raw, 8 + len(raw), size)
    assert len(calls) == 1
    kept.chmod(0o600)
    kept.parent.chmod(0o770)  # a folder its group may write into: nothing in it is read, nothing written
    fmt.forget_headers()
    fmt.parse_header_json(raw, 8 + len(raw), size)
    assert len(calls) == 2
    kept.parent.chmod(0o700)
    elsewhere = tmp_path / "elsewhere"
    kept.rename(elsewhere)
    kept.symlink_to(elsewhere)  # a link at the kept name: not followed
    fmt.forget_headers()
    fmt.parse_header_json(raw, 8 + len(raw), size)
    assert len(calls) == 3


def test_the_oldest_kept_headers_go_beyond_the_limit(cache_home, monkeypatch):
    monkeypatch.setattr(fmt, "DISK_FILES", 4)
    made = []
    for n in range(2000, 2006):
        raw, size = _header(n)
        fmt.parse_header_json(raw, 8 + len(raw), size)
        made.append(fmt._disk_path(fmt._disk_key(raw, 8 + len(raw), size)))
        os.utime(made[-1], (1_000_000 + n, 1_000_000 + n))  # in order, whatever the clock's grain
    left = {str(p) for p in _kept(cache_home)}
    assert len(left) <= 4 and made[-1] in left and made[0] not in left


def test_a_temporary_left_by_a_writer_that_died_goes_once_old(cache_home):
    raw, size = _header(2000)
    fmt.parse_header_json(raw, 8 + len(raw), size)
    folder = cache_home / "gdskit" / "headers"
    old = folder / ".st-dead.0123456789abcdef.gdskit-tmp"
    young = folder / ".st-live.fedcba9876543210.gdskit-tmp"
    old.write_bytes(b"half")
    young.write_bytes(b"half")
    os.utime(old, (1_000_000, 1_000_000))
    raw2, size2 = _header(2001)
    fmt.parse_header_json(raw2, 8 + len(raw2), size2)
    assert not old.exists() and young.exists()


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                     max_leaves=20)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_JSON, keyed=st.booleans(), metadata=_JSON, rows=_JSON)
def test_any_whole_kept_file_is_a_header_or_a_miss_never_an_error(cache_home, body, keyed, metadata, rows):
    """A kept file whose checksum holds but whose content this version did not write (any JSON,
    with this header's key or without) is read as a miss or as a header that ends where the
    file does; it never raises."""
    raw, size = _header(2000)
    key = fmt._disk_key(raw, 8 + len(raw), size)
    payload = json.dumps([key, metadata, rows] if keyed else body).encode()
    path = fmt._disk_path(key)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(fmt.DISK_FORMAT + hashlib.sha256(payload).digest() + payload)
    os.chmod(path, 0o600)
    got = fmt._from_disk(key, 8 + len(raw), size)
    assert got is None or (got.file_size == size and (got.metadata is None or isinstance(got.metadata, dict)))
    if not keyed:
        assert got is None
    fmt.forget_headers()
    assert fmt.parse_header_json(raw, 8 + len(raw), size).file_size == size  # the whole path: no error either
