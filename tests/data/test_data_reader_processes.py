"""gdskit.data.Loader with ``workers``: batches read by reader processes into shared memory.

Contents against numpy and against the in-process loader, the ledger, resume, a file that
shrinks or goes away, a reader process that dies, the wire's messages, and that nothing
(processes, descriptors, threads) is left behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings as hsettings, strategies as st

torch = pytest.importorskip("torch")

import gdskit  # noqa: E402
import gdskit.data as gd  # noqa: E402
from data_workers import LOADER_SEQ, SRC, loader_tokens, token_files, windows  # noqa: E402
from gdskit.engine import reader_processes  # noqa: E402
from gdskit.errors import GdskitError, GdskitFileNotFoundError, InvalidArgumentError  # noqa: E402
from leak_helpers import fd_count  # noqa: E402

SEQ = LOADER_SEQ


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return loader_tokens(tmp_path_factory.mktemp("procs"))


def children() -> set[int]:
    """This process's child processes, by pid."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                out.add(int(entry))
    return out


def reader_pids(loader) -> list[int]:
    return [p.pid for p in loader._reader._procs._procs]


@pytest.mark.parametrize("workers,prefetch", [(1, 0), (2, 2), (3, 5)])
def test_batches_equal_numpys_and_the_in_process_loaders_every_window_once(tokens, workers, prefetch):
    paths, want = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    with gd.Loader(ds, 4, device="cpu", shuffle=True, seed=3, workers=workers, prefetch=prefetch) as loader, \
            gd.Loader(ds, 4, device="cpu", shuffle=True, seed=3) as plain:
        for epoch in range(2):
            got = [b.numpy().copy() for b in loader]
            assert [b.numpy().tolist() for b in plain] == [g.tolist() for g in got]
            order = [i for idx in loader.batch_indices(epoch) for i in idx.tolist()]
            assert np.array_equal(np.concatenate(got), np.stack([want[i] for i in order]))
            assert sorted(order) == list(range(len(want)))  # every window once (66 = 16 * 4 + 2)
        assert loader.epoch == 2


def test_the_ledger_counts_the_reader_processes_reads_here(tokens):
    paths, want = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    with gd.Loader(ds, 8, device="cpu", workers=2) as loader:
        delivered = sum(b.numel() * b.element_size() for b in loader)
        delta = loader.stats()
    assert delivered == len(want) * (SEQ + 1) * 4
    assert delta.bytes_read == delivered
    assert set(delta.paths) == {"host"}
    assert delta.requests >= len(want) // 8


def test_resume_mid_epoch_gives_the_same_remaining_batches_with_or_without_workers(tokens):
    paths, _ = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    with gd.Loader(ds, 4, device="cpu", shuffle=True, seed=1, workers=2, prefetch=3) as first:
        it = iter(first)
        for _ in range(5):
            next(it)
        state = first.state_dict()
        rest = [b.numpy().tolist() for b in it]
    for workers in (0, 2):
        with gd.Loader(ds, 4, device="cpu", shuffle=True, seed=1, workers=workers) as again:
            again.load_state_dict(state)
            assert [b.numpy().tolist() for b in again] == rest


def test_a_pass_left_with_batches_asked_for_leaves_the_next_pass_its_own_answers(tokens):
    paths, want = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    with gd.Loader(ds, 3, device="cpu", shuffle=True, seed=2, workers=2, prefetch=3) as loader:
        order = loader.batch_indices(0)
        got = []
        for stop in (2, 5, 9):  # each pass ends with six batches asked of the reader_processes and not taken
            for b in loader:
                got.append(b.numpy().copy())
                if len(got) == stop:
                    break
        got += [b.numpy().copy() for b in loader]
    assert len(got) == len(order)
    for g, idx in zip(got, order):
        assert np.array_equal(g, np.stack([want[i] for i in idx.tolist()]))


