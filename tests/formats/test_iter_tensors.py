"""gdskit.safetensors.iter_tensors: file order, exact values, and the memory budget, measured."""

from __future__ import annotations

import json
import struct
import threading
import weakref

import pytest

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

import gdskit.safetensors as gs  # noqa: E402
from gdskit.errors import FormatError, InvalidArgumentError  # noqa: E402
from gdskit.formats import stream  # noqa: E402
from leak_helpers import fd_count  # noqa: E402

pytestmark = pytest.mark.torch


def file_order(path) -> list[str]:
    """Tensor names by data offset, read from the header with plain json (not gdskit's parser)."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    return sorted(header, key=lambda k: header[k]["data_offsets"])


def random_tensors(count: int, seed: int, most: int = 6000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, most, (count,), generator=g).tolist()
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.float16]
    return {f"w.{i}": torch.randn(n, generator=g).to(dtypes[i % 4]) if i % 4 != 2
            else torch.randint(-9, 9, (n,), generator=g) for i, n in enumerate(sizes)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "ckpt.safetensors"
    st_torch.save_file(random_tensors(150, seed=1), str(path))
    return path


def test_yields_every_tensor_in_file_order_with_the_reference_values(checkpoint) -> None:
    names = []
    with safe_open(str(checkpoint), framework="pt") as ref:
        for name, t in gs.iter_tensors(checkpoint, "cpu", max_inflight_bytes=64 << 10):
            assert torch.equal(t, ref.get_tensor(name)) and t.dtype == ref.get_tensor(name).dtype, name
            names.append(name)
    assert names == file_order(checkpoint)


def test_sharded_checkpoint_in_shard_then_file_order(tmp_path) -> None:
    tensors = random_tensors(40, seed=2)
    names = list(tensors)
    weight_map = {}
    order = []
    for i, part in enumerate((names[:25], names[25:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        st_torch.save_file({k: tensors[k] for k in part}, str(tmp_path / fname))
        weight_map.update(dict.fromkeys(part, fname))
        order += file_order(tmp_path / fname)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    got = [(n, t) for n, t in gs.iter_tensors(tmp_path, "cpu")]
    assert [n for n, _ in got] == order
    for n, t in got:
        assert torch.equal(t, tensors[n])


def test_keys_are_yielded_in_file_order_and_unknown_ones_refused(checkpoint) -> None:
    order = file_order(checkpoint)
    wanted = [order[7], order[2], order[40]]
    assert [n for n, _ in gs.iter_tensors(checkpoint, "cpu", keys=wanted)] == [order[2], order[7], order[40]]
    with pytest.raises(gs.MissingTensorError):
        gs.iter_tensors(checkpoint, "cpu", keys=["nope"])


class LiveBytes:
    """The bytes of the yielded tensors still alive, measured by finalizers on their storages."""

    def __init__(self) -> None:
        self.now = 0
        self.lock = threading.Lock()

    def watch(self, t: torch.Tensor) -> None:
        n = t.nbytes
        with self.lock:
            self.now += n
        weakref.finalize(t.untyped_storage(), self._freed, n)

    def _freed(self, n: int) -> None:
        with self.lock:
            self.now -= n


def test_memory_bound_holds_for_a_consumer_that_drops_each_tensor(checkpoint) -> None:
    budget = 128 << 10
    largest = max(t.nbytes for t in st_torch.load_file(str(checkpoint)).values())
    assert 2 * largest <= budget
    live = LiveBytes()
    it = gs.iter_tensors(checkpoint, "cpu", max_inflight_bytes=budget)
    most_yielded_alive = 0
    ahead = 0
    for _name, t in it:
        live.watch(t)
        most_yielded_alive = max(most_yielded_alive, live.now)
        # Bytes of the stream's tensors alive now (the one just yielded, and those read ahead),
        # measured by the stream's own finalizers: never above the budget.
        assert it.live_bytes <= budget
        ahead = max(ahead, it.live_bytes - t.nbytes)
        del t
    assert it.peak_live_bytes <= budget
    assert most_yielded_alive <= largest  # the caller held one tensor at a time ...
    assert ahead > largest                # ... while the stream read several ahead, within the budget
    assert it.live_bytes == 0


def test_a_consumer_that_keeps_views_leaves_less_room(checkpoint) -> None:
    budget = 128 << 10
    it = gs.iter_tensors(checkpoint, "cpu", max_inflight_bytes=budget)
    kept = []
    held = 0
    for _name, t in it:
        if held + t.nbytes <= budget // 2:
            kept.append(t[:1])  # a view keeps the whole storage alive
            held += t.nbytes
        del t
        assert it.live_bytes >= held  # counted by storage, views included
    assert it.peak_live_bytes <= budget
    del kept
    assert it.live_bytes == 0


def test_a_consumer_that_keeps_everything_still_gets_everything(checkpoint) -> None:
    budget = 128 << 10
    it = gs.iter_tensors(checkpoint, "cpu", max_inflight_bytes=budget)
    got = dict(it)
    ref = st_torch.load_file(str(checkpoint))
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    # Past the budget only by what the caller kept: each tensor then read when asked for.
    assert it.live_bytes == sum(t.nbytes for t in ref.values())


def test_default_budget_and_bad_budgets(checkpoint) -> None:
    largest = max(t.nbytes for t in st_torch.load_file(str(checkpoint)).values())
    it = gs.iter_tensors(checkpoint, "cpu")
    assert it.max_inflight_bytes == max(stream.DEFAULT_INFLIGHT_BYTES, 2 * largest)
    it.close()
    for bad in (0, -1, 1.5, True, "big", largest - 1):
        with pytest.raises(InvalidArgumentError):
            gs.iter_tensors(checkpoint, "cpu", max_inflight_bytes=bad)


def test_stopping_early_ends_the_reads_and_closes_the_file(checkpoint) -> None:
    fds = fd_count()
    threads = threading.active_count()
    with gs.iter_tensors(checkpoint, "cpu", max_inflight_bytes=128 << 10) as it:
        for i, _item in enumerate(it):
            if i == 5:
                break
    assert fd_count() == fds
    assert threading.active_count() == threads
    assert list(it) == []
    del _item
    assert it.live_bytes == 0


def test_abandoned_iterator_is_cleaned_up(checkpoint) -> None:
    fds = fd_count()
    threads = threading.active_count()
    it = gs.iter_tensors(checkpoint, "cpu", max_inflight_bytes=128 << 10)
    next(it)
    del it
    import gc
    gc.collect()
    assert fd_count() == fds
    assert threading.active_count() == threads


def test_bad_shard_refused_before_anything_is_read(tmp_path) -> None:
    p1, p2 = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    st_torch.save_file({"x": torch.ones(10)}, str(p1))
    st_torch.save_file({"y": torch.ones(10)}, str(p2))
    with open(p2, "r+b") as fh:
        fh.truncate(60)
    with pytest.raises(FormatError):
        gs.iter_tensors([p1, p2], "cpu")


def test_shard_that_shrinks_while_streaming_raises(tmp_path) -> None:
    p1, p2 = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    st_torch.save_file({"x": torch.ones(10)}, str(p1))
    st_torch.save_file({"y": torch.ones(10)}, str(p2))
    it = gs.iter_tensors([p1, p2], "cpu", max_inflight_bytes=40)  # one tensor at a time
    name, t = next(it)
    assert name == "x" and torch.equal(t, torch.ones(10))
    with open(p2, "r+b") as fh:
        fh.truncate(60)
    with pytest.raises(gs.TruncatedFileError):
        next(it)
    assert list(it) == []


@pytest.mark.gpu
def test_gpu_memory_bound_measured_by_the_allocator(tmp_path) -> None:
    g = torch.Generator().manual_seed(9)
    tensors = {f"t{i}": torch.randn(128 * int(n), generator=g)
               for i, n in enumerate(torch.randint(1, 2048, (200,), generator=g))}  # 512-byte multiples
    path = tmp_path / "gpu.safetensors"
    st_torch.save_file(tensors, str(path))
    budget = 8 << 20
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    sink = {k: torch.empty_like(v, device="cuda") for k, v in tensors.items()}
    sink_bytes = torch.cuda.memory_allocated() - base
    for name, t in gs.iter_tensors(path, "cuda:0", max_inflight_bytes=budget):
        sink[name].copy_(t)
        del t
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base - sink_bytes <= budget
    for k in tensors:
        assert torch.equal(sink[k].cpu(), tensors[k])
