"""Check ``gdskit bench``'s host path against fio on the same work.

Two cases, each with matching parameters, on files of one size:

* sequential read, 1 MiB I/Os, W workers, each reading its own slice once, O_DIRECT;
* random read, 4 KiB I/Os, W workers, each at random 4 KiB-aligned offsets in its
  own slice, for a fixed time, O_DIRECT.

fio runs with ``ioengine=psync`` (one blocking I/O at a time per job, as each
gdskit worker does), ``iomem=mmap`` (its buffers fresh anonymous mappings, as gdskit
bench's and the plain loop's: where the destination's pages lie in physical memory
changes how an O_DIRECT read is split into device requests, and on the H200 machine
that moved 1 MiB reads by up to 70 %), ``numjobs=W``, ``size`` = slice and ``offset_increment`` =
slice, so job ``i`` covers exactly worker ``i``'s slice. fio's jobs are processes;
gdskit bench runs twice, with worker threads (its default: what one Python process
gets) and with ``--processes`` (one process per worker, as fio's jobs). A fourth
column runs the same work from Python threads calling ``os.preadv`` on an O_DIRECT
descriptor with no gdskit engine in between: it separates the cost of the engine
from the cost of driving I/O from Python threads at all.

Fairness. Repetitions run the four in a rotating order (fio, gdskit, gdskit
--processes, plain; then gdskit, ..., fio; ...) so drift hits all alike; medians are reported.
There are four files of the same size, written the same way; in each repetition every tool
reads a different one, and the files move on by one from one repetition to the next, so
over four repetitions every tool reads every file. Every random run draws fresh offsets
(its own seed; fio's ``randrepeat`` would otherwise replay the same offsets each run).
In a VM the virtual disk is often a file cached by the host, file by file: data one tool
had just read would come back faster for the next (an earlier version of this script used
one shared file with fio always first), and a file the host keeps cached reads faster for
whichever tool is given it (the next version gave each tool its own file). After a
gdskit sequential run (threads and processes), ``fincore`` (util-linux) or cachestat(2) shows
how much of the file sits in the guest's page cache: near zero proves the reads were O_DIRECT.

Buffer memory. By default every runner's buffers are on ordinary 4 KiB pages, and how
many of a buffer's pages happen to lie next to each other in physical memory is left to
chance: on the two-GPU H200 machine that alone had gdskit's worker processes read 1 MiB
sequentially at 1.9x fio's rate. ``--huge-pages`` takes the chance away: fio gets
``iomem=shmhuge`` (2 MiB hugetlb pages), gdskit bench ``--huge-pages`` (2 MiB transparent
huge pages) and the plain loop the same, so one 1 MiB I/O lands in one physically contiguous
range for all of them. hugetlb pages must be reserved: as root the script raises
``/proc/sys/vm/nr_hugepages`` by what fio needs for the run and puts it back afterwards;
otherwise it says what to reserve.

Usage::

    PYTHONPATH=src python benchmarks/bench_vs_fio.py --file /path/on/disk/fio-test.bin --size 4G

(four files, ``fio-test.bin.0`` to ``.3``, each ``--size``; ``--reps`` a multiple of 4 gives
every tool every file equally often).

fio comes from ``PATH`` (Debian: ``apt-get install fio``). For a machine without a
package manager or network, a static build travels as one file: ``apt-get source fio``
(3.33 here), then ``./configure --build-static --disable-native && make`` in its
directory, and put the ``fio`` binary on ``PATH`` there.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from gdskit.bench import runner
from gdskit.bench.memory import HostBuffer
from gdskit.bench.params import make_params, parse_bytes


def fio_cmd(path: str, rw: str, bs: str, workers: int, slice_bytes: int, runtime: float | None,
            seed: int = 0, huge_pages: bool = False) -> list[str]:
    memory = ["--iomem=shmhuge", "--hugepage-size=2m"] if huge_pages else ["--iomem=mmap"]
    cmd = ["fio", "--name=gdskit-compare", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", "--direct=1",
           "--ioengine=psync", *memory, f"--numjobs={workers}", f"--size={slice_bytes}",
           f"--offset_increment={slice_bytes}", "--group_reporting", "--output-format=json",
           "--invalidate=1"]
    if runtime:
        cmd += [f"--runtime={runtime}", "--time_based"]
    if seed:
        cmd += ["--randrepeat=0", f"--randseed={seed}"]
    return cmd


def run_fio(cmd: list[str]) -> float:
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    data = json.loads(out[out.index("{"):])
    return data["jobs"][0]["read"]["bw_bytes"] / 2**30


def run_gdskit(path: str, size: int, io: str, workers: int, op: str, runtime: float | None, seed: int = 0,
               processes: bool = False, huge_pages: bool = False) -> float:
    p = make_params(file=path, size=size, io_size=io, workers=workers, paths="host", op=op,
                    duration=runtime, cache="cold", repeat=1, seed=seed, processes=processes,
                    huge_pages=huge_pages)
    (r,) = runner.run_benchmark(p).runs
    assert r.taken == {"host": r.bytes}, r.taken
    return r.gib_per_s


def run_plain(path: str, size: int, io: int, workers: int, random: bool, runtime: float | None,
              seed: int = 0, huge_pages: bool = False) -> float:
    """The same work from Python threads with os.preadv on O_DIRECT, no engine."""
    slice_bytes = size // workers
    slots = slice_bytes // io
    runner.make_cold([path], False)
    counts = [0] * workers
    barrier = threading.Barrier(workers + 1)
    end = [0.0]

    def work(w: int) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        buf = HostBuffer(io, huge_pages).array  # the kind of memory gdskit bench gives its workers
        rng = np.random.default_rng([seed, w])
        base = w * slice_bytes
        try:
            barrier.wait()
            i = 0
            while True:
                if runtime is None and i >= slots:
                    break
                if runtime is not None and time.perf_counter() >= end[0]:
                    break
                if random:
                    off = base + int(rng.integers(0, slots)) * io
                else:
                    off = base + i * io
                os.preadv(fd, [buf], off)
                counts[w] += 1
                i += 1
        finally:
            os.close(fd)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    end[0] = t0 + (runtime or 0)
    barrier.wait()
    for t in threads:
        t.join()
    return sum(counts) * io / (time.perf_counter() - t0) / 2**30


def resident_bytes(path: str) -> int | None:
    """Bytes of ``path`` in the page cache: fincore (util-linux) where present, else cachestat(2)."""
    if shutil.which("fincore") is not None:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "-o", "RES", path],
                             capture_output=True, text=True)
        if out.stdout.strip().isdigit():
            return int(out.stdout.strip())
    from gdskit.engine.residency import _cachestat
    fd = os.open(path, os.O_RDONLY)
    try:
        got = _cachestat(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return None if got is None else got[0] * mmap.PAGESIZE


def set_nr_hugepages(n: int) -> None:
    """The kernel's pool of 2 MiB hugetlb pages (root only)."""
    with open("/proc/sys/vm/nr_hugepages", "w", encoding="ascii") as fh:
        fh.write(str(n))