def test_a_file_that_shrinks_mid_epoch_is_a_truncated_file_and_nothing_is_left(tmp_path):
    paths = token_files(tmp_path, [2000, 2000], "uint32")
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    fds, kids = fd_count(), children()
    loader = gd.Loader(ds, 4, device="cpu", workers=2, prefetch=2)
    it = iter(loader)
    next(it)
    os.truncate(paths[1], 100)
    with pytest.raises(gd.TruncatedFileError, match="tokens01"):
        for _ in it:
            pass
    assert isinstance(gd.TruncatedFileError("x"), GdskitError)
    loader.close()
    assert fd_count() == fds and children() == kids


def test_a_file_gone_before_its_first_read_is_named(tmp_path):
    paths = token_files(tmp_path, [2000, 2000], "uint32")
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    os.unlink(paths[1])
    with gd.Loader(ds, 4, device="cpu", workers=1) as loader:
        with pytest.raises(GdskitFileNotFoundError, match="tokens01"):
            for _ in loader:
                pass


def test_a_reader_process_that_dies_is_an_error_naming_it_and_the_next_pass_starts_afresh(tokens):
    paths, want = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    kids = children()
    with gd.Loader(ds, 2, device="cpu", workers=2, prefetch=2) as loader:
        it = iter(loader)
        next(it)
        victim = reader_pids(loader)[1]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(reader_processes.ReaderProcessError, match=f"pid {victim}.*signal 9") as info:
            for _ in it:
                pass
        assert isinstance(info.value, GdskitError) and isinstance(info.value, RuntimeError)
        assert gd.ReaderProcessError is reader_processes.ReaderProcessError
        assert victim not in children()
        got = [b.numpy().copy() for b in loader]  # a new pass: new processes, the rest of the epoch
        assert victim not in reader_pids(loader)
        done = loader.state_dict()["batches_done"]
    order = [i for idx in loader.batch_indices(0) for i in idx.tolist()]
    assert got and np.array_equal(np.concatenate(got), np.stack([want[i] for i in order[-sum(len(g) for g in got):]]))
    assert done == 0 and children() == kids  # the epoch ended; close() ended every reader


def test_many_passes_errors_and_closes_leave_no_process_descriptor_or_thread(tokens):
    paths, _ = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    fds, kids = fd_count(), children()
    for round_ in range(3):
        loader = gd.Loader(ds, 3, device="cpu", shuffle=True, workers=2, prefetch=2)
        for epoch in range(2):
            it = iter(loader)
            for _ in range(4 + epoch):
                next(it)
        it = iter(loader)
        next(it)
        del it  # a pass dropped while batches are asked for: its answers are taken, none leaks
        loader.close()
    assert fd_count() == fds and children() == kids
    assert not [t for t in __import__("threading").enumerate() if t.name == "gdskit-data-prefetch"]


def test_workers_are_checked(tokens, tmp_path):
    paths, _ = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(InvalidArgumentError, match="workers"):
            gd.Loader(ds, 4, device="cpu", workers=bad)
    np.save(tmp_path / "a.npy", np.zeros((3, 4), dtype=np.float32))
    np.save(tmp_path / "b.npy", np.zeros((5,), dtype=np.int16))
    mixed = gd.NpyDataset([str(tmp_path / "a.npy"), str(tmp_path / "b.npy")])
    with pytest.raises(InvalidArgumentError, match="one sample layout"):
        gd.Loader(mixed, 1, device="cpu", workers=2)


def test_records_and_npy_rows_through_reader_processes(tmp_path):
    rows = np.random.default_rng(0).random((300, 7, 3), dtype=np.float32)
    np.save(tmp_path / "rows.npy", rows[:, :, 0])
    ds = gd.NpyDataset(str(tmp_path / "rows.npy"))
    with gd.Loader(ds, 16, device="cpu", shuffle=True, workers=2) as loader:
        order = [i for idx in loader.batch_indices() for i in idx.tolist()]
        got = np.concatenate([b.numpy() for b in loader])
    assert np.array_equal(got, rows[:, :, 0][order])
    rows.tofile(tmp_path / "r.bin")
    rec = gd.RecordDataset(str(tmp_path / "r.bin"), dtype="float32", shape=(7, 3))
    with gd.Loader(rec, 10, device="cpu", workers=1, drop_last=True) as loader:
        assert np.array_equal(np.concatenate([b.numpy() for b in loader]), rows)


