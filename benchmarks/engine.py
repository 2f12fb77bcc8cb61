"""Engine benchmark: read a large file into one GPU buffer, hot and cold, against KvikIO and a raw O_DIRECT reader.

Every case runs in its own fresh Python process (a user loading a model once sees the
first call), one after another in one run, so ratios are taken side by side.

    python3 benchmarks/engine.py --size 8GiB --dir /root/bench --json results.json

Cases (each reported as GB/s and CPU-seconds per GB):
  gdskit read, first call and repeated calls, page cache hot and cold
  KvikIO read (threads and task size as given), first and repeated, hot and cold
  raw O_DIRECT read into host memory (the disk's ceiling), cold
  gdskit write from the GPU buffer + fsync, against a raw O_DIRECT write of the same size
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
sys.path.insert(0, SRC)

from fresh_process import exit_status  # benchmarks/ is on sys.path when run as a script
from page_cache import drop_caches, warm
from raw_disk import odirect_io

GB = 1e9
# KvikIO's own POSIX path is its fastest where cuFile can only run in compat mode.
KVIKIO_ENV = {"KVIKIO_COMPAT_MODE": "ON"}


def parse_size(text: str) -> int:
    from gdskit.settings import parse_size as ps

    return ps(text)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def make_file(path: str, size: int) -> None:
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    import numpy as np

    block = np.random.default_rng(7).integers(0, 256, 64 << 20, dtype=np.uint8)
    with open(path + ".tmp", "wb") as fh:
        written = 0
        while written < size:
            n = min(len(block), size - written)
            block[:8] = np.frombuffer(written.to_bytes(8, "little"), dtype=np.uint8)
            fh.write(block[:n].tobytes())
            written += n
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------- children
def _DeviceArray(nbytes: int):  # noqa: N802 - reads as the class it returns
    from gdskit.engine.cuda import DeviceArray

    return DeviceArray(nbytes)


def child_gdskit_read(path: str, size: int, repeats: int) -> dict:
    import gdskit

    dev = _DeviceArray(size)
    out = {"times": [], "cpu": []}
    with gdskit.open(path) as f:
        for _ in range(repeats):
            c0, t0 = cpu_seconds(), time.perf_counter()
            n = f.read(dev, size)
            out["times"].append(time.perf_counter() - t0)
            out["cpu"].append(cpu_seconds() - c0)
            assert n == size, n
    out["ledger"] = gdskit.stats().to_dict()["paths"]
    out["pinned_bytes"] = gdskit.resources().pinned_bytes
    return out


def child_kvikio_read(path: str, size: int, repeats: int, threads: int, task_size: int) -> dict:
    import cupy
    import kvikio
    import kvikio.defaults

    kvikio.defaults.set({"num_threads": threads, "task_size": task_size})
    buf = cupy.empty(size, dtype=cupy.uint8)
    out = {"times": [], "cpu": [], "compat_mode": str(kvikio.defaults.get("compat_mode"))}
    with kvikio.CuFile(path, "r") as f:
        for _ in range(repeats):
            c0, t0 = cpu_seconds(), time.perf_counter()
            n = f.read(buf)
            cupy.cuda.runtime.deviceSynchronize()
            out["times"].append(time.perf_counter() - t0)
            out["cpu"].append(cpu_seconds() - c0)
            assert n == size, n
    return out


def _raw_odirect(path: str, size: int, threads: int, chunk: int, write: bool) -> dict:
    """``threads`` threads moving ``chunk``-byte O_DIRECT I/Os between the file and aligned host memory:
    the disk's own rate, with no GPU and no gdskit in between. Writes end with fsync."""
    moved, dt, cpu = odirect_io([path], threads, chunk, write=write, size=size)
    assert moved == size, (moved, size)
    return {"times": [dt], "cpu": [cpu]}


def child_raw_odirect_read(path: str, size: int, threads: int, chunk: int) -> dict:
    return _raw_odirect(path, size, threads, chunk, write=False)


