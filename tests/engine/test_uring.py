"""Batches of small host reads through io_uring (gdskit.engine.backends.uring): the bytes of plain reads,
the same counts and errors as the preadv loop, one ring per thread and per process, nothing left
open, and the memory never given back while a submitted read may still write into it."""

from __future__ import annotations

import errno
import gc
import json
import mmap
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from backend_conformance import aligned_array
from data_files import random_file
from leak_helpers import fd_count
from repo_paths import SRC

import gdskit
from gdskit.engine.backends import uring
from gdskit.engine.backends.host import URING_MIN_READS
from gdskit.errors import ConfigError, EnvironmentVariableError, GdskitIOError

SIZE = (1 << 20) + 3000
N = max(URING_MIN_READS, 24)  # reads per batch: enough for the ring


def _ring_works() -> bool:
    return bool(uring.availability().usable)


needs_uring = pytest.mark.skipif(not _ring_works(), reason=f"io_uring unusable here: {uring.availability().detail}")


class _File(tuple):
    """(path, bytes) with a short repr: hypothesis prints its arguments when a case fails."""

    def __repr__(self) -> str:
        return f"<{len(self[1])} random bytes at {self[0]}>"


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return _File(random_file(tmp_path_factory, "uring", SIZE, seed=11))


def _offsets(n: int, size: int, seed: int, align: int = 1) -> list[int]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, (SIZE - size) // align, n) * align).tolist()


def _check_bytes(buf, data: bytes, offsets: list[int], places: list[int], size: int, counts: list[int]) -> None:
    for off, bo, n in zip(offsets, places, counts):
        want = data[off:off + size]
        assert n == len(want) and bytes(buf[bo:bo + n]) == want


def _batch(path: str, offsets: list[int], size: int, io_uring: str, policy: str = "auto",
           aligned: bool = False) -> tuple[list[int], np.ndarray, gdskit.Stats]:
    buf = aligned_array(max(1, size * len(offsets))) if aligned else np.zeros(max(1, size * len(offsets)), np.uint8)
    before = gdskit.stats()
    with gdskit.settings.set(mode="host", odirect=policy, io_uring=io_uring), gdskit.open(path) as f:
        counts = f.read_batch(buf, offsets, size)
    return counts, buf, gdskit.stats() - before


def _host_row(delta) -> tuple[int, int, int]:
    host = delta.paths.get("host")
    return (0, 0, 0) if host is None else (host.bytes_read, host.ops_read, host.requests)


class Meddling(uring.Kernel):
    """The running kernel, with a hook that runs before each ``io_uring_enter`` on the ring's SQE
    array as the kernel will read it (struct io_uring_sqe, mapped through the ring's descriptor),
    and a count of calls. It changes only what a program may write: the kernel's rules hold."""

    def __init__(self, before_enter=None, setup_result: int | None = None) -> None:
        super().__init__()
        self.before_enter = before_enter
        self.setup_result = setup_result
        self.setups = self.enters = 0

    def setup(self, entries, params):
        self.setups += 1
        if self.setup_result is not None:
            return self.setup_result
        return super().setup(entries, params)

    def enter(self, fd, to_submit, min_complete, flags):
        self.enters += 1
        if self.before_enter is not None:
            # Unmapped when the last view of it goes (a traceback may keep one a while).
            m = mmap.mmap(fd, uring.RING_ENTRIES * 64, offset=0x10000000)
            sqes = np.frombuffer(m, dtype=np.int64).reshape(-1, 8)
            return self.before_enter(self, sqes, fd, to_submit, min_complete, flags)
        return super().enter(fd, to_submit, min_complete, flags)


# -- the bytes --------------------------------------------------------------------------------------
@needs_uring
@hsettings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(1, 70_000), extra=st.lists(st.integers(0, SIZE + 5000), min_size=0, max_size=20),
       policy=st.sampled_from(["auto", "always", "never"]), aligned=st.booleans(), seed=st.integers(0, 2**16))
