#!/usr/bin/env python3
"""Where a hot small read into GPU memory spends its time, and the bounce path against the host path.

Parts, in one process, on one (cached) file:

* ``steps``: one 4 KiB and one 1 MiB read into device memory taken apart, each step timed
  with ``perf_counter_ns`` around the engine's own pieces, as the bounce path runs them in
  the caller's thread: take a lane, make its device current, ask the page cache (residency),
  ``pread`` into the pinned stage, queue the copy, record the event, wait for it (the lane's
  spinning event, and for comparison a blocking-sync event and a stream sync), the ledger
  record, give the lane back.
* ``calls``: ``File.read`` through a driver wrapper that counts and times every driver call
  (``gdskit.engine.cuda.use_driver``): driver calls per read and the time inside them.
* ``paths``: ``File.read`` and ``File.read_batch`` latency (p50/p99) and rate per worker,
  1 and 4 worker threads, 4 KiB and 1 MiB: the bounce path into device memory against the
  host path into pageable and pinned host memory (and into a torch tensor, where torch is there).
* ``profile`` (not run by default): ``File.read`` under ``cProfile``, the functions that take
  the most time of their own per read: where the time outside the steps above goes.

Needs a GPU. About a minute:

    python benchmarks/small_io.py --out results/        # writes results/small_io.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

import gdskit
from gdskit.engine import cuda
from gdskit.engine.backends.staged import StageTarget, file_residency, read_chunk
from gdskit.engine.ledger import ledger
from gdskit.engine.pool import lanes
from gdskit.vocabulary import Path, Reason

KiB, MiB = 1 << 10, 1 << 20
SIZES = (4 * KiB, MiB)


def _pct(values: list[int], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.int64), q)) / 1e3 if values else float("nan")


def _summary(ns: list[int]) -> dict[str, float]:
    return {"p50_us": _pct(ns, 50), "p99_us": _pct(ns, 99), "mean_us": statistics.fmean(ns) / 1e3 if ns else 0.0}


def _make_file(path: str, size: int) -> None:
    """A new file of ``size`` random bytes at ``path``; an existing file is only ever read
    (it must hold ``size`` bytes)."""
    if os.path.exists(path):
        if os.path.getsize(path) < size:
            raise SystemExit(f"{path} holds {os.path.getsize(path)} bytes, fewer than --size {size}")
    else:
        with open(path, "xb") as fh:
            for _ in range(size // (8 * MiB)):
                fh.write(os.urandom(8 * MiB))
    with open(path, "rb") as fh:  # hot: every page cached
        while fh.read(8 * MiB):
            pass


def _offsets(size: int, io: int, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, size // io, n) * io).tolist()


# -- steps ------------------------------------------------------------------------------------
def steps(path: str, size: int, io: int, n: int) -> dict[str, Any]:
    """Each step of a bounce read of ``io`` bytes, as the caller's-thread path runs it."""
    cfg = gdskit.settings.snapshot()
    device = cuda.current_device()
    n_lanes, chunk = lanes.stage_layout(device, cfg.threads, cfg.chunk_size, cfg.pinned_budget, cfg.alignment)
    stage_bytes = chunk + 2 * cfg.alignment
    dst = cuda.DeviceArray(io)
    blocking = cuda.Event()  # the workers' kind of event, for comparison
    t: dict[str, list[int]] = {k: [] for k in ("lane_get", "set_device", "residency", "pread", "copy_enqueue",
                                               "event_record", "event_sync", "ledger", "lane_put", "total",
                                               "event_sync_blocking", "stream_sync")}
    clock = time.perf_counter_ns
    with gdskit.open(path) as f:
        of = f._of  # the engine's open file: the same object File.read hands its backends
        offsets = _offsets(size, io, n + 20, 1)
        for i, off in enumerate(offsets):
            t0 = clock()
            lane = lanes.acquire(device, stage_bytes, n_lanes, cfg.pinned_budget)
            t1 = clock()
            cuda.set_device(device)
            t2 = clock()
            where = file_residency(of, off, io)
            t3 = clock()
            stage, _ = lane.next_stage()
            res = read_chunk(of, StageTarget(stage.view, off, cfg.alignment), off, io, cfg.odirect, where)
            t4 = clock()
            lane.stream.copy_h2d(dst.ptr, stage.ptr + off % cfg.alignment, res.nbytes)
            t5 = clock()
            lane.quick_event.record(lane.stream)
            t6 = clock()
            lane.quick_event.wait()
            t7 = clock()
            ledger.record(Path.BOUNCE_CACHED, Reason.FORCED_BY_SETTING, "read", res.nbytes, 1, (t7 - t0) / 1e9,
                          device=device)
            t8 = clock()
            lanes.release(lane)
            t9 = clock()
            # The same copy again, waited for the other ways (not part of the total).
            lane = lanes.acquire(device, stage_bytes, n_lanes, cfg.pinned_budget)
            lane.stream.copy_h2d(dst.ptr, stage.ptr + off % cfg.alignment, res.nbytes)
            blocking.record(lane.stream)
            s0 = clock()
            blocking.wait()
            s1 = clock()
            lane.stream.copy_h2d(dst.ptr, stage.ptr + off % cfg.alignment, res.nbytes)
            s2 = clock()
            lane.stream.synchronize()
            s3 = clock()
            lanes.release(lane)
            if i < 20:
                continue  # warm-up
            for k, a, b in (("lane_get", t0, t1), ("set_device", t1, t2), ("residency", t2, t3), ("pread", t3, t4),
                            ("copy_enqueue", t4, t5), ("event_record", t5, t6), ("event_sync", t6, t7),
                            ("ledger", t7, t8), ("lane_put", t8, t9), ("total", t0, t9),
                            ("event_sync_blocking", s0, s1), ("stream_sync", s2, s3)):
                t[k].append(b - a)
    blocking.destroy()
    dst.free()
    return {k: _summary(v) for k, v in t.items()}


