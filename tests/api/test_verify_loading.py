"""Verified loading on the host path: every reader with verify= returns what it returns without,
and one flipped byte in any tensor raises ChecksumMismatchError naming that tensor."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

torch = pytest.importorskip("torch")
import safetensors.torch  # noqa: E402

import gdskit  # noqa: E402
import gdskit.safetensors as gs  # noqa: E402
from gdskit.errors import (ChecksumMismatchError, InvalidArgumentError, NothingToVerifyError,  # noqa: E402
                           StaleManifestError, UnverifiableRangeError)
from gdskit.formats import digest_scan  # noqa: E402
from gdskit.formats import safetensors_format as fmt  # noqa: E402
from object_server import moto_endpoint, s3  # noqa: E402, F401 - fixtures


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "emb": torch.randn(300, 17, generator=g),
        "bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "ids": torch.arange(1000, dtype=torch.int64),
        "mask": torch.rand(33, generator=g) > 0.5,
        "big": torch.randn(600, 1024, generator=g).half(),  # over a MiB: read straight into its own memory
        "empty": torch.empty(0, 4),
        "h": torch.randint(-100, 100, (7, 3), dtype=torch.int8, generator=g),
    }


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """A file with its digests in its header (save_file(digests=True))."""
    path = tmp_path_factory.mktemp("signed") / "model.safetensors"
    gs.save_file(_tensors(), path, digests=True)
    return str(path)


@pytest.fixture(scope="module")
def plain_with_manifest(tmp_path_factory):
    """A file written by the safetensors library, with a manifest beside it (gdskit digest)."""
    path = tmp_path_factory.mktemp("plain") / "model.safetensors"
    safetensors.torch.save_file(_tensors(), str(path))
    digest_scan.make_manifests([str(path)], chunk_bytes=64 << 10)
    return str(path)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


@pytest.mark.parametrize("which", ["signed", "plain_with_manifest"])
def test_every_reader_returns_the_same_tensors_verified(which, request):
    path = request.getfixturevalue(which)
    want = gs.load_file(path)
    assert _same(gs.load_file(path, verify=True), want)
    assert _same(dict(gs.iter_tensors(path, device="cpu", verify=True)), want)
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    gs.load_into(target, path, verify=True)
    assert _same(target, want)
    assert _same(gs.load_file(path, verify=True, keys=["ids", "empty"]), {k: want[k] for k in ("ids", "empty")})


def test_the_signed_file_stays_readable_by_safetensors(signed):
    assert _same(safetensors.torch.load_file(signed), _tensors())
    assert set(gs.read_metadata(signed)) == {"gdskit.blake3"}


def test_load_into_with_a_cast_checks_the_bytes_as_stored(signed):
    target = {k: torch.zeros(v.shape, dtype=torch.float64) if v.is_floating_point() else torch.zeros_like(v)
              for k, v in _tensors().items()}
    gs.load_into(target, signed, verify=True, cast=True)
    assert torch.equal(target["emb"], _tensors()["emb"].double())


def _flipped_copy(src: str, dst: str, name: str, at: int, keep_mtime: bool) -> None:
    shutil.copyfile(src, dst)
    header = fmt.read_header_file(dst)
    entry = next(e for e in header.entries if e.name == name)
    pos = header.data_start + entry.start + at % entry.nbytes
    with open(dst, "r+b") as fh:
        fh.seek(pos)
        byte = fh.read(1)[0]
        fh.seek(pos)
        fh.write(bytes([byte ^ 0x01]))
    if keep_mtime:  # a change the manifest cannot tell from corruption
        st = os.stat(src)
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


_FLIPPABLE = sorted(n for n, t in _tensors().items() if t.nbytes)
_READERS = {
    "load_file": lambda p: gs.load_file(p, verify=True),
    "iter_tensors": lambda p: dict(gs.iter_tensors(p, device="cpu", verify=True)),
    "load_into": lambda p: gs.load_into({k: torch.zeros_like(v) for k, v in _tensors().items()}, p, verify=True),
    "safe_open": lambda p: _every_tensor_through_safe_open(p),
}


def _every_tensor_through_safe_open(path: str) -> dict:
    with gs.safe_open(path, framework="pt", verify=True) as f:
        return {n: f.get_tensor(n) for n in f.keys()}


@pytest.mark.parametrize("reader", sorted(_READERS))
@given(name=st.sampled_from(_FLIPPABLE), at=st.integers(min_value=0, max_value=2**40))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_flipped_byte_in_any_tensor_is_caught_naming_it(reader, name, at, signed, tmp_path):
    bad = str(tmp_path / f"{reader}.safetensors")
    _flipped_copy(signed, bad, name, at, keep_mtime=False)
    with pytest.raises(ChecksumMismatchError) as info:
        _READERS[reader](bad)
    err = info.value
    assert err.tensor == name and err.path == bad
    entry = next(e for e in fmt.read_header_file(bad).entries if e.name == name)
    data_start = fmt.read_header_file(bad).data_start
    assert err.byte_range == (data_start + entry.start, data_start + entry.end)
    assert err.expected != err.actual and err.expected.startswith("blake3:")
    if reader == "load_into":
        assert name in err.unfilled and name not in err.filled
        assert set(err.filled) | set(err.unfilled) == set(_tensors())


@given(name=st.sampled_from(_FLIPPABLE), at=st.integers(min_value=0, max_value=2**40))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_flipped_byte_is_caught_against_a_manifest(name, at, plain_with_manifest, tmp_path):
    bad = str(tmp_path / "model.safetensors")
    _flipped_copy(plain_with_manifest, bad, name, at, keep_mtime=True)
    shutil.copyfile(plain_with_manifest + ".gdskit-digest.json", bad + ".gdskit-digest.json")
    with pytest.raises(ChecksumMismatchError) as info:
        gs.load_file(bad, verify=True)
    assert info.value.tensor == name
    with pytest.raises(ChecksumMismatchError):
        gs.load_file(bad, verify=bad + ".gdskit-digest.json")  # the manifest named


def test_safe_open_verified_equals_the_safetensors_library(signed, plain_with_manifest):
    for path, verify in ((signed, True), (plain_with_manifest, True),
                         (plain_with_manifest, plain_with_manifest + ".gdskit-digest.json")):
        with gs.safe_open(path, framework="pt", verify=verify) as f, \
                safetensors.safe_open(path, framework="pt") as ref:
            for n in ref.keys():
                assert torch.equal(f.get_tensor(n), ref.get_tensor(n))
                assert torch.equal(f.get_slice(n)[...], ref.get_slice(n)[...])  # a slice of all of it is checked
            assert _same(f.get_tensors(), {n: ref.get_tensor(n) for n in ref.keys()})


def test_safe_open_refuses_a_slice_of_part_of_a_tensor_when_verifying(signed):
    before = gdskit.stats().bytes_read
    with gs.safe_open(signed, framework="pt", verify=True) as f:
        for index in ((slice(0, 10),), (5,), (slice(None), slice(0, 3)), (slice(None, None, 2),)):
            with pytest.raises(UnverifiableRangeError):
                f.get_slice("emb")[index]
    assert gdskit.stats().bytes_read == before  # refused before a byte is read
    with gs.safe_open(signed, framework="pt") as f:  # without verify, slices read as ever
        assert torch.equal(f.get_slice("emb")[0:10], _tensors()["emb"][0:10])


def test_safe_open_with_nothing_to_verify_is_refused_at_open(tmp_path):
    path = str(tmp_path / "bare.safetensors")
    safetensors.torch.save_file({"a": torch.ones(3)}, path)
    with pytest.raises(NothingToVerifyError):
        gs.safe_open(path, framework="pt", verify=True)
    with pytest.raises(InvalidArgumentError):
        gs.safe_open(path, framework="pt", verify="sha256:" + "0" * 64)


def test_a_file_changed_after_its_manifest_is_stale_not_corrupt(plain_with_manifest, tmp_path):
    bad = str(tmp_path / "model.safetensors")
    _flipped_copy(plain_with_manifest, bad, "ids", 5, keep_mtime=False)
    shutil.copyfile(plain_with_manifest + ".gdskit-digest.json", bad + ".gdskit-digest.json")
    with pytest.raises(StaleManifestError):
        gs.load_file(bad, verify=True)


def test_nothing_to_verify_is_refused_before_reading(tmp_path):
    path = str(tmp_path / "bare.safetensors")
    safetensors.torch.save_file({"a": torch.ones(3)}, path)
    for call in (lambda: gs.load_file(path, verify=True),
                 lambda: gs.iter_tensors(path, device="cpu", verify=True),
                 lambda: gs.load_into({"a": torch.zeros(3)}, path, verify=True)):
        before = gdskit.stats().bytes_read
        with pytest.raises(NothingToVerifyError):
            call()
        assert gdskit.stats().bytes_read == before


def test_sha256_mode_checks_the_whole_file(signed, tmp_path):
    good = hashlib.sha256(open(signed, "rb").read()).hexdigest()
    assert _same(gs.load_file(signed, verify="sha256:" + good), _tensors())
    target = {k: torch.zeros_like(v) for k, v in _tensors().items()}
    gs.load_into(target, signed, verify="sha256:" + good.upper())
    with pytest.raises(ChecksumMismatchError) as info:
        gs.load_file(signed, verify="sha256:" + "0" * 64)
    assert info.value.expected == "sha256:" + "0" * 64 and info.value.actual == "sha256:" + good
    with pytest.raises(InvalidArgumentError):
        gs.iter_tensors(signed, device="cpu", verify="sha256:" + good)


def test_verified_bytes_are_counted_in_the_ledger(signed):
    before = gdskit.stats()
    gs.load_file(signed, verify=True)
    delta = gdskit.stats() - before
    assert delta.verified.bytes == sum(t.nbytes for t in _tensors().values())
    assert delta.verified.gpu_bytes == 0 and delta.verified.checks == len(_tensors())
    assert "verified" in delta.to_dict()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_no_descriptor_is_left_open(signed, plain_with_manifest, tmp_path):
    bad = str(tmp_path / "bad.safetensors")
    _flipped_copy(signed, bad, "emb", 11, keep_mtime=False)
    gs.load_file(signed, verify=True)  # warm-up: the engine's own long-lived descriptors
    before = _open_fds()
    for _ in range(3):
        gs.load_file(signed, verify=True)
        gs.load_file(plain_with_manifest, verify=True)
        with pytest.raises(ChecksumMismatchError):
            gs.load_file(bad, verify=True)
        with pytest.raises(ChecksumMismatchError):
            dict(gs.iter_tensors(bad, device="cpu", verify=True))
        with pytest.raises(ChecksumMismatchError):
            gs.load_file(signed, verify="sha256:" + "0" * 64)
    assert _open_fds() == before


# -- File.read against chunk digests ------------------------------------------------

@pytest.fixture()
def raw_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(10_000))
    digest_scan.make_manifests([str(path)], chunk_bytes=1024)
    return str(path)


def test_file_read_checks_whole_chunks(raw_file):
    data = open(raw_file, "rb").read()
    with gdskit.open(raw_file) as f:
        buf = bytearray(10_000)
        assert f.read(buf, verify=True) == 10_000 and bytes(buf) == data
        buf = bytearray(3072)
        assert f.read(buf, file_offset=2048, verify=True) == 3072 and bytes(buf) == data[2048:5120]
        buf = bytearray(4096)
        assert f.read(buf, file_offset=9216, verify=True) == 784 and bytes(buf[:784]) == data[9216:]
        for offset, size in ((10, 1024), (1024, 100), (0, 5000)):
            with pytest.raises(UnverifiableRangeError):
                f.read(bytearray(size), file_offset=offset, verify=True)


@given(at=st.integers(min_value=0, max_value=9_999))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_file_read_names_the_chunk_a_flipped_byte_is_in(at, raw_file):
    st_ = os.stat(raw_file)
    data = bytearray(open(raw_file, "rb").read())
    data[at] ^= 0x80
    with open(raw_file, "r+b") as fh:
        fh.write(data)
    os.utime(raw_file, ns=(st_.st_atime_ns, st_.st_mtime_ns))
    try:
        with gdskit.open(raw_file) as f, pytest.raises(ChecksumMismatchError) as info:
            f.read(bytearray(10_000), verify=True)
        start = at // 1024 * 1024
        assert info.value.byte_range == (start, min(start + 1024, 10_000)) and info.value.tensor is None
    finally:
        data[at] ^= 0x80
        with open(raw_file, "r+b") as fh:
            fh.write(data)
        os.utime(raw_file, ns=(st_.st_atime_ns, st_.st_mtime_ns))


# -- gdskit.torch.load against a manifest of the archive's storage records ----------------

@pytest.fixture(scope="module")
def torch_archive(tmp_path_factory):
    path = tmp_path_factory.mktemp("pt") / "model.pt"
    sd = _tensors()
    sd["view"] = sd["emb"][10:20]  # shares emb's storage: one record, two tensors
    torch.save(sd, path)
    digest_scan.make_manifests([str(path)], chunk_bytes=64 << 10)
    return str(path)


def test_torch_load_verified_equals_unverified(torch_archive):
    import gdskit.torch as gt

    want = gt.load(torch_archive)
    assert _same(gt.load(torch_archive, verify=True), want)
    assert _same(gt.load(torch_archive, verify=torch_archive + ".gdskit-digest.json"), want)
    good = hashlib.sha256(open(torch_archive, "rb").read()).hexdigest()
    assert _same(gt.load(torch_archive, verify="sha256:" + good), want)
    with open(torch_archive, "rb") as fh, pytest.raises(InvalidArgumentError):
        gt.load(fh, verify=True)


@given(record=st.integers(min_value=0, max_value=50), at=st.integers(min_value=0, max_value=2**40))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_torch_load_names_the_storage_record_a_flipped_byte_is_in(record, at, torch_archive, tmp_path):
    import gdskit.torch as gt

    spans = [s for s in digest_scan.tensor_spans(torch_archive, "torch") if s.nbytes]
    span = spans[record % len(spans)]
    bad = str(tmp_path / "model.pt")
    shutil.copyfile(torch_archive, bad)
    shutil.copyfile(torch_archive + ".gdskit-digest.json", bad + ".gdskit-digest.json")
    data = bytearray(open(bad, "rb").read())
    data[span.offset + at % span.nbytes] ^= 0x20
    with open(bad, "r+b") as fh:
        fh.write(data)
    st_ = os.stat(torch_archive)
    os.utime(bad, ns=(st_.st_atime_ns, st_.st_mtime_ns))
    with pytest.raises(ChecksumMismatchError) as info:
        gt.load(bad, verify=True)
    assert info.value.tensor == span.name
    assert info.value.byte_range == (span.offset, span.offset + span.nbytes)


def test_torch_save_writes_a_manifest_when_asked(tmp_path):
    import gdskit.torch as gt

    path = str(tmp_path / "saved.pt")
    gt.save(_tensors(), path, digests=True)
    assert os.path.isfile(path + ".gdskit-digest.json")
    assert _same(gt.load(path, verify=True), _tensors())
    gt.save(_tensors(), str(tmp_path / "plain.pt"))
    assert not os.path.exists(str(tmp_path / "plain.pt") + ".gdskit-digest.json")


# -- gdskit.data.preload against a dataset directory's manifest ----------------------------

@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    import numpy as np

    root = tmp_path_factory.mktemp("dataset")
    (root / "sub").mkdir()
    np.save(root / "a.npy", np.arange(1000, dtype=np.float32))
    np.save(root / "sub" / "b.npy", np.arange(30, dtype=">i4").reshape(5, 6))  # swapped once landed
    np.save(root / "f.npy", np.asfortranarray(np.arange(12.0).reshape(3, 4)))
    (root / "r.bin").write_bytes(os.urandom(10_000))
    digest_scan.make_manifests([str(root)], chunk_bytes=4096)
    return str(root)


def test_preload_verified_equals_unverified(dataset):
    from gdskit.data import preload

    want = preload(dataset, device="cpu")
    assert _same(preload(dataset, device="cpu", verify=True), want)
    assert _same(preload(dataset, device="cpu", verify=os.path.join(dataset, "gdskit-digest.json")), want)


@given(which=st.sampled_from(["a.npy", "sub/b.npy", "f.npy", "r.bin"]), at=st.integers(min_value=0, max_value=2**30))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_preload_names_the_file_a_flipped_byte_is_in(which, at, dataset, tmp_path):
    from gdskit.data import preload

    root = tmp_path / "copy"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(dataset, root)
    target = root / which
    spans = digest_scan.tensor_spans(str(target), digest_scan.file_kind(str(target)))
    start, n = (spans[0].offset, spans[0].nbytes) if spans else (0, target.stat().st_size)
    data = bytearray(target.read_bytes())
    data[start + at % n] ^= 0x40
    st_ = os.stat(os.path.join(dataset, which))
    target.write_bytes(data)
    os.utime(target, ns=(st_.st_atime_ns, st_.st_mtime_ns))
    with pytest.raises(ChecksumMismatchError) as info:
        preload(str(root), device="cpu", verify=True)
    assert info.value.path == str(target)
    assert info.value.tensor == ("array" if which.endswith(".npy") else None)


def test_a_snapshot_of_links_is_digested_and_verified(signed, tmp_path):
    """A Hugging Face cache: the snapshot's files are links into a folder of blobs."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    shutil.copyfile(signed, blobs / "0123abcd")
    os.symlink(blobs / "0123abcd", snapshot / "model.safetensors")
    digest_scan.make_manifests([str(snapshot)])
    assert set(read_manifest_files(snapshot)) == {"model.safetensors"}
    target = str(snapshot / "model.safetensors")
    os.remove(snapshot / "gdskit-digest.json")
    digest_scan.make_manifests([target])  # beside the link
    assert _same(gs.load_file(target, verify=target + ".gdskit-digest.json"), _tensors())
    assert all(r.status == "ok" for r in digest_scan.check_manifests([target]))


