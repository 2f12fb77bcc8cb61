"""gdskit.safetensors against the reference safetensors library (CPU tensors; GPU tests marked)."""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

import gdskit  # noqa: E402
import gdskit.safetensors as gs  # noqa: E402
from gpu_memory import load_from_one_segment, new_large_pool_segments  # noqa: E402
from leak_helpers import fd_count  # noqa: E402
from gdskit.errors import FormatError, GdskitError, MissingDependencyError  # noqa: E402
from gdskit.formats import read_plan  # noqa: E402
from gdskit.formats import safetensors_format as fmt  # noqa: E402

pytestmark = pytest.mark.torch


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and raw_bytes(a.cpu()) == raw_bytes(b.cpu())


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, dt in gs._dtype_table(torch).items():
        if name == "F4":
            out[name] = torch.randint(0, 256, (3, 4), dtype=torch.uint8, generator=g).view(dt)
        elif dt == torch.bool:
            out[name] = torch.randint(0, 2, (5, 3), generator=g).bool()
        else:
            # Random bytes reinterpreted: exercises every bit pattern, NaNs included.
            nbytes = 7 * 3 * torch.tensor([], dtype=dt).element_size()
            out[name] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dt).reshape(7, 3)
    return out




# -- round trips with the reference library -------------------------------------

def test_gdskit_file_loads_identically_with_reference(tmp_path) -> None:
    tensors = every_dtype()
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    tensors["empty"] = torch.empty(0, 7)
    tensors["transposed"] = torch.arange(24, dtype=torch.float32).reshape(4, 6).t().contiguous()
    tensors["big"] = torch.randn(300_000)
    path = tmp_path / "g.safetensors"
    gs.save_file(tensors, path, metadata={"format": "pt", "note": "ü"})
    ref = st_torch.load_file(str(path))
    assert set(ref) == set(tensors)
    for k, v in tensors.items():
        assert same(ref[k], v), k
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "ü"}
        for k in tensors:
            assert same(f.get_tensor(k), tensors[k]), k
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
    assert (8 + n) % 4096 == 0


def test_reference_file_loads_identically_with_gdskit(tmp_path) -> None:
    tensors = every_dtype()
    tensors["scalar"] = torch.tensor(7, dtype=torch.int32)
    tensors["empty"] = torch.empty(3, 0, dtype=torch.float16)
    path = tmp_path / "ref.safetensors"
    st_torch.save_file(tensors, str(path), metadata={"a": "b"})
    out = gs.load_file(path, device="cpu")
    assert set(out) == set(tensors)
    for k, v in tensors.items():
        assert same(out[k], v), k
    assert gs.read_metadata(path) == {"a": "b"}


def test_loaded_tensors_own_their_memory(tmp_path) -> None:
    tensors = {f"t{i}": torch.full((1000,), i, dtype=torch.int32) for i in range(20)}
    tensors["large"] = torch.ones(1 << 19)
    path = tmp_path / "own.safetensors"
    gs.save_file(tensors, path)
    out = gs.load_file(path, device="cpu")
    storages = {t.untyped_storage().data_ptr() for t in out.values()}
    assert len(storages) == len(out)
    for k, t in out.items():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), k
        assert torch.equal(t, tensors[k])


def test_many_small_tensors_go_through_coalesced_reads(tmp_path) -> None:
    tensors = {f"layer.{i}.w": torch.randn(17 + i % 5, 3) for i in range(500)}
    path = tmp_path / "small.safetensors"
    gs.save_file(tensors, path)
    h = fmt.read_header_file(path)
    p = read_plan.plan(fmt.extents(h, h.entries), small=gs.SMALL_TENSOR_BYTES, max_group=gs.MAX_GROUP_BYTES)
    assert len(p.groups) < len(tensors) // 10
    out = gs.load_file(path, device="cpu")
    for k, v in tensors.items():
        assert torch.equal(out[k], v), k


