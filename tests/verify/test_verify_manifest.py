"""The digest manifest is read as hostile input: every malformed one is a ManifestError
(a FormatError), never another exception, and a good one round-trips."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gdskit.errors import FormatError, InvalidArgumentError, NothingToVerifyError, StaleManifestError
from gdskit.verify import (HEADER_KEY, FileDigests, Manifest, ManifestError, TensorDigest, VerifyKind,
                           find_expectation, header_digests, parse_manifest, read_manifest, verify_mode, write_manifest)
from gdskit.verify.manifest import MAX_MANIFEST_BYTES

H = "ab" * 32


def _good() -> Manifest:
    return Manifest(1024, {"model.safetensors": FileDigests(3000, 5, H, (H, H, H),
                                                            {"w": TensorDigest(100, 2000, H)}),
                           "sub/x.npy": FileDigests(0, 1, H, ())})


def test_a_manifest_round_trips():
    text = _good().to_json()
    assert parse_manifest(text.encode()) == _good()


def test_written_manifests_replace_only_manifests(tmp_path):
    path = tmp_path / "m.gdskit-digest.json"
    write_manifest(_good(), path)
    assert read_manifest(path) == _good()
    write_manifest(_good(), path)  # a manifest is replaced
    other = tmp_path / "notes.txt"
    other.write_text("mine")
    with pytest.raises(InvalidArgumentError):
        write_manifest(_good(), other)
    assert other.read_text() == "mine"


@given(st.integers(min_value=0, max_value=2000))
@settings(max_examples=80, deadline=None)
def test_every_truncation_is_a_manifest_error(cut):
    text = _good().to_json().encode()
    if cut >= len(text.rstrip()):  # only the closing newline gone: still the whole document
        return
    with pytest.raises(ManifestError):
        parse_manifest(text[:cut])


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                     max_leaves=12)


@given(st.sampled_from(["format", "version", "algorithm", "chunk_bytes", "files"]), _JSON)
@settings(max_examples=150, deadline=None)
def test_a_wrong_typed_top_level_field_is_a_manifest_error(key, value):
    doc = json.loads(_good().to_json())
    if doc[key] == value:
        return
    doc[key] = value
    try:
        got = parse_manifest(json.dumps(doc).encode())
    except ManifestError:
        return
    # The only values taken are other valid ones (an equal-valued chunk size, an empty file list).
    assert got.chunk_bytes & (got.chunk_bytes - 1) == 0


@given(st.sampled_from(["size", "mtime_ns", "digest", "chunks", "tensors"]), _JSON)
@settings(max_examples=150, deadline=None)
def test_a_wrong_typed_file_field_is_a_manifest_error(key, value):
    doc = json.loads(_good().to_json())
    entry = doc["files"]["model.safetensors"]
    if entry[key] == value:
        return
    entry[key] = value
    try:
        got = parse_manifest(json.dumps(doc).encode())
    except ManifestError:
        return
    # Taken only where the value is another valid one (no tensors; a size with as many chunks):
    # then it is held with its own type, as written back.
    assert parse_manifest(got.to_json().encode()) == got
    held = got.files["model.safetensors"]
    assert json.loads(got.to_json())["files"]["model.safetensors"][key] == value
    assert isinstance(held.size, int) and not isinstance(held.size, bool)


@given(st.binary(max_size=300))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_arbitrary_bytes_are_refused_or_read_never_crash(data):
    try:
        parse_manifest(data)
    except ManifestError:
        pass


@pytest.mark.parametrize("bad", [
    b'{"format": "gdskit-digest", "format": "gdskit-digest"}',  # a key twice
    b"[" * 100000 + b"]" * 100000,  # nested past the parser's recursion
    b'{"format": NaN}',
])
def test_pathological_json_is_a_manifest_error(bad):
    with pytest.raises(ManifestError):
        parse_manifest(bad)


@pytest.mark.parametrize("name", ["/etc/passwd", "../up", "a//b", "./a", ""])
def test_file_names_must_be_plain_relative_paths(name):
    doc = json.loads(_good().to_json())
    doc["files"][name] = doc["files"].pop("sub/x.npy")
    with pytest.raises(ManifestError):
        parse_manifest(json.dumps(doc).encode())


def test_a_tensor_past_the_end_of_its_file_is_refused():
    doc = json.loads(_good().to_json())
    doc["files"]["model.safetensors"]["tensors"]["w"]["offset"] = 2000
    with pytest.raises(ManifestError):
        parse_manifest(json.dumps(doc).encode())


def test_a_huge_manifest_is_refused_unread(tmp_path):
    path = tmp_path / "x.gdskit-digest.json"
    with open(path, "wb") as fh:
        fh.truncate(MAX_MANIFEST_BYTES + 10)
    with pytest.raises(ManifestError) as info:
        read_manifest(path)
    assert isinstance(info.value, FormatError) and info.value.path == str(path)


def test_header_digests_are_checked_as_hostile_too():
    assert header_digests(None, "f") is None
    assert header_digests({HEADER_KEY: json.dumps({"a": H})}, "f") == {"a": H}
    for bad in ("not json", "[1]", json.dumps({"a": 3}), json.dumps({"a": "xyz"}), "[" * 100000):
        with pytest.raises(ManifestError):
            header_digests({HEADER_KEY: bad}, "f")


def test_verify_argument_forms():
    assert not verify_mode(False).on and not verify_mode(None).on
    assert verify_mode(True).kind is VerifyKind.AUTO and not verify_mode(True).whole_file
    sha = verify_mode("sha256:" + "0" * 64)
    assert sha.kind is VerifyKind.SHA256 and sha.whole_file and sha.sha256 == "0" * 64
    named = verify_mode("some/manifest.json")
    assert named.kind is VerifyKind.MANIFEST and named.manifest == "some/manifest.json"
    for given in (False, True, "some/manifest.json", "sha256:" + "ab" * 32):  # handed on to another reader as it came
        assert verify_mode(verify_mode(given).argument) == verify_mode(given)
    for bad in (1, b"x", "sha256:12", "", 0.5, ["x"]):
        with pytest.raises(InvalidArgumentError):
            verify_mode(bad)


def test_nothing_to_verify_and_stale_manifests(tmp_path):
    data = tmp_path / "d.bin"
    data.write_bytes(b"x" * 10)
    with pytest.raises(NothingToVerifyError):
        find_expectation(str(data), verify_mode(True))
    manifest = Manifest(1024, {"d.bin": FileDigests(11, 0, H, (H,))})
    write_manifest(manifest, str(data) + ".gdskit-digest.json")
    with pytest.raises(StaleManifestError):
        find_expectation(str(data), verify_mode(True))
    write_manifest(Manifest(1024, {"d.bin": FileDigests(10, os.stat(data).st_mtime_ns, H, (H,))}),
                   str(data) + ".gdskit-digest.json")
    assert find_expectation(str(data), verify_mode(True)).file.size == 10
    for not_digests in (False, "sha256:" + "0" * 64):  # a file's sha256 is not looked up in a manifest
        with pytest.raises(InvalidArgumentError):
            find_expectation(str(data), verify_mode(not_digests))