def test_the_exit_ends_the_reader_processes_of_a_loader_never_closed(tokens, tmp_path):
    paths, _ = tokens
    script = tmp_path / "run.py"
    script.write_text(
        "import sys, gdskit.data as gd\n"
        f"ds = gd.TokenDataset({paths!r}, dtype='uint32', seq_len={SEQ})\n"
        "loader = gd.Loader(ds, 2, device='cpu', workers=2)\n"
        "it = iter(loader); next(it)\n"
        "print(*[p.pid for p in loader._reader._procs._procs], flush=True)\n")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    for pid in map(int, out.stdout.split()):
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{pid}"), f"reader process {pid} outlived the loader's process"


# -- the wire ---------------------------------------------------------------------------------------
offsets = st.lists(st.integers(0, 2**62), max_size=40)


@hsettings(max_examples=60, deadline=None)
@given(st.integers(0, 2**62), st.lists(st.tuples(st.integers(0, 2**31), st.integers(1, 2**31), offsets), max_size=5))
def test_read_messages_come_back_as_they_were_sent(base, groups):
    sent = [(p, size, offs, list(reversed(offs))) for p, size, offs in groups]
    got_base, got = reader_processes.unpack_read(reader_processes.pack_read(base, sent))
    assert got_base == base and got == [(p, s, list(o), list(q)) for p, s, o, q in sent]


@hsettings(max_examples=60, deadline=None)
@given(st.binary(max_size=200))
def test_a_damaged_read_message_is_a_value_error_or_exactly_what_it_says(junk):
    try:
        base, groups = reader_processes.unpack_read(junk)
    except ValueError:
        return
    assert reader_processes.pack_read(base, groups) == junk  # what parses is a message, byte for byte


def test_a_reader_that_answers_nonsense_breaks_the_set_with_a_clear_error(tokens):
    paths, _ = tokens
    procs = reader_processes.ReaderProcesses(1, paths, 2, 4096, pinned=False, settings_values=gdskit.settings.as_dict())
    try:
        slot = procs.slot(0)
        procs.send(0, slot, [(0, 132, [0], [0])])
        assert procs.receive(0)[0] == [[132]]
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        procs._socks[0].close()
        procs._socks[0] = mine
        reader_processes.send_message(theirs, b"D", b"\x05\x00")  # a done message cut short
        with pytest.raises(reader_processes.ReaderProcessError, match="damaged"):
            procs.receive(0)
        with pytest.raises(reader_processes.ReaderProcessError, match="damaged"):
            procs.send(0, slot, [(0, 132, [0], [0])])  # broken for good
        theirs.close()
    finally:
        procs.close()


def test_the_shared_staging_stays_within_the_pinned_budget(tmp_path):
    seq = 16384
    paths = token_files(tmp_path, [200_000, 90_000], "uint32")
    want = windows(paths, "uint32", seq)
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=seq)
    slot = reader_processes.ReaderProcesses.slot_size(4 * (seq + 1) * 4)  # 320 KiB
    with gdskit.settings.set(pinned_budget="2MiB"):
        with gd.Loader(ds, 4, device="cpu", workers=3, prefetch=4) as loader:
            assert loader._reader.asked_ahead() == 4  # not 4 x 3: six slots fit the budget
            assert loader._reader._procs._mapping.nbytes == 6 * slot <= 2 << 20
            got = np.concatenate([b.numpy() for b in loader])
    with gdskit.settings.set(pinned_budget="1MiB"):
        with gd.Loader(ds, 4, device="cpu", workers=2) as loader:
            assert loader._reader.asked_ahead() == 1  # three slots
            assert np.array_equal(np.concatenate([b.numpy() for b in loader]), got)
    order = [i for idx in gd.Loader(ds, 4, device="cpu").batch_indices() for i in idx.tolist()]
    assert np.array_equal(got, np.stack([want[i] for i in order]))


