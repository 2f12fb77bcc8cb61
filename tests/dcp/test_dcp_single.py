"""gdskit.dcp in one process (``no_dist=True``): formats, interop, durability, errors."""

from __future__ import annotations

import collections
import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import gdskit  # noqa: E402
import gdskit.dcp  # noqa: E402
from gdskit.dcp import _archive  # noqa: E402
from gdskit.errors import FormatError, GdskitError  # noqa: E402
from gdskit.formats.safetensors_format import TruncatedFileError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    sd: dict[str, Any] = {
        "w": torch.randn(512, 1024, generator=g),                       # 2 MiB: aligned, written from its memory
        "bf": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "half": torch.randn(7, generator=g).half(),
        "i8": torch.randint(-100, 100, (9, 3), generator=g, dtype=torch.int8),
        "flag": torch.tensor([True, False, True]),
        "cplx": torch.randn(4, 2, generator=g, dtype=torch.complex64),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 5),
        "transposed": torch.randn(6, 10, generator=g).t(),             # not contiguous
        "window": torch.arange(5000, dtype=torch.int32)[1000:3000],    # view with a storage offset
        "big_view": torch.randn(2, 400_000, generator=g)[1],           # large view with an offset
        "opt": {"step": 12, "lr": 0.5, "name": "adamw", "betas": (0.9, 0.99)},
    }
    if hasattr(torch, "float8_e4m3fn"):
        sd["fp8"] = torch.randn(16, 16, generator=g).to(torch.float8_e4m3fn)
    return sd


def _zeros_like(sd: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
        elif isinstance(v, dict):
            out[k] = {kk: None for kk in v}
        else:
            out[k] = None
    return out


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        g = got[k]
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and g.shape == w.shape, k
            assert torch.equal(g.view(torch.uint8) if w.dtype.itemsize == 1 and w.is_floating_point() else g,
                               w.view(torch.uint8) if w.dtype.itemsize == 1 and w.is_floating_point() else w), k
        else:
            assert g == w, k


def _save(sd: dict[str, Any], writer: Any) -> None:
    dcp.save(sd, storage_writer=writer, no_dist=True)


def _load(sd: dict[str, Any], reader: Any) -> dict[str, Any]:
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd


def _failures(exc: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside DCP's CheckpointException."""
    fails = getattr(exc, "failures", None) or getattr(exc, "_failures", None) or {}
    return [e[0] if isinstance(e, tuple) else e for e in fails.values()]


def test_roundtrip_through_gdskit(tmp_path: Path) -> None:
    sd = _state()
    _save(sd, gdskit.dcp.StorageWriter(tmp_path / "c"))
    assert sorted(os.listdir(tmp_path / "c")) == [".metadata", "__0_0.distcp"]
    _assert_same(_load(_zeros_like(sd), gdskit.dcp.StorageReader(tmp_path / "c")), sd)


def test_written_by_gdskit_loads_with_stock_reader(tmp_path: Path) -> None:
    sd = _state()
    _save(sd, gdskit.dcp.StorageWriter(tmp_path / "c"))
    _assert_same(_load(_zeros_like(sd), dcp.FileSystemReader(tmp_path / "c")), sd)


@pytest.mark.parametrize("single_file", [True, False])
def test_written_by_stock_loads_with_gdskit(tmp_path: Path, single_file: bool) -> None:
    sd = _state()
    _save(sd, dcp.FileSystemWriter(tmp_path / "c", single_file_per_rank=single_file, thread_count=3))
    _assert_same(_load(_zeros_like(sd), gdskit.dcp.StorageReader(tmp_path / "c")), sd)


def test_large_non_tensor_items_round_trip(tmp_path: Path) -> None:
    """A pickled object of more than 1 MiB (optimizer state, a long list) is a raw byte item:
    packed with the small items, never sent down the aligned tensor path."""
    sd = {"w": torch.randn(300_000), "blob": {"ids": list(range(300_000)), "raw": os.urandom(3 << 20)}}
    _save(sd, gdskit.dcp.StorageWriter(tmp_path / "c"))
    for reader in (gdskit.dcp.StorageReader(tmp_path / "c"), dcp.FileSystemReader(tmp_path / "c")):
        _assert_same(_load(_zeros_like(sd), reader), sd)
    from gdskit.dcp._layout import ItemShape, place

    (p,), _ = place([ItemShape(0, 2 << 20, 0, raw=True)])
    assert not p.aligned  # raw items are packed, however large


def test_large_payloads_are_aligned(tmp_path: Path) -> None:
    sd = {"a": torch.randn(300_000), "b": torch.randn(3), "c": torch.randn(262_144)}
    _save(sd, gdskit.dcp.StorageWriter(tmp_path / "c"))
    md = gdskit.dcp.StorageReader(tmp_path / "c").read_metadata()
    path = tmp_path / "c" / "__0_0.distcp"
    with open(path, "rb") as fh:
        for idx, info in md.storage_data.items():
            fh.seek(info.offset)
            blob = fh.read(info.length)
            saved = _archive.parse(_pread(fh), info.offset, info.length, blob[:4096], blob[-8192:], idx.fqn)
            if idx.fqn in ("a", "c"):
                assert saved.record_offset % 4096 == 0, idx.fqn
            # every item is a complete torch.save archive on its own
            assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), sd[idx.fqn])


