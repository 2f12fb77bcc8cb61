"""gdskit.data.Loader on the CPU: batch contents against numpy, epochs and resume, errors, leaks."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gdskit  # noqa: E402
import gdskit.data as gd  # noqa: E402
from data_workers import LOADER_SEQ, SRC, loader_tokens, token_files  # noqa: E402
from gdskit.errors import GdskitFileNotFoundError, InvalidArgumentError  # noqa: E402
from leak_helpers import fd_count  # noqa: E402

SEQ = LOADER_SEQ


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return loader_tokens(tmp_path_factory.mktemp("loader"))


def expected(loader, want, epoch=None):
    return [np.stack([want[i] for i in idx.tolist()]) for idx in loader.batch_indices(epoch)]


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gdskit-data-prefetch"]


def threads_not_the_engines() -> set[int]:
    """Every live thread but the engine's worker pools (which grow on demand up to settings.threads each)."""
    return {t.ident for t in threading.enumerate() if not t.name.startswith(("gdskit-req", "gdskit-io"))}


def engine_threads() -> int:
    return sum(t.name.startswith(("gdskit-req", "gdskit-io")) for t in threading.enumerate())


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_batches_equal_numpys_windows(tokens, prefetch):
    paths, want = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    with gd.Loader(ds, 5, device="cpu", shuffle=True, seed=4, prefetch=prefetch) as loader:
        ref = expected(loader, want)
        got = list(loader)
    assert len(got) == len(loader) == 14 and [len(b) for b in got] == [5] * 13 + [1]
    assert all(b.shape[1:] == (SEQ + 1,) and b.dtype == torch.uint32 for b in got)
    assert all(np.array_equal(b.numpy(), r) for b, r in zip(got, ref))
    firsts = sorted(int(x) for b in got for x in b[:, 0])
    assert firsts == sorted(int(w[0]) for w in want)  # every window once


def test_records_and_npy_rows_in_batches(tmp_path):
    rec = np.random.default_rng(0).integers(0, 2**15, (37, 3, 4), dtype=np.int16)
    rec.tofile(tmp_path / "r.bin")
    ds = gd.RecordDataset(tmp_path / "r.bin", dtype="int16", shape=(3, 4))
    with gd.Loader(ds, 8, device="cpu", drop_last=True) as loader:  # in order: neighbours merge into one read
        got = list(loader)
    assert len(got) == 4 and all(np.array_equal(b.numpy(), rec[8 * k:8 * k + 8]) for k, b in enumerate(got))
    arr = np.asfortranarray(np.random.default_rng(1).random((5, 3, 2)))
    for k in range(4):
        np.save(tmp_path / f"s{k}.npy", arr + k)
    files = sorted(str(p) for p in tmp_path.glob("s*.npy"))
    with gd.Loader(gd.NpyDataset(files), 3, device="cpu", shuffle=True, seed=2) as loader:
        for b, idx in zip(loader, loader.batch_indices(0)):
            assert np.array_equal(b.numpy(), np.stack([np.load(files[i]) for i in idx.tolist()]))


def test_epochs_differ_and_repeat_for_the_same_seed(tokens):
    paths, want = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    loader = gd.Loader(ds, 4, device="cpu", shuffle=True, seed=9)
    e0 = [b[:, 0].tolist() for b in loader]
    assert loader.epoch == 1  # the pass moved it on
    e1 = [b[:, 0].tolist() for b in loader]
    assert e0 != e1
    loader.set_epoch(0)
    assert [b[:, 0].tolist() for b in loader] == e0
    other = gd.Loader(ds, 4, device="cpu", shuffle=True, seed=9)
    other.set_epoch(1)
    assert [b[:, 0].tolist() for b in other] == e1
    plain = gd.Loader(ds, 4, device="cpu")
    assert [b[:, 0].tolist() for b in plain] == [b[:, 0].tolist() for b in plain]  # unshuffled: one order
    loader.close(), other.close(), plain.close()


@pytest.mark.parametrize("k", [0, 1, 4, 7, 8])
def test_resume_after_k_batches_in_the_middle_of_a_prefetch(tokens, k):
    paths, _ = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    make = lambda: gd.Loader(ds, 8, device="cpu", shuffle=True, seed=1, prefetch=3)  # noqa: E731
    with make() as whole:
        whole.set_epoch(5)
        ref = [b.clone() for b in whole]
    with make() as first:
        first.set_epoch(5)
        it = iter(first)
        head = [next(it) for _ in range(k)]  # reads of the next 3 batches are under way
        state = first.state_dict()
    assert state["epoch"] == (6 if k == len(ref) else 5)
    with make() as second:
        second.load_state_dict(state)
        second.set_epoch(state["epoch"])  # the resumed epoch again: the position stays
        rest = list(second) if k < len(ref) else []
    assert len(head) + len(rest) == len(ref)
    assert all(torch.equal(a, b) for a, b in zip(head + rest, ref))


