#!/usr/bin/env python3
"""vLLM's weight loading with ``load_format="gdskit"`` against vLLM's own loaders, in fresh engines.

Makes the Llama-shaped checkpoint of ``benchmarks/loaders.py`` (about ``--size`` GiB in two
shards), warms the page cache with it, then starts one vLLM engine per load format and round,
each in its own process, the formats' order alternating from round to round. The figure is
vLLM's own: its model runner's "Model loading took ... seconds" (the model built on the GPU and
its weights loaded, by whichever loader), read from the engine's log.

    python benchmarks/vllm_load.py --dir /data/bench --size 8 --rounds 3
    python benchmarks/vllm_load.py --dir /data/bench --formats safetensors,fastsafetensors,gdskit --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

from fresh_process import exit_status  # benchmarks/ is on sys.path when run as a script
from loaders import _shard_files, ensure_llama
from page_cache import warm

_LOADING = re.compile(r"Model loading took ([0-9.]+) GiB(?: memory)? and ([0-9.]+) seconds")


def engine(path: str, load_format: str) -> None:
    """Start an engine (the child's side), as a user of vLLM's offline API does."""
    from vllm import LLM
    LLM(model=path, load_format=load_format, skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
        max_num_seqs=4, gpu_memory_utilization=0.6, dtype="bfloat16")


def timed_engine(path: str, load_format: str) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--engine", path, load_format],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ, VLLM_LOGGING_LEVEL="INFO"))
    log = proc.stdout + proc.stderr
    found = _LOADING.findall(log)
    if proc.returncode or not found:
        tail = "\n".join(log.splitlines()[-30:])
        return {"error": f"engine exited {proc.returncode}" + ("" if found else ", no loading time logged"),
                "log_tail": tail}
    gib, seconds = found[-1]
    return {"seconds": float(seconds), "model_gib": float(gib)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="where the checkpoint is made (once); required")
    ap.add_argument("--size", type=float, default=8, help="checkpoint size in GiB (default 8)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", default="safetensors,gdskit",
                    help="vLLM load formats, comma-separated (default safetensors,gdskit)")
    ap.add_argument("--json", help="write every run here")
    ap.add_argument("--engine", nargs=2, metavar=("PATH", "FORMAT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        engine(*args.engine)
        return
    if not args.dir:
        ap.error("--dir is required")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    formats = [f for f in args.formats.split(",") if f]
    path = ensure_llama(args.dir, args.size)
    shards = _shard_files(path)
    nbytes = sum(os.path.getsize(f) for f in shards)
    runs: dict[str, list[dict]] = {f: [] for f in formats}
    for r in range(args.rounds):
        for fmt in formats if r % 2 == 0 else formats[::-1]:
            warm(shards)
            res = runs[fmt]
            res.append(timed_engine(path, fmt))
            print(f"round {r + 1} {fmt}: {res[-1].get('seconds', res[-1].get('error'))}", file=sys.stderr, flush=True)
            if "error" in res[-1]:
                print(res[-1]["log_tail"], file=sys.stderr)
    print(f"\nvLLM model loading, {nbytes / 1e9:.2f} GB checkpoint in {len(shards)} shards, hot page cache, "
          f"{args.rounds} fresh engines each")
    print(f"{'load format':16s} {'seconds (each round)':32s} {'median s':>9s} {'GB/s':>7s} {'vs first':>9s}")
    medians = {}
    for fmt in formats:
        secs = [x["seconds"] for x in runs[fmt] if "seconds" in x]
        if not secs:
            print(f"{fmt:16s} failed: {runs[fmt][-1]['error']}")
            continue
        medians[fmt] = statistics.median(secs)
        first = medians.get(formats[0])
        ratio = f"{first / medians[fmt]:.2f}x" if first else ""
        print(f"{fmt:16s} {' '.join(f'{s:.2f}' for s in secs):32s} {medians[fmt]:9.2f} "
              f"{nbytes / 1e9 / medians[fmt]:7.1f} {ratio:>9s}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"bytes": nbytes, "shards": len(shards), "runs": runs}, fh, indent=2)
    raise SystemExit(exit_status(run for each in runs.values() for run in each))


if __name__ == "__main__":
    main()
