#!/usr/bin/env python3
"""What a fresh process's first load pays that its second does not: the budget, item by item.

Each round runs, per set, two fresh interpreters (torch imported and the CUDA context made
first, outside every clock, as in any program that loads a checkpoint):

- ``natural``: ``import gdskit.safetensors`` and the first load as a user makes it (the clock
  from before the import to ``torch.cuda.synchronize()``), then the second load;
- ``budget``: the same first call taken apart, each item run alone and in order, so that each
  one's milliseconds are its own (nothing overlaps): the import, the engine's modules, the
  driver's bindings, the driver and context set-up, the direct-route facts (cuFile probing),
  libcufile's driver (where a direct route exists), the machine facts (the GPU's NUMA node; the
  storage's distances, which only a machine of two or more GPUs reads), the worker threads, the
  pinned lanes (allocation and registration, streams), the header, the destinations, and last
  the reads with everything made (what is left of the load).

Sets (page cache hot): ``large``, one file of 32 MiB bf16 tensors (``--size`` GiB); ``many``,
a checkpoint of ``--count`` small tensors (20-180 KiB, about 2 GB for 20,000); ``preload``,
``--npy`` ``.npy`` files of ``--npy-mib`` MiB read by ``gdskit.data.preload``.

    python benchmarks/first_load_budget.py --dir /data/flb --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import fresh_process  # benchmarks/ is on sys.path when run as a script
from first_load import make_large
from page_cache import warm

MiB = 1 << 20


def make_many(path: str, count: int) -> None:
    """A safetensors file of ``count`` fp16 tensors of 20-180 KiB (sizes fixed by a seed)."""
    import numpy as np

    rng = np.random.default_rng(1)
    sizes = (rng.integers(10, 91, count) * 2048).tolist()  # 20-180 KiB in steps of 2 KiB
    header, offset = {}, 0
    for i, n in enumerate(sizes):
        header[f"blocks.{i}.weight"] = {"dtype": "F16", "shape": [n // 2], "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    block = rng.integers(0, 256, max(sizes), dtype=np.uint8).tobytes()
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        for n in sizes:
            fh.write(block[:n])
    os.replace(tmp, path)


def make_npy(directory: str, count: int, mib: int) -> list[str]:
    import numpy as np

    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, f"part{i}.npy") for i in range(count)]
    for i, p in enumerate(paths):
        if not os.path.exists(p):
            np.save(p + ".tmp.npy", np.random.default_rng(i).integers(0, 256, mib * MiB, dtype=np.uint8))
            os.replace(p + ".tmp.npy", p)
    return paths


def sets(args: argparse.Namespace) -> dict[str, list[str]]:
    os.makedirs(args.dir, exist_ok=True)
    out: dict[str, list[str]] = {}
    for name in args.sets.split(","):
        if name == "large":
            path = os.path.join(args.dir, f"large-{args.size:g}.safetensors")
            if not os.path.exists(path):
                make_large(path, args.size)
            out[name] = [path]
        elif name == "many":
            path = os.path.join(args.dir, f"many-{args.count}.safetensors")
            if not os.path.exists(path):
                make_many(path, args.count)
            out[name] = [path]
        elif name == "preload":
            out[name] = make_npy(os.path.join(args.dir, f"npy-{args.npy}x{args.npy_mib}"), args.npy, args.npy_mib)
        else:
            raise SystemExit(f"unknown set {name!r}")
    return out


# -- the children -------------------------------------------------------------------------------

def _context(dev: str):
    import torch

    if not dev.startswith("cuda"):  # --device cpu: a smoke test of the script without a GPU
        torch.cuda.synchronize = lambda: None
        return torch
    torch.cuda.init()
    torch.empty(1, device=dev)
    torch.cuda.synchronize()
    return torch


def _load(kind: str, paths: list[str], dev: str):
    if kind == "preload":
        import gdskit.data

        return gdskit.data.preload(paths, dev, progress=False)
    import gdskit.safetensors

    return gdskit.safetensors.load_file(paths[0] if len(paths) == 1 else paths, device=dev)  # several: shards


def child_natural(args: argparse.Namespace) -> dict:
    torch = _context(args.device)
    paths = args.paths.split(",")
    t0 = time.perf_counter()
    if args.kind == "preload":
        import gdskit.data  # noqa: F401
    else:
        import gdskit.safetensors  # noqa: F401
    t_import = time.perf_counter()
    got = _load(args.kind, paths, args.device)
    torch.cuda.synchronize()
    t_first = time.perf_counter()
    del got
    t1 = time.perf_counter()
    got = _load(args.kind, paths, args.device)
    torch.cuda.synchronize()
    t_second = time.perf_counter()
    return {"import_ms": 1e3 * (t_import - t0), "first_ms": 1e3 * (t_first - t_import),
            "first_with_import_ms": 1e3 * (t_first - t0), "second_ms": 1e3 * (t_second - t1)}


def child_budget(args: argparse.Namespace) -> dict:
    """Each item of the first call alone, in the order the call meets them."""
    torch = _context(args.device)
    paths = args.paths.split(",")
    dev = torch.device(args.device).index or 0
    items: dict[str, float] = {}
    notes: dict[str, object] = {}

    def item(name: str, fn):
        t = time.perf_counter()
        value = fn()
        items[name] = 1e3 * (time.perf_counter() - t)
        return value

    item("import the loader", lambda: __import__("gdskit.data" if args.kind == "preload" else "gdskit.safetensors"))
    notes["bindings imported before"] = "cuda.bindings.driver" in sys.modules

    def engine_modules():
        import gdskit.engine.buffers  # noqa: F401
        import gdskit.engine.file  # noqa: F401
        import gdskit.engine.many_files  # noqa: F401
        import gdskit.engine.pool  # noqa: F401
        import gdskit.engine.whole_files  # noqa: F401
        import gdskit.formats.torch_io  # noqa: F401

    item("the engine's modules", engine_modules)
    from gdskit.engine import cuda, direct_path, numa, pool

    if cuda.available():
        item("the driver's bindings", lambda: __import__("cuda.bindings.driver"))
    from gdskit.settings import settings

    if not cuda.available():  # --device cpu: what follows needs a GPU
        return {"items": items, "notes": notes}
    item("driver and context set-up", lambda: (cuda.available(), cuda.device_count(), cuda.current_device()))
    route = item("direct-route facts (cuFile probing)", direct_path.direct_route)
    notes["direct route"] = str(route.route)
    if route.route is not None:
        from gdskit.engine.backends.cufile import cufile_library

        item("libcufile and its driver", lambda: cufile_library().available)
    else:
        items["libcufile and its driver"] = 0.0  # not asked: no direct route
    item("machine facts: the GPU's NUMA node", lambda: numa.place_of(dev))
    notes["gpus"] = cuda.device_count()
    if cuda.device_count() > 1:
        from gdskit.engine.gpu_routing import gpu_bus_ids
        from gdskit.machine.storage import live_storage_facts

        item("machine facts: storage distances (2+ GPUs)",
             lambda: live_storage_facts(os.stat(paths[0]).st_dev, gpu_bus_ids()))
    cfg = settings.snapshot()

    def threads():
        ex = pool.io_executor(cfg.threads)
        for f in [ex.submit(lambda: None) for _ in range(cfg.threads)]:
            f.result()

    item("worker threads", threads)
    item("pinned lanes (allocation, registration, streams)",
         lambda: pool.prepare(dev, cfg.threads, cfg.chunk_size, cfg.pinned_budget, cfg.alignment))
    n_lanes, chunk = pool.lanes.stage_layout(dev, cfg.threads, cfg.chunk_size, cfg.pinned_budget, cfg.alignment)
    notes["pinned MiB"] = n_lanes * (chunk + 2 * cfg.alignment) / MiB
    if args.kind != "preload":
        from gdskit.formats import safetensors_format

        item("header", lambda: safetensors_format.read_header_file(paths[0]))
    t = time.perf_counter()
    got = _load(args.kind, paths, args.device)
    torch.cuda.synchronize()
    items["the load with everything made (header memo, destinations, reads)"] = 1e3 * (time.perf_counter() - t)
    del got
    return {"items": items, "notes": notes}


# -- the parent ---------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/gdskit-first-load-budget")
    ap.add_argument("--sets", default="large,many,preload")
    ap.add_argument("--size", type=float, default=8, help="GiB of the large set")
    ap.add_argument("--count", type=int, default=20_000, help="tensors of the many set")
    ap.add_argument("--npy", type=int, default=4, help=".npy files of the preload set")
    ap.add_argument("--npy-mib", type=int, default=512, help="MiB of each .npy file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=180)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--child", choices=("natural", "budget"), help=argparse.SUPPRESS)
    ap.add_argument("--child-kind", dest="kind", help=argparse.SUPPRESS)
    ap.add_argument("--child-paths", dest="paths", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        fresh_process.report((child_natural if args.child == "natural" else child_budget)(args))
        return
    fresh_process.source_trees("")  # bytecode made first, as installing the package does
    data = sets(args)
    runs: dict[str, dict[str, list]] = {name: {"natural": [], "budget": []} for name in data}
    for rnd in range(args.rounds):
        order = ("natural", "budget") if rnd % 2 == 0 else ("budget", "natural")
        for name, paths in data.items():
            for which in order:
                warm(paths)
                r = fresh_process.run_child(__file__, ["--child", which, "--child-kind", name, "--child-paths",
                                                       ",".join(paths), "--device", args.device], args.timeout)
                runs[name][which].append(r)
                print(f"round {rnd} {name} {which}: {json.dumps(r)[:300]}", file=sys.stderr, flush=True)
    report(data, runs)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"command": sys.argv, "runs": runs}, fh, indent=1)


def _span(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def report(data: dict[str, list[str]], runs: dict[str, dict[str, list]]) -> None:
    for name, paths in data.items():
        nbytes = sum(os.path.getsize(p) for p in paths)
        natural = [r for r in runs[name]["natural"] if "error" not in r]
        budget = [r for r in runs[name]["budget"] if "error" not in r]
        errors = [r["error"] for r in runs[name]["natural"] + runs[name]["budget"] if "error" in r]
        print(f"\n### {name}: {nbytes / 1e9:.2f} GB in {len(paths)} file(s); medians (ranges) of "
              f"{len(natural)} + {len(budget)} fresh processes")
        if errors:
            print(f"errors: {errors[:3]}")
        print("\n| item, each alone, in the first call's order | ms |\n|---|---:|")
        names = list(budget[0]["items"]) if budget else []
        for item in names:
            print(f"| {item} | {_span([r['items'][item] for r in budget if item in r['items']])} |")
        if budget:
            print(f"| **sum** | {_span([sum(r['items'].values()) for r in budget])} |")
            print(f"\nnotes: {budget[0]['notes']}")
        if natural:
            gbs = lambda ms: nbytes / ms / 1e6  # noqa: E731
            print("\n| the natural first call | ms | GB/s |\n|---|---:|---:|")
            for key, label in (("import_ms", "import"), ("first_ms", "first load"),
                               ("first_with_import_ms", "first call incl. import"), ("second_ms", "second load")):
                ms = [r[key] for r in natural]
                rate = "" if key == "import_ms" else _span([gbs(m) for m in ms])
                print(f"| {label} | {_span(ms)} | {rate} |")


if __name__ == "__main__":
    main()
