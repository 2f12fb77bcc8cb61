"""Digests of DCP checkpoints: ``StorageWriter(digests=True)`` records each item's digest in a
manifest beside ``.metadata``; ``StorageReader(verify=...)`` checks every item it reads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
blake3 = pytest.importorskip("blake3")

import gdskit  # noqa: E402
import gdskit.dcp  # noqa: E402
from gdskit.errors import ChecksumMismatchError, NothingToVerifyError  # noqa: E402
from gdskit.verify import DIRECTORY_MANIFEST, read_manifest  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(512, 1024, generator=g),                     # 2 MiB: aligned, read straight in
        "bf": torch.randn(33, 17, generator=g).to(torch.bfloat16),     # small: packed
        "i8": torch.randint(-100, 100, (9, 3), generator=g, dtype=torch.int8),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 5),
        "window": torch.arange(5000, dtype=torch.int32)[1000:3000],
        "opt": {"step": 12, "name": "adamw"},                          # byte items
    }


def _zeros_like(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else {kk: None for kk in v}
            for k, v in sd.items()}


def _failures(exc: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside DCP's CheckpointException (the exception itself otherwise)."""
    fails = getattr(exc, "failures", None) or getattr(exc, "_failures", None) or {}
    return [e[0] if isinstance(e, tuple) else e for e in fails.values()] or [exc]


def _save(sd: dict[str, Any], path: Path, digests: bool = True) -> None:
    dcp.save(sd, storage_writer=gdskit.dcp.StorageWriter(path, digests=digests), no_dist=True)


def _load(sd: dict[str, Any], reader: Any) -> dict[str, Any]:
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd


def _torch_load(path: Path, like: dict[str, Any]) -> dict[str, Any]:
    return _load(_zeros_like(like), dcp.FileSystemReader(str(path)))


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        if isinstance(w, torch.Tensor):
            assert got[k].dtype == w.dtype and got[k].shape == w.shape and torch.equal(got[k], w), k
        else:
            assert got[k] == w, k


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    sd = _state()
    _save(sd, tmp_path / "c")
    return tmp_path / "c", sd