def read_manifest_files(folder):
    from gdskit.verify import read_manifest

    return read_manifest(os.path.join(folder, "gdskit-digest.json")).files


def test_torch_load_into_checks_whole_records_and_refuses_views(torch_archive, tmp_path):
    import gdskit.torch as gt

    want = {k: v for k, v in _tensors().items()}
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    gt.load_into(target, torch_archive, verify=True, strict=False)
    assert _same(target, want)
    with pytest.raises(NothingToVerifyError):  # "view" is part of emb's record
        gt.load_into({"view": torch.zeros(10, 17)}, torch_archive, verify=True, strict=False)
    good = hashlib.sha256(open(torch_archive, "rb").read()).hexdigest()
    gt.load_into({"view": torch.zeros(10, 17)}, torch_archive, verify="sha256:" + good, strict=False)
    bad = str(tmp_path / "model.pt")
    shutil.copyfile(torch_archive, bad)
    shutil.copyfile(torch_archive + ".gdskit-digest.json", bad + ".gdskit-digest.json")
    span = next(s for s in digest_scan.tensor_spans(bad, "torch") if s.nbytes == _tensors()["ids"].nbytes)
    data = bytearray(open(bad, "rb").read())
    data[span.offset + 17] ^= 1
    with open(bad, "r+b") as fh:
        fh.write(data)
    st_ = os.stat(torch_archive)
    os.utime(bad, ns=(st_.st_atime_ns, st_.st_mtime_ns))
    with pytest.raises(ChecksumMismatchError) as info:
        gt.load_into({k: torch.zeros_like(v) for k, v in want.items()}, bad, verify=True, strict=False)
    assert info.value.tensor == "ids" and "ids" in info.value.unfilled and "emb" in info.value.filled