def test_load_converts_dtype_and_fills_non_contiguous_destinations(tmp_path: Path) -> None:
    sd = {"a": torch.randn(300_000), "m": torch.randn(8, 12), "big": torch.randn(600, 600)}
    _save(sd, gdskit.dcp.StorageWriter(tmp_path / "c"))
    out = {"a": torch.zeros(300_000, dtype=torch.float64), "m": torch.zeros(12, 8).t(),
           "big": torch.zeros(600, 600).t()}
    _load(out, gdskit.dcp.StorageReader(tmp_path / "c"))
    assert torch.equal(out["a"], sd["a"].double())
    assert torch.equal(out["m"], sd["m"])
    assert torch.equal(out["big"], sd["big"])


def test_partial_load(tmp_path: Path) -> None:
    sd = _state()
    _save(sd, gdskit.dcp.StorageWriter(tmp_path / "c"))
    out = _load({"w": torch.zeros(512, 1024), "window": torch.zeros(2000, dtype=torch.int32)},
                gdskit.dcp.StorageReader(tmp_path / "c"))
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["window"], sd["window"])


def test_ledger_records_the_moves(tmp_path: Path) -> None:
    sd = {"w": torch.randn(512, 1024)}
    before = gdskit.stats()
    _save(sd, gdskit.dcp.StorageWriter(tmp_path / "c"))
    mid = gdskit.stats()
    _load({"w": torch.zeros(512, 1024)}, gdskit.dcp.StorageReader(tmp_path / "c"))
    after = gdskit.stats()
    wrote, read = gdskit.stats_delta(before, mid), gdskit.stats_delta(mid, after)
    assert wrote.paths["host"].bytes_written >= 512 * 1024 * 4
    assert read.paths["host"].bytes_read >= 512 * 1024 * 4


def test_unsynced_save_still_loads(tmp_path: Path) -> None:
    sd = _state()
    _save(sd, gdskit.dcp.StorageWriter(tmp_path / "c", sync_files=False))
    _assert_same(_load(_zeros_like(sd), gdskit.dcp.StorageReader(tmp_path / "c")), sd)


def test_missing_metadata_is_incomplete(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "__0_0.distcp").write_bytes(b"partial")
    with pytest.raises(gdskit.dcp.IncompleteCheckpointError) as info:
        gdskit.dcp.StorageReader(tmp_path / "c").read_metadata()
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, GdskitError)
    with pytest.raises(gdskit.dcp.IncompleteCheckpointError):
        gdskit.dcp.StorageReader(tmp_path / "nothing").read_metadata()
    with pytest.raises(BaseException) as info2:
        _load({"w": torch.zeros(3)}, gdskit.dcp.StorageReader(tmp_path / "c"))
    assert type(info2.value).__name__ == "CheckpointException"