def test_the_manifest_is_beside_metadata_and_holds_each_items_bytes(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _sd = saved
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", DIRECTORY_MANIFEST]
    manifest = read_manifest(path / DIRECTORY_MANIFEST)
    entry = manifest.files["__0_0.distcp"]
    data = (path / "__0_0.distcp").read_bytes()
    assert entry.digest == blake3.blake3(data).hexdigest()
    assert "w@[0,0]" in entry.tensors and "opt.step" in entry.tensors and "scalar@[]" in entry.tensors
    for t in entry.tensors.values():
        assert blake3.blake3(data[t.offset:t.offset + t.nbytes]).hexdigest() == t.digest
    w = entry.tensors["w@[0,0]"]
    assert data[w.offset:w.offset + w.nbytes] == _state()["w"].numpy().tobytes()  # the tensor's own bytes


@pytest.mark.parametrize("verify", [True, "manifest"])
def test_verified_load_equals_torchs_own_load(saved: tuple[Path, dict[str, Any]], verify: Any) -> None:
    path, sd = saved
    arg = str(path / DIRECTORY_MANIFEST) if verify == "manifest" else True
    before = gdskit.stats().verified.bytes
    got = _load(_zeros_like(sd), gdskit.dcp.StorageReader(path, verify=arg))
    _assert_same(got, _torch_load(path, sd))
    _assert_same(got, sd)
    tensor_bytes = sum(v.nbytes for v in sd.values() if isinstance(v, torch.Tensor))
    assert gdskit.stats().verified.bytes - before >= tensor_bytes


def test_a_resharded_request_reads_and_checks_the_whole_item(saved: tuple[Path, dict[str, Any]]) -> None:
    """A load that wants part of a saved tensor (its first rows, as a resharded load would) still
    checks the whole record; the part equals torch's."""
    path, sd = saved

    class FirstRows(dcp.DefaultLoadPlanner):
        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            items = []
            for it in plan.items:
                if it.storage_index.fqn == "w":
                    it = dcp.planner.ReadItem(type=it.type, dest_index=it.dest_index, dest_offsets=it.dest_offsets,
                                              storage_index=it.storage_index, storage_offsets=torch.Size([0, 0]),
                                              lengths=torch.Size([100, 1024]))
                items.append(it)
            return dcp.planner.LoadPlan(items)

        def resolve_tensor(self, read_item: Any) -> Any:
            if read_item.storage_index.fqn == "w":
                return self.state_dict["w"][:100]
            return super().resolve_tensor(read_item)

    for flip in (False, True):
        if flip:
            _flip(path, lambda data: data.find(sd["w"][300].numpy().tobytes()))  # a row not asked for
        got = {"w": torch.zeros(512, 1024)}
        call = lambda: dcp.load(got, storage_reader=gdskit.dcp.StorageReader(path, verify=True),  # noqa: E731
                                planner=FirstRows(), no_dist=True)
        if not flip:
            call()
            assert torch.equal(got["w"][:100], sd["w"][:100])
        else:
            with pytest.raises(BaseException) as info:
                call()
            (err,) = _failures(info.value)
            assert isinstance(err, ChecksumMismatchError) and err.tensor == "w@[0,0]"


def _flip(path: Path, where: Any) -> None:
    """Flip one bit at the offset ``where(data)`` gives in the rank file, keeping its mtime."""
    f = path / "__0_0.distcp"
    st = f.stat()
    data = bytearray(f.read_bytes())
    at = where(bytes(data))
    assert at >= 0
    data[at] ^= 0x04
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # corruption, not a newer file


@pytest.mark.parametrize("item", ["w@[0,0]", "bf@[0,0]", "i8@[0,0]", "scalar@[]", "window@[0]", "opt.name"])
def test_a_flipped_byte_names_the_item(saved: tuple[Path, dict[str, Any]], item: str) -> None:
    path, sd = saved
    t = read_manifest(path / DIRECTORY_MANIFEST).files["__0_0.distcp"].tensors[item]
    _flip(path, lambda _data: t.offset + t.nbytes // 2)
    with pytest.raises(BaseException) as info:
        _load(_zeros_like(sd), gdskit.dcp.StorageReader(path, verify=True))
    (err,) = _failures(info.value)
    assert isinstance(err, ChecksumMismatchError) and isinstance(err, ValueError)
    assert err.tensor == item
    assert os.path.basename(err.path) == "__0_0.distcp"
    assert err.byte_range == (t.offset, t.offset + t.nbytes)
    assert err.expected == f"blake3:{t.digest}" and err.actual != err.expected
    _load(_zeros_like(sd), gdskit.dcp.StorageReader(path))  # unverified, the load goes through


def test_a_checkpoint_without_digests_is_refused(tmp_path: Path) -> None:
    sd = _state()
    _save(sd, tmp_path / "plain", digests=False)
    assert DIRECTORY_MANIFEST not in os.listdir(tmp_path / "plain")
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")), no_dist=True)
    for path in (tmp_path / "plain", tmp_path / "stock"):
        with pytest.raises(BaseException) as info:
            _load(_zeros_like(sd), gdskit.dcp.StorageReader(path, verify=True))
        (err,) = _failures(info.value)
        assert isinstance(err, NothingToVerifyError), err


def test_a_save_without_digests_removes_the_previous_manifest(saved: tuple[Path, dict[str, Any]]) -> None:
    """Digests of the data a save replaces never outlive it (they would describe other bytes)."""
    path, sd = saved
    _save(sd, path, digests=False)
    assert DIRECTORY_MANIFEST not in os.listdir(path)


def test_a_failed_save_leaves_no_manifest(tmp_path: Path) -> None:
    class Boom(RuntimeError):
        pass

    class FailingFinish(gdskit.dcp.StorageWriter):
        def _publish(self, owned: Any, name: str) -> None:
            if name == ".metadata":
                raise Boom("the metadata could not be written")
            super()._publish(owned, name)

    with pytest.raises(BaseException):
        dcp.save(_state(), storage_writer=FailingFinish(tmp_path / "c", digests=True), no_dist=True)
    assert DIRECTORY_MANIFEST not in os.listdir(tmp_path / "c")
    assert ".metadata" not in os.listdir(tmp_path / "c")


def test_a_file_that_is_not_a_manifest_is_never_replaced(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / DIRECTORY_MANIFEST).write_text("mine")
    with pytest.raises(BaseException):
        _save(_state(), tmp_path / "c")
    assert (tmp_path / "c" / DIRECTORY_MANIFEST).read_text() == "mine"


def _large_state() -> dict[str, Any]:
    """More than one 64 MiB chunk of file: large items (aligned, with holes before them), small and
    byte items packed, in host memory."""
    g = torch.Generator().manual_seed(4)
    sd = _state()
    sd["big"] = torch.randn(9 << 20, generator=g)  # 36 MiB
    sd["big2"] = torch.randn(9 << 20, generator=g).to(torch.float64)  # 72 MiB: across a chunk boundary
    sd["odd"] = torch.randint(0, 255, (3 << 20 | 7,), generator=g, dtype=torch.uint8)  # unaligned length
    return sd


def test_the_written_manifest_is_what_gdskit_digest_computes(tmp_path: Path) -> None:
    from gdskit.formats import digest_scan
    from gdskit.verify import DEFAULT_CHUNK_BYTES

    sd = _large_state()
    _save(sd, tmp_path / "c")
    data_file = tmp_path / "c" / "__0_0.distcp"
    entry = read_manifest(tmp_path / "c" / DIRECTORY_MANIFEST).files["__0_0.distcp"]
    assert len(entry.chunks) == 2
    spans = [digest_scan.Span(n, t.offset, t.nbytes) for n, t in entry.tensors.items()]
    assert digest_scan.digest_file(str(data_file), DEFAULT_CHUNK_BYTES, spans) == entry
    _assert_same(_load(_zeros_like(sd), gdskit.dcp.StorageReader(tmp_path / "c", verify=True)), sd)
    (result,) = digest_scan.make_manifests([str(data_file)])  # `gdskit digest __0_0.distcp`: raw bytes
    raw = read_manifest(str(data_file) + ".gdskit-digest.json").files["__0_0.distcp"]
    assert (raw.size, raw.mtime_ns, raw.digest, raw.chunks) == (entry.size, entry.mtime_ns, entry.digest, entry.chunks)
    assert result.digest == blake3.blake3(data_file.read_bytes()).hexdigest()


def _bytes_read_by_this_process() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


def test_the_writer_hashes_what_it_writes_and_never_reads_the_file_back(tmp_path: Path) -> None:
    sd = _large_state()
    size = sum(t.nbytes for t in sd.values() if isinstance(t, torch.Tensor))
    _save(sd, tmp_path / "warm-up")  # the first save's imports read files of their own
    before = _bytes_read_by_this_process()
    _save(sd, tmp_path / "c")
    assert _bytes_read_by_this_process() - before < size // 4
    assert read_manifest(tmp_path / "c" / DIRECTORY_MANIFEST).files["__0_0.distcp"].digest == \
        blake3.blake3((tmp_path / "c" / "__0_0.distcp").read_bytes()).hexdigest()


def test_a_save_whose_data_file_fails_records_no_digests(tmp_path: Path) -> None:
    """The previous save's digests are retired, and the failed one's never written."""
    class Boom(RuntimeError):
        pass

    class FailingData(gdskit.dcp.StorageWriter):
        def _publish(self, owned: Any, name: str) -> None:
            if name.endswith(".distcp"):
                raise Boom("the data file could not be put in place")
            super()._publish(owned, name)

    _save(_state(), tmp_path / "c")
    assert DIRECTORY_MANIFEST in os.listdir(tmp_path / "c")
    with pytest.raises(BaseException):
        dcp.save(_large_state(), storage_writer=FailingData(tmp_path / "c", digests=True), no_dist=True)
    assert DIRECTORY_MANIFEST not in os.listdir(tmp_path / "c")
    assert ".metadata" not in os.listdir(tmp_path / "c")