# -- driver calls -------------------------------------------------------------------------------
class CountingDriver:
    """The real driver, with every call counted and timed (what gdskit asks of it per read)."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.calls: dict[str, int] = {}
        self.ns: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if not callable(attr) or not name.startswith("cu"):
            return attr
        calls, ns, clock = self.calls, self.ns, time.perf_counter_ns

        def timed(*args: Any) -> Any:
            t0 = clock()
            try:
                return attr(*args)
            finally:
                ns[name] = ns.get(name, 0) + clock() - t0
                calls[name] = calls.get(name, 0) + 1

        setattr(self, name, timed)
        return timed


def driver_calls(path: str, size: int, io: int, n: int, buffer: str = "device") -> dict[str, Any]:
    wrapped = CountingDriver(cuda.driver_or_none())  # the driver gdskit is on (the bindings' module)
    with cuda.use_driver(wrapped):
        cuda.set_device(0)
        dst = _buffer(buffer, io)
        with gdskit.settings.set(mode="bounce"), gdskit.open(path) as f:
            for off in _offsets(size, io, 20, 2):
                f.read(dst, io, off)
            wrapped.calls.clear()
            wrapped.ns.clear()
            offsets = _offsets(size, io, n, 3)
            t0 = time.perf_counter_ns()
            for off in offsets:
                f.read(dst, io, off)
            wall = time.perf_counter_ns() - t0
        _free(dst)
        gdskit.release_resources()
    # Calls made less than once in 20 reads are the collector's (a buffer freed meanwhile), not the reads'.
    return {"per_read": {k: v / n for k, v in sorted(wrapped.calls.items()) if v / n >= 0.05},
            "us_per_read": {k: wrapped.ns[k] / n / 1e3 for k in sorted(wrapped.ns)},
            "wall_us_per_read": wall / n / 1e3}


# -- bounce against host ----------------------------------------------------------------------
def _buffer(kind: str, nbytes: int) -> Any:
    if kind == "device":
        return cuda.DeviceArray(nbytes)
    if kind == "torch":
        import torch  # noqa: PLC0415 - optional: the row is left out without it

        return torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    if kind == "pinned":
        return cuda.PinnedBuffer(nbytes)
    return np.zeros(nbytes, dtype=np.uint8)


def _as_obj(buf: Any) -> Any:
    if isinstance(buf, cuda.PinnedBuffer):
        return buf.view
    return buf


def _free(buf: Any) -> None:
    if hasattr(buf, "free"):
        buf.free()


def paths(path: str, size: int, io: int, workers: int, n: int, how: str) -> dict[str, dict[str, float]]:
    """Per-read latency and per-worker rate of ``workers`` threads each making ``n`` reads of ``io``."""
    out = {}
    kinds = [("device", "bounce"), ("pageable", "host"), ("pinned", "host")]
    if _have_torch():
        kinds.insert(1, ("torch", "bounce"))
    for kind, mode in kinds:
        bufs = [_buffer(kind, io if how == "read" else 64 * io) for _ in range(workers)]
        lat: list[list[int]] = [[] for _ in range(workers)]
        walls = [0.0] * workers
        start = threading.Barrier(workers)
        errors: list[BaseException] = []
        with gdskit.settings.set(mode=mode), gdskit.open(path) as f:

            def worker(w: int) -> None:
                try:
                    cuda.set_device(0)
                    obj = _as_obj(bufs[w])
                    offs = _offsets(size, io, n, 10 + w)
                    f.read(obj, io, offs[0])  # warm-up: the lane exists before the clock
                    start.wait(timeout=60)
                    t0 = time.perf_counter()
                    if how == "read":
                        clock = time.perf_counter_ns
                        for off in offs:
                            a = clock()
                            f.read(obj, io, off)
                            lat[w].append(clock() - a)
                    else:
                        per = 64 if io < MiB else 1
                        for k in range(0, n, per):
                            f.read_batch(obj, offs[k:k + per], io, [0] * len(offs[k:k + per]), latencies_ns=lat[w])
                    walls[w] = time.perf_counter() - t0
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)

            threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        for b in bufs:
            _free(b)
        if errors:
            raise errors[0]
        every = [x for w in lat for x in w]
        rate = statistics.fmean(n * io / max(wall, 1e-9) / 2**30 for wall in walls)
        out[f"{kind} ({mode})"] = {**_summary(every), "gib_per_s_per_worker": rate}
    return out


def profile(path: str, size: int, io: int, n: int, top: int = 25, buffer: str = "device") -> list[dict[str, Any]]:
    """``n`` bounce ``File.read`` calls of ``io`` bytes into device memory (``buffer``) under ``cProfile``:
    the ``top`` functions by time of their own, in µs per read (the profiler's own cost included,
    so the ranking, not the sum, is the answer)."""
    import cProfile  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    dst = _buffer(buffer, io)
    offsets = _offsets(size, io, n, 7)
    with gdskit.settings.set(mode="bounce"), gdskit.open(path) as f:
        f.read(dst, io, offsets[0])
        prof = cProfile.Profile()
        prof.enable()
        for off in offsets:
            f.read(dst, io, off)
        prof.disable()
    _free(dst)
    rows = []
    for (file, line, name), (_cc, calls, own, cum, _callers) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{os.path.basename(file)}:{line}({name})", "calls_per_read": calls / n,
                     "own_us_per_read": own / n * 1e6, "cum_us_per_read": cum / n * 1e6})
    rows.sort(key=lambda r: -r["own_us_per_read"])
    return rows[:top]


def _have_torch() -> bool:
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# -- main -------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory the JSON goes to (small_io.json)")
    ap.add_argument("--file", default=None, help="the file to read (default: a new 256 MiB file in --out)")
    ap.add_argument("--size", type=int, default=256 * MiB)
    ap.add_argument("--reads", type=int, default=4000, help="4 KiB reads per measurement (1 MiB: a tenth)")
    ap.add_argument("--parts", default="steps,calls,paths",
                    help="which parts to run (comma-separated: steps, calls, paths, profile)")
    ap.add_argument("--buffer", choices=("device", "torch"), default="device",
                    help="what the calls and profile parts read into: a cuda.DeviceArray or a torch tensor")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if cuda.device_count() == 0:
        print("small_io.py needs a GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    path = args.file or os.path.join(args.out, "small_io.bin")
    made = args.file is None
    _make_file(path, args.size)
    cuda.set_device(0)
    result: dict[str, Any] = {"kind": "gdskit.small_io", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "settings": gdskit.settings.as_dict(), "size": args.size, "sizes": {}}
    try:
        for io in SIZES:
            n = args.reads if io < MiB else max(50, args.reads // 10)
            entry: dict[str, Any] = {}
            if "steps" in parts:
                entry["steps"] = steps(path, args.size, io, n)
            if "calls" in parts:
                entry["calls"] = driver_calls(path, args.size, io, n, args.buffer)
            if "paths" in parts:
                entry["paths"] = {f"{how} x{workers}": paths(path, args.size, io, workers, n, how)
                                  for workers in (1, 4) for how in ("read", "read_batch")}
            if "profile" in parts:
                entry["profile"] = profile(path, args.size, io, n, buffer=args.buffer)
            result["sizes"][str(io)] = entry
    finally:
        if made:
            os.unlink(path)
    with open(os.path.join(args.out, "small_io.json"), "w") as fh:
        json.dump(result, fh, indent=2)
    _print(result)
    return 0


def _print(result: dict[str, Any]) -> None:
    for io, entry in result["sizes"].items():
        label = f"{int(io) // KiB} KiB" if int(io) < MiB else f"{int(io) // MiB} MiB"
        print(f"\n== {label} ==")
        if "steps" in entry:
            print("one bounce read in the caller's thread, step by step (us)")
            print(f"{'step':22s} {'p50':>8s} {'p99':>8s}")
            for k, v in entry["steps"].items():
                print(f"{k:22s} {v['p50_us']:8.1f} {v['p99_us']:8.1f}")
        if "calls" in entry:
            c = entry["calls"]
            print("driver calls per File.read (us inside): " + ", ".join(
                f"{k} {v:.2f} ({c['us_per_read'][k]:.1f})" for k, v in c["per_read"].items())
                  + f"; wall {c['wall_us_per_read']:.1f} us/read")
        if "paths" in entry:
            print(f"{'how':16s} {'memory (path)':20s} {'p50 us':>8s} {'p99 us':>8s} {'GiB/s/worker':>13s}")
            for how, rows in entry["paths"].items():
                for mem, v in rows.items():
                    print(f"{how:16s} {mem:20s} {v['p50_us']:8.1f} {v['p99_us']:8.1f} "
                          f"{v['gib_per_s_per_worker']:13.3f}")
        if "profile" in entry:
            print(f"{'File.read under cProfile: own time (us/read)':60s} {'own':>7s} {'cum':>7s} {'calls':>6s}")
            for r in entry["profile"]:
                print(f"{r['function'][:60]:60s} {r['own_us_per_read']:7.2f} {r['cum_us_per_read']:7.2f} "
                      f"{r['calls_per_read']:6.2f}")


if __name__ == "__main__":
    sys.exit(main())
