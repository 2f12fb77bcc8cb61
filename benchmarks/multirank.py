#!/usr/bin/env python3
"""N ranks each loading the same (replicated) safetensors checkpoint: fan-out against every rank reading everything.

For each N in ``--ranks`` this launches N processes (one per GPU with ``--device cuda``,
NCCL between them; gloo with ``--device cpu``), joined in one process group, and times:

- ``each``: every rank calls ``gdskit.safetensors.load_file`` alone (N times the storage traffic);
- ``fanout``: every rank calls it with ``process_group=``: each byte is read by one rank
  and broadcast to the others (docs/multigpu.md);
- ``bcast``: no storage at all, the same bytes broadcast in 64 MiB pieces from every rank
  in turn: the group's own bound for a hot fan-out load.

Loads run cold (page cache dropped before the launch: root's ``drop_caches``, else
``posix_fadvise(DONTNEED)``; gdskit reads cold misses with O_DIRECT, so in ``each`` every
rank goes to the disk) and hot (the file read once before). Each process loads
``--loads`` times; the first load is the fresh process's, the best of the others the
process's hot rate. Wall time is the slowest rank's, from a barrier to the end of its
load (``torch.cuda.synchronize``). Every rank reports its ledger: bytes from storage (by
path), bytes from peers (by sending rank and backend), and a checksum of what it loaded,
compared with the checksum written when the checkpoint was made. N=1 is the reference.

    python benchmarks/multirank.py --dir /data/mr --size 16GiB --ranks 1,2 --cold --json mr.json
    python benchmarks/multirank.py --device cpu --quick          # correctness run, gloo, small file

Targets (multi-GPU machine): N=2 cold >= 1.8x faster than ``each``; hot within 10 % of
``bcast``. NVLink multicast stays off in the launched ranks (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fresh_process import exit_status  # noqa: E402
from page_cache import drop_caches, warm  # noqa: E402

GB = 1e9
MiB = 1 << 20
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(float(t) * (1 << 30))  # a bare number is GiB


# -- the checkpoint -------------------------------------------------------------------

def _checksum(tensors: dict[str, Any]) -> int:
    """The sum of every tensor's bytes (order-free, exact), computed where the tensors are."""
    import torch

    total = 0
    for t in tensors.values():
        total += int(t.reshape(-1).view(torch.uint8).sum(dtype=torch.int64).item())
    return total


