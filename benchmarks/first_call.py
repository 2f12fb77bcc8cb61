#!/usr/bin/env python3
"""Where a fresh process's first hot read of a large file into GPU memory spends its time.

Each case runs in its own fresh process (CUDA context created before the clock) and
prints one JSON line; the parent prints a table. Cases:

* ``h2d``: no file at all. One 8 MiB pinned buffer copied over and over into device
  memory on 4 streams: into fresh ``cudaMalloc`` memory, again into the same memory,
  then into another fresh allocation. Shows whether the GPU side pays on first touch.
* ``pinned``: ``cudaHostAlloc`` of the engine's default ring (``--threads`` stages of
  ``--chunk``), from one thread and from ``--threads`` threads at once.
* ``ceiling``: what this machine allows a hot read through host memory, without gdskit.
  ``--threads`` threads ``pread`` the cached file in ``--chunk`` pieces into their own
  pinned buffers (page cache to pinned memory), then 4 streams copy pinned buffers into
  device memory over and over (host to device), then both at once, independently. A
  bounce read needs both, so the rate of each while the other runs bounds it.
* ``engine``: gdskit reads the (cached) file into fresh device memory, again into the
  same memory, then into another fresh allocation; with and without ``gdskit.prepare()``
  before the clock, once for each way of making the pinned ring (``--allocs``,
  ``settings.pinned_alloc``), interleaved.

    python benchmarks/first_call.py --file /data/big.bin --size 8GiB --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from fresh_process import exit_status  # benchmarks/ is on sys.path when run as a script
from page_cache import warm

from gdskit.bench.memory import anon_huge_bytes, transparent_huge_pages
from gdskit.bench.runner import fill_file
from gdskit.settings import parse_size

GB = 1e9
MiB = 1 << 20


def case_h2d(size: int, chunk: int, threads: int) -> dict:
    from gdskit.engine import cuda

    src = cuda.PinnedBuffer(chunk)
    streams = [cuda.Stream(0) for _ in range(4)]

    def fill(dst: cuda.DeviceArray) -> float:
        t0 = time.perf_counter()
        for i, off in enumerate(range(0, size, chunk)):
            streams[i % 4].copy_h2d(dst.ptr + off, src.ptr, min(chunk, size - off))
        for s in streams:
            s.synchronize()
        return size / (time.perf_counter() - t0) / GB

    a = cuda.DeviceArray(size)
    out = {"fresh_GBps": fill(a), "same_again_GBps": fill(a)}
    b = cuda.DeviceArray(size)
    out["second_fresh_GBps"] = fill(b)
    return out


def case_pinned(size: int, chunk: int, threads: int) -> dict:
    from gdskit.engine import cuda

    def alloc_all(workers: int) -> float:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(workers) as ex:
            bufs = list(ex.map(lambda _: cuda.PinnedBuffer(chunk), range(threads)))
        dt = time.perf_counter() - t0
        for b in bufs:
            b.free()
        return dt * 1e3

    out = {"ring_MiB": threads * chunk // MiB, "one_thread_ms": alloc_all(1), "parallel_ms": alloc_all(threads),
           "again_one_thread_ms": alloc_all(1)}
    out.update(_registered_ring(threads * chunk, huge=False))
    out.update(_registered_ring(threads * chunk, huge=True))
    return out


def _registered_ring(nbytes: int, huge: bool) -> dict:
    """The same bytes as one anonymous mapping (transparent huge pages asked for or not), touched,
    then page-locked with cudaHostRegister: is first touch cheaper with 2 MiB pages?"""
    import ctypes
    import mmap

    from gdskit.engine import cuda

    drv = cuda._driver()
    cuda.set_device(0)
    tag = "thp" if huge else "4k"
    t0 = time.perf_counter()
    m = mmap.mmap(-1, nbytes + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    start = (base + (2 << 20) - 1) & ~((2 << 20) - 1)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE, start - base, nbytes)
    ctypes.memset(start, 0, nbytes)
    t1 = time.perf_counter()
    cuda.check(drv.cuMemHostRegister(start, nbytes, drv.CU_MEMHOSTREGISTER_PORTABLE), "cuMemHostRegister")
    t2 = time.perf_counter()
    anon_huge = anon_huge_bytes() or 0
    cuda.check(drv.cuMemHostUnregister(start), "cuMemHostUnregister")
    thp_mode = transparent_huge_pages() or "unknown"
    return {f"{tag}_touch_ms": (t1 - t0) * 1e3, f"{tag}_register_ms": (t2 - t1) * 1e3,
            f"{tag}_anon_huge_MiB": anon_huge // MiB, "thp_mode": thp_mode}


def case_ceiling(size: int, chunk: int, threads: int, path: str, seconds: float = 2.0) -> dict:
    import threading

    from gdskit.engine import cuda

    bufs = [cuda.RegisteredHostBuffer(chunk) for _ in range(threads)]
    srcs = [cuda.RegisteredHostBuffer(chunk) for _ in range(4)]
    dst = cuda.DeviceArray(size)
    dst.fill(0)
    streams = [cuda.Stream(0) for _ in range(4)]
    fd = os.open(path, os.O_RDONLY)
    moved: dict[str, list[int]] = {"read": [], "h2d": []}
    stop = threading.Event()

    def reader(t: int) -> None:
        view = bufs[t].view
        off, n = t * chunk, 0
        while not stop.is_set():
            n += os.preadv(fd, [view], off)
            off += threads * chunk
            if off + chunk > size:
                off = t * chunk
        moved["read"].append(n)

    def copier() -> None:
        n, i = 0, 0
        while not stop.is_set():
            for k in range(16):  # 16 copies of 8 MiB in flight, then wait
                off = ((i + k) * chunk) % (size - chunk)
                streams[k % 4].copy_h2d(dst.ptr + off, srcs[k % 4].ptr, chunk)
            for st in streams:
                st.synchronize()
            n += 16 * chunk
            i += 16
        moved["h2d"].append(n)

    def run(read: bool, h2d: bool) -> dict:
        moved.update(read=[], h2d=[])
        stop.clear()
        ts = ([threading.Thread(target=reader, args=(t,)) for t in range(threads)] if read else [])
        ts += [threading.Thread(target=copier)] if h2d else []
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in ts:
            t.join()
        dt = time.perf_counter() - t0
        return {k: round(sum(v) / dt / GB, 1) for k, v in moved.items() if v}

    out = {"read_alone_GBps": run(True, False)["read"], "h2d_alone_GBps": run(False, True)["h2d"]}
    both = run(True, True)
    out["read_with_h2d_GBps"], out["h2d_with_read_GBps"] = both["read"], both["h2d"]
    os.close(fd)
    for b in bufs + srcs:
        b.free()
    dst.free()
    return out


def case_engine(size: int, chunk: int, threads: int, path: str, prepare: bool) -> dict:
    import gdskit
    from gdskit.engine import cuda

    out: dict = {}
    if prepare:
        t0 = time.perf_counter()
        gdskit.prepare(0)
        out["prepare_ms"] = (time.perf_counter() - t0) * 1e3
    with gdskit.open(path) as f:
        for label in ("fresh", "same_again", "second_fresh"):
            if label != "same_again":
                dst = cuda.DeviceArray(size)
            t0 = time.perf_counter()
            n = f.read(dst, size)
            dt = time.perf_counter() - t0
            assert n == size, (n, size)
            out[f"{label}_GBps"] = size / dt / GB
    out["paths"] = {k: v.bytes for k, v in gdskit.stats().paths.items()}
    from gdskit.engine import pool

    out["lane_setup_ms"] = sorted(round(x * 1e3, 1) for x in pool.setup_seconds)
    return out


def child(args: argparse.Namespace) -> None:
    from gdskit.engine import cuda

    cuda.set_device(0)
    cuda.DeviceArray(1).free()  # context outside the clock
    if args.case == "h2d":
        r = case_h2d(args.size, args.chunk, args.threads)
    elif args.case == "ceiling":
        r = case_ceiling(args.size, args.chunk, args.threads, args.file)
    elif args.case == "pinned":
        r = case_pinned(args.size, args.chunk, args.threads)
    else:
        r = case_engine(args.size, args.chunk, args.threads, args.file, args.case == "engine-prepared")
    print("RESULT " + json.dumps({"case": args.case, **r}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", default="/tmp/gdskit-first-call.bin")
    ap.add_argument("--size", type=parse_size, default=8 << 30)
    ap.add_argument("--chunk", type=parse_size, default=8 << 20)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--allocs", default="register,hostalloc",
                    help="pinned ring allocators to compare (settings.pinned_alloc values)")
    ap.add_argument("--cases", default="h2d,pinned,engine,engine-prepared")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        child(args)
        return
    if not os.path.exists(args.file) or os.path.getsize(args.file) < args.size:
        fill_file(args.file, args.size, 0)
    results = []
    runs = [(case, alloc) for case in args.cases.split(",")
            for alloc in (args.allocs.split(",") if case.startswith("engine") else [None])]
    for _ in range(args.repeats):
        for case, alloc in runs:
            if case.startswith("engine") or case == "ceiling":
                warm([args.file])  # only these cases read the file
            env = {**os.environ, "GDSKIT_THREADS": str(args.threads), "GDSKIT_CHUNK_SIZE": str(args.chunk)}
            if alloc:
                env["GDSKIT_PINNED_ALLOC"] = alloc
            proc = subprocess.run([sys.executable, __file__, "--case", case, "--file", args.file,
                                   "--size", str(args.size), "--chunk", str(args.chunk),
                                   "--threads", str(args.threads)], capture_output=True, text=True, env=env)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            r = json.loads(lines[-1][7:]) if lines else {"case": case, "error": proc.stderr[-2000:]}
            if alloc:
                r["pinned_alloc"] = alloc
            if proc.returncode:
                r["exit_status"] = proc.returncode  # e.g. -11: a crash after the result was printed
            print(json.dumps(r), flush=True)
            results.append(r)
    print("\n| case | pinned ring | first GB/s | same buffer again | another fresh buffer |")
    print("|---|---|---:|---:|---:|")
    for r in results:
        if "fresh_GBps" in r:
            print(f"| {r['case']} | {r.get('pinned_alloc', '')} | {r['fresh_GBps']:.1f} | "
                  f"{r['same_again_GBps']:.1f} | {r['second_fresh_GBps']:.1f} |")
    ceilings = [r for r in results if "read_alone_GBps" in r]
    if ceilings:
        print("\n| ceiling | page cache -> pinned, alone | host -> device, alone | page cache -> pinned, "
              "during copies | host -> device, during reads |")
        print("|---|---:|---:|---:|---:|")
        for r in ceilings:
            print(f"| {args.threads} threads x {args.chunk >> 20} MiB | {r['read_alone_GBps']} | "
                  f"{r['h2d_alone_GBps']} | {r['read_with_h2d_GBps']} | {r['h2d_with_read_GBps']} |")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=2)
    raise SystemExit(exit_status(results))


if __name__ == "__main__":
    main()
