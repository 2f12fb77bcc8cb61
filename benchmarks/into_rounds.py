#!/usr/bin/env python3
"""``gdskit.safetensors.load_into`` of a many-small-tensor checkpoint, loaded several times in
each fresh process: the first load (the engine set up inside it) and the later ones (the engine
ready), source trees or engine constants compared in the same run, interleaved process by process.

The checkpoint is ``loaders.py``'s small set (``--count`` bf16 tensors averaging ``--avg-kib``
KiB, page cache hot). The target is a dict of tensors on ``--device`` made before the clock (as a
built model's parameters are). Each process prints the rate of each of its ``--loads`` loads.

``--src name=path,...`` compares gdskit source trees (each compiled first, as installing does);
``--variants name=MODULE.CONSTANT=INTEGER;...,...`` sets integer engine constants in the child before its
first load, e.g. ``w16=gdskit.engine.backends.bounce.SCATTERED_HOT_WORKERS=16``. Trees and variants
combine: every tree runs every variant.

    python benchmarks/into_rounds.py --dir /data/ls --rounds 3 --src before=/old/src,now=src
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time

import fresh_process  # benchmarks/ is on sys.path when run as a script

GB = 1e9


def child(args: argparse.Namespace) -> None:
    import torch
    from safetensors import safe_open

    dev = args.device
    if dev.startswith("cuda"):
        torch.cuda.init()
        torch.empty(1, device=dev)
    import gdskit.safetensors

    for item in filter(None, args.variant.split(";")):
        target, value = item.split("=", 1)
        module, name = target.rsplit(".", 1)
        setattr(importlib.import_module(module), name, int(value))
    with safe_open(args.path, framework="pt") as f:
        target = {k: torch.empty(f.get_slice(k).get_shape(), dtype=torch.bfloat16, device=dev) for k in f.keys()}
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    sync()
    nbytes = sum(t.numel() * t.element_size() for t in target.values())
    rates = []
    for _ in range(args.loads):
        t0 = time.perf_counter()
        gdskit.safetensors.load_into(target, args.path, progress=False)
        sync()
        rates.append(nbytes / (time.perf_counter() - t0) / GB)
    fresh_process.report({"bytes": nbytes, "rates": rates})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/gdskit-into-rounds", help="where loaders.py's small set lives (made once)")
    ap.add_argument("--count", type=int, default=20000, help="tensors in the checkpoint")
    ap.add_argument("--avg-kib", type=int, default=100, help="their average size")
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per tree and variant")
    ap.add_argument("--loads", type=int, default=4, help="loads in each process")
    fresh_process.add_tree_options(ap)
    ap.add_argument("--variants", default="", help="name=MODULE.CONSTANT=INTEGER;...,... (default: none)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--child-path", dest="path", help=argparse.SUPPRESS)
    ap.add_argument("--child-variant", dest="variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.path:
        child(args)
        return
    if args.rounds < 1 or args.loads < 1:
        raise SystemExit("--rounds and --loads must be at least 1")
    trees = fresh_process.source_trees(args.src)
    variants = dict(item.split("=", 1) for item in args.variants.split(",") if item) or {"default": ""}
    from loaders import ensure_files
    from page_cache import warm

    path = ensure_files(args.dir, 0.25, args.count, args.avg_kib)["small"]["safetensors"]
    warm([path])
    cases = [(t, v) for t in trees for v in variants]
    runs = []
    for rnd in range(args.rounds):
        for tree, variant in (cases if rnd % 2 == 0 else cases[::-1]):  # drift falls on every case alike
            r = fresh_process.run_child_in_tree(
                __file__, ["--child-path", path, "--child-variant", variants[variant], "--device", args.device,
                           "--loads", str(args.loads)], trees[tree], args.timeout)
            r.update(round=rnd, tree=tree, variant=variant)
            runs.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
    print(f"\n{'tree':10} {'variant':12} {'first load GB/s (each process)':>32} {'later loads, median of each':>30}")
    for tree, variant in cases:
        rs = [r for r in runs if r["tree"] == tree and r["variant"] == variant and "rates" in r]
        firsts = " ".join(f"{r['rates'][0]:.2f}" for r in rs)
        later = " ".join(f"{statistics.median(r['rates'][1:]):.2f}" for r in rs if len(r["rates"]) > 1)
        print(f"{tree:10} {variant:12} {firsts:>32} {later:>30}")
    for r in runs:
        if "error" in r:
            print(f"error: {r['tree']} {r['variant']}: {r['error']}")
    fresh_process.write_runs(args.json_out, runs)
    raise SystemExit(fresh_process.exit_status(runs))


if __name__ == "__main__":
    main()
