"""``File.close()`` while other threads use the file.

close waits for the operations under way before it releases a descriptor; calls that start
after it raise ClosedFileError. Without that, a descriptor number freed by close and taken by
the next ``open`` sent another thread's write into an unrelated file, and a read returned that
file's bytes (or failed with a bare EBADF).
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable

import numpy as np
import pytest

import gdskit
from gdskit import errors
from leak_helpers import fd_count

A_BYTE, B_BYTE = 0xA5, 0x5A   # every byte of the file under test, every byte of the unrelated one
SIZE = 64 << 10
ROUNDS = 200
WORKERS = 4
ATOMIC_ROUNDS = 80


def _operations(f: gdskit.File, rng: random.Random) -> list[Callable[[], object]]:
    """One call of each kind, into or from host memory; reads check that they got ``A_BYTE``s."""
    n = rng.choice([1, 512, 4096, 20_000])
    off = rng.randrange(0, SIZE - n)
    out = np.zeros(n, np.uint8)
    out2 = bytearray(n)
    src = np.full(n, A_BYTE, np.uint8)

    def read() -> None:
        assert f.read(out, n, off) == n
        _expect_a(out)

    def pread() -> None:
        assert f.pread(out, n, off).result() == n
        _expect_a(out)

    def read_batch() -> None:
        k = max(1, n // 512)
        assert f.read_batch(out, [rng.randrange(0, SIZE - 512) for _ in range(k)], min(n, 512)) == [min(n, 512)] * k
        _expect_a(out[:k * min(n, 512)])

    def read_many() -> None:
        assert f.read_many([(out, n, off), (out2, n, SIZE - n)]) == [n, n]
        _expect_a(out)
        _expect_a(np.frombuffer(out2, np.uint8))

    def pread_many() -> None:
        assert f.pread_many([(out, n, off), (out2, n, 0)]).result() == [n, n]
        _expect_a(out)
        _expect_a(np.frombuffer(out2, np.uint8))

    return [
        read, pread, read_batch, read_many, pread_many,
        lambda: f.write(src, n, off),
        lambda: f.pwrite(src, n, off).result(),
        lambda: f.fsync(),
        lambda: _expect_equal(f.size, SIZE),
        lambda: f.cached(off, n),
        lambda: f.fileno(),
    ]


def _expect_a(arr: np.ndarray) -> None:
    if arr.size and not (arr == A_BYTE).all():
        raise AssertionError(f"read returned bytes of another file: {np.unique(arr)[:4]}")


def _expect_equal(a: object, b: object) -> None:
    if a != b:
        raise AssertionError(f"{a!r} != {b!r}")


def _device_operations(f: gdskit.File, rng: random.Random) -> list[Callable[[], object]]:
    """Reads into and writes from GPU memory (torch CUDA tensors)."""
    import torch

    n = rng.choice([1, 4096, 20_000])
    off = rng.randrange(0, SIZE - n)
    out = torch.zeros(n, dtype=torch.uint8, device="cuda")
    src = torch.full((n,), A_BYTE, dtype=torch.uint8, device="cuda")

    def check() -> None:
        _expect_a(out.cpu().numpy())

    def read() -> None:
        assert f.read(out, n, off) == n
        check()

    def pread() -> None:
        assert f.pread(out, n, off).result() == n
        check()

    def read_many() -> None:
        assert f.read_many([(out, n, off)]) == [n]
        check()

    return [read, pread, read_many, lambda: f.write(src, n, off), lambda: f.pwrite(src, n, off).result(),
            lambda: f.read_batch(out, [off], n)]


def _round(tmp_path, rng: random.Random, other: str,
           operations: Callable[[gdskit.File, random.Random], list[Callable[[], object]]] = _operations) -> list[str]:
    """One round: WORKERS threads use the file, one more closes it and opens ``other`` at once."""
    path = str(tmp_path / "a.bin")
    with open(path, "wb") as fh:
        fh.write(bytes([A_BYTE]) * SIZE)
    f = gdskit.open(path, "r+")
    problems: list[str] = []
    all_started = threading.Barrier(WORKERS + 1)

    def worker(seed: int) -> None:
        r = random.Random(seed)
        started = False
        closed_calls = 0
        for _ in range(10_000):
            op = r.choice(operations(f, r))
            try:
                op()
            except errors.ClosedFileError:
                closed_calls += 1
                if closed_calls == 12:  # a dozen calls after close: every one refused cleanly
                    break
            except BaseException as exc:  # noqa: BLE001 - anything else is the defect
                problems.append(f"{type(exc).__name__}: {exc}")
                break
            else:
                if closed_calls:
                    problems.append("a call after close succeeded")
            if not started:
                started = True
                all_started.wait()
        if not started:
            all_started.wait()

    threads = [threading.Thread(target=worker, args=(rng.random(),)) for _ in range(WORKERS)]
    for t in threads:
        t.start()
    all_started.wait()
    f.close()
    fd = os.open(other, os.O_RDWR)   # most likely the number the file under test had
    try:
        for t in threads:
            t.join()
    finally:
        os.close(fd)
    return problems


def test_close_while_threads_read_and_write_never_touches_a_reused_descriptor(tmp_path):
    other = str(tmp_path / "other.bin")
    with open(other, "wb") as fh:
        fh.write(bytes([B_BYTE]) * SIZE)
    rng = random.Random(1234)
    fds = fd_count()
    problems: list[str] = []
    for _ in range(ROUNDS):
        problems += _round(tmp_path, rng, other)
    with open(other, "rb") as fh:
        assert fh.read() == bytes([B_BYTE]) * SIZE, "a write landed in an unrelated file"
    assert not problems, problems[:5]
    assert fd_count() == fds


@pytest.mark.gpu
def test_gpu_close_while_threads_move_device_memory(tmp_path):
    pytest.importorskip("torch")
    other = str(tmp_path / "other.bin")
    with open(other, "wb") as fh:
        fh.write(bytes([B_BYTE]) * SIZE)
    rng = random.Random(4321)
    problems: list[str] = []
    for _ in range(60):
        problems += _round(tmp_path, rng, other, _device_operations)
    with open(other, "rb") as fh:
        assert fh.read() == bytes([B_BYTE]) * SIZE, "a write landed in an unrelated file"
    assert not problems, problems[:5]


def test_atomic_close_publishes_every_write_that_returned(tmp_path):
    """Writers race close on an atomic file: every write that returned is in the published
    file, every one that did not start raised ClosedFileError, and an unrelated file opened
    right after close is untouched."""
    slot = 256 << 10   # four chunks: a write is under way for a while
    other = str(tmp_path / "other.bin")
    with open(other, "wb") as fh:
        fh.write(bytes([B_BYTE]) * slot)
    rng = random.Random(99)
    with gdskit.settings.set(chunk_size=64 << 10):
        for r in range(ATOMIC_ROUNDS):
            path = str(tmp_path / f"pub{r}.bin")
            done, problems = _atomic_round(path, slot, rng, other)
            assert not problems, problems[:5]
            with open(path, "rb") as fh:
                published = fh.read()
            for k, ok in done.items():
                if ok:
                    assert published[k * slot:(k + 1) * slot] == bytes([k % 251 + 1]) * slot, \
                        f"write {k} returned but is not in the file"
    with open(other, "rb") as fh:
        assert fh.read() == bytes([B_BYTE]) * slot, "a write landed in an unrelated file"
    assert sorted(os.listdir(tmp_path)) == sorted([f"pub{i}.bin" for i in range(ATOMIC_ROUNDS)] + ["other.bin"]), \
        "a temporary file was left behind"


def _atomic_round(path: str, slot: int, rng: random.Random, other: str) -> tuple[dict[int, bool], list[str]]:
    f = gdskit.open(path, "w", atomic=True)
    done: dict[int, bool] = {}
    problems: list[str] = []
    all_started = threading.Barrier(WORKERS + 1)
    lock = threading.Lock()
    counter = iter(range(10**6))

    def writer(background: bool) -> None:
        started = False
        while True:
            with lock:
                k = next(counter)
            data = np.full(slot, k % 251 + 1, np.uint8)
            try:
                if background:
                    f.pwrite(data, slot, k * slot).result()
                else:
                    f.write(data, slot, k * slot)
                done[k] = True
            except errors.ClosedFileError:
                done[k] = False
                break
            except BaseException as exc:  # noqa: BLE001 - anything else is the defect
                problems.append(f"{type(exc).__name__}: {exc}")
                break
            if not started:
                started = True
                all_started.wait()
        if not started:
            all_started.wait()

    threads = [threading.Thread(target=writer, args=(i % 2 == 1,)) for i in range(WORKERS)]
    for t in threads:
        t.start()
    all_started.wait()
    if rng.random() < 0.5:
        f.close()
    else:
        with f:
            pass
    fd = os.open(other, os.O_RDWR)   # most likely the number the atomic file had
    try:
        for t in threads:
            t.join()
    finally:
        os.close(fd)
    return done, problems


# -- one thread: every call after close ------------------------------------------

def _every_call(f: gdskit.File) -> dict[str, Callable[[], object]]:
    buf = bytearray(16)
    return {
        "read": lambda: f.read(buf), "write": lambda: f.write(buf, file_offset=0),
        "pread": lambda: f.pread(buf), "pwrite": lambda: f.pwrite(buf, file_offset=0),
        "read_batch": lambda: f.read_batch(buf, [0], 4), "read_many": lambda: f.read_many([(buf, 4, 0)]),
        "pread_many": lambda: f.pread_many([(buf, 4, 0)]), "fsync": lambda: f.fsync(), "size": lambda: f.size,
        "cached": lambda: f.cached(), "fileno": lambda: f.fileno(),
    }


@pytest.mark.parametrize("call", list(_every_call(None)))  # type: ignore[arg-type]
@pytest.mark.parametrize("how", ["close", "abort", "with"])
def test_every_call_after_close_raises_closed_file_error(tmp_path, call, how):
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(64))
    f = gdskit.open(str(p), "r+")
    if how == "with":
        with f:
            pass
    else:
        getattr(f, how)()
    assert f.closed
    with pytest.raises(errors.ClosedFileError):
        _every_call(f)[call]()
    assert p.read_bytes() == bytes(64)


def test_close_waits_for_a_read_under_way(tmp_path):
    """A read whose progress callback is held: close() does not return (nor release the
    descriptor) until the read has finished, and the read gets the right bytes."""
    p = tmp_path / "f.bin"
    data = os.urandom(1 << 20)
    p.write_bytes(data)
    f = gdskit.open(str(p))
    in_read, release = threading.Event(), threading.Event()

    def held(_n: int) -> None:
        in_read.set()
        release.wait()

    out = bytearray(len(data))
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(f.read_many([(out, len(data), 0)], on_bytes=held)))
    reader.start()
    in_read.wait()
    closer = threading.Thread(target=f.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive(), "close() returned while a read was under way"
    with pytest.raises(errors.ClosedFileError):
        f.read(bytearray(4))  # closing: new calls are refused at once
    release.set()
    reader.join()
    closer.join()
    assert result == [[len(data)]] and bytes(out) == data


def test_close_from_inside_the_files_own_callback_is_refused(tmp_path):
    """close() from an on_bytes callback would wait for the read that calls it: it is refused
    (the read then fails with that error) and the file stays usable."""
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(1 << 16))
    with gdskit.open(str(p)) as f:
        with pytest.raises(errors.InvalidArgumentError):
            f.read_many([(bytearray(1 << 16), 1 << 16, 0)], on_bytes=lambda _n: f.close())
        assert not f.closed and f.read(bytearray(8)) == 8


def test_second_close_returns_once_the_file_is_closed(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(1 << 20))
    f = gdskit.open(str(p))
    in_read, release = threading.Event(), threading.Event()

    def held(_n: int) -> None:
        in_read.set()
        release.wait()

    fut = f.pread_many([(bytearray(1 << 20), 1 << 20, 0)], on_bytes=held)
    in_read.wait()
    closers = [threading.Thread(target=f.close) for _ in range(2)]
    for t in closers:
        t.start()
    for t in closers:
        t.join(0.2)
    assert all(t.is_alive() for t in closers), "a close() returned before the file was closed"
    release.set()
    for t in closers:
        t.join()
    assert fut.result() == [1 << 20]


def test_cancelled_background_request_does_not_block_close(tmp_path, monkeypatch):
    """A request cancelled before it ran leaves nothing for close() to wait for."""
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(4096))
    with gdskit.settings.set(threads=1), gdskit.open(str(p)) as f:
        gate = threading.Event()
        first = f.pread_many([(bytearray(4096), 4096, 0)], on_bytes=lambda _n: gate.wait())
        queued = f.pread(bytearray(4096))
        cancelled = queued.cancel()
        gate.set()
        assert first.result() == [4096]
        if not cancelled:
            assert queued.result() == 4096
    assert f.closed


def test_fileno_is_valid_until_close(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"hello")
    f = gdskit.open(str(p))
    assert os.pread(f.fileno(), 5, 0) == b"hello"
    f.close()
    with pytest.raises(errors.ClosedFileError):
        f.fileno()


def test_atomic_file_with_a_failed_write_is_not_published(tmp_path, monkeypatch):
    """A write that failed (its caller caught the error and went on) left a hole: close()
    removes the temporary file and raises that error instead of publishing it."""
    import errno

    from gdskit.engine.backends import base

    target = tmp_path / "ckpt.bin"
    target.write_bytes(b"previous checkpoint")
    real = os.pwrite
    fail = {"on": True}

    def failing(fd, data, offset):
        if fail["on"]:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, data, offset)

    monkeypatch.setattr(base.os, "pwrite", failing)
    with gdskit.settings.set(odirect="never"):
        f = gdskit.open(str(target), "w", atomic=True)
        with pytest.raises(errors.GdskitIOError):
            f.write(b"first part", file_offset=0)
        fail["on"] = False
        f.write(b"second part", file_offset=100)
        with pytest.raises(errors.GdskitIOError) as ei:
            f.close()
    assert ei.value.errno == errno.EIO
    assert target.read_bytes() == b"previous checkpoint"
    assert os.listdir(tmp_path) == ["ckpt.bin"]