def test_groups_larger_than_a_chunk_give_exact_bytes(tmp_path) -> None:
    # ~12 MB of small tensors: one group, which the engine reads as several chunks whose
    # edges fall inside tensors.
    tensors = {f"b.{i}": torch.randn(7000 + 13 * i) for i in range(300)}
    path = tmp_path / "pieces.safetensors"
    gs.save_file(tensors, path)
    h = fmt.read_header_file(path)
    p = read_plan.plan(fmt.extents(h, h.entries), small=gs.SMALL_TENSOR_BYTES, max_group=gs.MAX_GROUP_BYTES)
    assert max(g.nbytes for g in p.groups) > gdskit.settings.chunk_size
    out = gs.load_file(path, device="cpu")
    ref = st_torch.load_file(str(path))
    assert out.keys() == ref.keys()
    for k, v in ref.items():
        assert torch.equal(out[k], v), k


def test_keys_subset_reads_only_those_bytes(tmp_path) -> None:
    tensors = {"a": torch.randn(1000), "b": torch.randn(5000), "c": torch.randn(300_000), "d": torch.randn(7)}
    path = tmp_path / "sub.safetensors"
    gs.save_file(tensors, path)
    out, stats = gs.load_file(path, device="cpu", keys=["d", "c"], return_stats=True)
    assert list(out) == ["d", "c"]
    assert torch.equal(out["c"], tensors["c"]) and torch.equal(out["d"], tensors["d"])
    assert sum(p.bytes_read for p in stats.paths.values()) == 4 * (300_000 + 7)


def test_missing_key_is_a_key_error(tmp_path) -> None:
    path = tmp_path / "k.safetensors"
    gs.save_file({"a": torch.zeros(2)}, path)
    with pytest.raises(gs.MissingTensorError) as info:
        gs.load_file(path, device="cpu", keys=["a", "zz"])
    assert isinstance(info.value, KeyError) and isinstance(info.value, GdskitError)


def test_progress_callback_reaches_total(tmp_path) -> None:
    tensors = {f"t{i}": torch.randn(1000 * (i + 1)) for i in range(10)}
    tensors["big"] = torch.randn(1 << 19)
    path = tmp_path / "p.safetensors"
    gs.save_file(tensors, path)
    calls: list[tuple[int, int]] = []
    gs.load_file(path, device="cpu", progress=lambda done, total: calls.append((done, total)))
    total = sum(t.numel() * 4 for t in tensors.values())
    assert max(calls) == (total, total)
    assert all(t == total for _d, t in calls)


# -- sharded checkpoints --------------------------------------------------------

def write_shards(tmp_path, index: bool = True) -> dict[str, torch.Tensor]:
    tensors = {f"w{i}": torch.randn(10, i + 1) for i in range(6)}
    shards = {"model-00001-of-00002.safetensors": ["w0", "w1", "w2"],
              "model-00002-of-00002.safetensors": ["w3", "w4", "w5"]}
    wm = {}
    for fname, names in shards.items():
        st_torch.save_file({n: tensors[n] for n in names}, str(tmp_path / fname))
        wm.update({n: fname for n in names})
    if index:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return tensors


@pytest.mark.parametrize("how", ["dir", "index", "list"])
def test_sharded_checkpoint(tmp_path, how: str) -> None:
    tensors = write_shards(tmp_path)
    arg = {"dir": tmp_path, "index": tmp_path / "model.safetensors.index.json",
           "list": sorted(str(p) for p in tmp_path.glob("*.safetensors"))}[how]
    out = gs.load_file(arg, device="cpu")
    assert set(out) == set(tensors)
    for k, v in tensors.items():
        assert torch.equal(out[k], v)


def test_index_pointing_to_the_wrong_shard(tmp_path) -> None:
    write_shards(tmp_path)
    idx = tmp_path / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    doc["weight_map"]["w0"] = "model-00002-of-00002.safetensors"
    idx.write_text(json.dumps(doc))
    with pytest.raises(FormatError):
        gs.load_file(tmp_path, device="cpu")


def test_duplicate_name_across_shards(tmp_path) -> None:
    st_torch.save_file({"a": torch.zeros(1)}, str(tmp_path / "1.safetensors"))
    st_torch.save_file({"a": torch.ones(1)}, str(tmp_path / "2.safetensors"))
    with pytest.raises(FormatError):
        gs.load_file(tmp_path, device="cpu")


# -- bad files through the loader -----------------------------------------------

