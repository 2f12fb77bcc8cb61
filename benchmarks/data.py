#!/usr/bin/env python3
"""gdskit.data against its peers: dataset preload, token streaming, and a training-step-shaped loop.

Workloads (``--quick``: small sizes for a smoke run, on the CPU too):
  preload-shards  8 GiB in 1,024 ``.npy`` shards of 8 MiB     (quick: 64 MiB in 32)
  preload-small   100,000 ``.npy`` files of 64 KiB (6.6 GB)  (quick: 2,000 of 16 KiB; --small-files)
  tokens          a 4 GiB uint16 token file, seq_len 2048, batch 64, shuffled; --batches of them
                  (quick: 128 MiB, 200 batches)
  step            the tokens workload, each batch consumed by a fixed-duration GPU kernel (calibrated
                  to --step-ms); does the loader keep the GPU busy?

Peers. preload: ``gdskit`` (gdskit.data.preload); ``engine`` (gdskit.open + pread of each file,
2 x threads files in flight: the files one by one through the engine); ``odirect`` (raw O_DIRECT
reads into host memory, the disk's ceiling; cold only); ``kvikio`` (KvikIO reads of each file into
preallocated device memory, when importable); ``numpy`` (np.load, then .to(device)).
tokens: ``gdskit`` (TokenDataset + Loader, prefetch 2; ``gdskit-prefetch-4``: prefetch 4,
``gdskit-prefetch-0``: each batch read when asked for, ``gdskit-workers-N``: N reader processes; these
run only when named in --peers);
``dataloader-N`` (torch DataLoader, N workers reading the windows with numpy, pin_memory=True,
.to(device, non_blocking=True)).
step: ``memory`` (the batches already in GPU memory: the step alone), ``gdskit``, ``dataloader-8``.
Every measurement runs in a fresh process; rounds interleave the peers (alternating order);
``--cold`` also runs the preloads with the page cache dropped before each run (root:
/proc/sys/vm/drop_caches, else posix_fadvise DONTNEED per file). Reports GB/s (1 GB = 1e9 bytes),
batches/s, step ms, CPU-seconds per GB (this process and its child processes: DataLoader's workers,
gdskit's reader processes), peak GPU memory in batches (tokens rows: a step's own memory is
not the loader's), and the ledger's paths. Token and step rows also give the time to the first batch and
the steady rate: batches/s after the first tenth of the batches (workers started, buffers made), for
every peer alike.

    python benchmarks/data.py --device cuda:0 --cold --json /tmp/out/data.json   # about 4 minutes
    python benchmarks/data.py --device cpu --quick                                # smoke run, any machine
    python benchmarks/data.py --workloads preload-small --peers gdskit,odirect --cold --no-hot --rounds 3 \
        --src before=/old/src,now=src                                 # two trees, cold pairs by round
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import fresh_process  # benchmarks/ is on sys.path when run as a script
from page_cache import drop_caches, warm

GB = 1e9
MiB = 1 << 20

WORKLOADS = ["preload-shards", "preload-small", "tokens", "step"]
PEERS = {
    "preload-shards": ["gdskit", "engine", "odirect", "kvikio", "numpy"],
    "preload-small": ["gdskit", "engine", "odirect", "numpy"],
    "tokens": ["gdskit", "dataloader-8", "dataloader-16"],
    "step": ["memory", "gdskit", "dataloader-8"],
}
EXTRA_PEERS = {"tokens": ["gdskit-prefetch-4", "gdskit-prefetch-0", "gdskit-workers-2", "gdskit-workers-4",
                          "gdskit-workers-8"],
               "step": ["gdskit-workers-4"]}  # variants, run only when named
COLD_ONLY = {"odirect"}          # the disk's ceiling: a hot run of it measures nothing
HOT_ONLY = {"tokens", "step"}    # streaming workloads run hot (the file fits the page cache)


def sizes(quick: bool) -> dict:
    if quick:
        return {"shards": 32, "shard_bytes": 2 * MiB, "small": 2000, "small_bytes": 16 << 10,
                "token_bytes": 128 * MiB, "seq_len": 2048, "batch": 64, "batches": 200, "step_ms": 2.0}
    return {"shards": 1024, "shard_bytes": 8 * MiB, "small": 100_000, "small_bytes": 64 << 10,
            "token_bytes": 4 << 30, "seq_len": 2048, "batch": 64, "batches": 1000, "step_ms": 5.0}


# -- the data (made once per size; later runs reuse it) ----------------------------------------------

def ensure_data(directory: str, sz: dict, workloads: list[str]) -> dict[str, list[str]]:
    """The files of ``workloads`` (made once; later runs reuse them)."""
    import numpy as np

    rng = np.random.default_rng(0)
    pool = rng.random((64 * MiB) // 4, dtype=np.float32)  # each file a different window of it: fast to make
    out: dict[str, list[str]] = {}
    for name, count, nbytes in (("shards", sz["shards"], sz["shard_bytes"]), ("small", sz["small"], sz["small_bytes"])):
        if f"preload-{name}" not in workloads:
            continue
        d = os.path.join(directory, f"{name}-{count}x{nbytes}")
        paths = [os.path.join(d, f"{i:06d}.npy") for i in range(count)]
        if not os.path.exists(paths[-1]):
            print(f"making {count} .npy files of {nbytes} bytes in {d} ...", file=sys.stderr, flush=True)
            os.makedirs(d, exist_ok=True)
            n = nbytes // 4
            for i, p in enumerate(paths):
                start = (i * 4099) % (len(pool) - n)
                np.save(p, pool[start:start + n].reshape(-1, 256))
        out[name] = paths
    if "tokens" not in workloads and "step" not in workloads:
        return out
    tok = os.path.join(directory, f"tokens-{sz['token_bytes']}.bin")
    if not os.path.exists(tok) or os.path.getsize(tok) != sz["token_bytes"]:
        print(f"making {tok} ...", file=sys.stderr, flush=True)
        block = rng.integers(0, 50257, (64 * MiB) // 2, dtype=np.uint16).tobytes()
        with open(tok + ".part", "wb") as f:
            left = sz["token_bytes"]
            while left:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
        os.replace(tok + ".part", tok)
    out["tokens"] = [tok]
    return out


# -- the child: one measurement ------------------------------------------------------------------

def _cpu_s() -> float:
    """CPU seconds of this process and of its child processes (DataLoader's workers, gdskit's
    reader processes): those still running or unreaped from /proc, the reaped ones from rusage."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + _unreaped_children_cpu_s()


