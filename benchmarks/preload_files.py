"""`gdskit.data.preload` of many small `.npy` files, hot and cold, by how the files are read,
next to the raw O_DIRECT read of the same files.

Two ways are compared in one run: ``whole`` (the default: each file of at most 1 MiB read whole,
header and array in one read, by ``gdskit.engine.whole_files``) and ``headers-N`` (every header read
first, then the arrays by the many-file job on N workers: what preload did before, forced here by
``preload.WHOLE_FILE_MAX = 0``). Hot: whole preloads, µs a file (best of ``--rounds``). Cold: whole
preloads with the page cache dropped before each (root: all of it; else each file's pages),
interleaved with `raw_disk.odirect_io` of the same files on 16 threads, rounds in alternating order.

    python benchmarks/preload_files.py --dir /data/pf --files 20000 --threads 16 --cold --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
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


@contextlib.contextmanager
def way(label: str):
    """Preload's reads as ``label`` names them (``whole``, ``headers-N``)."""
    import gdskit

    pre = importlib.import_module("gdskit.data.preload")
    keep = pre.WHOLE_FILE_MAX
    if label == "whole":
        yield
        return
    pre.WHOLE_FILE_MAX = 0
    try:
        with gdskit.settings.set(threads=int(label.split("-")[1])):
            yield
    finally:
        pre.WHOLE_FILE_MAX = keep


def timed_preload(paths: list[str], device: str, label: str) -> float:
    """Seconds of one whole preload, read as ``label`` says, to the device's synchronize."""
    import torch

    import gdskit.data as gd

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with way(label):
        t0 = time.perf_counter()
        got = gd.preload(paths, device=device)
        sync()
        took = time.perf_counter() - t0
    del got
    return took


def cold_runs(paths: list[str], device: str, labels: list[str], rounds: int) -> dict[str, list[float]]:
    """GB/s of whole cold preloads each way and of the raw O_DIRECT read, interleaved."""
    from page_cache import drop_caches
    from raw_disk import odirect_io

    nbytes = sum(os.path.getsize(p) for p in paths)

    def raw() -> float:
        t0 = time.perf_counter()
        odirect_io(paths, 16, 16 << 20)
        return time.perf_counter() - t0

    runs = [("odirect-16", raw)] + [(label, lambda lb=label: timed_preload(paths, device, lb)) for label in labels]
    out: dict[str, list[float]] = {}
    for r in range(rounds):
        for label, fn in (runs if r % 2 == 0 else runs[::-1]):
            drop_caches(paths)
            rate = nbytes / fn() / 1e9
            out.setdefault(label, []).append(rate)
            print(f"# round {r + 1} cold {label}: {rate:.3f} GB/s", file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/gdskit-preload-files", help="where the files live (made once)")
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--bytes", type=int, default=65536, help="array bytes a file (after its 128-byte header)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--threads", default="2,16",
                    help="worker counts of the headers-first way (settings.threads), comma list")
    ap.add_argument("--cold", action="store_true", help="also whole preloads from the disk (drops the page cache)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    labels = ["whole"] + [f"headers-{int(x)}" for x in args.threads.split(",") if x]
    paths = make_files(args.dir, args.files, args.bytes)

    import torch

    import gdskit.data as gd
    from gdskit.formats.gc_pause import collector_paused

    if args.device.startswith("cuda"):
        torch.empty(1, device=args.device)
    for p in paths:  # hot: every file in the page cache
        with open(p, "rb") as fh:
            fh.read()
    for label in labels:
        with way(label):
            gd.preload(paths[:200], device=args.device)  # the engine set up once each way
    nbytes = sum(os.path.getsize(p) for p in paths)
    result: dict[str, object] = {"files": len(paths), "bytes": args.bytes, "device": args.device, "hot": {}}
    print(f"{'way':>12} {'µs a file':>10} {'GB/s':>7}   (hot, best of {args.rounds})")
    for label in labels:
        with collector_paused():
            best = min(timed_preload(paths, args.device, label) for _ in range(args.rounds))
        result["hot"][label] = best  # type: ignore[index]
        print(f"{label:>12} {best / len(paths) * 1e6:>10.1f} {nbytes / best / 1e9:>7.3f}")
    if args.cold:
        from page_cache import drop_caches

        from gdskit.data.sources import resolve

        drop_caches(paths)
        t0 = time.perf_counter()
        resolve(paths)  # every file's size, from the disk
        took = time.perf_counter() - t0
        result["cold_resolve_s"] = took
        print(f"cold resolve: {took:.3f} s, {took / len(paths) * 1e6:.1f} µs a file")
        cold = cold_runs(paths, args.device, labels, args.rounds)
        result["cold_gb_s"] = cold
        for label, rates in cold.items():
            print(f"cold {label:>12}: " + ", ".join(f"{r:.3f}" for r in rates) + " GB/s")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
