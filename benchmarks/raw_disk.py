"""The disk's own rate, the reference the benchmarks hold gdskit to: O_DIRECT I/O from plain
threads between files and aligned host memory, with no GPU and no gdskit in between.

The buffers are private anonymous mappings with huge-page advice. Where a destination's pages
lie in physical memory can change how the kernel splits an O_DIRECT request into device requests
(on the H200 machine's virtio disk, 1 MiB reads ran at 1.0 GiB/s into heap memory and at
1.4-1.7 into fresh mappings), so the reference gets the layout gdskit's own stages have, not a
worse one. Python's default anonymous mapping is shared memory, which takes no huge pages.

Run as a script, it sweeps cold reads of a file over block sizes, thread counts and orders:

    python benchmarks/raw_disk.py /data/big.bin --blocks 8MiB,16MiB,64MiB --threads 16,32 --rounds 2
"""

from __future__ import annotations

import os
import resource
import threading
import time
from typing import NamedTuple

from gdskit.bench.memory import HostBuffer


ALIGN = 4096


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Moved(NamedTuple):
    """What :func:`odirect_io` did: bytes, wall seconds and CPU seconds of the same window."""

    bytes: int
    seconds: float
    cpu_s: float


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _allow_open_files(n: int) -> None:
    """Raise this (benchmark) process's soft limit on open files to ``n`` where the hard limit
    allows (100,000 small files are more than the usual soft limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        if hard != resource.RLIM_INFINITY and hard < n:
            raise OSError(f"the raw O_DIRECT reference opens its {n - 64} files at once; the hard limit "
                          f"on open files is {hard} (ulimit -Hn)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


def odirect_io(paths: list[str], threads: int, block: int, *, write: bool = False,
               size: int | None = None, ranges: bool = False) -> Moved:
    """Move every byte of ``paths`` (or the first ``size`` bytes of each) in ``block``-byte O_DIRECT
    reads, or writes of ``size`` bytes ending with fsync, on ``threads`` threads.

    The buffers (``gdskit bench --huge-pages``'s: 2 MiB-aligned, on huge pages where the
    system allows, touched) are made before the clock starts. A read's tail past the last whole 4 KiB block is asked for
    as a whole block (O_DIRECT lengths must be aligned) and the file's end shortens it; writes
    need a ``size`` that is a multiple of 4 KiB.

    Reads open each file inside the clock, as any program reading files must (for 100,000 small
    files the opens are part of the work): the first thread to reach a file's first block opens
    it, and the thread that reads its last block closes it. Writes open their files before the
    clock starts.

    Blocks are handed out in file order to whichever thread is free (``ranges=False``, as
    gdskit's workers take chunks), or each thread moves its own contiguous run of blocks
    (``ranges=True``): on a disk that rewards sequential streams, the two can differ.
    """
    if write and (size is None or size % ALIGN):
        raise ValueError(f"O_DIRECT writes need a size that is a multiple of {ALIGN} bytes, not {size}")
    direct = getattr(os, "O_DIRECT", 0)
    files = _OpenedFiles(paths, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct if write else os.O_RDONLY | direct)
    try:
        if write:
            files.open_all()
        jobs = []
        for i, p in enumerate(paths):
            n = size if size is not None else os.path.getsize(p)
            blocks = [(i, off, min(block, _round_up(n - off))) for off in range(0, n, block)]
            files.left[i] = len(blocks)
            jobs += blocks
        bufs = [HostBuffer(block, huge_pages=True) for _ in range(threads)]
        per = -(-len(jobs) // threads)  # each thread's run of blocks, with ranges=True
        queues = [iter(jobs[i * per:(i + 1) * per]) for i in range(threads)] if ranges else None
        nxt = iter(jobs)
        lock = threading.Lock()
        moved = [0] * threads

        errors: list[BaseException] = []

        def worker(i: int) -> None:
            mv = memoryview(bufs[i].array)
            try:
                while not errors:
                    if queues is not None:
                        job = next(queues[i], None)
                    else:
                        with lock:
                            job = next(nxt, None)
                    if job is None:
                        return
                    k, off, n = job
                    fd = files.fd(k)
                    moved[i] += os.pwrite(fd, mv[:n], off) if write else os.preadv(fd, [mv[:n]], off)
                    if not write:
                        files.block_done(k)
            except BaseException as exc:  # noqa: BLE001 - raised below, after every thread stopped
                errors.append(exc)

        c0, t0 = _cpu_s(), time.perf_counter()
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errors:
            raise errors[0]
        if write:
            for fd in files.opened():
                os.fsync(fd)
        return Moved(sum(moved), time.perf_counter() - t0, _cpu_s() - c0)
    finally:
        files.close_all()


class _OpenedFiles:
    """The reference's descriptors: opened once each (by the first thread that needs one, the
    others for the same file waiting for it) and closed after the file's last block."""

    def __init__(self, paths: list[str], flags: int) -> None:
        self._paths, self._flags = paths, flags
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}
        self._opening: dict[int, threading.Event] = {}
        self.left = [0] * len(paths)

    def open_all(self) -> None:
        _allow_open_files(len(self._paths) + 64)
        for k in range(len(self._paths)):
            self.fd(k)

    def fd(self, k: int) -> int:
        with self._lock:
            if k in self._fds:
                return self._fds[k]
            ready = self._opening.get(k)
            mine = ready is None
            if mine:
                ready = self._opening[k] = threading.Event()
        if not mine:
            ready.wait()
            with self._lock:
                if k not in self._fds:
                    raise OSError(f"{self._paths[k]}: another thread failed to open it")
                return self._fds[k]
        try:
            fd = os.open(self._paths[k], self._flags, 0o644)
            with self._lock:
                self._fds[k] = fd
        finally:
            ready.set()
        return fd

    def block_done(self, k: int) -> None:
        with self._lock:
            self.left[k] -= 1
            fd = self._fds.pop(k) if self.left[k] == 0 else None
        if fd is not None:
            os.close(fd)

    def opened(self) -> list[int]:
        with self._lock:
            return list(self._fds.values())

    def close_all(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)