# -- s3:// objects: checked against the digests in their header ---------------------------

def test_an_object_is_checked_against_its_header_digests(s3, tmp_path):
    local = tmp_path / "m.safetensors"
    gs.save_file(_tensors(), local, digests=True)
    s3.put("m.safetensors", local.read_bytes())
    assert _same(gs.load_file(s3.url("m.safetensors"), verify=True), _tensors())
    bad = str(tmp_path / "bad.safetensors")
    _flipped_copy(str(local), bad, "ids", 3, keep_mtime=False)
    s3.put("bad.safetensors", open(bad, "rb").read())
    with pytest.raises(ChecksumMismatchError) as info:
        gs.load_file(s3.url("bad.safetensors"), verify=True)
    assert info.value.tensor == "ids"
    plain = tmp_path / "plain.safetensors"
    safetensors.torch.save_file({"a": torch.ones(3)}, str(plain))
    s3.put("plain.safetensors", plain.read_bytes())
    with pytest.raises(NothingToVerifyError):
        gs.load_file(s3.url("plain.safetensors"), verify=True)
    with pytest.raises(InvalidArgumentError):
        gs.load_file(s3.url("plain.safetensors"), verify="sha256:" + "0" * 64)


def _several_batches_of_tensors(seed: int) -> dict:
    """8 MiB tensors filling more than two of a host load's hash batches, and one small tensor."""
    from gdskit.formats.verified import HOST_BATCH_BYTES
    g = torch.Generator().manual_seed(seed)
    n = 2 * HOST_BATCH_BYTES // (8 << 20) + 2
    tensors = {f"t{i:02d}": torch.randn(2 << 20, generator=g) for i in range(n)}
    tensors["small"] = torch.arange(10)
    return tensors


