#!/usr/bin/env python3
"""torch.distributed.checkpoint through gdskit against DCP's stock FileSystemWriter/Reader.

One rank with a sharded state dict on the GPU (DTensors on a one-rank mesh, 32 MiB
bf16 shards, ``--size`` in total), or ``--ranks N`` processes, one per GPU, each with its
shards of the same layers (NCCL between the GPUs, NVLink multicast off); every rank
reports its own rate and ledger. Every run is a fresh process timed from the
``dcp.save``/``dcp.load`` call to ``torch.cuda.synchronize()``; CPU time is the
process's user+system time over the same span. Saves fsync on both sides (the
stock writer's ``sync_files=True``); the stock writer is run with each
``--threads`` count and its best is the reference. Loads run hot (files read once
before) and, with ``--cold``, after dropping the page cache (root:
``/proc/sys/vm/drop_caches``, else ``posix_fadvise(DONTNEED)``). A raw
multi-threaded O_DIRECT read of the gdskit checkpoint gives the disk's rate.

    python benchmarks/dcp.py --dir /data/dcp-bench --size 8GiB --cold --json dcp.json

Targets (the issue): load >= 5x stock hot, >= 0.95x the raw disk rate cold (median of
``--cold-pairs`` raw-read / gdskit-load pairs, each pair back to back);
save >= 2x the best stock save.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

from fresh_process import exit_status  # benchmarks/ is on sys.path when run as a script
from page_cache import drop_caches, warm
from raw_disk import odirect_io

GB = 1e9
MiB = 1 << 20
SHARD_ELEMS = 4096 * 4096  # 32 MiB of bf16


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(float(t) * (1 << 30))  # a bare number is GiB


# -- inside the child ---------------------------------------------------------------

def _init_dist(device: str, rank: int, world: int, store: str):
    import torch.distributed as dist
    from torch.distributed.tensor import init_device_mesh
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") and world > 1 else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    return init_device_mesh(device.split(":")[0], (world,))


def _state_dict(total: int, device: str, mesh, zeros: bool):
    """This rank's shards: layers of ``world`` x 4096 rows, 4096 columns, bf16, sharded by rows
    (32 MiB a rank a layer); ``total`` bytes over all ranks. Returns the state dict and this rank's bytes."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    world, rank = mesh.size(), mesh.get_local_rank()
    n = max(1, total // (SHARD_ELEMS * 2 * world))
    g = torch.Generator(device=device).manual_seed(rank)
    sd = {}
    for i in range(n):
        t = torch.empty(4096, 4096, dtype=torch.bfloat16, device=device)
        if zeros:
            t.zero_()
        else:
            t.view(torch.int16).random_(generator=g)
        sd[f"layers.{i}.weight"] = DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
    sd["step"] = 1000
    return sd, n * SHARD_ELEMS * 2


def child(args: argparse.Namespace) -> None:
    if args.impl == "gdskit":
        os.environ.setdefault("GDSKIT_THREADS", str(args.gdskit_threads))
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import gdskit
    import gdskit.dcp
    device = args.device
    if device.startswith("cuda") and args.world > 1:  # one GPU a rank
        device = f"cuda:{args.rank % torch.cuda.device_count()}"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    mesh = _init_dist(device, args.rank, args.world, args.store)
    sd, nbytes = _state_dict(parse_size(args.size), device, mesh, zeros=args.op == "load")
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    dist.barrier()  # every rank starts the clock together
    before = gdskit.stats()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    if args.op == "save":
        if args.impl == "gdskit":
            writer = gdskit.dcp.StorageWriter(args.path)
        else:
            writer = dcp.FileSystemWriter(args.path, sync_files=True, thread_count=args.stock_threads)
        dcp.save(sd, storage_writer=writer)
    else:
        reader = gdskit.dcp.StorageReader(args.path) if args.impl == "gdskit" else dcp.FileSystemReader(args.path)
        dcp.load(sd, storage_reader=reader)
    sync()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    paths = {k: {"read": v["bytes_read"], "written": v["bytes_written"]}
             for k, v in gdskit.stats_delta(before, gdskit.stats()).to_dict()["paths"].items()}
    print("RESULT " + json.dumps({"rank": args.rank, "wall_s": wall, "cpu_s": cpu, "bytes": nbytes, "paths": paths}))
    dist.destroy_process_group()


# -- the parent ---------------------------------------------------------------------

def data_files(directory: str) -> list[str]:
    return [os.path.join(directory, n) for n in sorted(os.listdir(directory)) if n.endswith(".distcp")]


def odirect_rate(paths: list[str], threads: int, block: int = 16 * MiB) -> float:
    """GB/s of a raw O_DIRECT read of ``paths`` with ``threads`` workers (the disk's own rate)."""
    got = odirect_io(paths, threads, block)
    return got.bytes / GB / got.seconds


def run_child(args: argparse.Namespace, op: str, impl: str, path: str, stock_threads: int = 1) -> dict:
    """One timed save or load, by ``--ranks`` processes (one per GPU); the whole and each rank's part."""
    store = os.path.join(args.dir, f".store.{os.getpid()}.{time.monotonic_ns()}")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in range(args.ranks):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--op", op, "--impl", impl, "--path", path,
               "--size", args.size, "--device", args.device, "--gdskit-threads", str(args.gdskit_threads),
               "--stock-threads", str(stock_threads), "--rank", str(rank), "--world", str(args.ranks),
               "--store", store]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
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
            tail = (stderr or stdout).strip().splitlines()[-3:]
            return {"error": " | ".join(tail) or f"exit {p.returncode}"}
        r = found[-1]
        r["gb_per_s"] = r["bytes"] / GB / r["wall_s"]
        ranks.append(r)
    total, wall, cpu = sum(r["bytes"] for r in ranks), max(r["wall_s"] for r in ranks), sum(r["cpu_s"] for r in ranks)
    paths: dict[str, dict[str, int]] = {}  # every rank's ledger, added up
    for r in ranks:
        for name, moved in r["paths"].items():
            acc = paths.setdefault(name, {"read": 0, "written": 0})
            acc["read"] += moved["read"]
            acc["written"] += moved["written"]
    out = {"wall_s": wall, "cpu_s": cpu, "bytes": total, "gb_per_s": total / GB / wall,
           "cpu_s_per_gb": cpu / (total / GB), "paths": paths}
    if len(ranks) > 1:
        out["ranks"] = ranks
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/gdskit-dcp-bench", help="where the checkpoints are written")
    ap.add_argument("--size", default="8GiB", help="state dict size (e.g. 8GiB, 512MiB)")
    ap.add_argument("--threads", default="1,4,8,16", help="thread_count values tried for the stock writer")
    ap.add_argument("--gdskit-threads", type=int, default=16, help="GDSKIT_THREADS for the gdskit runs")
    ap.add_argument("--cold", action="store_true", help="also load with the page cache dropped")
    ap.add_argument("--repeats", type=int, default=1, help="runs per case (best is reported)")
    ap.add_argument("--cold-pairs", type=int, default=3,
                    help="raw O_DIRECT read / gdskit cold load pairs for the cold target (median ratio)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--ranks", type=int, default=1,
                    help="processes, one per GPU (rank r on cuda:r), NCCL between them; --size is their total")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", dest="json_out", help="write all results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--op", help=argparse.SUPPRESS)
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--stock-threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    os.makedirs(args.dir, exist_ok=True)
    results: list[dict] = []

    def best(op: str, impl: str, path: str, label: str, stock_threads: int = 1, prepare=None) -> dict:
        runs = []
        for _ in range(max(1, args.repeats)):
            how = prepare() if prepare else None
            r = run_child(args, op, impl, path, stock_threads)
            r.update({"op": op, "impl": label, "cache": how})
            runs.append(r)
        ok = [r for r in runs if "error" not in r]
        pick = max(ok, key=lambda r: r["gb_per_s"]) if ok else runs[0]
        results.append(pick)
        per_rank = ""
        if "ranks" in pick:
            per_rank = "  (" + ", ".join(f"rank {r['rank']} {r['gb_per_s']:.2f}" for r in pick["ranks"]) + " GB/s)"
        print(f"  {op:5} {label:40} {pick.get('cache') or '':12} "
              + (f"{pick['gb_per_s']:7.2f} GB/s  {pick['cpu_s_per_gb']:6.2f} CPU-s/GB{per_rank}" if "error" not in pick
                 else pick["error"]), flush=True)
        return pick

    def fresh(path: str):
        def prep() -> str:
            shutil.rmtree(path, ignore_errors=True)
            os.sync()
            return "new dir"
        return prep

    # saves (fsync on both), keeping the last of each kind for the loads
    g_path = os.path.join(args.dir, "gdskit")
    s_path = os.path.join(args.dir, "stock")
    best("save", "gdskit", g_path, "gdskit StorageWriter", prepare=fresh(g_path))
    for t in [int(x) for x in args.threads.split(",") if x]:
        best("save", "stock", s_path, f"stock FileSystemWriter t={t}", stock_threads=t, prepare=fresh(s_path))

    modes = ["hot"] + (["cold"] if args.cold else [])
    for mode in modes:
        for impl, path, label in (("gdskit", g_path, "gdskit StorageReader"),
                                  ("stock", s_path, "stock FileSystemReader"),
                                  ("gdskit", s_path, "gdskit reading stock files")):
            files = data_files(path)

            def prep(files=files, mode=mode) -> str:
                if mode == "cold":
                    return drop_caches(files)
                warm(files)
                return "warmed"
            best("load", impl, path, label + f" ({mode})", prepare=prep)
    raw = None
    if args.cold:
        # The disk's rate moves from one minute to the next: pair each raw read with a gdskit
        # cold load right after it and judge the median of the pairs' ratios.
        files = data_files(g_path)
        ratios = []
        for i in range(max(1, args.cold_pairs)):
            drop_caches(files)
            r_raw = odirect_rate(files, args.gdskit_threads)
            drop_caches(files)
            r_g = run_child(args, "load", "gdskit", g_path)
            if "error" in r_g:
                print(f"  pair {i + 1}: gdskit cold load failed: {r_g['error']}")
                continue
            ratios.append(r_g["gb_per_s"] / r_raw)
            results.append({"op": "raw", "impl": "O_DIRECT read", "gb_per_s": r_raw, "pair": i})
            results.append({**r_g, "op": "load-pair", "impl": "gdskit StorageReader (cold, paired)", "pair": i})
            print(f"  pair {i + 1}: raw O_DIRECT ({args.gdskit_threads} threads x 16 MiB) {r_raw:6.2f} GB/s, "
                  f"gdskit cold load {r_g['gb_per_s']:6.2f} GB/s, ratio {ratios[-1]:.2f}", flush=True)
        raw = statistics.median(ratios) if ratios else None
    verdict = evaluate(results, raw)
    for k, v in verdict.items():
        print(f"{k}: {v}")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                       "results": results, "targets": verdict}, fh, indent=2)
    raise SystemExit(exit_status(results))


