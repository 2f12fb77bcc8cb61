#!/usr/bin/env python3
"""Many small reads into host memory: ``File.read_batch`` through io_uring, through the preadv
loop, and a bare ``os.preadv`` loop, side by side. CPU only (no GPU needed).

Parts, on one file (made with random bytes if it does not exist):

* ``hot``: batches of 64 random 4,098-byte reads (a token window of 2,049 int16 tokens) of a
  file the page cache holds. Three ways in interleaved rounds: ``uring``
  (``settings.io_uring="auto"``), ``preadv`` (``"never"``: the tight preadv loop) and ``raw``
  (a bare ``os.preadv`` loop with no gdskit at all). Per read µs and batches/s, the median
  round.
* ``threads``: the same batches from 1, 2 and 4 threads at once (each with its own buffer):
  batches/s of all of them together.
* ``sweep``: µs per batch against the number of reads in it (1 to 64), io_uring on and off:
  where ``URING_MIN_READS`` comes from.
* ``cold``: O_DIRECT-aligned 4 KiB reads (``odirect="always"``) of a file dropped from the page
  cache before each round (``posix_fadvise(DONTNEED)``): io_uring submits the whole batch at
  queue depth 64, the loop one read at a time.

    python benchmarks/read_batch.py --out results/        # prints a table, writes results/read_batch.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

import gdskit
from gdskit.engine.backends import uring
from page_cache import drop_caches, warm  # benchmarks/ is on sys.path when run as a script

MiB = 1 << 20
WINDOW = 4098


def _make_file(path: str, size: int) -> None:
    """A new file of ``size`` random bytes at ``path``; an existing one is only read (it must
    hold ``size`` bytes)."""
    if os.path.exists(path):
        if os.path.getsize(path) < size:
            raise SystemExit(f"{path} holds {os.path.getsize(path)} bytes, fewer than --size {size}")
        return
    with open(path, "xb") as fh:
        for _ in range(size // (8 * MiB)):
            fh.write(os.urandom(8 * MiB))


def _batches(file_size: int, io: int, align: int, n: int, count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    slots = (file_size - io) // align
    return [(rng.integers(0, slots, n) * align).tolist() for _ in range(count)]


class _Reader:
    """One way of reading a batch: ``run(offsets)`` into its own buffer."""

    def __init__(self, mode: str, path: str, io: int, n: int, odirect: str) -> None:
        self.mode, self.io = mode, io
        self.buf = np.empty(n * io + 4096, dtype=np.uint8)
        start = (-self.buf.ctypes.data) % 4096  # page-aligned, as O_DIRECT wants
        self.view = self.buf[start:start + n * io]
        self.places = list(range(0, n * io, io))
        self.settings = {"io_uring": "never" if mode == "preadv" else "auto", "odirect": odirect}
        if mode == "raw":
            flags = os.O_RDONLY | (os.O_DIRECT if odirect == "always" else 0)
            self.fd = os.open(path, flags)
            self.mv = memoryview(self.view)
        else:
            self.f = gdskit.open(path, "r")

    def run(self, offsets: list[int]) -> None:
        if self.mode == "raw":
            preadv, mv, io, fd = os.preadv, self.mv, self.io, self.fd
            for off, bo in zip(offsets, self.places):
                preadv(fd, [mv[bo:bo + io]], off)
        else:
            self.f.read_batch(self.view, offsets, self.io, self.places)

    def close(self) -> None:
        if self.mode == "raw":
            os.close(self.fd)
        else:
            self.f.close()


def _timed(reader: _Reader, batches: list[list[int]]) -> float:
    with gdskit.settings.set(**reader.settings):
        t0 = time.perf_counter()
        for offsets in batches:
            reader.run(offsets)
        return time.perf_counter() - t0


def _rates(seconds: list[float], batches: int, n: int) -> dict[str, float]:
    med = statistics.median(seconds)
    return {"us_per_read": med / (batches * n) * 1e6, "batches_per_s": batches / med,
            "rounds": len(seconds), "min_us_per_read": min(seconds) / (batches * n) * 1e6}


MODES = ("uring", "preadv", "raw")


def hot(path: str, file_size: int, n: int, batches: int, rounds: int) -> dict[str, Any]:
    readers = {m: _Reader(m, path, WINDOW, n, "auto") for m in MODES}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for r in range(rounds):  # interleaved: drift on a shared machine hits all three alike
            work = _batches(file_size, WINDOW, WINDOW, n, batches, seed=r)
            for m in MODES:
                times[m].append(_timed(readers[m], work))
    finally:
        for reader in readers.values():
            reader.close()
    return {m: _rates(times[m], batches, n) for m in MODES}


def threads(path: str, file_size: int, n: int, batches: int, rounds: int, counts: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in counts:
        row: dict[str, Any] = {}
        for m in MODES:
            readers = [_Reader(m, path, WINDOW, n, "auto") for _ in range(k)]
            rates = []
            try:
                for r in range(rounds):
                    work = [_batches(file_size, WINDOW, WINDOW, n, batches, seed=1000 * r + i) for i in range(k)]
                    start = threading.Barrier(k + 1)
                    with gdskit.settings.set(**readers[0].settings):
                        def go(i: int) -> None:
                            start.wait()
                            for offsets in work[i]:
                                readers[i].run(offsets)
                        ts = [threading.Thread(target=go, args=(i,)) for i in range(k)]
                        for t in ts:
                            t.start()
                        start.wait()
                        t0 = time.perf_counter()
                        for t in ts:
                            t.join()
                        rates.append(k * batches / (time.perf_counter() - t0))
            finally:
                for reader in readers:
                    reader.close()
            med = statistics.median(rates)
            row[m] = {"batches_per_s": med, "us_per_read": 1e6 / (med * n)}
        out[str(k)] = row
    return out


def sweep(path: str, file_size: int, sizes: tuple[int, ...], reads: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in sizes:
        count = max(50, reads // n)
        readers = {m: _Reader(m, path, WINDOW, n, "auto") for m in ("uring", "preadv")}
        times: dict[str, list[float]] = {m: [] for m in readers}
        try:
            for r in range(rounds):
                work = _batches(file_size, WINDOW, WINDOW, n, count, seed=r)
                for m, reader in readers.items():
                    times[m].append(_timed(reader, work))
        finally:
            for reader in readers.values():
                reader.close()
        out[str(n)] = {m: statistics.median(t) / count * 1e6 for m, t in times.items()}
    return out


def cold(path: str, file_size: int, n: int, batches: int, rounds: int) -> dict[str, Any]:
    readers = {m: _Reader(m, path, 4096, n, "always") for m in MODES}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for r in range(rounds):
            work = _batches(file_size, 4096, 4096, n, batches, seed=7 + r)
            for m in MODES:
                drop_caches([path])
                times[m].append(_timed(readers[m], work))
    finally:
        for reader in readers.values():
            reader.close()
    return {m: _rates(times[m], batches, n) for m in MODES}


def _table(result: dict[str, Any]) -> str:
    lines = [f"read_batch into host memory, {result['machine']}; io_uring: {result['io_uring']}"]
    for part, label in (("hot", f"hot: {result['reads']} x {WINDOW} B random reads a batch"),
                        ("cold", f"cold O_DIRECT: {result['reads']} x 4096 B, page cache dropped each round")):
        if part in result:
            lines.append(label)
            for m, v in result[part].items():
                lines.append(f"  {m:7s} {v['us_per_read']:7.2f} us/read  {v['batches_per_s']:9.0f} batches/s")
    if "threads" in result:
        lines.append("threads at once (hot), batches/s of all together: " + "  ".join(MODES))
        for k, row in result["threads"].items():
            lines.append(f"  {k} thread(s)  " + "  ".join(f"{row[m]['batches_per_s']:8.0f}" for m in MODES))
    if "sweep" in result:
        lines.append("us per batch against reads per batch (hot):   uring   preadv")
        for n, row in result["sweep"].items():
            lines.append(f"  {n:>3s} reads                         {row['uring']:8.1f} {row['preadv']:8.1f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory the JSON goes to (read_batch.json)")
    ap.add_argument("--file", default="/tmp/gdskit_read_batch.bin", help="file to read (made if missing)")
    ap.add_argument("--size", default=256 * MiB, type=int, help="bytes in the file (default 256 MiB)")
    ap.add_argument("--reads", default=64, type=int, help="reads per batch")
    ap.add_argument("--batches", default=500, type=int, help="batches per round (hot)")
    ap.add_argument("--rounds", default=7, type=int)
    ap.add_argument("--cold-batches", default=50, type=int, help="batches per round (cold)")
    ap.add_argument("--skip", default="", help="parts to leave out, comma-separated: hot,threads,sweep,cold")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    os.makedirs(args.out, exist_ok=True)
    _make_file(args.file, args.size)
    warm([args.file])
    result: dict[str, Any] = {"machine": f"{platform.node()} {platform.release()} {os.cpu_count()} CPUs",
                              "io_uring": uring.availability().detail, "reads": args.reads, "file": args.file,
                              "file_bytes": args.size}
    if "hot" not in skip:
        result["hot"] = hot(args.file, args.size, args.reads, args.batches, args.rounds)
    if "threads" not in skip:
        result["threads"] = threads(args.file, args.size, args.reads, args.batches // 2, max(3, args.rounds // 2),
                                    (1, 2, 4))
    if "sweep" not in skip:
        result["sweep"] = sweep(args.file, args.size, (1, 2, 4, 8, 16, 32, 64), 8000, args.rounds)
    if "cold" not in skip:
        result["cold"] = cold(args.file, args.size, args.reads, args.cold_batches, max(3, args.rounds // 2))
        warm([args.file])
    print(_table(result))
    with open(os.path.join(args.out, "read_batch.json"), "w") as fh:
        json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
