"""Datasets of objects in moto's S3 server: ``TokenDataset("s3://...")`` gives the batches the
same dataset on a local copy gives, for random index batches, and reads a batch's windows with
no more GETs than the runs its nearby windows make (the ledger's object requests)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

torch = pytest.importorskip("torch")

import gdskit  # noqa: E402
from gdskit.data import Loader, NpyDataset, RecordDataset, TokenDataset  # noqa: E402
from gdskit.data.errors import UnsupportedLayoutError  # noqa: E402
from gdskit.data.read import FileCache, read_samples  # noqa: E402

from object_server import moto_endpoint, s3  # noqa: E402, F401 - fixtures

SEQ = 64
TOKENS = 40_000
PART = 5 << 20


def _tokens(seed: int, n: int = TOKENS) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.uint16)


@pytest.fixture
def token_pair(s3: Any, tmp_path: Any) -> tuple[TokenDataset, TokenDataset]:
    """The same two token files as objects under a prefix and as local files."""
    (tmp_path / "local").mkdir()
    for i in range(2):
        data = _tokens(i).tobytes()
        s3.put(f"tokens/shard-{i}.bin", data)
        (tmp_path / "local" / f"shard-{i}.bin").write_bytes(data)
    remote = TokenDataset(s3.url("tokens/"), dtype="uint16", seq_len=SEQ)
    local = TokenDataset(str(tmp_path / "local"), dtype="uint16", seq_len=SEQ)
    return remote, local


def _runs(dataset: TokenDataset, indices: list[int], gap: int) -> int:
    """GETs a batch needs at most: windows of one file taken by offset, one joining the run
    before it where it starts at most ``gap`` bytes past that run's end and the run stays
    within one part."""
    files, offsets = dataset.locate(np.array(indices, dtype=np.int64))
    size = (SEQ + 1) * 2
    runs = 0
    for f in set(files.tolist()):
        start = end = None
        for off in sorted(set(int(o) for o, g in zip(offsets, files) if g == f)):
            if end is not None and off - end <= gap and max(end, off + size) - start <= PART:
                end = max(end, off + size)
                continue
            runs += 1
            start, end = off, off + size
    return runs


def _gets(before: Any) -> int:
    return sum(o.ops for o in (gdskit.stats() - before).objects if o.op == "read")


@hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), gap=st.sampled_from([0, 100, 300, 4096, 1 << 20]))
def test_random_batches_equal_the_local_copy_in_no_more_gets_than_runs(token_pair, data, gap):
    remote, local = token_pair
    assert len(remote) == len(local)
    indices = data.draw(st.lists(st.integers(0, len(local) - 1), min_size=1, max_size=48))
    # neighbours too: a batch of a sequential sampler's runs
    start = data.draw(st.integers(0, len(local) - 8))
    indices += list(range(start, start + data.draw(st.integers(0, 8))))
    idx = np.array(indices, dtype=np.int64)
    with gdskit.settings.set(s3_part_size=PART, s3_coalesce_gap=gap), FileCache() as files:
        before = gdskit.stats()
        got = read_samples(remote, idx, torch.device("cpu"), files)
        gets = _gets(before)
    with FileCache() as files:
        want = read_samples(local, idx, torch.device("cpu"), files)
    assert torch.equal(got, want)
    assert gets <= _runs(remote, indices, gap)


def test_a_batch_of_neighbouring_windows_is_one_get(token_pair):
    remote, local = token_pair
    idx = np.array([5, 3, 4, 6, 7, 9], dtype=np.int64)  # 8 is missing: a gap of one window
    with gdskit.settings.set(s3_coalesce_gap=SEQ * 2), FileCache() as files:
        before = gdskit.stats()
        got = read_samples(remote, idx, torch.device("cpu"), files)
        assert _gets(before) == 1
    with gdskit.settings.set(s3_coalesce_gap=0), FileCache() as files:
        before = gdskit.stats()
        read_samples(remote, idx, torch.device("cpu"), files)
        assert _gets(before) == 2  # 3..7 touch (windows overlap by a token); 9 is apart
    with FileCache() as files:
        assert torch.equal(got, read_samples(local, idx, torch.device("cpu"), files))


def test_a_loader_over_objects_gives_the_local_batches(token_pair):
    remote, local = token_pair
    with Loader(remote, 16, device="cpu", shuffle=True, seed=3) as a, \
            Loader(local, 16, device="cpu", shuffle=True, seed=3) as b:
        batches = list(zip(a, b))
    assert len(batches) == len(local) // 16
    for x, y in batches:
        assert torch.equal(x, y)


def test_an_object_dataset_keeps_its_fingerprint_under_another_prefix(s3):
    for prefix in ("a/", "b/deeper/"):
        for i in range(2):
            s3.put(f"{prefix}shard-{i}.bin", _tokens(i, 1000).tobytes())
    one = TokenDataset(s3.url("a/"), dtype="uint16", seq_len=SEQ)
    other = TokenDataset(s3.url("b/deeper/"), dtype="uint16", seq_len=SEQ)
    assert one.fingerprint() == other.fingerprint()
    assert one.fingerprint() != TokenDataset(s3.url("a/"), dtype="uint16", seq_len=SEQ + 1).fingerprint()


def test_records_of_an_object_equal_the_local_file(s3, tmp_path):
    data = np.random.default_rng(5).integers(0, 255, 4096 * 12, dtype=np.uint8).tobytes()
    s3.put("rec.bin", data)
    (tmp_path / "rec.bin").write_bytes(data)
    remote = RecordDataset(s3.url("rec.bin"), record_bytes=4096)
    local = RecordDataset(str(tmp_path / "rec.bin"), record_bytes=4096)
    for i in (0, 5, 11):
        assert torch.equal(remote[i], local[i])


@pytest.mark.parametrize("order", ["C", "F"])
def test_npy_objects_equal_the_local_files(s3, tmp_path, order):
    """Rows of one .npy object, and whole arrays of a prefix of them, as the local files give."""
    rng = np.random.default_rng(7)
    arrays = [np.asarray(rng.standard_normal((9, 5)).astype(np.float32), order=order) for _ in range(3)]
    for i, a in enumerate(arrays):
        np.save(tmp_path / f"part{i}.npy", a)
        s3.put(f"npy/part{i}.npy", (tmp_path / f"part{i}.npy").read_bytes())
    if order == "C":
        rows = NpyDataset(s3.url("npy/part0.npy"), rows=True)
        assert len(rows) == 9 and all(torch.equal(rows[i], torch.from_numpy(arrays[0][i])) for i in range(9))
    else:  # as for the local file: a Fortran-order array's rows are scattered
        with pytest.raises(UnsupportedLayoutError):
            NpyDataset(s3.url("npy/part0.npy"), rows=True)
    whole = NpyDataset(s3.url("npy/"))
    local = NpyDataset([str(tmp_path / f"part{i}.npy") for i in range(3)])
    assert len(whole) == len(local) == 3
    for i in range(3):
        assert torch.equal(whole[i], local[i]) and torch.equal(whole[i], torch.from_numpy(np.ascontiguousarray(arrays[i])))


def test_a_token_object_of_a_partial_token_is_refused(s3):
    s3.put("odd.bin", b"\x00" * 1001)
    with pytest.raises(gdskit.data.FileSizeError):
        TokenDataset(s3.url("odd.bin"), dtype="uint16", seq_len=SEQ)


def test_a_missing_object_is_named_at_once(s3):
    with pytest.raises(FileNotFoundError):
        TokenDataset(s3.url("missing.bin"), dtype="uint16", seq_len=SEQ)
    with pytest.raises(FileNotFoundError):
        TokenDataset(s3.url("empty-prefix/"), dtype="uint16", seq_len=SEQ)