def main() -> None:
    """Cold O_DIRECT reads of the given files for each block size, thread count and order,
    the page cache dropped before every run; one line per run."""
    import argparse
    import itertools

    from gdskit.settings import parse_size
    from page_cache import drop_caches  # benchmarks/ is on sys.path when run as a script

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--blocks", default="16MiB", help="comma-separated read sizes (default 16MiB)")
    ap.add_argument("--threads", default="16", help="comma-separated thread counts (default 16)")
    ap.add_argument("--orders", default="file,ranges",
                    help="'file' (blocks handed out in file order), 'ranges' (each thread its own run), or both")
    ap.add_argument("--rounds", type=int, default=1, help="run the whole sweep this many times")
    args = ap.parse_args()
    try:
        blocks = [parse_size(b) for b in args.blocks.split(",")]
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError as exc:  # gdskit's ConfigError is a ValueError too
        ap.error(str(exc))
    if min(threads) < 1 or min(blocks) < ALIGN or any(b % ALIGN for b in blocks):
        ap.error(f"threads must be >= 1 and blocks multiples of {ALIGN} bytes")
    orders = args.orders.split(",")
    if not set(orders) <= {"file", "ranges"}:
        ap.error(f"--orders takes 'file' and 'ranges', got {args.orders!r}")
    for rnd, block, n, order in itertools.product(range(1, args.rounds + 1), blocks, threads, orders):
        how = drop_caches(args.files)
        m = odirect_io(args.files, n, block, ranges=order == "ranges")
        print(f"round {rnd}  block {block / 2**20:>4g} MiB  threads {n:>3}  order {order:<6}  "
              f"{m.bytes / m.seconds / 1e9:6.2f} GB/s  {m.cpu_s / (m.bytes / 1e9):.3f} CPU-s/GB  ({how})", flush=True)


if __name__ == "__main__":
    main()