def corrupt_variants(good: bytes) -> dict[str, tuple[bytes, type]]:
    (n,) = struct.unpack("<Q", good[:8])
    return {
        "truncated data": (good[:-3], fmt.TruncatedFileError),
        "truncated header": (good[:20], fmt.TruncatedFileError),
        "huge length": (struct.pack("<Q", 1 << 60) + good[8:], fmt.HeaderError),
        "garbage header": (good[:8] + b"x" * n + good[8 + n:], fmt.HeaderError),
        "trailing": (good + b"\0" * 5, fmt.LayoutError),
    }


@pytest.mark.parametrize("case", ["truncated data", "truncated header", "huge length", "garbage header", "trailing"])
def test_bad_files_raise_format_errors_and_leak_no_fd(tmp_path, case: str) -> None:
    path = tmp_path / "good.safetensors"
    st_torch.save_file({"a": torch.randn(100), "b": torch.randn(3)}, str(path))
    data, cls = corrupt_variants(path.read_bytes())[case]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data)
    before = fd_count()
    with pytest.raises(cls):
        gs.load_file(bad, device="cpu")
    assert fd_count() == before


def test_file_that_shrinks_after_its_header_is_read(tmp_path, monkeypatch) -> None:
    path = tmp_path / "shrink.safetensors"
    gs.save_file({"a": torch.randn(1 << 18), "b": torch.randn(10)}, path)
    real = fmt.read_header_file

    def read_then_shrink(p):  # the file shrinks between the header parse and the data reads
        h = real(p)
        os.truncate(p, h.file_size - 100)
        return h

    monkeypatch.setattr(fmt, "read_header_file", read_then_shrink)
    before = fd_count()
    with pytest.raises(fmt.TruncatedFileError):
        gs.load_file(path, device="cpu")
    assert fd_count() == before


def test_short_read_in_the_executor_is_detected(tmp_path) -> None:
    from gdskit.formats.torch_io import execute
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(5000))
    for extents in ([read_plan.Extent("x", 4000, 2000)], [read_plan.Extent("a", 10, 100), read_plan.Extent("b", 4990, 100)]):
        p = read_plan.plan(extents, small=1024, max_group=1 << 20, max_gap=1 << 20)
        with gdskit.open(path) as f, pytest.raises(fmt.TruncatedFileError):
            execute(f, p, torch.device("cpu"))
    # A group of several engine chunks whose later chunks find no bytes.
    path.write_bytes(bytes(5 << 20))
    extents = [read_plan.Extent(f"t{i}", i * (512 << 10), 512 << 10) for i in range(24)]
    p = read_plan.plan(extents, small=1 << 20, max_group=16 << 20)
    assert len(p.groups) == 1
    with gdskit.open(path) as f, pytest.raises(fmt.TruncatedFileError):
        execute(f, p, torch.device("cpu"))


def test_unsupported_dtype_in_file(tmp_path) -> None:
    body = json.dumps({"a": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}).encode()
    path = tmp_path / "f6.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body + bytes(3))
    with pytest.raises(gs.UnsupportedDtypeError) as info:
        gs.load_file(path, device="cpu")
    assert isinstance(info.value, FormatError)


# -- saving ---------------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    {"a": [1, 2]},
    {"a": torch.zeros(2, device="meta")},
    {"a": torch.zeros(3).to_sparse()},
])
def test_save_rejects_what_has_no_bytes(tmp_path, bad) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"old")
    with pytest.raises(gs.UnsupportedTensorError) as info:
        gs.save_file(bad, path)
    assert isinstance(info.value, TypeError)
    assert path.read_bytes() == b"old"


def test_save_is_atomic_when_a_write_fails(tmp_path, monkeypatch) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"old")
    import gdskit.engine.file

    def failing_pwrite(self, *a, **kw):
        raise gdskit.errors.GdskitIOError(5, "injected failure")

    monkeypatch.setattr(gdskit.engine.file.File, "pwrite", failing_pwrite)
    with pytest.raises(gdskit.errors.GdskitIOError):
        gs.save_file({"a": torch.randn(100)}, path)
    assert path.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["x.safetensors"]


def test_save_then_aligned_big_tensors(tmp_path) -> None:
    tensors = {"odd": torch.zeros(3, dtype=torch.uint8), "p1": torch.randn(4096), "p2": torch.randn(2048)}
    path = tmp_path / "a.safetensors"
    gs.save_file(tensors, path)
    h = fmt.read_header_file(path)
    for e in h.entries:
        if e.nbytes % 4096 == 0:
            assert (h.data_start + e.start) % 4096 == 0