def ensure_checkpoint(directory: str, size: int, tensor_bytes: int) -> dict[str, Any]:
    """``model.safetensors`` of about ``size`` bytes of bf16 tensors (made once) and its checksum."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "model.safetensors")
    meta_path = path + ".bench.json"
    if os.path.exists(path) and os.path.exists(meta_path):
        with open(meta_path) as fh:
            meta = json.load(fh)
        if meta.get("size") == size and meta.get("tensor_bytes") == tensor_bytes:
            return meta
    import torch

    import gdskit.safetensors

    print(f"creating a {size / GB:.2f} GB checkpoint in {directory} ...", file=sys.stderr, flush=True)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    left, i = size, 0
    while left > 0:
        n = min(tensor_bytes, left)
        n -= n % 2
        if n <= 0:
            break
        t = torch.empty(n // 2, dtype=torch.int16)
        t.random_(generator=g)
        tensors[f"layers.{i}.weight"] = t.view(torch.bfloat16)
        left -= n
        i += 1
    tensors["norm.bias"] = torch.arange(1001, dtype=torch.float32)  # an odd small one
    gdskit.safetensors.save_file(tensors, path)
    meta = {"path": path, "size": size, "tensor_bytes": tensor_bytes, "checksum": _checksum(tensors),
            "data_bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "tensors": len(tensors)}
    with open(meta_path, "w") as fh:
        json.dump(meta, fh)
    return meta


# -- inside one rank --------------------------------------------------------------------

def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import gdskit
    import gdskit.group
    import gdskit.safetensors

    rank, world = args.rank, args.world
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = args.backend if args.backend != "auto" else ("cpu:gloo,cuda:nccl" if cuda else "gloo")
    dist.init_process_group(backend, init_method=f"file://{args.store}", rank=rank, world_size=world)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    # The first collective sets up the backend's connections; it is not the load's to pay for.
    warm_up = torch.zeros(1, device=device)
    dist.all_reduce(warm_up)
    sync()
    with open(args.meta) as fh:
        meta = json.load(fh)
    loads = []
    for _ in range(args.loads):
        dist.barrier()
        before = gdskit.stats()
        t0 = time.perf_counter()
        if args.mode == "bcast":
            total = meta["data_bytes"]
            buf = torch.empty(total, dtype=torch.uint8, device=device)
            piece = 64 * MiB
            works = [dist.broadcast(buf[off:off + piece], src=(off // piece) % world, async_op=True)
                     for off in range(0, total, piece)]
            for w in works:
                w.wait()
            sync()
            out: dict[str, Any] = {}
        else:
            group = dist.group.WORLD if args.mode == "fanout" else None
            with gdskit.group.options(window=args.window):
                out = gdskit.safetensors.load_file(meta["path"], device, process_group=group)
            sync()
        wall = time.perf_counter() - t0
        delta = gdskit.stats_delta(before, gdskit.stats())
        loads.append({"wall_s": wall, "storage_bytes": delta.storage_bytes, "peer_bytes": delta.peer_bytes,
                      "paths": {k: v.bytes_read for k, v in delta.paths.items()},
                      "sources": {f"{p.source_rank}/{p.backend}": p.bytes for p in delta.peers},
                      "exact": None if not out else _checksum(out) == meta["checksum"]})
        del out
    print("RESULT " + json.dumps({"rank": rank, "loads": loads}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# -- the parent -----------------------------------------------------------------------

def run_case(args: argparse.Namespace, meta_path: str, mode: str, world: int) -> dict[str, Any]:
    store = os.path.join(args.dir, f".store.{os.getpid()}.{time.monotonic_ns()}")
    env = {**os.environ, **NO_MULTICAST, "OMP_NUM_THREADS": "1"}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(here, "..", "src"), env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", "--mode", mode,
                               "--rank", str(r), "--world", str(world), "--store", store, "--meta", meta_path,
                               "--device", args.device, "--loads", str(args.loads), "--window", args.window,
                               "--backend", args.backend],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    outs = []
    deadline = time.monotonic() + args.timeout
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:.0f} s"}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if os.path.exists(store):
            os.unlink(store)
    ranks = []
    for p, (stdout, stderr) in zip(procs, outs):
        found = [json.loads(ln[7:]) for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        if not found:
            tail = (stderr or stdout).strip().splitlines()[-4:]
            return {"error": " | ".join(tail) or f"exit {p.returncode}"}
        ranks.append(found[-1])
    per_load = []
    for i in range(args.loads):
        rows = [r["loads"][i] for r in ranks]
        per_load.append({"wall_s": max(x["wall_s"] for x in rows), "ranks": rows})
    return {"first": per_load[0], "hot_best": min(per_load[1:], key=lambda x: x["wall_s"]) if args.loads > 1 else None}


def summarize(case: dict[str, Any], meta: dict[str, Any], world: int) -> dict[str, Any]:
    load = case["first"]
    data = meta["data_bytes"]
    shares = [r["storage_bytes"] / data for r in load["ranks"]]
    exact = [r["exact"] for r in load["ranks"] if r["exact"] is not None]
    out = {"wall_s": load["wall_s"], "gb_per_s_per_rank": data / GB / load["wall_s"],
           "storage_share_per_rank": shares, "peer_bytes_per_rank": [r["peer_bytes"] for r in load["ranks"]],
           "exact": all(exact) if exact else None}
    if case.get("hot_best"):
        out["hot_second_wall_s"] = case["hot_best"]["wall_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/gdskit-multirank-bench", help="where the checkpoint is made")
    ap.add_argument("--size", default=None, help="checkpoint size (default 16GiB; 64MiB with --quick)")
    ap.add_argument("--tensor-size", default=None, help="bytes per tensor (default 256MiB; 2MiB with --quick)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--backend", default="auto",
                    help="torch.distributed backend (default: cpu:gloo,cuda:nccl with cuda, gloo on cpu); "
                         "gloo with cuda puts several ranks on one GPU (a correctness run, not a speed one)")
    ap.add_argument("--ranks", default=None, help="comma-separated N values (default 1 and every GPU; 1,2 on cpu)")
    ap.add_argument("--cold", action="store_true", help="also run with the page cache dropped")
    ap.add_argument("--loads", type=int, default=2, help="loads per process (the first, then the best of the rest)")
    ap.add_argument("--window", default="1GiB", help="gdskit.group.options(window=) for the fan-out")
    ap.add_argument("--quick", action="store_true", help="a small checkpoint and small windows: a correctness run")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", dest="json_out", help="write all results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--meta", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.loads < 1:
        ap.error("--loads must be at least 1")
    size = parse_size(args.size or ("64MiB" if args.quick else "16GiB"))
    tensor = parse_size(args.tensor_size or ("2MiB" if args.quick else "256MiB"))
    if args.quick and args.window == "1GiB":
        args.window = "8MiB"
    if args.ranks:
        worlds = [int(x) for x in args.ranks.split(",")]
    elif args.device == "cuda":
        import torch
        worlds = sorted({1, max(1, torch.cuda.device_count())})
    else:
        worlds = [1, 2]
    if min(worlds) < 1:
        ap.error("--ranks must be positive")
    meta = ensure_checkpoint(args.dir, size, tensor)
    meta_path = meta["path"] + ".bench.json"

    temps = (["cold"] if args.cold else []) + ["hot"]
    results = []
    for world in worlds:
        for mode in (["each"] if world == 1 else ["each", "fanout", "bcast"]):
            for temp in (["hot"] if mode == "bcast" else temps):
                if temp == "cold":
                    how = drop_caches([meta["path"]])
                else:
                    warm([meta["path"]])
                    how = "warm"
                print(f"N={world} {mode} {temp} ...", file=sys.stderr, flush=True)
                case = run_case(args, meta_path, mode, world)
                row = {"ranks": world, "mode": mode, "cache": temp, "cache_control": how}
                row.update({"error": case["error"]} if "error" in case else summarize(case, meta, world))
                row["raw"] = case
                results.append(row)
    report(results, meta, args)


def _ratio(results: list[dict[str, Any]], world: int, cache: str) -> float | None:
    def wall(mode: str) -> float | None:
        for r in results:
            if r["ranks"] == world and r["mode"] == mode and r["cache"] == cache and "wall_s" in r:
                return r["wall_s"]
        return None
    each, fan = wall("each"), wall("fanout")
    return each / fan if each and fan else None


def report(results: list[dict[str, Any]], meta: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\ncheckpoint: {meta['data_bytes'] / GB:.2f} GB in {meta['tensors']} tensors; device {args.device}")
    head = f"{'N':>2} {'mode':7s} {'cache':5s} {'wall s':>8s} {'GB/s/rank':>10s} {'2nd s':>8s} " \
           f"{'storage share per rank':24s} {'exact':5s}"
    print(head)
    print("-" * len(head))
    for r in results:
        if "error" in r:
            print(f"{r['ranks']:>2} {r['mode']:7s} {r['cache']:5s} error: {r['error']}")
            continue
        shares = " ".join(f"{s:.2f}" for s in r["storage_share_per_rank"])
        second = f"{r['hot_second_wall_s']:8.3f}" if r.get("hot_second_wall_s") else f"{'-':>8s}"
        print(f"{r['ranks']:>2} {r['mode']:7s} {r['cache']:5s} {r['wall_s']:8.3f} {r['gb_per_s_per_rank']:10.2f} "
              f"{second} {shares:24s} {str(r['exact']):5s}")
    speedups = {f"N={w} {c}": _ratio(results, w, c) for w in sorted({r["ranks"] for r in results}) if w > 1
                for c in ("cold", "hot")}
    for k, v in speedups.items():
        if v is not None:
            print(f"fan-out vs each rank reading everything, {k}: {v:.2f}x")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("child", "mode", "rank", "world",
                                                                            "store", "meta")},
                       "checkpoint": meta, "results": results, "speedups": speedups}, fh, indent=1)
    else:
        print(json.dumps({"results": [{k: v for k, v in r.items() if k != "raw"} for r in results],
                          "speedups": speedups}))
    raise SystemExit(exit_status(results))


if __name__ == "__main__":
    main()