def _unreaped_children_cpu_s() -> float:
    tick, pid, total = os.sysconf("SC_CLK_TCK"), os.getpid(), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile: reaped, so counted by rusage
        if int(fields[1]) == pid:  # fields[11] and [12] are utime and stime (stat's 14th and 15th)
            total += int(fields[11]) + int(fields[12])
    return total / tick


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def _preload(peer: str, paths: list[str], device: str, threads: int) -> int:
    import numpy as np
    import torch
    if peer == "gdskit":
        import gdskit.data
        out = gdskit.data.preload(paths, device=device, progress=False)
        return sum(t.numel() * t.element_size() for t in out.values())
    if peer == "numpy":
        return sum(torch.from_numpy(np.load(p)).to(device).nbytes for p in paths)
    if peer == "odirect":
        from raw_disk import odirect_io
        return odirect_io(paths, threads, 16 * MiB).bytes
    sizes_ = [os.path.getsize(p) for p in paths]
    bufs = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes_]
    _sync(device)
    if peer == "engine":
        import gdskit
        from collections import deque
        running: deque = deque()
        for p, b in zip(paths, bufs):
            if len(running) >= 2 * threads:
                f, fut = running.popleft()
                fut.result()
                f.close()
            f = gdskit.open(p)
            running.append((f, f.pread(b)))
        for f, fut in running:
            fut.result()
            f.close()
        return sum(sizes_)
    if peer == "kvikio":
        import kvikio
        futs = []
        for p, b in zip(paths, bufs):
            f = kvikio.CuFile(p, "r")
            futs.append((f, f.pread(b)))
        for f, fut in futs:
            fut.get()
            f.close()
        return sum(sizes_)
    raise SystemExit(f"unknown peer {peer}")


class _Windows:
    """The token windows for torch's DataLoader: each read with os.pread (a worker per process)."""

    def __init__(self, path: str, seq_len: int) -> None:
        self.path, self.seq_len = path, seq_len
        self.n = (os.path.getsize(path) // 2 - 1) // seq_len
        self.fd = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import numpy as np
        import torch
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDONLY)
        nb = (self.seq_len + 1) * 2
        return torch.from_numpy(np.frombuffer(os.pread(self.fd, nb, i * self.seq_len * 2), dtype=np.uint16).copy())