def test_any_batch_reads_what_plain_reads_read_with_io_uring_on_and_off(data_file, size, extra, policy, aligned,
                                                                       seed):
    path, data = data_file
    if aligned:  # O_DIRECT-aligned: whole 4 KiB blocks at 4 KiB offsets into 4 KiB-aligned memory
        size = -(-size // 4096) * 4096
        extra = [off // 4096 * 4096 for off in extra]
        offsets = _offsets(N, size, seed, 4096) + extra
    else:
        offsets = _offsets(N, size, seed) + extra  # extra: anywhere, past the end of the file too
    places = [i * size for i in range(len(offsets))]
    results = {}
    for mode in ("auto", "never"):
        counts, buf, delta = _batch(path, offsets, size, mode, policy, aligned)
        _check_bytes(buf, data, offsets, places, size, counts)
        results[mode] = (counts, _host_row(delta))
    assert results["auto"] == results["never"]  # counts and the ledger's bytes, ops and requests


@needs_uring
@pytest.mark.parametrize("policy, aligned", [("auto", False), ("never", False), ("always", True)])
def test_read_batch_submits_through_the_ring(data_file, policy, aligned):
    """Fails if read_batch stops using io_uring where it should (or uses it where it is off)."""
    path, data = data_file
    size = 4096 if aligned else 4098
    offsets = _offsets(N, size, 5, 4096 if aligned else 1)
    kernel = Meddling()
    with uring.use_kernel(kernel):
        before = uring.activity()
        counts, buf, delta = _batch(path, offsets, size, "auto", policy, aligned)
        used = uring.activity() - before
        assert used.batches == 1 and used.reads == N and kernel.enters >= 1
        _check_bytes(buf, data, offsets, [i * size for i in range(N)], size, counts)
        assert _host_row(delta) == (N * size, N, N)  # the tight loop's one record: host path, bytes, ops, requests
        kernel.enters = 0
        before = uring.activity()
        counts, buf, _ = _batch(path, offsets, size, "never", policy, aligned)
        assert uring.activity() - before == uring.Activity() and kernel.enters == 0
        _check_bytes(buf, data, offsets, [i * size for i in range(N)], size, counts)


@needs_uring
def test_small_batches_and_timed_batches_keep_the_loop(data_file):
    path, _ = data_file
    before = uring.activity()
    _batch(path, _offsets(URING_MIN_READS - 1, 4098, 1), 4098, "auto")
    buf = np.zeros(N * 4098, np.uint8)
    with gdskit.settings.set(mode="host"), gdskit.open(path) as f:
        lat: list[int] = []
        f.read_batch(buf, _offsets(N, 4098, 2), 4098, latencies_ns=lat)
    assert (uring.activity() - before).batches == 0 and len(lat) == N


@needs_uring
def test_a_batch_bigger_than_the_ring_goes_in_rounds(data_file):
    path, data = data_file
    n = 2 * uring.RING_ENTRIES + 7
    offsets = _offsets(n, 1000, 9)
    kernel = Meddling()
    with uring.use_kernel(kernel):
        counts, buf, delta = _batch(path, offsets, 1000, "auto")
    _check_bytes(buf, data, offsets, [i * 1000 for i in range(n)], 1000, counts)
    assert counts == [1000] * n and kernel.enters >= 3 and _host_row(delta) == (n * 1000, n, n)


# -- counts and errors, as the loop gives them --------------------------------------------------------
@needs_uring
@pytest.mark.parametrize("policy", ["auto", "always"])
def test_reads_at_and_past_the_end_are_counted_as_before(data_file, policy):
    path, data = data_file
    size = 4096
    offsets = _offsets(N, size, 3, 4096) + [SIZE // 4096 * 4096, SIZE + 4096, (SIZE - 4096) // 4096 * 4096]
    results = {}
    for mode in ("auto", "never"):
        counts, buf, delta = _batch(path, offsets, size, mode, policy, aligned=True)
        _check_bytes(buf, data, offsets, [i * size for i in range(len(offsets))], size, counts)
        results[mode] = (counts, _host_row(delta))
    assert results["auto"] == results["never"]
    assert results["auto"][0][-3:] == [SIZE % 4096, 0, 4096]


@needs_uring
def test_a_file_truncated_between_batches_gives_the_loops_counts(tmp_path):
    data = np.random.default_rng(4).integers(0, 256, 256 * 1024, dtype=np.uint8).tobytes()
    offsets = _offsets(N, 4098, 8)
    offsets = [off % (len(data) - 4098) for off in offsets]
    results = {}
    for mode in ("auto", "never"):
        path = tmp_path / f"shrinking-{mode}.bin"
        path.write_bytes(data)
        buf = np.zeros(N * 4098, np.uint8)
        with gdskit.settings.set(mode="host", io_uring=mode), gdskit.open(path) as f:
            first = f.read_batch(buf, offsets, 4098)
            os.truncate(path, 100_000)
            before = gdskit.stats()
            second = f.read_batch(buf, offsets, 4098)
            row = _host_row(gdskit.stats() - before)
        _check_bytes(buf, data[:100_000], offsets, [i * 4098 for i in range(N)], 4098, second)
        results[mode] = (first, second, row)
    assert results["auto"] == results["never"]
    assert any(0 < n < 4098 for n in results["auto"][1]) or 0 in results["auto"][1]


def _fail_offset(target: int):
    """A hook that makes the kernel refuse the read at file offset ``target`` (an offset of -2:
    EINVAL), as a read the kernel cannot do."""
    def hook(kernel, sqes, fd, to_submit, min_complete, flags):
        sqes[:, 1][sqes[:, 1] == target] = -2  # (-1 would mean "the file position")
        return uring.Kernel.enter(kernel, fd, to_submit, min_complete, flags)
    return hook


@needs_uring
def test_a_read_the_ring_cannot_do_takes_the_general_path_and_raises_its_error(data_file, monkeypatch):
    path, data = data_file
    offsets = _offsets(N, 4096, 12, 4096)
    bad = offsets[N // 2]
    with uring.use_kernel(Meddling(_fail_offset(bad))):
        # Only the ring fails that read: the general path reads it whole.
        counts, buf, delta = _batch(path, offsets, 4096, "auto")
        _check_bytes(buf, data, offsets, [i * 4096 for i in range(N)], 4096, counts)
        assert counts == [4096] * N and uring.availability().usable  # one read's EINVAL is not the kernel's
        # Where the general path fails too, the error is the one the loop raises.
        real = os.preadv

        def failing(fd, iov, off, *flags):
            if off == bad:
                raise OSError(errno.EIO, "injected I/O error")
            return real(fd, iov, off, *flags)

        monkeypatch.setattr(os, "preadv", failing)
        errors = {}
        for mode in ("auto", "never"):
            with pytest.raises(GdskitIOError) as info:
                _batch(path, offsets, 4096, mode)
            errors[mode] = (type(info.value), info.value.errno)
        assert errors["auto"] == errors["never"] == (GdskitIOError, errno.EIO)


@needs_uring
def test_a_kernel_that_refuses_every_buffered_read_is_not_asked_again(data_file):
    path, data = data_file
    offsets = _offsets(N, 4098, 13)

    def refuse_all(kernel, sqes, fd, to_submit, min_complete, flags):
        sqes[:, 1] = -2  # every read: EINVAL, as a kernel without IORING_OP_READ answers
        return uring.Kernel.enter(kernel, fd, to_submit, min_complete, flags)

    kernel = Meddling(refuse_all)
    with uring.use_kernel(kernel):
        counts, buf, _ = _batch(path, offsets, 4098, "auto")
        _check_bytes(buf, data, offsets, [i * 4098 for i in range(N)], 4098, counts)
        assert uring.availability().usable is False
        enters = kernel.enters
        counts, buf, _ = _batch(path, offsets, 4098, "auto")
        _check_bytes(buf, data, offsets, [i * 4098 for i in range(N)], 4098, counts)
        assert kernel.enters == enters


@pytest.mark.parametrize("err", [errno.EPERM, errno.ENOSYS, errno.ENOMEM])
def test_a_refused_io_uring_setup_reads_the_same_bytes_and_is_asked_once(data_file, err):
    path, data = data_file
    kernel = Meddling(setup_result=-err)
    with uring.use_kernel(kernel):
        for seed in range(3):
            offsets = _offsets(N, 4098, seed)
            counts, buf, delta = _batch(path, offsets, 4098, "auto")
            _check_bytes(buf, data, offsets, [i * 4098 for i in range(N)], 4098, counts)
            assert _host_row(delta) == (N * 4098, N, N)
        known = uring.availability()
        assert known.usable is False and kernel.setups == 1 and kernel.enters == 0


# -- interrupted waits: nothing returns while a read may still land --------------------------------
@needs_uring
@pytest.mark.parametrize("interruption", ["eintr", "keyboard"])
def test_an_interrupted_wait_waits_for_every_read_before_returning_or_raising(data_file, interruption):
    path, data = data_file
    offsets = _offsets(N, 4096, 21, 4096)
    state = {"first": True}

    def interrupt(kernel, sqes, fd, to_submit, min_complete, flags):
        if state["first"]:  # submit, do not wait, and come back as a signal would make it
            state["first"] = False
            uring.Kernel.enter(kernel, fd, to_submit, 0, 0)
            if interruption == "keyboard":
                raise KeyboardInterrupt
            return -errno.EINTR
        return uring.Kernel.enter(kernel, fd, to_submit, min_complete, flags)

    buf = aligned_array(N * 4096)
    with uring.use_kernel(Meddling(interrupt)), gdskit.settings.set(mode="host", odirect="always"), \
            gdskit.open(path) as f:
        if interruption == "keyboard":
            with pytest.raises(KeyboardInterrupt):
                f.read_batch(buf, offsets, 4096)
            # Raised only once every read had landed: the memory holds all of them.
            _check_bytes(buf, data, offsets, [i * 4096 for i in range(N)], 4096, [4096] * N)
        else:
            counts = f.read_batch(buf, offsets, 4096)
            _check_bytes(buf, data, offsets, [i * 4096 for i in range(N)], 4096, counts)
        buf[:] = 0  # the ring still works afterwards
        counts = f.read_batch(buf, offsets, 4096)
        _check_bytes(buf, data, offsets, [i * 4096 for i in range(N)], 4096, counts)


@needs_uring
def test_closing_rings_while_a_batch_is_in_flight_waits_for_it(data_file):
    path, data = data_file
    offsets = _offsets(N, 4098, 31)
    inside, go_on = threading.Event(), threading.Event()

    ring_fds = []

    def stall(kernel, sqes, fd, to_submit, min_complete, flags):
        r = uring.Kernel.enter(kernel, fd, to_submit, 0, 0)  # submitted, not waited for
        ring_fds.append(fd)
        inside.set()
        go_on.wait(30)
        return r

    buf = np.zeros(N * 4098, np.uint8)
    out = {}
    with uring.use_kernel(Meddling(stall)):
        def reader():
            with gdskit.settings.set(mode="host"), gdskit.open(path) as f:
                out["counts"] = f.read_batch(buf, offsets, 4098)
        t = threading.Thread(target=reader)
        t.start()
        assert inside.wait(30)
        uring.close_all()          # the ring is in use: it must not be unmapped under the batch
        # Its descriptor is still the ring (other descriptors of the process may come and go meanwhile).
        assert os.readlink(f"/proc/self/fd/{ring_fds[0]}") == "anon_inode:[io_uring]"
        go_on.set()
        t.join(30)
    _check_bytes(buf, data, offsets, [i * 4098 for i in range(N)], 4098, out["counts"])


# -- threads, processes, descriptors, exit ----------------------------------------------------------
@needs_uring
def test_threads_reading_at_once_each_get_their_bytes_on_their_own_ring(data_file):
    path, data = data_file
    before = uring.activity()
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def reader(i: int) -> None:
        try:
            start.wait()
            with gdskit.open(path) as f:
                for round_ in range(10):
                    offsets = _offsets(N, 4098, 100 * i + round_)
                    buf = np.zeros(N * 4098, np.uint8)
                    counts = f.read_batch(buf, offsets, 4098)
                    _check_bytes(buf, data, offsets, [k * 4098 for k in range(N)], 4098, counts)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    # Settings are the process's: set once here, not in each thread (four threads setting and
    # restoring them at once would leave one thread's "before" behind).
    with gdskit.settings.set(mode="host"):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    used = uring.activity() - before
    assert used.rings >= 4 and used.batches == 40


@needs_uring
def test_no_descriptor_leaks_after_many_batches_threads_and_closing(data_file):
    path, data = data_file
    offsets = _offsets(N, 4098, 41)
    _batch(path, offsets, 4098, "auto")  # this thread's ring exists from here on
    gc.collect()
    before = fd_count()
    for _ in range(200):
        _batch(path, offsets, 4098, "auto")
    threads = [threading.Thread(target=_batch, args=(path, offsets, 4098, "auto")) for _ in range(5)]
    for t in threads:
        t.start()
        t.join()
    del threads
    gc.collect()  # a finished thread's ring goes with it
    assert fd_count() == before
    uring.close_all()
    assert fd_count() == before - 1
    counts, buf, _ = _batch(path, offsets, 4098, "auto")  # a new ring after closing
    _check_bytes(buf, data, offsets, [i * 4098 for i in range(N)], 4098, counts)
    assert fd_count() == before


@needs_uring
def test_a_forked_child_reads_on_its_own_ring(data_file):
    path, data = data_file
    offsets = _offsets(N, 4098, 51)
    _batch(path, offsets, 4098, "auto")
    parent_ring = uring.ring_for_thread()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, and leave without running the parent's exit
        ok = False
        try:
            os.close(read_end)
            before = uring.activity()
            counts, buf, _ = _batch(path, offsets, 4098, "auto")
            used = uring.activity() - before
            ring = uring.ring_for_thread()
            ok = (counts == [4098] * N and used.rings == 1 and used.batches == 1 and ring is not parent_ring
                  and all(bytes(buf[i * 4098:(i + 1) * 4098]) == data[o:o + 4098] for i, o in enumerate(offsets)))
        finally:
            os.write(write_end, b"ok" if ok else b"bad")
            os._exit(0)
    os.close(write_end)
    try:
        answer = os.read(read_end, 16)
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    assert answer == b"ok"
    assert uring.ring_for_thread() is parent_ring  # the parent's ring is untouched and still its own
    counts, buf, _ = _batch(path, offsets, 4098, "auto")
    _check_bytes(buf, data, offsets, [i * 4098 for i in range(N)], 4098, counts)


@needs_uring
def test_the_ordered_exit_closes_every_ring(data_file, tmp_path):
    path, _ = data_file
    code = f"""
        import atexit, os, threading
        def rings():
            return sum(os.readlink(f"/proc/self/fd/{{fd}}") == "anon_inode:[io_uring]" for fd in os.listdir("/proc/self/fd")
                       if os.path.exists(f"/proc/self/fd/{{fd}}"))
        atexit.register(lambda: print("after-exit", rings(), flush=True))  # runs after gdskit's exit
        import numpy as np, gdskit
        buf = np.zeros({N} * 4098, np.uint8)
        f = gdskit.open({path!r})
        f.read_batch(buf, [i * 4098 for i in range({N})], 4098)
        t = threading.Thread(target=f.read_batch, args=(np.zeros({N} * 4098, np.uint8), [0] * {N}, 4098))
        t.start(); t.join()
        keep = t  # the thread's ring is still referenced by nobody; the main thread's is alive
        print("before-exit", rings(), flush=True)
    """
    env = dict(os.environ, PYTHONPATH=str(SRC))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split() for line in out.stdout.splitlines())
    assert int(lines["before-exit"]) >= 1 and int(lines["after-exit"]) == 0


# -- the setting and the check ----------------------------------------------------------------------
def test_the_setting_takes_auto_or_never(tmp_path):
    assert gdskit.settings.io_uring == "auto"
    with pytest.raises(ConfigError):
        gdskit.settings.set(io_uring="sometimes")
    with gdskit.settings.set(io_uring="NEVER"):
        assert gdskit.settings.io_uring == "never"
    code = "import gdskit\ntry:\n    gdskit.settings.snapshot()\nexcept Exception as e:\n    print(type(e).__name__)"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(SRC),
                                                                 GDSKIT_IO_URING="maybe"),
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.stdout.strip() == EnvironmentVariableError.__name__


def test_check_says_in_one_line_whether_io_uring_is_usable():
    from check_helpers import fixture_root
    from gdskit.probe.check import _io_uring
    from gdskit.machine.root import SystemRoot

    live = _io_uring(SystemRoot("/")).to_dict()
    assert live["status"] == ("usable" if uring.availability().usable else "unavailable") and live["detail"]
    assert _io_uring(SystemRoot(fixture_root("no-gpu"))).to_dict()["status"] == "not-probed"
    json.dumps(live)


def _uncached_after(path: str, offsets: list[int], size: int) -> bool:
    with gdskit.open(path) as f:
        return not any(f.cached(off, size) for off in offsets)


@needs_uring
@pytest.mark.parametrize("aligned", [True, False])
def test_a_cold_batch_under_auto_goes_through_the_ring(data_file, aligned):
    """A batch that the page cache holds none of was read one read after another (each O_DIRECT,
    through a stage where unaligned); it is now one submission: O_DIRECT where every read is
    aligned (the cache stays as it was), buffered where not (the kernel reads only the pages asked
    for, and they stay cached for the next epoch)."""
    from backend_conformance import drop_cache

    path, data = data_file
    size = 4096 if aligned else 4098
    offsets = sorted(set(_offsets(N, size, 21, 4096 if aligned else 1)))
    drop_cache(path)
    if not _uncached_after(path, offsets, size):
        pytest.skip("the page cache cannot be emptied for this file here")
    before = uring.activity()
    counts, buf, delta = _batch(path, offsets, size, "auto", "auto", aligned)
    used = uring.activity() - before
    _check_bytes(buf, data, offsets, [i * size for i in range(len(offsets))], size, counts)
    assert used.batches == 1 and used.reads == len(offsets)
    assert _host_row(delta) == (len(offsets) * size, len(offsets), len(offsets))
    assert _uncached_after(path, offsets, size) is aligned


@needs_uring
def test_a_cold_unaligned_batch_under_always_stays_o_direct_read_by_read(data_file):
    from backend_conformance import drop_cache

    path, data = data_file
    offsets = sorted(set(_offsets(N, 4098, 22)))
    drop_cache(path)
    if not _uncached_after(path, offsets, 4098):
        pytest.skip("the page cache cannot be emptied for this file here")
    before = uring.activity()
    counts, buf, _ = _batch(path, offsets, 4098, "auto", "always")
    assert (uring.activity() - before).batches == 0
    _check_bytes(buf, data, offsets, [i * 4098 for i in range(len(offsets))], 4098, counts)
    assert _uncached_after(path, offsets, 4098)


# -- many files, each read once (read_each) -------------------------------------------------------------
@needs_uring
@hsettings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 9000), min_size=1, max_size=300), seed=st.integers(0, 99))
def test_read_each_reads_each_descriptors_own_range_as_pread_does(data_file, sizes, seed):
    path, data = data_file
    rng = np.random.default_rng(seed)
    fds = [os.open(path, os.O_RDONLY) for _ in range(3)]
    try:
        which = rng.integers(0, 3, len(sizes)).tolist()
        offsets = [int(rng.integers(0, SIZE + 100)) for _ in sizes]  # some at and past the end
        places = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
        buf = bytearray(sum(sizes))
        ring = uring.ring_for_thread()
        got = ring.read_each([fds[w] for w in which], memoryview(buf), offsets, places, sizes)
        for off, bo, n, k in zip(offsets, places, sizes, got):
            want = data[off:off + n]
            assert k == len(want) and bytes(buf[bo:bo + k]) == want
    finally:
        for fd in fds:
            os.close(fd)