def test_a_new_iterator_continues_and_set_epoch_restarts(tokens):
    paths, _ = tokens
    loader = gd.Loader(gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ), 10, device="cpu")
    ref = [b[:, 0].tolist() for b in loader]
    loader.set_epoch(0)
    for i, b in enumerate(loader):
        if i == 2:
            break
    assert [b[:, 0].tolist() for b in loader] == ref[3:]  # the break kept the position
    assert loader.epoch == 1
    loader.close()


def test_state_dicts_of_other_loaders_are_refused(tokens, tmp_path):
    paths, _ = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    state = gd.Loader(ds, 4, device="cpu", world_size=2, rank=1, seed=3, shuffle=True).state_dict()
    gd.Loader(ds, 4, device="cpu", world_size=2, rank=0, seed=3, shuffle=True).load_state_dict(state)  # any rank
    others = [
        gd.Loader(gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ + 1), 4, device="cpu", world_size=2, seed=3,
                  shuffle=True),
        gd.Loader(gd.TokenDataset(paths[:3], dtype="uint32", seq_len=SEQ), 4, device="cpu", world_size=2, seed=3,
                  shuffle=True),
        gd.Loader(ds, 4, device="cpu", world_size=4, seed=3, shuffle=True),
        gd.Loader(ds, 5, device="cpu", world_size=2, seed=3, shuffle=True),
        gd.Loader(ds, 4, device="cpu", world_size=2, seed=4, shuffle=True),
        gd.Loader(ds, 4, device="cpu", world_size=2, seed=3),
    ]
    for other in others:
        with pytest.raises(gd.StateDictMismatchError):
            other.load_state_dict(state)
    target = gd.Loader(ds, 4, device="cpu", world_size=2, seed=3, shuffle=True)
    for broken in ({}, [], dict(state, batches_done=len(target) + 1), dict(state, epoch=-1),
                   dict(state, batches_done="2"), dict(state, format="other"),
                   dict(state, epoch=2**64 - 3)):  # seed + epoch past what torch's generator takes
        with pytest.raises(gd.StateDictMismatchError):
            target.load_state_dict(broken)
    assert issubclass(gd.StateDictMismatchError, ValueError)


def test_bad_arguments(tokens, tmp_path):
    paths, _ = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    for kw in (dict(batch_size=0), dict(batch_size=-2), dict(batch_size=1.5), dict(batch_size=4, prefetch=-1),
               dict(batch_size=4, device="meta"), dict(batch_size=4, device="nonsense"),
               dict(batch_size=4, rank=2, world_size=2), dict(batch_size=4, seed=-1), dict(batch_size=4, seed=2**64)):
        with pytest.raises(InvalidArgumentError):
            gd.Loader(ds, **kw)
    loader = gd.Loader(ds, 4, device="cpu", seed=2**64 - 10, shuffle=True)
    loader.set_epoch(9)  # the last epoch torch's generator can seed
    assert len(list(loader)) == len(loader)
    with pytest.raises(InvalidArgumentError):
        loader.set_epoch(10)
    with pytest.raises(InvalidArgumentError):
        gd.Loader(list(range(10)), 2, device="cpu")
    with pytest.raises(gd.DatasetTooSmallError):
        gd.Loader(ds, 40, device="cpu", world_size=2, drop_last=True)  # 33 each: no whole batch of 40
    assert len(gd.Loader(ds, 40, device="cpu", world_size=2)) == 1
    np.save(tmp_path / "a.npy", np.zeros((2, 3), dtype=np.float32))
    np.save(tmp_path / "b.npy", np.zeros((3, 2), dtype=np.float32))
    mixed = gd.NpyDataset([tmp_path / "a.npy", tmp_path / "b.npy"])
    with pytest.raises(gd.SampleMismatchError):
        gd.Loader(mixed, 2, device="cpu")
    shapes = [tuple(b.shape) for b in gd.Loader(mixed, 1, device="cpu")]
    assert shapes == [(1, 2, 3), (1, 3, 2)]