@pytest.fixture(scope="module")
def several_batches(tmp_path_factory):
    """A file whose host load is hashed in several batches (more than HOST_BATCH_BYTES of tensors)."""
    tensors = _several_batches_of_tensors(seed=5)
    path = tmp_path_factory.mktemp("batches") / "model.safetensors"
    gs.save_file(tensors, path, digests=True)
    return str(path), tensors


@pytest.mark.parametrize("which", ["t00", "middle", "last", "small"])
def test_a_load_hashed_batch_by_batch_catches_a_flip_in_any_batch(several_batches, which, tmp_path):
    path, tensors = several_batches
    names = sorted(n for n in tensors if n != "small")
    name = {"middle": names[len(names) // 2], "last": names[-1]}.get(which, which)
    before = gdskit.stats().verified.bytes
    assert _same(gs.load_file(path, verify=True), tensors)
    assert gdskit.stats().verified.bytes - before == sum(t.nbytes for t in tensors.values())
    bad = str(tmp_path / "bad.safetensors")
    _flipped_copy(path, bad, name, 12345, keep_mtime=False)
    with pytest.raises(ChecksumMismatchError) as info:
        gs.load_file(bad, verify=True)
    assert info.value.tensor == name


def test_a_manifest_outranks_the_digests_a_replaced_file_carries(tmp_path):
    """A file replaced by another that vouches for itself (its own header digests) is caught by
    the manifest made of the first; a manifest path that does not exist is the gdskit error."""
    path = tmp_path / "model.safetensors"
    gs.save_file({"w": torch.ones(3)}, str(path))
    assert digest_scan.make_manifests([str(path)])[0].status == "written"
    gs.save_file({"w": torch.full((3,), 666.0)}, str(path), digests=True)  # its own digests
    with pytest.raises((ChecksumMismatchError, gdskit.errors.StaleManifestError)):  # refused, either way
        gs.load_file(str(path), verify=True)
    with pytest.raises(gdskit.errors.GdskitFileNotFoundError):
        gs.load_file(str(path), verify=str(tmp_path / "no-such-manifest.json"))


def test_a_short_read_of_a_file_shorter_than_its_manifest_is_a_truncation_not_a_mismatch(raw_file, tmp_path):
    """The file behind an open descriptor shrinks while its name shows the size the manifest
    records: the read comes back short, which is a truncated file, not bytes that differ."""
    from gdskit.formats.safetensors_format import TruncatedFileError

    intact = str(tmp_path / "intact.bin")
    with gdskit.open(raw_file) as f:
        shutil.copy2(raw_file, intact)
        os.truncate(raw_file, 5000)  # the file the descriptor holds
        os.replace(intact, raw_file)  # the name: the whole file again, its mtime kept
        with pytest.raises(TruncatedFileError) as info:
            f.read(bytearray(10_000), verify=True)
    assert not isinstance(info.value, ChecksumMismatchError)
    assert info.value.path == raw_file


_BATCHED_READERS = {
    "load_into": lambda p, t: gs.load_into({k: torch.zeros_like(v) for k, v in t.items()}, p, verify=True),
    "iter_tensors": lambda p, t: dict(gs.iter_tensors(p, device="cpu", verify=True)),
}


@pytest.mark.parametrize("reader", sorted(_BATCHED_READERS))
@pytest.mark.parametrize("which", ["t00", "middle", "last", "small"])
def test_every_safetensors_reader_hashed_batch_by_batch_catches_a_flip_in_any_batch(several_batches, reader,
                                                                                   which, tmp_path):
    path, tensors = several_batches
    names = sorted(n for n in tensors if n != "small")
    name = {"middle": names[len(names) // 2], "last": names[-1]}.get(which, which)
    before = gdskit.stats().verified.bytes
    target = {k: torch.zeros_like(v) for k, v in tensors.items()}
    gs.load_into(target, path, verify=True)
    assert _same(target, tensors)
    assert _same(dict(gs.iter_tensors(path, device="cpu", verify=True)), tensors)
    assert gdskit.stats().verified.bytes - before == 2 * sum(t.nbytes for t in tensors.values())
    bad = str(tmp_path / "bad.safetensors")
    _flipped_copy(path, bad, name, 12345, keep_mtime=False)
    with pytest.raises(ChecksumMismatchError) as info:
        _BATCHED_READERS[reader](bad, tensors)
    assert info.value.tensor == name


@pytest.fixture(scope="module")
def several_batches_pt(tmp_path_factory):
    """A torch.save archive whose host load is hashed in several batches, with its manifest."""
    tensors = _several_batches_of_tensors(seed=6)
    path = tmp_path_factory.mktemp("batches_pt") / "model.pt"
    torch.save(tensors, path)
    digest_scan.make_manifests([str(path)])
    return str(path), tensors


@pytest.mark.parametrize("reader", ["load_cpu", "load_saved_place", "load_into"])
@pytest.mark.parametrize("which", ["first", "middle", "last", "small"])
def test_every_torch_reader_hashed_batch_by_batch_catches_a_flip_in_any_batch(several_batches_pt, reader, which,
                                                                              tmp_path):
    import gdskit.torch as gt

    path, tensors = several_batches_pt
    read = {"load_cpu": lambda p: gt.load(p, map_location="cpu", verify=True),  # read while unpickling
            "load_saved_place": lambda p: gt.load(p, verify=True),  # read after unpickling
            "load_into": lambda p: _filled(gt, p, tensors)}[reader]
    assert _same(read(path), tensors)
    spans = sorted((s for s in digest_scan.tensor_spans(path, "torch") if s.nbytes), key=lambda s: s.offset)
    small = next(s for s in spans if s.nbytes == tensors["small"].nbytes)
    large = [s for s in spans if s is not small]
    span = {"first": large[0], "middle": large[len(large) // 2], "last": large[-1], "small": small}[which]
    bad = str(tmp_path / "model.pt")
    shutil.copyfile(path, bad)
    shutil.copyfile(path + ".gdskit-digest.json", bad + ".gdskit-digest.json")
    with open(bad, "r+b") as fh:
        fh.seek(span.offset + 4321 % span.nbytes)
        byte = fh.read(1)[0]
        fh.seek(span.offset + 4321 % span.nbytes)
        fh.write(bytes([byte ^ 0x04]))
    st_ = os.stat(path)
    os.utime(bad, ns=(st_.st_atime_ns, st_.st_mtime_ns))
    with pytest.raises(ChecksumMismatchError) as info:
        read(bad)
    assert info.value.byte_range == (span.offset, span.offset + span.nbytes)


def _filled(gt, path, tensors):
    target = {k: torch.zeros_like(v) for k, v in tensors.items()}
    gt.load_into(target, path, verify=True)
    return target


def test_host_memory_alone_is_hashed_while_the_reads_run():
    from gdskit.formats.verified import hashes_while_reading

    assert hashes_while_reading(True, torch.device("cpu")) and hashes_while_reading(True, "cpu")
    assert not hashes_while_reading(False, torch.device("cpu"))
    assert not hashes_while_reading(True, torch.device("cuda", 0)) and not hashes_while_reading(True, "cuda:0")


def test_gpu_memory_alone_has_its_digests_started_as_tensors_land():
    from gdskit.formats.verified import hashes_when_landed

    assert hashes_when_landed(True, torch.device("cuda", 0)) and hashes_when_landed(True, "cuda:0")
    assert hashes_when_landed(True, "cuda")
    assert not hashes_when_landed(False, torch.device("cuda", 0))
    assert not hashes_when_landed(True, torch.device("cpu")) and not hashes_when_landed(True, "cpu")
