#!/usr/bin/env python3
"""Small random reads of a hot file into GPU memory: cuFile's batch API against one call per read.

For each read size (``--sizes``, KiB) and each repeat, the same random page-aligned offsets are
read into one device buffer by every variant, one after another (interleaved, so drift in the
machine hits all alike):

* ``batch``: ``File.read_batch`` with ``mode="cufile", cufile_batch="always"`` (groups of up to
  ``io_batchsize`` entries through ``cuFileBatchIOSubmit``);
* ``one-call-each``: ``read_batch`` with ``cufile_batch="never"``: one ``cuFileRead`` per read,
  one after another (what ``read_batch`` does without batches);
* ``one-call-each-parallel``: the same reads as one ``File.read_many`` job with
  ``cufile_batch="never"``: one ``cuFileRead`` per read, side by side on the workers (what a
  job does without batches);
* ``bounce``: ``read_batch`` with ``mode="bounce"`` (the pinned ring), for reference.

Prints a table (median rate and time per read, min-max over the repeats), the table row
``BATCH_WINS`` should hold for each size (batch faster than both one-call variants by 5 %),
what libcufile allowed (entries per batch, a refusal) and which counters a batch moved; writes
all of it to OUTDIR/batch_io.json. Run on the GPU machine through scripts/gpu_test.sh, so that
libcufile can register the file (compat mode without nvidia-fs):

    bash scripts/gpu_test.sh python3 benchmarks/batch_io.py /tmp/batch-results

Bounded by ``--time-limit`` (default 100 s of measuring; repeats stop early past it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from page_cache import warm  # noqa: E402

VARIANTS = ("batch", "one-call-each", "one-call-each-parallel", "bounce")
KiB = 1024


def _settings(variant: str) -> dict:
    return {"batch": {"mode": "cufile", "cufile_batch": "always"},
            "one-call-each": {"mode": "cufile", "cufile_batch": "never"},
            "one-call-each-parallel": {"mode": "cufile", "cufile_batch": "never"},
            "bounce": {"mode": "bounce"}}[variant]


def _run(f, buf, variant: str, offsets: list[int], size: int) -> float:
    """Seconds for one variant's reads (counts checked)."""
    import gdskit

    with gdskit.settings.set(**_settings(variant)):
        t0 = time.perf_counter()
        if variant == "one-call-each-parallel":
            counts = f.read_many([(buf, size, off, i * size) for i, off in enumerate(offsets)])
        else:
            counts = f.read_batch(buf, offsets, size)
        elapsed = time.perf_counter() - t0
    if counts != [size] * len(offsets):
        raise SystemExit(f"{variant}: short reads at {size} B: {sorted(set(counts))}")
    return elapsed


def _evidence(f, buf, offsets: list[int], size: int) -> dict:
    """What one batched call moved: libcufile's batch and per-GPU counters, the ledger's paths,
    gdskit's batch activity."""
    import gdskit
    from gdskit.engine.backends import cufile_batch as cb
    from gdskit.engine.backends.cufile import cufile_library

    lib = cufile_library()
    l1, l3 = cb.batch_counters(lib), lib.counters(buf.device)
    before, act = gdskit.stats(), cb.activity()
    _run(f, buf, "batch", offsets, size)
    l1_after, l3_after = cb.batch_counters(lib), lib.counters(buf.device)
    delta = gdskit.stats() - before

    def diff(a, b):
        return None if a is None or b is None else {k: b[k] - a[k] for k in a if b[k] != a[k]}

    support = cb.batch_support(lib)
    return {"batch_counters_delta": diff(l1, l1_after), "per_gpu_counters_delta": diff(l3, l3_after),
            "ledger_paths": {p: s.bytes_read for p, s in delta.paths.items()},
            "activity": vars(cb.activity() - act),
            "limit": support.limit, "refused": support.refused}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--file", default="/tmp/gdskit-batch-io.bin")
    ap.add_argument("--file-size", default="512MiB")
    ap.add_argument("--sizes", default="4,8,16,32,64", help="read sizes in KiB")
    ap.add_argument("--reads", type=int, default=1024, help="reads per variant, size and repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--time-limit", type=float, default=100.0, help="seconds of measuring at most")
    a = ap.parse_args()

    import numpy as np

    import gdskit
    from gdskit.engine import cuda
    from gdskit.bench.runner import fill_file
    from gdskit.settings import parse_size

    file_size = parse_size(a.file_size)
    sizes = [int(s) * KiB for s in a.sizes.split(",")]
    os.makedirs(a.outdir, exist_ok=True)
    if not os.path.exists(a.file):
        fill_file(a.file, file_size, seed=7)
    elif os.path.getsize(a.file) < file_size:  # another file of that name is only ever read
        raise SystemExit(f"{a.file} holds {os.path.getsize(a.file)} bytes, fewer than --file-size {file_size}")
    warm([a.file])
    buf = cuda.DeviceArray(a.reads * max(sizes))
    times: dict[tuple[int, str], list[float]] = {(s, v): [] for s in sizes for v in VARIANTS}
    start = time.monotonic()
    with gdskit.open(a.file) as f:
        for s in sizes:  # first touch of every path (registration, lanes, batches) off the clock
            offs = (np.random.default_rng(s).integers(0, file_size // s, 16) * s).tolist()
            for v in VARIANTS:
                _run(f, buf, v, offs, s)
        evidence = _evidence(f, buf, (np.random.default_rng(1).integers(0, file_size // 4096, 256) * 4096).tolist(),
                             4096)
        done_repeats = 0
        for r in range(a.repeats):
            if r and time.monotonic() - start > a.time_limit:
                break
            for s in sizes:
                rng = np.random.default_rng(1000 * r + s)
                offsets = (rng.integers(0, file_size // s, a.reads) * s).tolist()
                order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
                for v in order:
                    times[(s, v)].append(_run(f, buf, v, offsets, s))
            done_repeats += 1

    rows, wins = [], {}
    print(f"{'size':>6} {'variant':<24} {'MB/s':>9} {'us/read':>9} {'range MB/s':>17}")
    for s in sizes:
        med = {}
        for v in VARIANTS:
            t = times[(s, v)]
            rates = [a.reads * s / x / 1e6 for x in t]
            med[v] = statistics.median(rates)
            row = {"size": s, "variant": v, "median_MBps": med[v], "min_MBps": min(rates), "max_MBps": max(rates),
                   "median_us_per_read": statistics.median(t) / a.reads * 1e6, "seconds": t}
            rows.append(row)
            print(f"{s // KiB:>4}Ki {v:<24} {med[v]:>9.1f} {row['median_us_per_read']:>9.1f} "
                  f"{min(rates):>8.1f}-{max(rates):<8.1f}")
        wins[s] = med["batch"] > 1.05 * max(med["one-call-each"], med["one-call-each-parallel"])
    print("BATCH_WINS = {" + ", ".join(f"{s // KiB} * KiB: {wins[s]}" for s in sizes) + "}")
    print(f"batches: {evidence['limit']} entries at most, refused: {evidence['refused']}; one batched call moved "
          f"batch counters {evidence['batch_counters_delta']}, per-GPU counters {evidence['per_gpu_counters_delta']}, "
          f"ledger {evidence['ledger_paths']}")
    out = {"reads": a.reads, "repeats": done_repeats, "file_size": file_size, "rows": rows,
           "batch_wins": {str(s): w for s, w in wins.items()}, "evidence": evidence,
           "settings": gdskit.settings.as_dict()}
    path = os.path.join(a.outdir, "batch_io.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