def evaluate(results: list[dict], raw: float | None) -> dict[str, str]:
    """The issue's targets; ``raw`` is the median gdskit/raw ratio of the paired cold runs."""
    def rate(op: str, pred) -> float | None:
        xs = [r["gb_per_s"] for r in results if r.get("op") == op and "gb_per_s" in r and pred(r["impl"])]
        return max(xs) if xs else None

    out: dict[str, str] = {}
    g_save = rate("save", lambda i: i.startswith("gdskit"))
    s_save = rate("save", lambda i: i.startswith("stock"))
    if g_save and s_save:
        out["save >= 2x best stock"] = f"{g_save / s_save:.2f}x ({'met' if g_save >= 2 * s_save else 'missed'})"
    g_hot = rate("load", lambda i: i == "gdskit StorageReader (hot)")
    s_hot = rate("load", lambda i: i == "stock FileSystemReader (hot)")
    if g_hot and s_hot:
        out["load hot >= 5x stock"] = f"{g_hot / s_hot:.2f}x ({'met' if g_hot >= 5 * s_hot else 'missed'})"
    if raw:  # the median ratio of the paired cold runs
        out["load cold >= 0.95x raw disk"] = f"{raw:.2f}x, median of pairs ({'met' if raw >= 0.95 else 'missed'})"
    return out


if __name__ == "__main__":
    main()