@needs_uring
def test_read_each_reports_each_reads_own_error_and_checks_its_arguments(data_file):
    path, data = data_file
    fd = os.open(path, os.O_RDONLY)
    wfd = os.open(os.devnull, os.O_WRONLY)
    try:
        ring = uring.ring_for_thread()
        buf = bytearray(300)
        got = ring.read_each([fd, wfd, fd], memoryview(buf), [0, 0, 10], [0, 100, 200], [100, 100, 100])
        assert got == [100, -errno.EBADF, 100] and bytes(buf[200:300]) == data[10:110]
        for bad in ([100, 100, 101], [0, 100, 0]):
            with pytest.raises(ValueError):
                ring.read_each([fd] * 3, memoryview(buf), [0] * 3, [0, 100, 200], bad)
        with pytest.raises(ValueError):
            ring.read_each([fd, fd], memoryview(buf), [0], [0, 1], [1, 1])
        assert ring.read_each([], memoryview(buf), [], [], []) == []
        # A batch of one size on one descriptor after one of many: the SQEs are filled afresh.
        counts = ring.read(fd, memoryview(buf), [5, 7, 9], [0, 100, 200], 50)
        assert counts == [50] * 3 and bytes(buf[100:150]) == data[7:57]
    finally:
        os.close(fd)
        os.close(wfd)