def test_a_file_that_shrinks_mid_epoch_fails_the_batch_that_reads_it(tmp_path):
    rec = np.arange(64 * 10, dtype=np.int64).reshape(64, 10)
    rec[:32].tofile(tmp_path / "a.bin")
    rec[32:].tofile(tmp_path / "b.bin")
    ds = gd.RecordDataset([tmp_path / "a.bin", tmp_path / "b.bin"], dtype="int64", shape=(10,))
    threads, fds = threads_not_the_engines(), fd_count()
    loader = gd.Loader(ds, 4, device="cpu", prefetch=2)
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    os.truncate(tmp_path / "b.bin", 8 * 10 * 8)  # b keeps 8 of its 32 records
    with pytest.raises(gd.TruncatedFileError) as info:
        while True:
            got.append(next(it))
    assert str(tmp_path / "b.bin") in str(info.value)
    assert len(got) == 10  # batches 0-9 were whole: a, then b's first 8 records
    assert all(np.array_equal(b.numpy(), rec[4 * k:4 * k + 4]) for k, b in enumerate(got))
    with pytest.raises(StopIteration):
        next(it)  # the pass is over
    assert loader.state_dict()["batches_done"] == 10  # resuming retries the failed batch
    assert not prefetch_threads()
    loader.close()
    assert fd_count() == fds and threads_not_the_engines() == threads
    assert engine_threads() <= 2 * gdskit.settings.threads


def test_a_file_removed_after_the_dataset_was_made_is_named(tmp_path):
    paths = token_files(tmp_path, [200, 200], "uint16")
    ds = gd.TokenDataset(paths, dtype="uint16", seq_len=8)
    os.unlink(paths[1])
    with gd.Loader(ds, 6, device="cpu") as loader:
        with pytest.raises(GdskitFileNotFoundError) as info:
            list(loader)
    assert info.value.filename == paths[1]


def test_no_leaks_after_many_epochs_errors_and_abandoned_passes(tokens, tmp_path):
    paths, _ = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    with gd.Loader(ds, 7, device="cpu") as warm:  # the engine's workers exist from here on
        list(warm)
    gc.collect()
    fds, threads, pinned = fd_count(), threads_not_the_engines(), gdskit.resources().pinned_bytes
    loader = gd.Loader(ds, 7, device="cpu", shuffle=True, prefetch=2)
    for epoch in range(25):
        for i, b in enumerate(loader):
            if epoch % 3 == 0 and i == 2:
                break  # abandoned mid-epoch: the next pass ends it
    it = iter(loader)
    next(it)
    del it  # dropped with reads under way: closed
    gc.collect()
    assert not prefetch_threads()
    loader.close()
    del loader
    shrinking = tmp_path / "s.bin"
    shrinking.write_bytes(b"\1" * 4000)
    for _ in range(5):
        bad = gd.Loader(gd.RecordDataset(shrinking, record_bytes=100), 3, device="cpu", prefetch=2)
        os.truncate(shrinking, 1000)
        with pytest.raises(gd.TruncatedFileError):
            list(bad)
        bad.close()
        shrinking.write_bytes(b"\1" * 4000)
    gc.collect()
    assert fd_count() == fds
    assert threads_not_the_engines() == threads and engine_threads() <= 2 * gdskit.settings.threads
    assert gdskit.resources().pinned_bytes == pinned


def test_ledger_and_progress_count_the_bytes_delivered(tokens):
    paths, _ = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    seen = []
    loader = gd.Loader(ds, 6, device="cpu", shuffle=True, progress=lambda done, total: seen.append((done, total)))
    delivered = sum(b.numel() * b.element_size() for b in loader)
    delta = loader.stats()
    assert delta.bytes_read == delivered == len(ds) * (SEQ + 1) * 4
    assert set(delta.paths) == {"host"}
    assert seen[-1] == (delivered, delivered) and all(t == delivered for _, t in seen)
    loader.close()


def test_ranks_share_out_an_epoch(tokens):
    paths, want = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    shares = []
    for rank in range(3):
        with gd.Loader(ds, 4, device="cpu", shuffle=True, rank=rank, world_size=3) as loader:
            shares.append([int(x) for b in loader for x in b[:, 0]])
    assert len({len(s) for s in shares}) == 1 and sum(map(len, shares)) == len(want)  # 66 divides by 3
    assert sorted(x for s in shares for x in s) == sorted(int(w[0]) for w in want)


def test_without_torch_an_install_hint_and_with_it_exit_with_a_pass_under_way(tokens):
    """One fresh interpreter (torch's import is the costly part): without torch, ``import gdskit``
    works and ``import gdskit.data`` raises the install hint; with torch, the interpreter exits
    while a pass has reads under way, without hanging."""
    paths, _ = tokens
    script = f"""
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("no torch here")
blocker = NoTorch()
sys.meta_path.insert(0, blocker)
import gdskit
from gdskit.errors import MissingDependencyError
try:
    import gdskit.data
    print("imported without torch")
except MissingDependencyError as exc:
    print("hint", isinstance(exc, ImportError), "gdskit[torch]" in str(exc))
sys.meta_path.remove(blocker)
for name in [m for m in sys.modules if m.startswith("gdskit.data")]:
    del sys.modules[name]
import gdskit.data as gd
ds = gd.TokenDataset({paths!r}, dtype='uint32', seq_len={SEQ})
loader = gd.Loader(ds, 2, device='cpu', prefetch=4)
it = iter(loader)
next(it)
print('exiting')
"""
    env = dict(os.environ, PYTHONPATH=str(SRC))
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:2] == ["hint True True", "exiting"]



