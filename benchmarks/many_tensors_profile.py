#!/usr/bin/env python3
"""Where a load of many small tensors goes, in one fresh process: the first and the second
``gdskit.safetensors.load_file`` onto a GPU, then making one tensor per entry alone (torch's
allocator warm by then), then the header parsed alone and read from the copy kept between
processes (``$XDG_CACHE_HOME/gdskit/headers``), both with the collector on. ``--profile``
also prints cProfile's functions by own time for each load (slower; the items stay comparable).

    python benchmarks/many_tensors_profile.py /data/flb/many-20000.safetensors
    python benchmarks/many_tensors_profile.py /data/flb/many-20000.safetensors --profile

(``benchmarks/first_load_budget.py``'s ``make_many`` writes the 20,000-tensor set.)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def _show(profile: cProfile.Profile, title: str, top: int) -> None:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
    print(title)
    print("\n".join(line for line in out.getvalue().splitlines()[3:] if line.strip()))


def _timed_load(gst, path: str, device: str, torch, profile: bool, title: str, top: int) -> float:
    prof = cProfile.Profile() if profile else None
    t = time.perf_counter()
    if prof is not None:
        prof.enable()
    got = gst.load_file(path, device=device)
    torch.cuda.synchronize()
    if prof is not None:
        prof.disable()
    elapsed = time.perf_counter() - t
    del got
    if prof is not None:
        _show(prof, title, top)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a safetensors file of many small tensors (page cache warmed first for a hot load)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--profile", action="store_true", help="cProfile each load (own time)")
    ap.add_argument("--top", type=int, default=28)
    args = ap.parse_args()
    import torch

    torch.cuda.init()
    torch.empty(1, device=args.device)
    torch.cuda.synchronize()
    t = time.perf_counter()
    import gdskit.safetensors as gst
    from gdskit.formats import safetensors_format as fmt

    imported = time.perf_counter() - t
    first = _timed_load(gst, args.path, args.device, torch, args.profile, "FIRST LOAD (own time)", args.top)
    second = _timed_load(gst, args.path, args.device, torch, args.profile, "SECOND LOAD (own time)", args.top)
    header = fmt.read_header_file(args.path)
    dev = torch.device(args.device)
    types = [(gst._torch_type(torch, e)) for e in header.entries]
    t = time.perf_counter()
    made = [torch.empty(shape, dtype=dt, device=dev) for dt, shape in types]
    torch.cuda.synchronize()
    alloc = time.perf_counter() - t
    del made
    with open(args.path, "rb") as fh:
        raw = fh.read(header.data_start)[8:]
    t = time.perf_counter()
    fmt._parse_header_json(raw, header.data_start, header.file_size)
    parse = time.perf_counter() - t
    fmt.forget_headers()
    t = time.perf_counter()
    fmt.read_header_file(args.path)  # the copy kept between processes, where there is one
    kept = time.perf_counter() - t
    n = len(header.entries)
    print(f"{n} tensors, {header.data_size / 1e9:.2f} GB: import {imported * 1e3:.1f} ms, first load "
          f"{first * 1e3:.1f} ms, second load {second * 1e3:.1f} ms, {n} torch.empty alone "
          f"{alloc * 1e3:.1f} ms ({alloc / max(n, 1) * 1e6:.2f} us each), header parsed alone (collector on) "
          f"{parse * 1e3:.1f} ms, read from its kept copy {kept * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
