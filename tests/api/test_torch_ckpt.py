"""gdskit.torch.save / load against plain torch.save / torch.load (CPU tensors; GPU tests marked)."""

from __future__ import annotations

import os
import pickle

import pytest

torch = pytest.importorskip("torch")

import gdskit.torch as gt  # noqa: E402
from gpu_memory import load_from_one_segment  # noqa: E402
from leak_helpers import fd_count  # noqa: E402
from torch_checkpoints import checkpoint, same  # noqa: E402
from gdskit.errors import FormatError, GdskitError  # noqa: E402

pytestmark = pytest.mark.torch


# -- files written by gdskit ----------------------------------------------------

def test_gdskit_save_loads_with_plain_torch_load(tmp_path) -> None:
    sd = checkpoint()
    path = tmp_path / "g.pt"
    gt.save(sd, path)
    assert same(torch.load(path), sd)
    assert same(torch.load(path, mmap=True), sd)
    assert same(torch.load(path, weights_only=False), sd)


def test_gdskit_save_aligns_storages_to_4k(tmp_path) -> None:
    path = tmp_path / "g.pt"
    gt.save(checkpoint(), path)
    r = torch._C.PyTorchFileReader(str(path))
    names = [n for n in r.get_all_records() if n.startswith("data/")]
    # The literal, not gt.STORAGE_ALIGNMENT: the test must fail if the constant drifts from 4 KiB.
    assert names and all(r.get_record_offset(n) % 4096 == 0 for n in names)


def test_gdskit_save_restores_torch_setting(tmp_path) -> None:
    from torch.utils.serialization import config
    before = config.save.storage_alignment
    gt.save({"a": torch.ones(2)}, tmp_path / "x.pt")
    assert config.save.storage_alignment == before


def test_gdskit_round_trip_keeps_shared_storages(tmp_path) -> None:
    sd = checkpoint()
    path = tmp_path / "g.pt"
    gt.save(sd, path)
    out = gt.load(path)
    assert same(out, sd)
    ptr = out["w"].untyped_storage().data_ptr()
    assert out["w_t"].untyped_storage().data_ptr() == ptr
    assert out["w_rows"].untyped_storage().data_ptr() == ptr
    out["w"][0, 0] = 42.0  # one storage: the views see the write
    assert out["w_t"][0, 0].item() == 42.0


def test_save_is_atomic_when_a_write_fails(tmp_path, monkeypatch) -> None:
    path = tmp_path / "x.pt"
    path.write_bytes(b"old")
    import gdskit.engine.file

    def failing_pwrite(self, *a, **kw):
        raise gdskit.errors.GdskitIOError(5, "injected failure")

    monkeypatch.setattr(gdskit.engine.file.File, "pwrite", failing_pwrite)
    with pytest.raises(gdskit.errors.GdskitIOError):
        gt.save({"a": torch.randn(100)}, path)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["x.pt"]


# -- files written by torch.save -------------------------------------------------