def reserve_hugetlb_pages(pages: int) -> int | None:
    """Make sure ``pages`` 2 MiB hugetlb pages are free, raising vm.nr_hugepages as root.

    Returns the setting to put back afterwards (None when nothing was changed)."""
    def meminfo(key: str) -> int:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        return 0

    if meminfo("Hugepagesize") != 2048:
        raise SystemExit("--huge-pages needs 2 MiB huge pages (Hugepagesize in /proc/meminfo)")
    free = meminfo("HugePages_Free")
    if free >= pages:
        return None
    total = meminfo("HugePages_Total")
    if os.geteuid() != 0:
        raise SystemExit(f"--huge-pages: fio needs {pages} free 2 MiB hugetlb pages, {free} are; as root: "
                         f"sysctl vm.nr_hugepages={total + pages - free}")
    set_nr_hugepages(total + pages - free)
    if meminfo("HugePages_Free") < pages:
        raise SystemExit(f"--huge-pages: the kernel found only {meminfo('HugePages_Free')} free 2 MiB pages")
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", default="gdskit-fio-test.bin")
    ap.add_argument("--size", default="4G")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--runtime", type=float, default=5.0, help="seconds per random-read run")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--keep", action="store_true", help="keep the test file")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--huge-pages", action="store_true",
                    help="every runner's buffers on 2 MiB pages (fio: iomem=shmhuge, reserved here as root)")
    args = ap.parse_args()
    if shutil.which("fio") is None:
        print("fio is not installed (Debian: apt-get install fio)", file=sys.stderr)
        return 2
    size = parse_bytes(args.size, "--size")
    W = args.workers
    slice_bytes = size // W
    tools = ("fio", "gdskit", "gdskit-processes", "plain")
    files = [f"{args.file}.{i}" for i in range(len(tools))]
    made = [p for p in files if not os.path.exists(p) or os.path.getsize(p) < size]
    for p in made:
        runner.fill_file(p, size, files.index(p))  # each file its own contents, whichever were missing
    cases = {
        "sequential read 1 MiB": dict(rw="read", bs="1M", io="1M", op="read", runtime=None, random=False,
                                      io_bytes=2**20),
        "random read 4 KiB": dict(rw="randread", bs="4k", io="4K", op="randread", runtime=args.runtime,
                                  random=True, io_bytes=4096),
    }
    results: dict[str, dict[str, list[float]]] = {c: {t: [] for t in tools} for c in cases}
    commands = {}
    resident: dict[str, int | None] = {}
    # fio's shm buffer per job is bs rounded up to whole huge pages, plus slack.
    restore_hugetlb = reserve_hugetlb_pages(2 * W) if args.huge_pages else None
    try:
        for rep in range(args.reps):
            order = tools[rep % len(tools):] + tools[:rep % len(tools)]
            for name, c in cases.items():
                for tool in order:
                    seed = 1 + rep * 10 + tools.index(tool)  # fresh offsets for every random run
                    path = files[(tools.index(tool) + rep) % len(files)]  # every tool every file
                    if tool == "fio":
                        cmd = fio_cmd(path, c["rw"], c["bs"], W, slice_bytes, c["runtime"], seed, args.huge_pages)
                        commands[name] = " ".join(cmd)
                        results[name]["fio"].append(run_fio(cmd))
                    elif tool.startswith("gdskit"):
                        results[name][tool].append(run_gdskit(path, size, c["io"], W, c["op"], c["runtime"],
                                                              seed, processes=tool == "gdskit-processes",
                                                              huge_pages=args.huge_pages))
                        if c["op"] == "read" and tool not in resident:
                            resident[tool] = resident_bytes(path)
                    else:
                        results[name]["plain"].append(run_plain(path, size, c["io_bytes"], W, c["random"],
                                                                c["runtime"], seed, args.huge_pages))
                got = ", ".join(f"{t} {results[name][t][-1]:.3f}" for t in tools)
                print(f"rep {rep + 1} ({', '.join(order)}): {name}: {got} GiB/s", file=sys.stderr)
    finally:
        if restore_hugetlb is not None:
            set_nr_hugepages(restore_hugetlb)
        if not args.keep:
            for p in made:
                os.unlink(p)

    summary = {}
    for name, r in results.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        summary[name] = {"median_gib_per_s": med, "all": r, "gdskit_vs_fio": med["gdskit"] / med["fio"],
                         "gdskit_processes_vs_fio": med["gdskit-processes"] / med["fio"],
                         "plain_vs_fio": med["plain"] / med["fio"], "fio_command": commands[name]}
    if args.json:
        print(json.dumps({"workers": W, "size": size, "huge_pages": args.huge_pages,
                          "page_cache_after_gdskit_seq_read": resident, "cases": summary}, indent=2))
        return 0
    memory = "2 MiB pages" if args.huge_pages else "4 KiB pages"
    print(f"| case ({W} workers, O_DIRECT, {memory}) | fio GiB/s | gdskit bench (threads) GiB/s | / fio | "
          f"gdskit bench --processes GiB/s | / fio | plain Python threads GiB/s | / fio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, s in summary.items():
        m = s["median_gib_per_s"]
        print(f"| {name} | {m['fio']:.3f} | {m['gdskit']:.3f} | {s['gdskit_vs_fio']:.2f} | "
              f"{m['gdskit-processes']:.3f} | {s['gdskit_processes_vs_fio']:.2f} | {m['plain']:.3f} | "
              f"{s['plain_vs_fio']:.2f} |")
    print(f"\nbytes of the file in the page cache after a gdskit cold sequential read: {resident}")
    for name, s in summary.items():
        print(f"\nfio, {name}: `{s['fio_command']}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