def test_overwrite_false_refuses_existing(tmp_path: Path) -> None:
    _save({"a": torch.ones(3)}, gdskit.dcp.StorageWriter(tmp_path / "c"))
    w = gdskit.dcp.StorageWriter(tmp_path / "c", overwrite=False)
    w.set_up_storage_writer(True, rank=0, use_collectives=True)
    with pytest.raises(gdskit.dcp.CheckpointExistsError):
        w.prepare_local_plan(dcp.planner.SavePlan([]))
    with pytest.raises(BaseException) as info:
        _save({"a": torch.zeros(3)}, gdskit.dcp.StorageWriter(tmp_path / "c", overwrite=False))
    assert any(isinstance(e, gdskit.dcp.CheckpointExistsError) for e in _failures(info.value))
    out = _load({"a": torch.zeros(3)}, gdskit.dcp.StorageReader(tmp_path / "c"))
    assert torch.equal(out["a"], torch.ones(3))


def test_overwrite_replaces_and_cleans_temporaries(tmp_path: Path) -> None:
    _save({"a": torch.ones(3)}, gdskit.dcp.StorageWriter(tmp_path / "c"))
    stale = tmp_path / "c" / ".__0_0.distcp.deadbeef.gdskit-tmp"
    stale.write_bytes(b"x" * 100)
    _save({"a": torch.full((3,), 2.0)}, gdskit.dcp.StorageWriter(tmp_path / "c"))
    assert not stale.exists()
    out = _load({"a": torch.zeros(3)}, gdskit.dcp.StorageReader(tmp_path / "c"))
    assert torch.equal(out["a"], torch.full((3,), 2.0))


class _Boom(RuntimeError):
    pass


class _FailingPlanner(dcp.DefaultSavePlanner):
    def resolve_data(self, write_item: Any) -> Any:
        if write_item.index.fqn == "w":
            raise _Boom("failure while writing")
        return super().resolve_data(write_item)


def test_failed_save_leaves_nothing_and_spares_other_checkpoints(tmp_path: Path) -> None:
    sd = _state()
    _save(sd, gdskit.dcp.StorageWriter(tmp_path / "step1"))
    with pytest.raises(BaseException) as info:
        dcp.save(sd, storage_writer=gdskit.dcp.StorageWriter(tmp_path / "step2"), planner=_FailingPlanner(),
                 no_dist=True)
    assert any(isinstance(e, _Boom) for e in _failures(info.value))
    assert os.listdir(tmp_path / "step2") == []
    _assert_same(_load(_zeros_like(sd), gdskit.dcp.StorageReader(tmp_path / "step1")), sd)


def _corrupt(tmp_path: Path, fn: Any) -> BaseException:
    sd = {"a": torch.randn(300_000), "b": torch.randn(5)}
    _save(sd, gdskit.dcp.StorageWriter(tmp_path / "c"))
    fn(tmp_path / "c")
    with pytest.raises(BaseException) as info:
        _load({"a": torch.zeros(300_000), "b": torch.zeros(5)}, gdskit.dcp.StorageReader(tmp_path / "c"))
    fails = _failures(info.value)
    assert fails, info.value
    return fails[0]