class _Step:
    """A training-step-shaped piece of work that consumes a batch. On a GPU: one kernel that reads
    the batch, then one fixed-duration kernel (``torch.cuda._sleep``, calibrated to ``step_ms``):
    the step keeps the GPU busy and costs the interpreter two launches, as a compiled or
    graph-captured step does. On the CPU (a smoke run): a small matmul loop of about ``step_ms``."""

    def __init__(self, device: str, step_ms: float, seq_len: int) -> None:
        import torch
        self.torch = torch
        self.cuda = device.startswith("cuda")
        self.out = torch.zeros((), device=device, dtype=torch.float32)
        if self.cuda:
            self.cycles = 1_000_000
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(self.cycles)  # warm
            start.record()
            torch.cuda._sleep(self.cycles)
            end.record()
            end.synchronize()
            self.cycles = max(1, int(self.cycles * step_ms / start.elapsed_time(end)))
            return
        self.width = 256
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.w = torch.randn(self.width, self.width, generator=gen) / self.width ** 0.5
        self.repeats = 1
        probe = torch.zeros(64, seq_len + 1, dtype=torch.int64)
        self(probe)
        n = 20
        t0 = time.perf_counter()
        for _ in range(n):
            self(probe)
        self.repeats = max(1, round(step_ms / 1000 / ((time.perf_counter() - t0) / n)))

    def __call__(self, batch) -> None:
        if self.cuda:
            self.out += batch[:, -1].float().mean()  # the step's result depends on every batch
            self.torch.cuda._sleep(self.cycles)
            return
        h = batch[:, :self.width].float() / 50257
        h = h.repeat(self.width // h.shape[0] or 1, 1)[:, :self.width]
        for _ in range(self.repeats):
            h = self.torch.tanh(h @ self.w)
        self.out += h.mean()


def _stream(peer: str, path: str, device: str, sz: dict, threads: int, with_step: bool) -> tuple[int, int]:
    """Batches of the token file through ``peer``; (batches, bytes)."""
    import torch
    n_batches, bs, seq = sz["batches"], sz["batch"], sz["seq_len"]
    step = _Step(device, sz["step_ms"], seq) if with_step else None
    _restart_clock()  # the step's calibration is not the peer's time
    batch_bytes = bs * (seq + 1) * 2
    if peer == "memory":
        import numpy as np
        # The batches the loader would give, already in device memory: the step alone.
        rng = np.random.default_rng(0)
        n_windows = (os.path.getsize(path) // 2 - 1) // seq
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        ring = min(n_batches, 64)
        batches = [torch.from_numpy(np.stack([tokens[i * seq:i * seq + seq + 1] for i in
                                              rng.integers(0, n_windows, bs)])).to(device) for _ in range(ring)]
        _sync(device)
        _restart_clock()  # the clock starts once the data is in memory
        for k in range(n_batches):
            step(batches[k % ring])
            _batch_done(k + 1, n_batches, device)
        return n_batches, n_batches * batch_bytes
    if peer.startswith("gdskit"):
        import gdskit.data as gd
        prefetch = {"gdskit-prefetch-4": 4, "gdskit-prefetch-0": 0}.get(peer, 2)
        workers = int(peer.rsplit("-", 1)[1]) if peer.startswith("gdskit-workers-") else 0
        ds = gd.TokenDataset(path, dtype="uint16", seq_len=seq)
        loader = gd.Loader(ds, bs, device=device, shuffle=True, seed=0, prefetch=prefetch, workers=workers)
        done = 0
        for b in loader:
            if step is not None:
                step(b)
            done += 1
            _batch_done(done, n_batches, device)
            if done == n_batches:
                break
        loader.close()
        return done, done * batch_bytes
    if peer.startswith("dataloader-"):
        from torch.utils.data import DataLoader
        workers = int(peer.split("-")[1])
        if sz.get("dl_workers"):
            workers = min(workers, sz["dl_workers"])
        cuda = device.startswith("cuda")
        dl = DataLoader(_Windows(path, seq), batch_size=bs, shuffle=True, num_workers=workers,
                        pin_memory=cuda, drop_last=True, persistent_workers=False,
                        prefetch_factor=2 if workers else None)
        done = 0
        for b in dl:
            b = b.to(device, non_blocking=True)
            if step is not None:
                step(b)
            done += 1
            _batch_done(done, n_batches, device)
            if done == n_batches:
                break
        del dl
        return done, done * batch_bytes
    raise SystemExit(f"unknown peer {peer}")


_CLOCK: dict[str, float] = {}  # wall and CPU time at the start of the measurement


def _restart_clock() -> None:
    """Start the measurement now (after a peer's set-up that is not part of it)."""
    _CLOCK.clear()
    _CLOCK.update(wall=time.perf_counter(), cpu=_cpu_s())


def _batch_done(done: int, n_batches: int, device: str) -> None:
    """Mark the first batch's arrival and the start of the steady part (after the first tenth of
    the batches: workers started, buffers made, the pipeline full), for every peer alike."""
    if done == 1:
        _CLOCK["first"] = time.perf_counter()
    if done == max(1, n_batches // 10) and done < n_batches:
        _sync(device)
        _CLOCK.update(steady_wall=time.perf_counter(), steady_cpu=_cpu_s(), steady_from=done)


def child(args: argparse.Namespace) -> None:
    if args.peer == "kvikio":
        os.environ.setdefault("KVIKIO_NTHREADS", str(args.threads))
        os.environ.setdefault("KVIKIO_COMPAT_MODE", "ON")
    os.environ.setdefault("GDSKIT_THREADS", str(args.threads))
    import torch
    sz = json.loads(args.sizes)
    with open(args.paths) as f:
        paths = json.load(f)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.empty(1, device=args.device)  # the CUDA context outside the clock, for every peer alike
        torch.cuda.reset_peak_memory_stats()
    if args.peer.startswith("gdskit") or args.peer == "engine":
        import gdskit
        import gdskit.data  # noqa: F401 - imported once, outside the clock
        before = gdskit.stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    _restart_clock()
    batches = None
    if args.workload.startswith("preload"):
        nbytes = _preload(args.peer, paths, args.device, args.threads)
    else:
        batches, nbytes = _stream(args.peer, paths[0], args.device, sz, args.threads, args.workload == "step")
    _sync(args.device)
    wall, cpu = time.perf_counter() - _CLOCK["wall"], _cpu_s() - _CLOCK["cpu"]
    out = {"wall_s": wall, "cpu_s": cpu, "bytes": nbytes, "batches": batches,
           "peak_gpu_bytes": (torch.cuda.max_memory_allocated() - base) if cuda else 0}
    if "first" in _CLOCK:
        out["first_batch_s"] = _CLOCK["first"] - _CLOCK["wall"]
    if "steady_wall" in _CLOCK and batches:
        out["steady_batches"] = batches - _CLOCK["steady_from"]
        out["steady_wall_s"] = time.perf_counter() - _CLOCK["steady_wall"]
        out["steady_cpu_s"] = _cpu_s() - _CLOCK["steady_cpu"]
    if args.peer.startswith("gdskit") or args.peer == "engine":
        d = gdskit.stats() - before
        out["paths"] = {k: v.bytes_read for k, v in d.paths.items() if v.bytes_read}
        out["pinned_bytes"] = gdskit.resources().pinned_bytes
    fresh_process.report(out)


# -- the parent -------------------------------------------------------------------------------------

def installed(peer: str) -> bool:
    import importlib.util
    mod = {"kvikio": "kvikio"}.get(peer)
    return mod is None or importlib.util.find_spec(mod) is not None


def run_child(argv: list[str], timeout: float) -> dict:
    return fresh_process.run_child(__file__, argv, timeout)


def summarize(r: dict, sz: dict, workload: str) -> dict:
    if "error" in r:
        return r
    gb = r["bytes"] / GB
    r["gb_per_s"] = gb / r["wall_s"] if r["bytes"] else None
    r["cpu_s_per_gb"] = r["cpu_s"] / gb if r["bytes"] else None
    if r.get("batches"):
        r["batches_per_s"] = r["batches"] / r["wall_s"]
        r["step_ms"] = 1000 * r["wall_s"] / r["batches"]
        if r.get("steady_wall_s"):
            r["steady_batches_per_s"] = r["steady_batches"] / r["steady_wall_s"]
            r["steady_cpu_s_per_gb"] = r["steady_cpu_s"] / (r["steady_batches"] * r["bytes"] / r["batches"] / GB)
        if r["peak_gpu_bytes"] and workload == "tokens":  # a step's own memory is not the loader's
            r["peak_gpu_batches"] = r["peak_gpu_bytes"] / (sz["batch"] * (sz["seq_len"] + 1) * 2)
    return r


def _per_tree(peer: str) -> bool:
    """Whether ``peer`` runs gdskit's code, and so once for each ``--src`` tree."""
    return peer.startswith("gdskit") or peer == "engine"


def measure(args: argparse.Namespace, data: dict, sz: dict) -> list[dict]:
    results = []
    # With --src, gdskit's peers run once per tree; the last tree named keeps the plain label (the
    # one the targets are read for), the others are labelled peer@name. The other peers run with
    # the last tree on their path (the raw reads' host buffers are gdskit's).
    trees = fresh_process.source_trees(args.src) if args.src else {"this": None}
    last = list(trees)[-1]
    modes = ([] if args.no_hot else ["hot"]) + (["cold"] if args.cold else [])
    workloads = args.workloads.split(",")
    every_path = [p for ps in data.values() for p in ps]
    warmed: set[str] = set()  # workloads whose files are in the page cache now
    for rnd in range(args.rounds):
        for w in workloads:
            named = args.peers.split(",") if args.peers else None
            peers = [p for p in PEERS[w] if named is None or p in named] + \
                [p for p in EXTRA_PEERS.get(w, []) if named is not None and p in named]
            runs = [(f"{p}@{name}" if name != last else p, p, tree)
                    for p in peers for name, tree in (trees.items() if _per_tree(p) else [(last, trees[last])])]
            if rnd % 2:
                runs = runs[::-1]  # alternate the order: none always first after the data was made
            paths = data["tokens"] if w in ("tokens", "step") else data["shards" if w == "preload-shards" else "small"]
            listing = os.path.join(args.dir, f"{w}.paths.json")  # many paths outgrow argv
            with open(listing, "w") as f:
                json.dump(paths, f)
            for mode in modes:  # the hot runs of a workload together: its files are warmed once
                for label, peer, tree in runs:
                    if (mode == "cold" and (w in HOT_ONLY or peer == "memory")) or \
                            (mode == "hot" and peer in COLD_ONLY):
                        continue
                    if not installed(peer):
                        results.append({"workload": w, "peer": label, "mode": mode, "round": rnd,
                                        "error": "not installed"})
                        continue
                    if mode == "cold":
                        how = drop_caches(every_path)
                        warmed.clear()
                    else:
                        if w not in warmed:
                            warm(paths)
                            warmed.add(w)
                        how = "warmed"
                    argv = ["--child", peer, "--workload", w, "--device", args.device, "--threads",
                            str(args.threads), "--sizes", json.dumps(sz), "--paths", listing]
                    r = summarize(run_child(argv, args.timeout) if tree is None else
                                  fresh_process.run_child_in_tree(__file__, argv, tree, args.timeout), sz, w)
                    r.update(workload=w, peer=label, mode=mode, round=rnd, cache=how)
                    results.append(r)
                    print(f"# {time.perf_counter() - START:6.1f} s  round {rnd + 1} {w} {label} {mode}: "
                          f"{r.get('gb_per_s') or r.get('step_ms') or r.get('error')}", file=sys.stderr, flush=True)
    return results


START = time.perf_counter()


def combine(results: list[dict]) -> list[dict]:
    """One row per workload, peer and mode: the median round (the lower middle for an even count)."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["workload"], r["peer"], r["mode"]), []).append(r)
    out = []
    for key, runs in groups.items():
        ok = sorted((r for r in runs if "wall_s" in r), key=lambda r: r["wall_s"])
        out.append({**(ok[(len(ok) - 1) // 2] if ok else runs[0]), "rounds": len(runs)})
    order = {w: i for i, w in enumerate(WORKLOADS)}

    def peer_rank(r: dict) -> tuple[int, str]:
        peer, _, tree = r["peer"].partition("@")
        return (PEERS[r["workload"]] + EXTRA_PEERS.get(r["workload"], [])).index(peer), tree
    return sorted(out, key=lambda r: (order[r["workload"]], r["mode"], peer_rank(r)))


def pairs(results: list[dict]) -> list[str]:
    """Each cold preload round's gdskit runs against the O_DIRECT run of the same round (its wall
    time over theirs: higher is better), the figures to read on a disk that drifts."""
    lines = []
    for w in ("preload-shards", "preload-small"):
        cold = [r for r in results if r["workload"] == w and r["mode"] == "cold" and "wall_s" in r]
        ref = {r["round"]: r for r in cold if r["peer"] == "odirect"}
        for label in dict.fromkeys(r["peer"] for r in cold if _per_tree(r["peer"].partition("@")[0])):
            by = [f"{ref[r['round']]['wall_s'] / r['wall_s']:.2f}x" for r in cold
                  if r["peer"] == label and r["round"] in ref]
            if by:
                lines.append(f"pairs {w} cold {label} / odirect, by round: {', '.join(by)}")
    return lines


def _fmt(x, spec: str) -> str:
    """``x`` in ``spec`` (e.g. ``"7.2f"``), or a dash as wide."""
    return format(x, spec) if x is not None else "-".rjust(int(spec.split(".")[0]))


def report(rows: list[dict]) -> str:
    ref = {(r["workload"], r["mode"]): r for r in rows if r["peer"] == "gdskit" and "wall_s" in r}
    lines = [f"{'workload':15} {'peer':17} {'mode':4} {'GB/s':>7} {'batch/s':>8} {'steady':>8} {'first ms':>8} "
             f"{'step ms':>8} {'vs gdskit':>9} {'CPU-s/GB':>9} {'GPU/batch':>9}  note"]
    for r in rows:
        if "wall_s" not in r:
            lines.append(f"{r['workload']:15} {r['peer']:17} {r['mode']:4} {'-':>7} {'-':>8} {'-':>8} {'-':>8} "
                         f"{'-':>8} {'-':>9} {'-':>9} {'-':>9}  {r.get('error', '')}")
            continue
        g = ref.get((r["workload"], r["mode"]))
        if g is None or g is r:
            ratio = "-"
        elif r["workload"] == "step":
            ratio = f"{g['wall_s'] / r['wall_s']:.2f}x"  # step time: gdskit's over this one's
        else:
            ratio = f"{r['wall_s'] and g['wall_s'] / r['wall_s']:.2f}x"
        note = ""
        if r.get("paths"):
            total = sum(r["paths"].values())
            note = " ".join(f"{k} {v / total:.0%}" for k, v in sorted(r["paths"].items(), key=lambda kv: -kv[1]))
        if r.get("pinned_bytes"):
            note += f" pinned {r['pinned_bytes'] / MiB:.0f} MiB"
        lines.append(f"{r['workload']:15} {r['peer']:17} {r['mode']:4} {_fmt(r.get('gb_per_s'), '7.2f')} "
                     f"{_fmt(r.get('batches_per_s'), '8.1f')} {_fmt(r.get('steady_batches_per_s'), '8.1f')} "
                     f"{_fmt(r.get('first_batch_s') and 1000 * r['first_batch_s'], '8.1f')} "
                     f"{_fmt(r.get('step_ms'), '8.2f')} {ratio:>9} "
                     f"{_fmt(r.get('cpu_s_per_gb'), '9.3f')} {_fmt(r.get('peak_gpu_batches'), '9.2f')}  {note}")
    return "\n".join(lines)


def targets(rows: list[dict]) -> dict[str, str]:
    """The issue's targets, against this run's numbers (ratios of wall time: higher is better)."""
    def find(w: str, peer: str, mode: str) -> dict | None:
        return next((r for r in rows if (r["workload"], r["peer"], r["mode"]) == (w, peer, mode) and "wall_s" in r),
                    None)

    out = {}
    for w in ("preload-shards", "preload-small"):
        g, e, o = find(w, "gdskit", "hot"), find(w, "engine", "hot"), find(w, "odirect", "cold")
        if g and e:
            out[f"{w} hot >= 0.9x engine"] = f"{e['wall_s'] / g['wall_s']:.2f}x"
        gc_ = find(w, "gdskit", "cold")
        if gc_ and o:
            out[f"{w} cold >= 0.95x O_DIRECT"] = f"{o['wall_s'] / gc_['wall_s']:.2f}x"
    g = find("tokens", "gdskit", "hot")
    dls = [r for r in (find("tokens", "dataloader-8", "hot"), find("tokens", "dataloader-16", "hot")) if r]
    if g and dls:
        best = max(dls, key=lambda r: r["batches_per_s"])
        out["tokens >= 5x DataLoader batches/s"] = f"{g['batches_per_s'] / best['batches_per_s']:.2f}x"
        out["tokens CPU-s/GB <= DataLoader's"] = f"{g['cpu_s_per_gb']:.3f} vs {best['cpu_s_per_gb']:.3f}"
        steady = [r for r in dls if r.get("steady_batches_per_s")]
        sb = max(steady, key=lambda r: r["steady_batches_per_s"]) if steady else None
        for v in rows:  # the default and every variant run
            if v["workload"] != "tokens" or v["mode"] != "hot" or not v["peer"].startswith("gdskit") \
                    or "wall_s" not in v:
                continue
            label = "" if v["peer"] == "gdskit" else f" ({v['peer']})"
            if v is not g:
                out[f"tokens >= 5x DataLoader batches/s{label}"] = \
                    f"{v['batches_per_s'] / best['batches_per_s']:.2f}x"
            if sb is not None and v.get("steady_batches_per_s"):
                out[f"tokens >= 5x DataLoader batches/s, steady part{label}"] = (
                    f"{v['steady_batches_per_s'] / sb['steady_batches_per_s']:.2f}x "
                    f"({v['steady_batches_per_s']:.0f} vs {sb['steady_batches_per_s']:.0f}; CPU-s/GB "
                    f"{v['steady_cpu_s_per_gb']:.3f} vs {sb['steady_cpu_s_per_gb']:.3f})")
    s, m = find("step", "gdskit", "hot"), find("step", "memory", "hot")
    if s and m:
        out["step: gdskit's loader adds <= 5% to the step"] = f"{100 * (s['wall_s'] / m['wall_s'] - 1):+.1f}%"
    sw = find("step", "gdskit-workers-4", "hot")
    if sw and m:
        out["step: gdskit's loader with 4 reader processes adds <= 5%"] = \
            f"{100 * (sw['wall_s'] / m['wall_s'] - 1):+.1f}%"
    d = find("step", "dataloader-8", "hot")
    if d and m:
        out["step: DataLoader adds (for comparison)"] = f"{100 * (d['wall_s'] / m['wall_s'] - 1):+.1f}%"
    if g and g.get("peak_gpu_batches") is not None:
        out["tokens: GPU memory <= prefetch + 1 = 3 batches"] = f"{g['peak_gpu_batches']:.2f}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/gdskit-data-bench", help="where the data lives (made once)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--peers", default=None, help="only these peers (comma list)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds, peers interleaved in alternating order")
    ap.add_argument("--cold", action="store_true", help="also run with the page cache dropped before each run")
    ap.add_argument("--no-hot", action="store_true")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--batches", type=int, default=None, help="token batches per run")
    ap.add_argument("--small-files", type=int, default=None,
                    help="files of the preload-small workload (default 100,000; --quick 2,000)")
    ap.add_argument("--step-ms", type=float, default=None, help="the step alone, in ms (calibrated)")
    ap.add_argument("--dl-workers", type=int, default=None, help="cap on DataLoader workers (small machines)")
    ap.add_argument("--timeout", type=float, default=120, help="seconds per measurement")
    ap.add_argument("--src", default="", help="name=path,... gdskit source trees: each gdskit peer runs once per "
                    "tree, interleaved; the last named is the one the targets are read for")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--child", dest="peer", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", help=argparse.SUPPRESS)
    ap.add_argument("--paths", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        child(args)
        return
    sz = sizes(args.quick)
    if args.batches:
        sz["batches"] = args.batches
    if args.step_ms:
        sz["step_ms"] = args.step_ms
    if args.dl_workers or (args.quick and not args.device.startswith("cuda")):
        sz["dl_workers"] = args.dl_workers or 2
    if args.small_files:
        sz["small"] = args.small_files
    data = ensure_data(args.dir, sz, args.workloads.split(","))
    results = measure(args, data, sz)
    rows = combine(results)
    text = report(rows)
    print(text)
    for line in pairs(results):
        print(line)
    goals = targets(rows)
    for k, v in goals.items():
        print(f"target {k}: {v}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": args.device, "sizes": sz, "rows": rows, "targets": goals, "pairs": pairs(results)},
                      f, indent=1)
    raise SystemExit(fresh_process.exit_status(rows))


if __name__ == "__main__":
    main()