def test_batches_of_many_reads_asked_ahead_never_deadlock_the_sockets(tmp_path):
    """Batches of 20,000 reads (320 KB of offsets asked, 160 KB of counts answered, more than a
    socket holds) asked several ahead of one process: the loader must not block sending while
    the reader blocks answering. Run in a child process with a time limit: a deadlock would hang."""
    records = np.arange(200_000, dtype=np.int32)
    records.tofile(tmp_path / "r.bin")
    script = tmp_path / "many.py"
    script.write_text(
        "import numpy as np, gdskit.data as gd\n"
        f"ds = gd.RecordDataset({str(tmp_path / 'r.bin')!r}, dtype='int32', shape=())\n"
        "with gd.Loader(ds, 20_000, device='cpu', shuffle=True, workers=1, prefetch=4) as loader:\n"
        "    order = np.concatenate(loader.batch_indices())\n"
        "    got = np.concatenate([b.numpy() for b in loader])\n"
        "assert np.array_equal(got, order.astype(np.int32)), 'wrong bytes'\n"
        "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    try:
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the loader and its reader process deadlocked on their sockets")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_gdskit_in_the_working_directory_is_never_what_the_readers_import(tokens, tmp_path):
    """A loader run from a directory others can write (/tmp): a "gdskit" planted there must not
    run in the reader processes."""
    paths, want = tokens
    planted = tmp_path / "planted"
    (planted / "gdskit").mkdir(parents=True)
    marker = tmp_path / "ran"
    for name in ("__init__.py", "reader_main.py"):
        (planted / "gdskit" / name).write_text(f"open({str(marker)!r}, 'w').write('planted code ran')\n")
    script = tmp_path / "run.py"
    script.write_text(
        "import numpy as np, gdskit.data as gd\n"
        f"ds = gd.TokenDataset({paths!r}, dtype='uint32', seq_len={SEQ})\n"
        "with gd.Loader(ds, 4, device='cpu', workers=2) as loader:\n"
        "    print(sum(int(b.numel()) for b in loader))\n")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, str(script)], cwd=planted, capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(want) * (SEQ + 1)
    assert not marker.exists()


def test_reader_processes_never_load_cuda(tokens):
    """A reader process reads into host memory only: neither the CUDA bindings nor the driver
    library is loaded there (the driver's start would cost each process a tenth of a second)."""
    paths, _ = tokens
    ds = gd.TokenDataset(paths, dtype="uint32", seq_len=SEQ)
    with gd.Loader(ds, 4, device="cpu", workers=2) as loader:
        next(iter(loader))
        for pid in reader_pids(loader):
            with open(f"/proc/{pid}/maps") as f:
                mapped = f.read()
            assert "cuda/bindings" not in mapped and "libcuda" not in mapped, f"reader {pid} loaded CUDA"


def test_readers_started_from_a_gdskit_thread_still_take_sigterm(tokens):
    """A child inherits the signal mask of the thread that started it; gdskit's threads block the
    process's signals, so a reader started from one unblocks them first thing."""
    import signal

    from gdskit.threads import start_thread
    from signal_helpers import blocked_signals

    paths, _ = tokens
    made = []
    start_thread(lambda: made.append(reader_processes.ReaderProcesses(1, paths, 2, 4096, pinned=False,
                                                             settings_values=gdskit.settings.as_dict())),
                 "gdskit-test").join()
    (procs,) = made
    try:
        slot = procs.slot(0)
        procs.send(0, slot, [(0, 132, [0], [0])])
        assert procs.receive(0)[0] == [[132]]  # the reader is past its start
        blocked = blocked_signals(procs._procs[0].pid)
        assert signal.SIGTERM not in blocked and signal.SIGINT not in blocked
    finally:
        procs.close()