def test_missing_torch_gives_install_hint(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(MissingDependencyError) as info:
        gs._torch()
    assert isinstance(info.value, ImportError)


# -- GPU ------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_round_trip_with_reference(tmp_path) -> None:
    tensors = {k: v.cuda() for k, v in every_dtype().items()}
    tensors["big"] = torch.randn(1 << 22, device="cuda")
    tensors["nc"] = torch.randn(64, 32, device="cuda").t().contiguous()
    for i in range(300):
        tensors[f"small{i}"] = torch.randn(100 + i, device="cuda")
    path = tmp_path / "gpu.safetensors"
    gs.save_file(tensors, path)
    ref = st_torch.load_file(str(path))
    for k, v in tensors.items():
        assert same(ref[k], v), k
    out = gs.load_file(path, device="cuda:0")
    torch.cuda.synchronize()
    for k, v in tensors.items():
        assert out[k].device.type == "cuda" and same(out[k], v), k


@pytest.mark.gpu
def test_gpu_first_load_sets_the_engine_up_in_the_background(tmp_path, monkeypatch) -> None:
    from gdskit.engine import pool
    from gdskit.formats import torch_io

    tensors = {f"w{i}": torch.randn(1 << 20) for i in range(8)}  # 8 x 4 MiB
    path = tmp_path / "warm.safetensors"
    gs.save_file(tensors, path)
    started: list[int] = []
    real = torch_io.start_warm_up
    monkeypatch.setattr(torch_io, "start_warm_up",
                        lambda device, nbytes, workers=None: started.append(device) or real(device, nbytes, workers))
    gdskit.release_resources()
    with gdskit.settings.set(threads=4, chunk_size="1MiB"):
        first = gs.load_file(path, device="cuda:0")
        assert started == [0] and pool.lanes.holds(0)
        lanes = gdskit.resources().lanes
        again = gs.load_file(path, device="cuda:0")  # the ring exists: nothing more is made
        assert gdskit.resources().lanes == lanes and gdskit.resources().lanes_busy == 0
    torch.cuda.synchronize()
    for k, v in tensors.items():
        assert same(first[k].cpu(), v) and same(again[k].cpu(), v), k
    gdskit.release_resources()


@pytest.mark.gpu
def test_gpu_hot_load_asks_the_page_cache_once(tmp_path, monkeypatch) -> None:
    from gdskit.engine.backends import bounce, staged
    from gdskit.formats import torch_io

    tensors = {f"s{i}": torch.randn(5000 + i) for i in range(2000)}  # about 40 MB of small tensors
    path = tmp_path / "hot.safetensors"
    gs.save_file(tensors, path)
    gs.load_file(path, device="cuda:0")  # now every byte is in the page cache
    monkeypatch.setattr(torch_io, "SCATTER_BATCH_BYTES", 4 << 20)  # several scattered jobs
    spans: list[int] = []
    real = staged.file_residency
    monkeypatch.setattr(bounce, "file_residency", lambda f, pos, n: spans.append(n) or real(f, pos, n))
    lanes: list[int] = []
    run = bounce.run_requests
    monkeypatch.setattr(bounce, "run_requests", lambda *a, **k: lanes.append(k["max_lanes"]) or run(*a, **k))
    with gdskit.settings.set(mode="bounce"):
        out = gs.load_file(path, device="cuda:0")
    for k, v in tensors.items():
        assert same(out[k].cpu(), v), k
    assert len(lanes) > 2 and set(lanes) == {bounce.SCATTERED_HOT_WORKERS}
    assert spans == []  # the loader's one question stood for every job


@pytest.mark.gpu
def test_gpu_peak_memory_close_to_checkpoint_size(tmp_path) -> None:
    tensors = {f"t{i}": torch.randn(25_000) for i in range(400)}
    tensors.update({f"big{i}": torch.randn(1 << 21) for i in range(4)})
    path = tmp_path / "mem.safetensors"
    gs.save_file(tensors, path)
    size = sum(t.numel() * 4 for t in tensors.values())
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = gs.load_file(path, device="cuda:0")
    torch.cuda.synchronize()
    # Small tensors are read straight into their own memory: no staging on the device.
    assert torch.cuda.max_memory_allocated() - base <= size + (1 << 20)
    for k, v in tensors.items():
        assert out[k].untyped_storage().nbytes() == v.numel() * 4, k  # each owns exactly its bytes
        assert same(out[k].cpu(), v), k
    del out


@pytest.mark.gpu
def test_gpu_large_tensors_come_from_one_reserved_segment(tmp_path) -> None:
    tensors, out, made, held = load_from_one_segment(tmp_path, gs.save_file,
                                                     lambda p: gs.load_file(p, device="cuda:0"), "many.safetensors")
    assert made <= 1 and held == 1, (made, held, torch.cuda.memory_allocated())
    for k, v in tensors.items():
        assert same(out[k].cpu(), v), k
    # Each tensor still owns its memory: dropping all but one leaves only that one allocated.
    allocated = torch.cuda.memory_allocated()
    keep = out.pop("w0")
    del out
    assert allocated - torch.cuda.memory_allocated() == 23 * (4 << 20)
    assert keep.sum().item() == 0.0


@pytest.mark.gpu
def test_gpu_reservation_stands_aside_when_allocator_is_configured(monkeypatch) -> None:
    from gdskit.formats import device_memory

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    _, segments = new_large_pool_segments(lambda: device_memory.reserve_device_memory(torch.device("cuda:0"), [256 << 20]))
    assert segments == 0


@pytest.mark.gpu
def test_gpu_group_members_are_independent_copies() -> None:
    from gdskit.formats.torch_io import _clone_all

    staging = torch.arange(4096, device="cuda").to(torch.uint8)
    parts = list(torch.split_with_sizes(staging, [100, 900, 3096]))
    copies = _clone_all(parts)
    staging.zero_()
    torch.cuda.synchronize()
    for i, (c, n) in enumerate(zip(copies, [100, 900, 3096])):
        start = [0, 100, 1000][i]
        assert c.dtype == torch.uint8 and c.numel() == n
        assert c.untyped_storage().nbytes() == n  # owns exactly its own bytes
        assert torch.equal(c.cpu(), (torch.arange(start, start + n) % 256).to(torch.uint8))


@pytest.mark.parametrize("uncached", [None, 0, 37, 499])
def test_whether_the_groups_are_cached_is_asked_of_a_sample(uncached):
    # One question about a whole 20,000-tensor file's span cost a tenth of its hot load; a few
    # groups spread over the plan, the first and last among them, are asked about instead.
    from gdskit.formats import torch_io

    groups = tuple(read_plan.Group(i * 1000, 1000, (read_plan.Extent(i, i * 1000, 1000),)) for i in range(500))
    asked: list[tuple[int, int]] = []

    class File:
        def cached(self, offset, size):
            asked.append((offset, size))
            return uncached is None or offset != uncached * 1000

    held = torch_io._held_in_page_cache(File(), groups)
    assert len(asked) <= torch_io.CACHED_GROUP_SAMPLES
    if uncached is None:
        assert held is True and (0, 1000) in asked and (499_000, 1000) in asked
    elif uncached in (0, 499):  # the first and last group are always asked about
        assert held is False
    else:
        assert held is ((uncached * 1000, 1000) not in asked)
    assert torch_io._held_in_page_cache(File(), ()) is False


# -- tensors handed over while the last ones are read (execute(landed=...)) -------------------


def test_landed_split_leaves_a_tail_of_an_eighth_or_more() -> None:
    from gdskit.formats.torch_io import LANDED_MIN_BYTES, landed_split

    mib = 1 << 20
    assert landed_split(()) == 0
    assert landed_split((read_plan.Extent("one", 0, 1 << 30),)) == 0  # one tensor: nothing to overlap
    small = tuple(read_plan.Extent(f"s{i}", i * mib, mib) for i in range(LANDED_MIN_BYTES // mib - 1))
    assert landed_split(small) == 0  # too few bytes to be worth a second job
    even = tuple(read_plan.Extent(f"e{i}", i * 32 * mib, 32 * mib) for i in range(256))
    assert landed_split(even) == 224  # the last 32 of 256 equal tensors: exactly an eighth
    uneven = (read_plan.Extent("big", 0, 900 * mib), read_plan.Extent("a", 900 * mib, 60 * mib),
              read_plan.Extent("b", 960 * mib, 64 * mib))
    assert landed_split(uneven) == 1  # 124 of 1024 MiB is short of an eighth, but the first stays first
    two = (read_plan.Extent("x", 0, 100 * mib), read_plan.Extent("y", 100 * mib, 900 * mib))
    assert landed_split(two) == 1


def _landed_file(tmp_path, n: int = 24, size: int = 4 << 20) -> tuple[Any, list[read_plan.Extent], bytes]:
    data = os.urandom(n * size + 123)
    path = tmp_path / "landed.bin"
    path.write_bytes(data)
    return path, [read_plan.Extent(f"t{i}", 123 + i * size, size) for i in range(n)], data


def test_execute_hands_over_the_first_tensors_whole_before_the_last(tmp_path, monkeypatch) -> None:
    from gdskit.formats import torch_io

    monkeypatch.setattr(torch_io, "LANDED_MIN_BYTES", 1 << 20)
    path, extents, data = _landed_file(tmp_path)
    p = read_plan.plan(extents, small=1 << 20, max_group=1 << 20, max_gap=0)
    cut = torch_io.landed_split(p.direct)
    assert 0 < cut < len(extents)
    seen: list[tuple[list[str], bool, bool]] = []
    jobs: list[Any] = []

    def landed(tensors) -> None:
        # Each handed-over tensor holds its bytes already, whatever the rest are doing.
        whole = all(bytes(t.numpy()) == data[e.file_offset:e.end] for e, t in zip(extents, tensors.values()))
        seen.append((list(tensors), whole, jobs[0].done()))

    with gdskit.open(path) as f:
        real = f.pread_many
        monkeypatch.setattr(f, "pread_many", lambda *a, **k: jobs.append(real(*a, **k)) or jobs[-1])
        out = torch_io.execute(f, p, torch.device("cpu"), landed=landed)
    assert seen == [([e.key for e in extents[:cut]], True, True)] and len(jobs) == 2
    for e in extents:
        assert bytes(out[e.key].numpy()) == data[e.file_offset:e.end], e.key


def test_execute_without_a_split_hands_nothing_over(tmp_path) -> None:
    from gdskit.formats import torch_io

    path, extents, data = _landed_file(tmp_path, n=3, size=1 << 20)  # under LANDED_MIN_BYTES
    p = read_plan.plan(extents, small=1 << 10, max_group=1 << 20, max_gap=0)
    calls: list[Any] = []
    with gdskit.open(path) as f:
        out = torch_io.execute(f, p, torch.device("cpu"), landed=calls.append)
    assert calls == [] and all(bytes(out[e.key].numpy()) == data[e.file_offset:e.end] for e in extents)


def test_a_failing_hand_over_ends_the_load_after_the_last_reads(tmp_path, monkeypatch) -> None:
    from gdskit.formats import torch_io

    monkeypatch.setattr(torch_io, "LANDED_MIN_BYTES", 1 << 20)
    path, extents, _data = _landed_file(tmp_path)
    p = read_plan.plan(extents, small=1 << 20, max_group=1 << 20, max_gap=0)
    jobs: list[Any] = []
    with gdskit.open(path) as f:
        real = f.pread_many

        def counted(*args, **kwargs):
            jobs.append(real(*args, **kwargs))
            return jobs[-1]

        monkeypatch.setattr(f, "pread_many", counted)

        def landed(tensors) -> None:
            raise ValueError("the caller's own failure")

        with pytest.raises(ValueError, match="the caller's own failure"):
            torch_io.execute(f, p, torch.device("cpu"), landed=landed)
        assert len(jobs) == 2 and all(j.done() for j in jobs)  # nothing still reading into freed tensors


def test_a_short_first_job_is_a_truncation_and_hands_nothing_over(tmp_path, monkeypatch) -> None:
    from gdskit.formats import torch_io

    monkeypatch.setattr(torch_io, "LANDED_MIN_BYTES", 1 << 20)
    path, extents, data = _landed_file(tmp_path)
    p = read_plan.plan(extents, small=1 << 20, max_group=1 << 20, max_gap=0)
    path.write_bytes(data[:extents[3].file_offset + 100])  # shrank after the plan was made
    calls: list[Any] = []
    with gdskit.open(path) as f, pytest.raises(fmt.TruncatedFileError):
        torch_io.execute(f, p, torch.device("cpu"), landed=calls.append)
    assert calls == []
