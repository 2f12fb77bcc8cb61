#!/usr/bin/env python3
"""Where a fresh process's first ``gdskit.safetensors.load_file`` (or, with ``--preload``,
``gdskit.data.preload`` of the files given) spends its time: cProfile from the import to
``torch.cuda.synchronize()``, the functions with the most cumulative time (``--sort tottime``:
time in each function itself). torch is imported and the CUDA context made before the profile, as in any
program that loads a checkpoint. ``GDSKIT_RESIDENT=require`` profiles a first call through the
resident loader (``gdskit serve`` must be running).

    python benchmarks/first_call_profile.py /data/flb/large-8.safetensors --top 40
    python benchmarks/first_call_profile.py --preload /data/flb/npy-4x512/*.npy
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="a safetensors file, or the files of --preload (their page cache "
                    "warmed first, if a hot load is meant)")
    ap.add_argument("--preload", action="store_true", help="profile gdskit.data.preload of the files")
    ap.add_argument("--sort", choices=("cumulative", "tottime"), default="cumulative")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--top", type=int, default=40, help="functions shown, by cumulative time")
    args = ap.parse_args()
    import torch

    torch.cuda.init()
    torch.empty(1, device=args.device)
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    if args.preload:
        import gdskit.data

        got = gdskit.data.preload(args.paths, args.device, progress=False)
    else:
        import gdskit.safetensors

        got = gdskit.safetensors.load_file(args.paths[0], device=args.device)
    torch.cuda.synchronize()
    profile.disable()
    elapsed = time.perf_counter() - t0
    print(f"first call, import included: {elapsed * 1e3:.1f} ms under the profiler, "
          f"{sum(t.nbytes for t in got.values()) / elapsed / 1e9:.1f} GB/s")
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats(args.sort).print_stats(args.top)
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip()))


if __name__ == "__main__":
    main()
