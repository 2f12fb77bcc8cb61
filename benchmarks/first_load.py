#!/usr/bin/env python3
"""The first load of a fresh process, as a user feels it: the clock starts before
``import gdskit.safetensors`` and stops after ``torch.cuda.synchronize()``.

Each run is a fresh interpreter that has already imported torch and made its CUDA context
(both outside the clock, as in any program that loads a checkpoint). It then imports
gdskit, loads the checkpoint with ``gdskit.safetensors.load_file`` (the first call), drops
the tensors and loads it again (the second call). The breakdown: the import, the lanes'
set-up (pinned staging and streams, the slowest lane), the first and the last chunk read
(from the start of the load), and the whole first and second calls. ``safetensors`` runs
the same first call with ``safetensors.torch.load_file`` for reference, and ``instanttensor``
with InstantTensor's buffered backend (``safe_open(..., backend=BackendPolicy.BUFFERED)``, tensors
owned); both also time a second call in the same process.

Sets (page cache hot): ``large``, one file of 32 MiB bf16 tensors (``--size`` GiB), and
``llama``, a Llama-shaped two-shard checkpoint of about ``--llama-size`` GiB (made by
``loaders.py``'s generator). ``--src`` compares source trees of gdskit in the same run,
interleaved round by round (``before=/path/to/old/src,after=src``); each tree's bytecode is
compiled first, as installing a package does.

    python benchmarks/first_load.py --dir /data/fl --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import fresh_process  # benchmarks/ is on sys.path when run as a script
from page_cache import warm

GB = 1e9
MiB = 1 << 20
LOADERS = ("gdskit", "safetensors", "instanttensor")


def make_large(path: str, size_gib: float, first: int = 0) -> None:
    """A safetensors file of 32 MiB bf16 tensors (``layers.{first}.weight`` on); each tensor's bytes
    are one random block rotated, so the file is made at disk speed (a hot read does not care
    what the bytes are)."""
    import numpy as np

    n = max(1, int(size_gib * 1024 / 32))
    block = np.random.default_rng(0).integers(0, 256, 32 * MiB, dtype=np.uint8)
    header = {f"layers.{first + i}.weight": {"dtype": "BF16", "shape": [4096, 4096],
                                             "data_offsets": [i * 32 * MiB, (i + 1) * 32 * MiB]} for i in range(n)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        for i in range(n):
            fh.write(np.roll(block, i * 4099).tobytes())
    os.replace(tmp, path)


def sets(args: argparse.Namespace) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    os.makedirs(args.dir, exist_ok=True)
    if "large" in args.sets:
        path = os.path.join(args.dir, f"large-{args.size:g}.safetensors")
        if not os.path.exists(path):
            print(f"creating {path} ...", file=sys.stderr, flush=True)
            make_large(path, args.size)
        out["large"] = [path]
    if "llama" in args.sets:
        from loaders import _shard_files, ensure_llama

        out["llama"] = _shard_files(ensure_llama(os.path.join(args.dir, f"llama-{args.llama_size:g}"),
                                                 args.llama_size))
    return out


class StackSampler:
    """Every thread's Python stack, sampled about every ``interval`` seconds by a thread of its own
    (which holds the interpreter while it samples: the load it watches runs somewhat slower)."""

    def __init__(self, interval: float = 0.0003, depth: int = 3) -> None:
        self.samples: list[tuple[float, int, str]] = []
        self.depth = depth
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            t = time.perf_counter()
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                names = []
                while frame is not None and len(names) < self.depth:
                    names.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")
                    frame = frame.f_back
                self.samples.append((t, tid, " < ".join(names)))
            self._stop.wait(self._interval)

    def start(self) -> None:
        self._thread.start()

    def summary(self, t0: float) -> dict:
        """The main thread's most sampled stack in each 10 ms from ``t0``, and each thread's most
        sampled stacks overall."""
        import collections

        self._stop.set()
        self._thread.join()
        names = {t.ident: t.name for t in threading.enumerate()}
        main = threading.main_thread().ident
        buckets: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for t, tid, stack in self.samples:
            if t < t0:
                continue
            who = "main" if tid == main else names.get(tid, "ended")
            threads[who][stack] += 1
            if tid == main:
                buckets[int((t - t0) * 100)][stack] += 1
        return {"main_by_10ms": [[b * 10, *buckets[b].most_common(1)[0]] for b in sorted(buckets)],
                "threads": {w: c.most_common(4) for w, c in threads.items() if sum(c.values()) >= 20}}


def peer_loader(name: str, dev: str):
    """A function loading a list of safetensors files into ``dev`` with a peer library, imported now."""
    if name == "safetensors":
        from safetensors.torch import load_file

        def load(paths: list[str]) -> dict:
            got = {}
            for p in paths:
                got.update(load_file(p, device=dev))
            return got
        return load
    import torch
    from instanttensor import BackendPolicy, safe_open

    def load_buffered(paths: list[str]) -> dict:
        with safe_open(list(paths), framework="pt", device=torch.device(dev).index or 0,
                       backend=BackendPolicy.BUFFERED) as f:
            return dict(f.tensors())
    return load_buffered


def child(args: argparse.Namespace) -> None:
    import torch

    dev = args.device
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    if dev.startswith("cuda"):
        torch.cuda.init()
        torch.empty(1, device=dev)  # the CUDA context, outside the clock
        sync()
    paths = args.paths.split(",")
    nbytes = sum(os.path.getsize(p) for p in paths)
    out: dict = {"bytes": nbytes}
    if args.loader in ("safetensors", "instanttensor"):
        t0 = time.perf_counter()
        load = peer_loader(args.loader, dev)  # its import inside the first call's clock
        got = load(paths)
        sync()
        t_first = time.perf_counter()
        del got
        got = load(paths)
        sync()
        out.update(first_s=t_first - t0, second_s=time.perf_counter() - t_first)
        fresh_process.report(out)
        return
    sampler = StackSampler() if args.stack_samples else None
    if sampler is not None:
        sampler.start()
    t0 = time.perf_counter()
    import gdskit.safetensors
    t_import = time.perf_counter()
    from gdskit.engine import pool
    from gdskit.engine.backends import staged

    marks: list[float] = []
    # An older tree (--src) may lack a function measured here: its step is then not reported.
    real_read = getattr(staged, "read_chunk", None)
    timing = [True]

    def read_chunk(*a, **k):  # the first and last chunk's times; two clock reads per chunk
        if not timing[0]:
            return real_read(*a, **k)
        if not marks:
            marks.append(time.perf_counter())
        try:
            return real_read(*a, **k)
        finally:
            if len(marks) < 2:
                marks.append(0.0)
            marks[1] = time.perf_counter()

    if real_read is not None:
        staged.read_chunk = read_chunk
    # When the load reaches each step (seconds from the import's end), for the breakdown.
    steps: dict[str, float] = {}
    from gdskit.formats import safetensors_format, torch_io
    import gdskit.engine.file

    def step(name: str, fn):
        def wrapper(*a, **k):
            steps.setdefault(name + "_start", time.perf_counter() - t_import)
            try:
                return fn(*a, **k)
            finally:
                steps.setdefault(name + "_end", time.perf_counter() - t_import)
        return wrapper
    def warm_up(real_start):
        def start(*a, **k):
            steps.setdefault("warm_up_start", time.perf_counter() - t_import)
            return step("warm_up_wait", real_start(*a, **k))
        return start

    import gdskit.engine.direct_path
    from gdskit.engine import cuda

    patches = [(safetensors_format, "read_header_file", lambda f: step("header", f)),
               (gdskit.safetensors, "open_file", lambda f: step("open", f)),
               (torch_io, "start_warm_up", warm_up),
               (gdskit.engine.file.File, "pread_many", lambda f: step("submit", f)),
               (torch_io, "reserve_device_memory", lambda f: step("reserve", f)),
               # Inside the warm-up: the driver's bindings, the direct-route facts, the lanes.
               (cuda, "_load_bindings", lambda f: step("bindings", f)),
               (gdskit.engine.direct_path, "direct_route", lambda f: step("direct_route", f)),
               (pool, "prepare", lambda f: step("lanes", f))]
    real = [(owner, name, getattr(owner, name)) for owner, name, _ in patches if hasattr(owner, name)]
    for owner, name, wrap in patches:
        if hasattr(owner, name):
            setattr(owner, name, wrap(getattr(owner, name)))
    got = gdskit.safetensors.load_file(paths if len(paths) > 1 else paths[0], device=dev, progress=False)
    sync()
    t_first = time.perf_counter()
    if sampler is not None:
        out["stack_samples"] = sampler.summary(t0)
    timing[0] = False
    for owner, name, fn in real:
        setattr(owner, name, fn)
    del got
    got = gdskit.safetensors.load_file(paths if len(paths) > 1 else paths[0], device=dev, progress=False)
    sync()
    t_second = time.perf_counter()
    out.update(import_s=t_import - t0, first_s=t_first - t0, load_s=t_first - t_import,
               second_s=t_second - t_first,
               first_byte_s=(marks[0] - t_import) if marks else None,
               last_byte_s=(marks[1] - t_import) if len(marks) > 1 else None,
               lane_setup_max_s=max(getattr(pool, "setup_seconds", []), default=0.0),
               lanes=len(getattr(pool, "setup_seconds", [])),
               steps={k: round(v, 4) for k, v in sorted(steps.items(), key=lambda kv: kv[1])},
               paths={k: v.bytes for k, v in gdskit.stats().paths.items()})
    fresh_process.report(out)


def print_samples(r: dict) -> None:
    samples = r["stack_samples"]
    print(f"\n{r['set']} {r['tree']} round {r['round']}: the main thread's most sampled stack, by 10 ms")
    for start, stack, n in samples["main_by_10ms"]:
        print(f"  {start:5d} ms  {n:3d}x {stack}")
    for who, stacks in samples["threads"].items():
        print(f"  {who}: " + " | ".join(f"{n}x {s}" for s, n in stacks))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/gdskit-first-load")
    ap.add_argument("--size", type=float, default=8, help="GiB of the large set")
    ap.add_argument("--llama-size", type=float, default=5, help="GiB of the Llama-shaped set")
    ap.add_argument("--sets", default="large,llama")
    ap.add_argument("--loaders", default="gdskit,safetensors")
    fresh_process.add_tree_options(ap)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--stack-samples", action="store_true",
                    help="sample every thread's stack during the first call and print where it went "
                         "(slows the call: not for the rates)")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--child-loader", dest="loader", help=argparse.SUPPRESS)
    ap.add_argument("--child-paths", dest="paths", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.loader:
        child(args)
        return
    trees = fresh_process.source_trees(args.src)
    files = sets(args)
    warm([p for ps in files.values() for p in ps])
    runs = []
    for rnd in range(args.rounds):
        order = [(t, s, ld) for s in files for ld in args.loaders.split(",") for t in trees
                 if ld == "gdskit" or t == next(iter(trees))]
        if rnd % 2:
            order.reverse()  # alternate the order: drift of the machine falls on every case alike
        for tree, name, loader in order:
            r = fresh_process.run_child_in_tree(
                __file__, ["--child-loader", loader, "--child-paths", ",".join(files[name]), "--device", args.device]
                + (["--stack-samples"] if args.stack_samples else []), trees[tree], args.timeout)
            r.update(round=rnd, tree=tree, set=name, loader=loader)
            runs.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
            if "stack_samples" in r:
                print_samples(r)
    print(f"\n{'set':6} {'tree':8} {'loader':12} {'first GB/s':>18} {'second GB/s':>12} {'import ms':>10} "
          f"{'setup ms':>9} {'1st byte ms':>11} {'last byte ms':>12}")
    for name in files:
        for loader in args.loaders.split(","):
            for tree in trees:
                rs = [r for r in runs if r["set"] == name and r["tree"] == tree and r["loader"] == loader
                      and "first_s" in r]
                if not rs:
                    continue
                first = [r["bytes"] / r["first_s"] / GB for r in rs]

                def med(key: str, scale: float = 1e3) -> str:
                    vals = [r[key] * scale for r in rs if r.get(key) is not None]
                    return f"{statistics.median(vals):.0f}" if vals else "-"
                second = [r["bytes"] / r["second_s"] / GB for r in rs if r.get("second_s")]
                first_col = f"{statistics.median(first):.1f} ({min(first):.1f}-{max(first):.1f})"
                second_col = f"{statistics.median(second):.1f}" if second else "-"
                print(f"{name:6} {tree:8} {loader:12} {first_col:>18} {second_col:>12} {med('import_s'):>10} "
                      f"{med('lane_setup_max_s'):>9} {med('first_byte_s'):>11} {med('last_byte_s'):>12}")
    errors = [r for r in runs if "error" in r]
    for r in errors:
        print(f"error: {r['set']} {r['tree']} {r['loader']}: {r['error']}")
    fresh_process.write_runs(args.json_out, runs)
    raise SystemExit(fresh_process.exit_status(runs))


if __name__ == "__main__":
    main()