def test_a_pass_closed_during_the_interpreters_teardown_does_not_wait_for_its_readers(tokens, monkeypatch):
    """While the interpreter is torn down its threads can no longer run: a pass closed then (its
    finaliser) must not join readers that are still reading, or the exit waits for ever."""
    from gdskit.data import loader as L
    paths, _ = tokens
    gate = threading.Event()
    real = L._Reader.start

    def stuck(self, *a, **k):  # a reader in the middle of a read that does not end by itself
        gate.wait(30)
        return real(self, *a, **k)

    monkeypatch.setattr(L._Reader, "start", stuck)
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    it = iter(gd.Loader(ds, 2, device="cpu", prefetch=4))
    readers = [it._pipeline._thread]
    assert readers and all(t.is_alive() for t in readers)
    closed = threading.Event()
    monkeypatch.setattr(sys, "is_finalizing", lambda: True)
    try:
        closer = threading.Thread(target=lambda: (it.close(), closed.set()), daemon=True)
        closer.start()
        finished = closed.wait(5)
    finally:
        monkeypatch.setattr(sys, "is_finalizing", lambda: False)
        gate.set()
    for t in readers:
        t.join(10)
    closer.join(10)
    assert finished, "close() waited for readers that could no longer run"
    assert not any(t.is_alive() for t in readers)


def test_the_exit_stops_a_pass_and_waits_for_its_readers(tokens):
    """The ordered exit closes every pass still reading ahead (before the engine stops), so
    that no reader is left running into the interpreter's teardown."""
    from gdskit.data import loader as L
    paths, _ = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    it = iter(gd.Loader(ds, 2, device="cpu", prefetch=4))
    next(it)
    readers = [it._pipeline._thread]
    L._live.close_all()  # what gdskit.shutdown runs at exit
    assert not any(t.is_alive() for t in readers)
    it.close()


def test_the_exit_waits_for_readers_still_reading(tokens):
    """A pass whose readers are in the middle of slow reads when the program ends: the exit stops
    them and waits for their reads, and the process ends with its own status (a reader left
    running into the interpreter's teardown made the pass's finaliser wait for ever)."""
    paths, _ = tokens
    script = f"""
import time
import gdskit.data as gd
from gdskit.data import loader as L
real = L._Reader.start
def slow(self, *a, **k):
    time.sleep(1.0)
    return real(self, *a, **k)
L._Reader.start = slow
ds = gd.TokenDataset({paths!r}, dtype='uint32', seq_len={SEQ})
it = iter(gd.Loader(ds, 2, device='cpu', prefetch=4))
next(it)
print('exiting', flush=True)
"""
    env = dict(os.environ, PYTHONPATH=str(SRC))
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "exiting"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA is not available")
def test_a_gpu_asked_for_where_there_is_none_is_a_device_error(tokens, tmp_path):
    """The default device is cuda:0: without CUDA, the loader and preload say so and how to go on."""
    from gdskit.errors import DeviceUnavailableError

    paths, _ = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    for make in (lambda: gd.Loader(ds, 4), lambda: gd.Loader(ds, 4, device=1), lambda: gd.preload(paths[0])):
        with pytest.raises(DeviceUnavailableError, match="device='cpu'"):
            make()


@pytest.mark.parametrize("world_size", [2**40, 2**64 + 3])
def test_a_rank_of_a_world_far_larger_than_the_dataset_gets_its_one_sample(tokens, world_size):
    """Every rank of a huge world gets one padded sample, planned from its share alone."""
    import tracemalloc

    paths, want = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    for rank in (0, 5, world_size - 1):
        tracemalloc.start()
        try:
            with gd.Loader(ds, 4, device="cpu", world_size=world_size, rank=rank, prefetch=0) as loader:
                (batch,) = list(loader)
                assert loader.state_dict()["world_size"] == world_size
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert np.array_equal(batch.numpy(), want[rank % len(want)][None])
        assert peak < 8 << 20


def test_sampler_arguments_of_the_wrong_kind_are_refused(tokens):
    paths, _ = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    for kw in (dict(world_size=0), dict(world_size=2.0), dict(world_size="4"), dict(world_size=True),
               dict(rank=-1, world_size=2), dict(rank=1.0, world_size=2), dict(rank=2**40, world_size=2**40),
               dict(shuffle="no"), dict(shuffle=np.array([True, False])), dict(drop_last=2)):
        with pytest.raises(InvalidArgumentError):
            gd.Loader(ds, 4, device="cpu", **kw)