def test_truncated_file(tmp_path: Path) -> None:
    def cut(d: Path) -> None:
        p = d / "__0_0.distcp"
        os.truncate(p, p.stat().st_size // 2)
    assert isinstance(_corrupt(tmp_path, cut), TruncatedFileError)


def test_item_that_is_not_an_archive(tmp_path: Path) -> None:
    def scribble(d: Path) -> None:
        md = gdskit.dcp.StorageReader(d).read_metadata()
        off = min(info.offset for info in md.storage_data.values())
        with open(d / "__0_0.distcp", "r+b") as fh:
            fh.seek(off)
            fh.write(b"NOTAZIP!")
    assert isinstance(_corrupt(tmp_path, scribble), FormatError)


def test_stream_transforms_are_refused(tmp_path: Path) -> None:
    def add_transform(d: Path) -> None:
        with open(d / ".metadata", "rb") as fh:
            md = pickle.load(fh)
        for info in md.storage_data.values():
            info.transform_descriptors = ["zstd"]
        with open(d / ".metadata", "wb") as fh:
            pickle.dump(md, fh)
    assert isinstance(_corrupt(tmp_path, add_transform), gdskit.dcp.UnsupportedItemError)


def test_metadata_that_is_not_metadata(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    with open(tmp_path / "c" / ".metadata", "wb") as fh:
        pickle.dump({"not": "metadata"}, fh)
    with pytest.raises(FormatError):
        gdskit.dcp.StorageReader(tmp_path / "c").read_metadata()


class _Planted:
    """Unpickled by a plain unpickler, this makes a directory: any code could run instead."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("payload", ["call", "call inside metadata", "unknown class", "bad arguments", "garbage"])
def test_hostile_metadata_runs_nothing_and_is_a_format_error(tmp_path: Path, payload: str) -> None:
    """The ``.metadata`` pickle is read with an unpickler that knows only DCP's metadata classes:
    a planted call is refused before it runs, and every malformed stream is a FormatError."""
    _save({"w": torch.arange(6.0)}, gdskit.dcp.StorageWriter(tmp_path / "c"))
    marker = str(tmp_path / "ran")
    meta = tmp_path / "c" / ".metadata"
    good = gdskit.dcp.StorageReader(tmp_path / "c").read_metadata()
    if payload == "call":
        blob = pickle.dumps(_Planted(marker))
    elif payload == "call inside metadata":
        good.planner_data = {"x": _Planted(marker)}
        blob = pickle.dumps(good)
    elif payload == "unknown class":
        blob = pickle.dumps(collections.Counter("abc"))
    elif payload == "bad arguments":  # an allowed callable given what it cannot take
        blob = b"\x80\x04ctorch\nSize\n(I1\ntR."
    else:
        blob = pickle.dumps(good)[:40] + b"\xff" * 20
    meta.write_bytes(blob)
    with pytest.raises(FormatError):
        gdskit.dcp.StorageReader(tmp_path / "c").read_metadata()
    assert not os.path.exists(marker)


def _tampered(tmp_path: Path, change: Any) -> BaseException:
    """The error reading a checkpoint whose metadata ``change(md)`` altered raises (at read_metadata)."""
    _save({"w": torch.arange(6.0), "b": io.BytesIO(b"xyz")}, gdskit.dcp.StorageWriter(tmp_path / "c"))
    md = gdskit.dcp.StorageReader(tmp_path / "c").read_metadata()
    md.storage_meta = None
    change(md)
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(FormatError) as info:
        gdskit.dcp.StorageReader(tmp_path / "c").read_metadata()
    return info.value


@pytest.mark.parametrize("where", ["../outside.bin", "/etc/hostname", "a/../../x", "..", "", "a\\..\\..\\x"])
def test_an_item_file_outside_the_checkpoint_is_refused(tmp_path: Path, where: str) -> None:
    def move(md: Any) -> None:
        for info in md.storage_data.values():
            info.relative_path = where

    assert "outside the checkpoint" in str(_tampered(tmp_path, move))


@pytest.mark.parametrize("change", ["item type", "dtype", "size", "chunk outside", "negative offset", "storage key",
                                    "planner data"])
def test_metadata_of_the_wrong_types_is_refused(tmp_path: Path, change: str) -> None:
    def alter(md: Any) -> None:
        item = md.state_dict_metadata["w"]
        if change == "item type":
            md.state_dict_metadata["w"] = "not an item"
        elif change == "dtype":
            item.properties.dtype = "float32"
        elif change == "size":
            item.size = [6]
        elif change == "chunk outside":
            item.chunks[0].sizes = torch.Size([7])
        elif change == "negative offset":
            next(iter(md.storage_data.values())).offset = -1
        elif change == "storage key":
            md.storage_data = {"w": next(iter(md.storage_data.values()))}
        else:
            md.planner_data = [1, 2]

    _tampered(tmp_path, alter)


def test_mutated_metadata_is_read_or_refused_never_anything_else(tmp_path: Path) -> None:
    """Bytes of a real .metadata flipped, cut, repeated and renamed: read_metadata gives valid
    metadata or a FormatError (or an incomplete-checkpoint error), and nothing planted runs.
    The cases run in a child under a memory cap: a case that costs more than the cap fails the
    test instead of taking the run down."""
    from hypothesis import HealthCheck, given, settings, strategies as st
    from memory_cap import run_capped

    _save({"w": torch.arange(6.0).reshape(2, 3), "b": io.BytesIO(b"xyz"), "n": {"k": 1}},
          gdskit.dcp.StorageWriter(tmp_path / "c"))
    base = (tmp_path / "c" / ".metadata").read_bytes()
    target = tmp_path / "m"
    target.mkdir()
    names = [b"Metadata", b"Size", b"_get_layout", b"PosixPath", b"torch.distributed.checkpoint.metadata"]

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(st.sampled_from(["flip", "cut", "repeat", "rename"]), st.integers(0, len(base) - 1),
                              st.integers(0, 255)), min_size=1, max_size=4))
    def check(edits: list[tuple[str, int, int]]) -> None:
        blob = bytearray(base)
        for kind, at, value in edits:
            at %= max(len(blob), 1)
            if kind == "flip":
                blob[at] = value
            elif kind == "cut":
                del blob[at:at + value]
            elif kind == "repeat":
                blob[at:at] = blob[at:at + value % 32]
            else:  # another name where a global's name is: os.system, builtins.eval, ...
                old = names[value % len(names)]
                new = [b"system", b"eval", b"os", b"builtins"][value % 4]
                blob = bytearray(bytes(blob).replace(old, new, 1))
        (target / ".metadata").write_bytes(bytes(blob))
        try:
            md = gdskit.dcp.StorageReader(target).read_metadata()
        except (FormatError, gdskit.dcp.IncompleteCheckpointError):
            return
        assert isinstance(md.state_dict_metadata, dict)

    outcome = run_capped(check, cap_bytes=1 << 30, timeout_s=400)
    assert outcome.status == "returned", outcome


def test_metadata_written_by_torch_with_byte_items_and_paths_still_reads(tmp_path: Path) -> None:
    sd = {"w": torch.randn(4, 4), "b": torch.zeros(3, dtype=torch.bfloat16), "extra": {"step": 3, "name": "x"},
          "buf": io.BytesIO(b"abc")}
    _save(sd, dcp.FileSystemWriter(str(tmp_path / "c")))
    md = gdskit.dcp.StorageReader(tmp_path / "c").read_metadata()
    with open(tmp_path / "c" / ".metadata", "rb") as fh:
        want = pickle.load(fh)  # the test's own file: the reference reading
    assert md.state_dict_metadata == want.state_dict_metadata
    assert md.storage_data == want.storage_data


def test_template_matches_torch_save_layout() -> None:
    t = torch.randn(30, 7)
    tpl = _archive.template(t.dtype, tuple(t.shape))
    blob = tpl.head + t.numpy().tobytes() + tpl.tail
    assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), t)


def _pread(fh: Any) -> Any:
    return lambda offset, n: os.pread(fh.fileno(), n, offset)


def test_parse_reads_views_from_stock_archives(tmp_path: Path) -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    view = base[1:5, 2:].t()                      # strided, with a storage offset; torch.save keeps the view
    buf = io.BytesIO()
    torch.save(view, buf)
    blob = buf.getvalue()
    p = tmp_path / "x"
    p.write_bytes(b"\0" * 100 + blob)
    with open(p, "rb") as fh:
        saved = _archive.parse(_pread(fh), 100, len(blob), blob[:64], blob[-64:], "x")
    assert saved.meta.shape == view.shape and saved.meta.stride() == view.stride()
    assert saved.meta.storage_offset() == view.storage_offset()
    raw = torch.frombuffer(bytearray(p.read_bytes()[saved.record_offset:saved.record_offset + saved.record_nbytes]),
                           dtype=torch.float32)
    assert torch.equal(raw.as_strided(view.shape, view.stride(), view.storage_offset()), view)


def test_parse_refuses_other_objects(tmp_path: Path) -> None:
    buf = io.BytesIO()
    torch.save({"a": torch.ones(2), "b": torch.ones(3)}, buf)
    blob = buf.getvalue()
    p = tmp_path / "x"
    p.write_bytes(blob)
    with open(p, "rb") as fh, pytest.raises(FormatError):
        _archive.parse(_pread(fh), 0, len(blob), blob, blob, "x")


def test_parse_refuses_a_deflated_storage_record(tmp_path: Path) -> None:
    # Its bytes in the file are compressed: reading them at the record's offset would give
    # wrong values, so the item is refused.
    import zipfile

    buf = io.BytesIO()
    torch.save(torch.arange(4096, dtype=torch.float32) % 7, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            method = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            dst.writestr(info.filename, src.read(info.filename), compress_type=method)
    blob = out.getvalue()
    assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), torch.arange(4096, dtype=torch.float32) % 7)
    p = tmp_path / "x"
    p.write_bytes(blob)
    with open(p, "rb") as fh, pytest.raises(FormatError):
        _archive.parse(_pread(fh), 0, len(blob), blob, blob, "x")


def test_validate_checkpoint_id(tmp_path: Path) -> None:
    assert gdskit.dcp.StorageWriter.validate_checkpoint_id(tmp_path / "new")
    assert gdskit.dcp.StorageReader.validate_checkpoint_id(str(tmp_path / "new"))
    assert gdskit.dcp.StorageWriter.validate_checkpoint_id("s3://bucket/x/")  # an object prefix
    assert gdskit.dcp.StorageReader.validate_checkpoint_id("s3://bucket/x")
    assert not gdskit.dcp.StorageWriter.validate_checkpoint_id("gs://bucket/x")


def test_checkpoint_id_and_storage_meta(tmp_path: Path) -> None:
    w = gdskit.dcp.StorageWriter(tmp_path / "a")
    w.reset(tmp_path / "b")
    assert w.checkpoint_id == str(tmp_path / "b")
    meta = w.storage_meta()
    assert meta.checkpoint_id == str(tmp_path / "b") and meta.save_id
    dcp.save({"x": torch.ones(2)}, checkpoint_id=tmp_path / "b", storage_writer=w, no_dist=True)
    md = gdskit.dcp.StorageReader(tmp_path / "b").read_metadata()
    assert md.storage_meta.save_id == w.save_id != meta.save_id   # every save gets a fresh id


class _ReaderWithoutSizes:
    """torch's archive reader as torch 2.11 has it: no ``get_record_size``."""

    def __init__(self, *args: Any) -> None:
        self._reader = _REAL_READER(*args)

    def __getattr__(self, name: str) -> Any:
        if name == "get_record_size":
            raise AttributeError(name)
        return getattr(self._reader, name)


_REAL_READER = torch._C.PyTorchFileReader


def test_roundtrip_where_torch_reader_gives_no_record_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_archive.torch._C, "PyTorchFileReader", _ReaderWithoutSizes)
    _archive.template.cache_clear()
    try:
        sd = _state()
        _save(sd, gdskit.dcp.StorageWriter(tmp_path / "c"))
        _assert_same(_load(_zeros_like(sd), gdskit.dcp.StorageReader(tmp_path / "c")), sd)
        _save(sd, dcp.FileSystemWriter(tmp_path / "s"))
        _assert_same(_load(_zeros_like(sd), gdskit.dcp.StorageReader(tmp_path / "s")), sd)
    finally:
        _archive.template.cache_clear()


@pytest.mark.parametrize("batch", [None, 100])
def test_small_items_are_served_from_the_bytes_read_to_parse_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  batch: int | None) -> None:
    """An item archive small enough to be read whole for parsing is not read a second time;
    its bytes reach the destinations in batches (here also one or two items a batch)."""
    from gdskit.dcp import _reader
    from gdskit.formats import torch_io

    if batch is not None:
        monkeypatch.setattr(_reader, "_SERVED_BATCH", batch)

    sd = {"m": torch.randn(8, 12), "i": torch.arange(10), "h": torch.randn(5, 3).half(), "w": torch.randn(512, 1024)}
    _save(sd, gdskit.dcp.StorageWriter(tmp_path / "c"))
    planned: list[int] = []
    real = torch_io.execute

    def spy(f: Any, plan: Any, device: Any, **kw: Any) -> Any:
        planned.append(plan.payload_bytes)
        return real(f, plan, device, **kw)

    monkeypatch.setattr(torch_io, "execute", spy)
    out = _load({"m": torch.zeros(12, 8).t(), "i": torch.zeros(10, dtype=torch.int64),
                 "h": torch.zeros(5, 3, dtype=torch.float32), "w": torch.zeros(512, 1024)},
                gdskit.dcp.StorageReader(tmp_path / "c"))
    assert torch.equal(out["m"], sd["m"]) and torch.equal(out["i"], sd["i"])
    assert torch.equal(out["h"], sd["h"].float())      # converted on the way
    assert torch.equal(out["w"], sd["w"])
    assert planned == [512 * 1024 * 4]                  # only the large tensor went to the engine