def child_gdskit_write(path: str, size: int) -> dict:
    import gdskit

    dev = _DeviceArray(size)
    c0, t0 = cpu_seconds(), time.perf_counter()
    with gdskit.open(path, "w") as f:
        f.write(dev, size)
        f.fsync()
    dt = time.perf_counter() - t0
    return {"times": [dt], "cpu": [cpu_seconds() - c0], "ledger": gdskit.stats().to_dict()["paths"]}


def child_raw_odirect_write(path: str, size: int, threads: int, chunk: int) -> dict:
    return _raw_odirect(path, size, threads, chunk, write=True)


def child_pinned_alloc() -> dict:
    """How long pinned allocations take, serial vs in parallel (informs the ring design)."""
    from gdskit.engine import cuda

    cuda.set_device(0)  # initialise CUDA before the clock
    out = {}
    t0 = time.perf_counter()
    b = cuda.PinnedBuffer(256 << 20)
    out["serial_256MiB_s"] = time.perf_counter() - t0
    b.free()
    res: list = []

    def one() -> None:
        res.append(cuda.PinnedBuffer(16 << 20))

    t0 = time.perf_counter()
    ts = [threading.Thread(target=one) for _ in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out["parallel_16x16MiB_s"] = time.perf_counter() - t0
    for b in res:
        b.free()
    return out


def child_pinned_variants() -> dict:
    """Pinned staging set-up cost: cudaHostAlloc vs registering (huge-page backed) mmap memory."""
    import ctypes

    from gdskit.engine import cuda

    drv = cuda._driver()
    cuda.set_device(0)
    out = {}
    for mib in (64, 256):
        n = mib << 20
        t0 = time.perf_counter()
        b = cuda.PinnedBuffer(n)
        out[f"hostalloc_{mib}MiB_ms"] = (time.perf_counter() - t0) * 1e3
        b.free()
        for label, advice in (("register_thp", getattr(mmap, "MADV_HUGEPAGE", None)), ("register_plain", None)):
            t0 = time.perf_counter()
            m = mmap.mmap(-1, n + (2 << 20))
            addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
            start = (addr + (2 << 20) - 1) & ~((2 << 20) - 1)
            if advice is not None:
                m.madvise(advice, start - addr, n)
            ctypes.memset(start, 0, n)
            t1 = time.perf_counter()
            cuda.check(drv.cuMemHostRegister(start, n, drv.CU_MEMHOSTREGISTER_PORTABLE), "cuMemHostRegister")
            t2 = time.perf_counter()
            drv.cuMemHostUnregister(start)
            out[f"{label}_{mib}MiB_touch_ms"] = (t1 - t0) * 1e3
            out[f"{label}_{mib}MiB_register_ms"] = (t2 - t1) * 1e3
    try:
        out["thp"] = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError:
        pass
    return out


def child_tune(path: str, size: int) -> dict:
    """Repeated-call hot throughput of the bounce path for several thread counts and chunk sizes."""
    import gdskit

    dev = _DeviceArray(size)
    out = {}
    with gdskit.open(path) as f:
        for threads in (8, 16, 24):
            for chunk_mib in (1, 2, 4, 8, 16):
                with gdskit.settings.set(threads=threads, chunk_size=chunk_mib << 20):
                    f.read(dev, size)
                    times = []
                    for _ in range(3):
                        t0 = time.perf_counter()
                        f.read(dev, size)
                        times.append(time.perf_counter() - t0)
                gdskit.release_resources()
                out[f"t{threads}_c{chunk_mib}M_GBps"] = round(size / statistics.median(times) / GB, 2)
    return out


def child_first_call(path: str, size: int, threads: int, chunk_mib: int, stages: int, prepare: int = 0,
                     touch: int = 0) -> dict:
    """First-call hot throughput in a fresh process for one ring shape, with lane set-up times.

    ``prepare``: call gdskit.prepare() first; ``touch``: write the destination once first
    (to tell gdskit's set-up cost from the first touch of fresh device memory).
    """
    import gdskit
    from gdskit.engine import pool

    pool.Lane.stages_per_device_lane = stages
    dev = _DeviceArray(size)
    if touch:
        dev.fill(0)
    with gdskit.settings.set(threads=threads, chunk_size=chunk_mib << 20), gdskit.open(path) as f:
        if prepare:
            gdskit.prepare()
        t0 = time.perf_counter()
        f.read(dev, size)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        f.read(dev, size)
        second = time.perf_counter() - t0
    return {"first_GBps": round(size / first / GB, 2), "second_GBps": round(size / second / GB, 2),
            "lane_setup_ms": [round(x * 1e3, 1) for x in pool.setup_seconds],
            "pinned_MiB": gdskit.resources().pinned_bytes >> 20}


def child_timeline(path: str, size: int) -> dict:
    """Where the first call's time goes: per-chunk timings of the first and second call."""
    import gdskit
    from gdskit.engine import direct_path
    from gdskit.engine.backends import bounce

    t0 = time.perf_counter()
    direct_path.direct_route()
    route_ms = (time.perf_counter() - t0) * 1e3
    dev = _DeviceArray(size)
    log: list = []
    real = bounce.read_to_stage

    def traced(*args, **kw):
        a = time.perf_counter()
        res = real(*args, **kw)
        log.append((threading.get_ident(), a, time.perf_counter()))
        return res

    bounce.read_to_stage = traced
    out = {"direct_route_ms": round(route_ms, 1)}
    with gdskit.open(path) as f:
        for label in ("first", "second"):
            log.clear()
            t0 = time.perf_counter()
            f.read(dev, size)
            t1 = time.perf_counter()
            durs = sorted(e - s for _, s, e in log)
            busy = sum(durs)
            out[label] = {"total_ms": round((t1 - t0) * 1e3, 1),
                          "first_chunk_start_ms": round((min(s for _, s, _ in log) - t0) * 1e3, 1),
                          "last_chunk_end_ms": round((max(e for _, _, e in log) - t0) * 1e3, 1),
                          "threads": len({t for t, _, _ in log}),
                          "chunk_ms_p50": round(durs[len(durs) // 2] * 1e3, 2),
                          "chunk_ms_p99": round(durs[int(len(durs) * 0.99)] * 1e3, 2),
                          "read_busy_fraction": round(busy / ((t1 - t0) * len({t for t, _, _ in log})), 2)}
    return out


CHILDREN = {
    "timeline": child_timeline,
    "first-call": child_first_call,
    "pinned-variants": child_pinned_variants,
    "tune": child_tune,
    "gdskit-read": child_gdskit_read,
    "kvikio-read": child_kvikio_read,
    "raw-odirect-read": child_raw_odirect_read,
    "gdskit-write": child_gdskit_write,
    "raw-odirect-write": child_raw_odirect_write,
    "pinned-alloc": child_pinned_alloc,
}


def run_child(name: str, *args: object, env: dict | None = None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=900)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(res: dict, size: int) -> dict:
    if "error" in res:
        return res
    t = res["times"]
    c = res["cpu"]
    out = {"first_GBps": size / t[0] / GB, "first_cpu_s_per_GB": c[0] / (size / GB)}
    if len(t) > 1:
        out["repeat_GBps"] = size / statistics.median(t[1:]) / GB
        out["repeat_cpu_s_per_GB"] = statistics.median(c[1:]) / (size / GB)
    for k in ("ledger", "pinned_bytes", "compat_mode"):
        if k in res:
            out[k] = res[k]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="8GiB")
    ap.add_argument("--dir", default=".")
    ap.add_argument("--repeats", type=int, default=4, help="calls per process (first + repeated)")
    ap.add_argument("--kvikio-threads", type=int, default=16)
    ap.add_argument("--kvikio-task-size", default="16MiB")
    ap.add_argument("--raw-threads", type=int, default=16)
    ap.add_argument("--raw-chunk", default="8MiB")
    ap.add_argument("--cases", default="pinned,hot,cold,write")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        name, *args = a.child
        fn = CHILDREN[name]
        conv = [int(x) if x.isdigit() else x for x in args]
        print(json.dumps(fn(*conv)))
        return

    size = parse_size(a.size)
    path = os.path.join(a.dir, f"gdskit-bench-{size}.bin")
    os.makedirs(a.dir, exist_ok=True)
    make_file(path, size)
    kv_task = parse_size(a.kvikio_task_size)
    raw_chunk = parse_size(a.raw_chunk)
    cases = set(a.cases.split(","))
    results: dict = {"size": size, "file": path, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if "pinned" in cases:
        results["pinned_alloc"] = run_child("pinned-alloc")
    if "variants" in cases:
        results["pinned_variants"] = run_child("pinned-variants")
    if cases & {"tune", "timeline", "first", "hot"}:
        warm([path])  # once: nothing below evicts it before the cold cases
    if "tune" in cases:
        results["tune"] = run_child("tune", path, size)
    if "timeline" in cases:
        results["timeline"] = run_child("timeline", path, size)
    if "first" in cases:
        for threads, chunk, stages, prep, touch in ((16, 8, 1, 0, 0), (16, 8, 1, 1, 0), (16, 8, 1, 0, 1),
                                                    (16, 8, 1, 1, 1), (12, 8, 1, 0, 0), (16, 8, 1, 0, 0)):
            results[f"first_t{threads}_c{chunk}_s{stages}_p{prep}_t{touch}_{len(results)}"] = run_child(
                "first-call", path, size, threads, chunk, stages, prep, touch)
    if "hot" in cases:
        results["hot_gdskit"] = summarize(run_child("gdskit-read", path, size, a.repeats), size)
        results["hot_kvikio"] = summarize(run_child("kvikio-read", path, size, a.repeats, a.kvikio_threads, kv_task,
                                                    env=KVIKIO_ENV), size)
        results["hot_gdskit_2"] = summarize(run_child("gdskit-read", path, size, a.repeats), size)
    if "cold" in cases:
        for label, name, args in (("cold_raw_odirect", "raw-odirect-read", (a.raw_threads, raw_chunk)),
                                  ("cold_gdskit", "gdskit-read", (1,)),
                                  ("cold_kvikio", "kvikio-read", (1, a.kvikio_threads, kv_task)),
                                  ("cold_kvikio_posix", "kvikio-read-posix", (1, a.kvikio_threads, kv_task)),
                                  ("cold_raw_odirect_2", "raw-odirect-read", (a.raw_threads, raw_chunk)),
                                  ("cold_gdskit_2", "gdskit-read", (1,))):
            drop_caches([path])
            env = KVIKIO_ENV if name == "kvikio-read-posix" else None
            results[label] = summarize(run_child(name.replace("-posix", ""), path, size, *args, env=env), size)
    if "write" in cases:
        wpath = path + ".w"
        results["write_gdskit"] = summarize(run_child("gdskit-write", wpath, size), size)
        os.unlink(wpath)
        results["write_raw_odirect"] = summarize(run_child("raw-odirect-write", wpath, size, a.raw_threads, raw_chunk), size)
        os.unlink(wpath)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=2)
    print(f"\n{'case':22s} {'first GB/s':>10s} {'repeat GB/s':>11s} {'CPU-s/GB':>9s}")
    for k, v in results.items():
        if not isinstance(v, dict) or k in ("pinned_alloc", "pinned_variants", "tune", "timeline") or k.startswith("first_"):
            continue
        if "error" in v:
            print(f"{k:22s} error: {v['error']}")
            continue
        rep = v.get("repeat_GBps")
        print(f"{k:22s} {v['first_GBps']:10.2f} {rep if rep is None else round(rep, 2)!s:>11s} "
              f"{v.get('repeat_cpu_s_per_GB', v['first_cpu_s_per_GB']):9.3f}")
    for k in results:
        if k in ("pinned_alloc", "pinned_variants", "tune", "timeline") or k.startswith("first_"):
            print(f"{k}:", json.dumps(results[k]))
    raise SystemExit(exit_status(v for v in results.values() if isinstance(v, dict)))


if __name__ == "__main__":
    main()