def test_plain_torch_save_loads_with_gdskit(tmp_path) -> None:
    sd = checkpoint()
    path = tmp_path / "plain.pt"
    torch.save(sd, path)
    out = gt.load(path)
    assert same(out, sd)
    assert out["w_t"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()


def test_legacy_format_is_read(tmp_path) -> None:
    sd = {"a": torch.randn(5), "b": torch.arange(3)}
    path = tmp_path / "legacy.pt"
    torch.save(sd, path, _use_new_zipfile_serialization=False)
    assert same(gt.load(path), sd)


def test_untyped_storage_objects(tmp_path) -> None:
    s = torch.arange(10, dtype=torch.uint8).untyped_storage()
    path = tmp_path / "s.pt"
    torch.save({"s": s}, path)
    out = gt.load(path)
    ref = torch.load(path)
    assert type(out["s"]) is type(ref["s"]) and out["s"].tolist() == s.tolist()


@pytest.mark.parametrize("map_location", [None, "cpu", torch.device("cpu"), {"cpu": "cpu"},
                                          lambda storage, loc: storage, lambda storage, loc: None])
def test_map_location_forms(tmp_path, map_location) -> None:
    sd = checkpoint()
    path = tmp_path / "m.pt"
    gt.save(sd, path)
    out = gt.load(path, map_location=map_location)
    assert same(out, sd)


def test_map_location_meta_reads_nothing(tmp_path) -> None:
    path = tmp_path / "m.pt"
    gt.save({"a": torch.randn(1000)}, path)
    out, stats = gt.load(path, map_location="meta", return_stats=True)
    assert out["a"].device.type == "meta" and out["a"].shape == (1000,)
    assert sum(p.bytes_read for p in stats.paths.values()) == 0


def test_return_stats_counts_every_storage_byte(tmp_path) -> None:
    sd = {"a": torch.randn(1000), "b": torch.randn(300_000)}
    path = tmp_path / "s.pt"
    gt.save(sd, path)
    out, stats = gt.load(path, return_stats=True)
    assert same(out, sd)
    assert sum(p.bytes_read for p in stats.paths.values()) >= 4 * 301_000


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_location_without_cuda(tmp_path) -> None:
    path = tmp_path / "c.pt"
    gt.save({"a": torch.ones(2)}, path)
    with pytest.raises(gt.DeviceUnavailableError) as info:
        gt.load(path, map_location="cuda:0")
    assert isinstance(info.value, RuntimeError)


# -- safety -----------------------------------------------------------------------

class Unsafe:
    def __reduce__(self):
        return (os.system, ("echo should-never-run",))


class Plain:
    def __init__(self) -> None:
        self.x = 1


@pytest.mark.parametrize("obj", [Plain(), Unsafe()])
def test_weights_only_by_default_refuses_arbitrary_objects(tmp_path, obj) -> None:
    path = tmp_path / "u.pt"
    torch.save({"obj": obj, "t": torch.ones(2)}, path)
    with pytest.raises(gt.UnsafeCheckpointError) as info:
        gt.load(path)
    assert isinstance(info.value, pickle.UnpicklingError) and isinstance(info.value, GdskitError)


def test_weights_only_false_loads_trusted_objects(tmp_path) -> None:
    path = tmp_path / "p.pt"
    torch.save({"obj": Plain(), "t": torch.ones(2)}, path)
    out = gt.load(path, weights_only=False)
    assert isinstance(out["obj"], Plain) and torch.equal(out["t"], torch.ones(2))


def test_legacy_unsafe_file_refused(tmp_path) -> None:
    path = tmp_path / "lu.pt"
    torch.save({"obj": Plain()}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(gt.UnsafeCheckpointError):
        gt.load(path)


# -- bad files ------------------------------------------------------------------

def bad_variants(good: bytes) -> dict[str, bytes]:
    return {
        "empty": b"",
        "garbage": b"hello world, not a checkpoint",
        "truncated zip": good[: len(good) // 2],
        "zip header only": good[:100],
        "not a torch zip": b"PK\x03\x04" + bytes(200),
    }


@pytest.mark.parametrize("case", ["empty", "garbage", "truncated zip", "zip header only", "not a torch zip"])
def test_bad_files_raise_format_error_and_leak_no_fd(tmp_path, case) -> None:
    good = tmp_path / "good.pt"
    gt.save(checkpoint(), good)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bad_variants(good.read_bytes())[case])
    before = fd_count()
    with pytest.raises(FormatError):
        gt.load(bad)
    assert fd_count() == before


def test_missing_file_is_file_not_found(tmp_path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        gt.load(tmp_path / "nope.pt")
    assert isinstance(info.value, GdskitError)


# -- storages read while the pickle is unpickled ------------------------------------

@pytest.fixture
def read_ahead(monkeypatch):
    """Counts the loads that read their large storages while unpickling."""
    started = []
    real = gt._ReadAhead.start.__func__

    def start(cls, *a, **k):
        r = real(cls, *a, **k)
        started.append(r)
        return r
    monkeypatch.setattr(gt._ReadAhead, "start", classmethod(start))
    return started


def _load_threads() -> list[str]:
    import threading
    return [t.name for t in threading.enumerate() if t.name.startswith("gdskit-load")]


def test_read_ahead_loads_like_torch_load(tmp_path, read_ahead) -> None:
    sd = checkpoint()
    ours, plain = tmp_path / "a.pt", tmp_path / "p.pt"
    gt.save(sd, ours)
    torch.save(sd, plain)  # unaligned records
    for path in (ours, plain):
        out = gt.load(path, map_location="cpu")
        assert same(out, sd) and same(out, torch.load(path, weights_only=True))
        assert out["w_t"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()
    assert len(read_ahead) == 2 and all(r is not None for r in read_ahead)
    assert not _load_threads()


def test_read_ahead_waits_for_its_reads_when_unpickling_is_refused(tmp_path, read_ahead) -> None:
    path = tmp_path / "u.pt"
    torch.save({"obj": Unsafe(), "t": torch.randn(300_000)}, path)
    before = fd_count()
    with pytest.raises(gt.UnsafeCheckpointError):
        gt.load(path, map_location="cpu")
    assert read_ahead and read_ahead[0]._job.done()
    assert fd_count() == before and not _load_threads()


def test_read_ahead_stops_when_unpickling_is_refused(tmp_path, read_ahead, monkeypatch) -> None:
    import threading
    import time

    import gdskit
    path = tmp_path / "big.pt"
    torch.save({f"t{i}": torch.randn(300_000) for i in range(40)}, path)  # 40 large storages, 48 MB
    first = threading.Event()
    real_advance = gt._AbandonableProgress.advance
    pieces: list[int] = []

    def advance(self, n):
        pieces.append(n)
        if len(pieces) == 1:  # the first piece read holds the one worker until the load is given up
            first.set()
            deadline = time.monotonic() + 5
            while not self.abandoned and time.monotonic() < deadline:
                time.sleep(0.001)
        real_advance(self, n)

    def refuse(*a, **k):
        assert first.wait(10)
        raise gt.UnsafeCheckpointError("refused for the test")
    monkeypatch.setattr(gt._AbandonableProgress, "advance", advance)
    monkeypatch.setattr(gt, "_unpickle", refuse)
    with gdskit.settings.set(threads=1, chunk_size=64 << 10), pytest.raises(gt.UnsafeCheckpointError):
        gt.load(path, map_location="cpu")
    assert len(pieces) == 1  # of 40 x 19 pieces: the job stopped after the one under way
    assert not _load_threads()


def test_read_ahead_error_surfaces_after_unpickling(tmp_path, read_ahead, monkeypatch) -> None:
    from gdskit.formats import torch_io

    def failing_execute(*a, **k):
        raise gt.TruncatedFileError("storage bytes went missing")
    monkeypatch.setattr(torch_io, "execute", failing_execute)
    path = tmp_path / "e.pt"
    gt.save(checkpoint(), path)
    before = fd_count()
    with pytest.raises(gt.TruncatedFileError, match="went missing"):
        gt.load(path, map_location="cpu")
    assert read_ahead and read_ahead[0] is not None  # the error came from the read-ahead's job
    assert fd_count() == before


# -- GPU ------------------------------------------------------------------------

def to_cuda(x):
    if isinstance(x, torch.nn.Parameter):
        return torch.nn.Parameter(x.detach().cuda(), requires_grad=x.requires_grad)
    if isinstance(x, torch.Tensor):
        return x.cuda()
    if isinstance(x, dict):
        return type(x)((k, to_cuda(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return type(x)(to_cuda(v) for v in x)
    return x


@pytest.mark.gpu
def test_gpu_save_and_load_both_ways(tmp_path) -> None:
    sd = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(100, device="cuda"),
          "many": [torch.randn(1000 + i, device="cuda") for i in range(200)]}
    sd["view"] = sd["w"][10:20]
    path = tmp_path / "gpu.pt"
    gt.save(sd, path)
    assert same(torch.load(path), sd)
    out = gt.load(path)
    torch.cuda.synchronize()
    assert out["w"].device.type == "cuda" and same(out, sd)
    assert out["view"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()
    plain = tmp_path / "plain.pt"
    torch.save(sd, plain)
    assert same(gt.load(plain, map_location="cuda:0"), sd)
    cpu = gt.load(path, map_location="cpu")
    assert cpu["w"].device.type == "cpu" and torch.equal(cpu["w"], sd["w"].cpu())


@pytest.mark.gpu
def test_gpu_load_on_a_side_stream(tmp_path) -> None:
    """Storages read while unpickling, small ones copied out of staging: done when the caller's
    stream says so, whichever stream that is."""
    sd = checkpoint()
    path = tmp_path / "s.pt"
    gt.save(sd, path)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = gt.load(path, map_location="cuda:0")
        # Compared on the side stream, with nothing synchronised in between.
        equal = [torch.equal(a, b.to("cuda")) for a, b in zip(leaves(out), leaves(sd))]
    assert len(equal) == len(leaves(sd)) and all(equal)


def leaves(x) -> list:
    """The tensors of a nested checkpoint, in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in leaves(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in leaves(v)]
    return []


@pytest.mark.gpu
def test_gpu_load_to_one_device_takes_one_segment(tmp_path) -> None:
    sd, out, made, held = load_from_one_segment(tmp_path, gt.save, lambda p: gt.load(p, map_location="cuda:0"),
                                                "many.pt")
    assert made <= 1 and held == 1, (made, held, torch.cuda.memory_allocated())
    assert same(out, {k: v.cuda() for k, v in sd.items()})


@pytest.mark.gpu
def test_gpu_load_reserves_memory_for_the_large_storages_only(tmp_path) -> None:
    """The allocator block set aside for a load covers the large storages, not the small ones
    (which come from torch's small pool): peak GPU memory stays near the checkpoint's size."""
    sd = {"big": torch.randn(128 << 20)}  # 512 MiB, first in the archive
    sd.update({f"s{i}": torch.randn(25_000) for i in range(2000)})  # 100 KB each, 200 MB in all
    path = tmp_path / "mixed.pt"
    gt.save(sd, path)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    out = gt.load(path, map_location="cuda:0")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved() - base
    # (what lies past the first large storage, 712 MB, reserved on top of the small pool: 1.4x)
    assert peak <= 1.15 * total, (peak, total)
    assert torch.equal(out["big"].cpu(), sd["big"]) and torch.equal(out["s1999"].cpu(), sd["s1999"])
