"""Where `gdskit.data.preload` of many small `.npy` files spends its time, by worker count, hot
and cold, next to the raw O_DIRECT read of the same files.

Hot: each phase of a preload timed apart (resolve the list, read the headers, make the tensors,
make the engine's views, the engine's many-file job), in microseconds a file. Cold: whole preloads
with the page cache dropped before each (root: all of it; else each file's pages), interleaved
with `raw_disk.odirect_io` of the same files on 16 threads, rounds in alternating order.

    python benchmarks/preload_files.py --dir /data/pf --files 20000 --threads 1,2,4,16 --cold --rounds 2
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import numpy as np


def make_files(directory: str, count: int, nbytes: int) -> list[str]:
    """``count`` ``.npy`` files of ``nbytes`` of uint8 each (made once; kept for the next run)."""
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, f"{i:06d}.npy") for i in range(count)]
    array = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    made = False
    for p in paths:
        if not os.path.exists(p):
            np.save(p, array)
            made = True
    if made:
        os.sync()
    return paths


def hot_phases(paths: list[str], device: str, threads: int) -> dict[str, float]:
    """One preload's phases, µs a file, under ``settings.threads = threads``."""
    import torch

    import gdskit
    from gdskit.data import sources

    from gdskit.formats._gc import collector_paused

    pre = importlib.import_module("gdskit.data.preload")
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with gdskit.settings.set(threads=threads), collector_paused():  # as preload itself runs
        t = [time.perf_counter()]
        srcs = sources.resolve(paths)
        t.append(time.perf_counter())
        layouts = pre._layouts(srcs)
        t.append(time.perf_counter())
        raws = [torch.empty(lay.nbytes, dtype=torch.uint8, device=device) for lay, _ in layouts]
        sync()
        t.append(time.perf_counter())
        reads = [(pre.FileReads(s, ((lay.nbytes, off, 0),)), view)
                 for s, (lay, off), view in zip(srcs, layouts, pre.engine_views(raws))]
        t.append(time.perf_counter())
        pre.read_files(reads)
        sync()
        t.append(time.perf_counter())
    names = ("resolve", "headers", "empty", "views", "engine_job")
    out = {n: (b - a) / len(paths) * 1e6 for n, a, b in zip(names, t, t[1:])}
    out["total"] = (t[-1] - t[0]) / len(paths) * 1e6
    return out


def cold_runs(paths: list[str], device: str, threads: list[int], rounds: int) -> dict[str, list[float]]:
    """GB/s of whole cold preloads by thread count and of the raw O_DIRECT read, interleaved."""
    import torch

    import gdskit
    import gdskit.data as gd
    from page_cache import drop_caches
    from raw_disk import odirect_io

    nbytes = sum(os.path.getsize(p) for p in paths)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def preload_on(n: int):
        def run() -> None:
            with gdskit.settings.set(threads=n):
                gd.preload(paths, device=device)
        return run

    runs = [("odirect-16", lambda: odirect_io(paths, 16, 16 << 20))] + [(f"gdskit-{n}", preload_on(n)) for n in threads]
    out: dict[str, list[float]] = {}
    for r in range(rounds):
        for label, fn in (runs if r % 2 == 0 else runs[::-1]):
            drop_caches(paths)
            t0 = time.perf_counter()
            fn()
            sync()
            rate = nbytes / (time.perf_counter() - t0) / 1e9
            out.setdefault(label, []).append(rate)
            print(f"# round {r + 1} cold {label}: {rate:.3f} GB/s", file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/gdskit-preload-files", help="where the files live (made once)")
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--bytes", type=int, default=65536, help="array bytes a file (after its 128-byte header)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--threads", default="1,2,4,16", help="worker counts (settings.threads), comma list")
    ap.add_argument("--cold", action="store_true", help="also whole preloads from the disk (drops the page cache)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    threads = [int(x) for x in args.threads.split(",")]
    paths = make_files(args.dir, args.files, args.bytes)

    import torch

    import gdskit.data as gd

    if args.device.startswith("cuda"):
        torch.empty(1, device=args.device)
    for p in paths:  # hot: every file in the page cache
        with open(p, "rb") as fh:
            fh.read()
    gd.preload(paths[:200], device=args.device)  # the engine set up once
    result: dict[str, object] = {"files": len(paths), "bytes": args.bytes, "device": args.device, "hot": {}}
    cols = ("resolve", "headers", "empty", "views", "engine_job", "total")
    print(f"{'threads':>7} " + " ".join(f"{c:>10}" for c in cols) + "   (hot, µs a file)")
    for n in threads:
        ph = hot_phases(paths, args.device, n)
        result["hot"][n] = ph  # type: ignore[index]
        print(f"{n:>7} " + " ".join(f"{ph[k]:>10.1f}" for k in cols))
    if args.cold:
        cold = cold_runs(paths, args.device, threads, args.rounds)
        result["cold_gb_s"] = cold
        for label, rates in cold.items():
            print(f"cold {label:>12}: " + ", ".join(f"{r:.3f}" for r in rates) + " GB/s")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
