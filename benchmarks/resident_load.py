#!/usr/bin/env python3
"""A fresh process's first load, in the process and through the resident loader (``gdskit serve``).

One ``gdskit serve --device N`` is started (and warmed by one load of each set, as a loader
that has been running a while is); then each round runs, per set, fresh processes of each kind,
in alternating order, page cache warmed before each: ``here`` (``GDSKIT_RESIDENT=off``, the load
made in the process) and ``resident`` (``GDSKIT_RESIDENT=require``). Each process imports torch
and makes its CUDA context before the clock (as any program that loads a checkpoint), then times
``import gdskit.safetensors``, the first ``load_file`` and a second one
(``first_load_budget.py``'s ``natural`` child). The source tree is compiled first, as installing
the package does (a machine with ``PYTHONDONTWRITEBYTECODE`` would otherwise compile every
module at every import).

Sets: ``large`` (one file of 32 MiB bf16 tensors, ``--size`` GiB), ``shards`` (the same size in
``--shards`` files, loaded as one checkpoint), ``many`` (``--count`` small tensors), ``preload``
(``--npy`` ``.npy`` files of ``--npy-mib`` MiB read by ``gdskit.data.preload``). ``--peers instanttensor`` adds InstantTensor's buffered first call
(first_load.py's child) to each round, for the safetensors sets.

    python benchmarks/resident_load.py --dir /data/flb --rounds 4 --peers instanttensor --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import fresh_process  # benchmarks/ is on sys.path when run as a script
from first_load_budget import make_many, make_npy
from first_load import make_large
from page_cache import warm

HERE = os.path.dirname(os.path.abspath(__file__))
BUDGET = os.path.join(HERE, "first_load_budget.py")
FIRST_LOAD = os.path.join(HERE, "first_load.py")
PEERS = ("instanttensor", "safetensors")


def _sets(args: argparse.Namespace) -> dict[str, list[str]]:
    os.makedirs(args.dir, exist_ok=True)
    out = {}
    for name in args.sets.split(","):
        if name == "large":
            path = os.path.join(args.dir, f"large-{args.size:g}.safetensors")
            if not os.path.exists(path):
                make_large(path, args.size)
            out[name] = [path]
        elif name == "shards":  # the large set's size in --shards files, loaded as one checkpoint
            paths = [os.path.join(args.dir, f"shards-{args.size:g}", f"model-{k + 1:05d}-of-{args.shards:05d}.safetensors")
                     for k in range(args.shards)]
            per = args.size / args.shards
            for k, path in enumerate(paths):
                if not os.path.exists(path):
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    make_large(path, per, first=k * max(1, int(per * 1024 / 32)))
            out[name] = paths
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


def _child(name: str, paths: list[str], kind: str, device: str, timeout: float) -> dict:
    if kind in PEERS:  # first_load.py's child: the peer's import is inside its first call
        r = fresh_process.run_child(FIRST_LOAD, ["--child-loader", kind, "--child-paths", ",".join(paths),
                                                 "--device", device], timeout)
        if "error" in r:
            return r
        return {"import_ms": None, "first_ms": 1e3 * r["first_s"], "first_with_import_ms": 1e3 * r["first_s"],
                "second_ms": 1e3 * r["second_s"]}
    os.environ["GDSKIT_RESIDENT"] = "off" if kind == "here" else "require"
    return fresh_process.run_child(BUDGET, ["--child", "natural", "--child-kind", "preload" if name == "preload"
                                            else "large", "--child-paths", ",".join(paths), "--device", device],
                                   timeout)


def _span(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{statistics.median(known):.1f} ({min(known):.1f}-{max(known):.1f})" if known else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/gdskit-resident-load")
    ap.add_argument("--sets", default="large,many")
    ap.add_argument("--size", type=float, default=8, help="GiB of the large set")
    ap.add_argument("--count", type=int, default=20_000, help="tensors of the many set")
    ap.add_argument("--shards", type=int, default=4, help="files of the shards set")
    ap.add_argument("--npy", type=int, default=4, help=".npy files of the preload set")
    ap.add_argument("--npy-mib", type=int, default=512, help="MiB of each .npy file")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--peers", default="", help=f"other loaders timed alike, interleaved: {','.join(PEERS)} "
                    "(their import is inside their first load)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--timeout", type=float, default=180)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    peers = [p for p in args.peers.split(",") if p]
    if any(p not in PEERS for p in peers):
        raise SystemExit(f"--peers takes {', '.join(PEERS)}")
    kinds = ["here", "resident", *peers]
    fresh_process.source_trees("")  # bytecode made first, as installing the package does
    data = _sets(args)
    index = args.device.partition(":")[2] or "0"
    server = subprocess.Popen([sys.executable, "-m", "gdskit", "serve", "--device", index, "--json"],
                              stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        if not line or json.loads(line)["event"] != "listening":
            raise SystemExit(f"gdskit serve did not start: {line!r}")
        for name, paths in data.items():  # a loader that has served before
            warm(paths)
            _child(name, paths, "resident", args.device, args.timeout)
        runs: dict[str, dict[str, list[dict]]] = {n: {k: [] for k in kinds} for n in data}
        for rnd in range(args.rounds):
            order = kinds if rnd % 2 == 0 else kinds[::-1]
            for name, paths in data.items():
                for kind in order:
                    if kind in PEERS and name == "preload":
                        continue  # the peers load safetensors
                    warm(paths)
                    r = _child(name, paths, kind, args.device, args.timeout)
                    runs[name][kind].append(r)
                    print(f"round {rnd} {name} {kind}: {json.dumps(r)}", file=sys.stderr, flush=True)
    finally:
        server.terminate()
        tail, _ = server.communicate(timeout=60)
    served = [json.loads(x) for x in tail.splitlines() if x.startswith("{")]
    done = [e for e in served if e["event"] == "served"]
    print(f"the resident loader served {len(done)} loads in the rounds and the warm-up")
    for files in sorted({e.get("files", 1) for e in done}):
        mine = [e for e in done if e.get("files", 1) == files]
        print(f"  requests of {files} file(s): {len(mine)}, the loader's ms each "
              f"{_span([1e3 * e['seconds'] for e in mine])}, mapping {_span([1e3 * e['map_seconds'] for e in mine])}")
    print("| set | kind | import ms | first load ms | first call incl. import, GB/s | second load, GB/s | first/second |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, paths in data.items():
        nbytes = sum(os.path.getsize(p) for p in paths)
        for kind in kinds:
            if not runs[name][kind]:
                continue
            ok = [r for r in runs[name][kind] if "error" not in r]
            bad = len(runs[name][kind]) - len(ok)
            print(f"| {name} | {kind}{f' ({bad} failed)' if bad else ''} | {_span([r['import_ms'] for r in ok])} | "
                  f"{_span([r['first_ms'] for r in ok])} | "
                  f"{_span([nbytes / r['first_with_import_ms'] / 1e6 for r in ok])} | "
                  f"{_span([nbytes / r['second_ms'] / 1e6 for r in ok])} | "
                  f"{_span([r['second_ms'] / r['first_ms'] for r in ok])} |")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"command": sys.argv, "runs": runs, "loader_events": served}, fh, indent=1)


if __name__ == "__main__":
    main()
