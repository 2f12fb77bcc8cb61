"""One run's workers, wherever they run: the loop each worker runs and what it reports.

:mod:`gdskit.bench.runner` runs these workers as threads of its own process;
:mod:`gdskit.bench.procs` runs the very same loop in processes of their own
(``--processes``). Both import it from here, so neither imports the other's module.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

import gdskit
from gdskit.bench import cpu as cpu_mod
from gdskit.bench.memory import allocate, pattern
from gdskit.bench.params import GPU_PATHS, BenchParams, Cache, PathUnavailableError
from gdskit.errors import DirectPathUnavailable, GdskitIOError


@dataclass
class Targets:
    """The files a benchmark uses, each worker's slice, and what to remove afterwards."""

    files: list[str]
    slices: list[tuple[str, int, int]]         # per worker: (file, start, length)
    remove_always: list[str] = field(default_factory=list)      # temporary files
    remove_on_failure: list[str] = field(default_factory=list)  # created here, kept on success
    dir_made: str | None = None                                 # the -D directory, when made here

    def cleanup(self, failed: bool) -> None:
        for p in self.remove_always + (self.remove_on_failure if failed else []):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
            except OSError:
                pass
        if failed and self.dir_made is not None:
            try:
                os.rmdir(self.dir_made)  # only when empty: nothing but what this run made
            except OSError:
                pass


# -- cache policy -----------------------------------------------------------------------
def make_cold(files: list[str], drop_all: bool) -> None:
    """Evict the files' pages (and with ``drop_all`` the whole page cache) before a run."""
    if drop_all:
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as fh:
                fh.write("1\n")
        except OSError as exc:
            raise from_os_error(exc, "/proc/sys/vm/drop_caches") from exc
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


# -- one run ----------------------------------------------------------------------------
@dataclass
class WorkerOut:
    """What one worker did in a run's window."""

    nbytes: int = 0
    ops: int = 0
    latencies: list[int] = field(default_factory=list)
    checked: int = 0
    mismatched: int = 0
    first_bad: int | None = None
    first_bad_file: str | None = None
    error: BaseException | None = None


_BATCH_BYTES = 1 << 20


def _offsets(params: BenchParams, io: int, start: int, length: int, worker: int, rep: int) -> Iterator[int]:
    """One offset at a time: those of :func:`_offset_batches`, drawn 4096 at a time."""
    return itertools.chain.from_iterable(_offset_batches(params, io, start, length, worker, rep, 4096))


def _offset_batches(params: BenchParams, io: int, start: int, length: int, worker: int, rep: int,
                    k: int) -> Iterator[list[int]]:
    """A worker's offsets, ``k`` at a time, made with numpy (a few nanoseconds per offset
    instead of a generator step each): its slice in order, or at random, the same for every path."""
    slots = length // io
    if not params.op.is_random:
        i = 0
        while True:
            yield (start + (np.arange(i, i + k) % slots) * io).tolist()
            i += k
    # The same seed for every path: A and B do the very same I/O.
    rng = np.random.default_rng([params.seed, worker, io, rep])
    while True:
        yield (start + rng.integers(0, slots, size=k) * io).tolist()


def _check(buf: object, expected: np.ndarray, out: WorkerOut, offset: int, path: str) -> None:
    got = buf.to_host(expected.size)  # type: ignore[attr-defined]
    bad = np.flatnonzero(got != expected)
    out.checked += expected.size
    if bad.size:
        out.mismatched += int(bad.size)
        if out.first_bad is None:
            out.first_bad = offset + int(bad[0])
            out.first_bad_file = path


@dataclass(frozen=True)
class RunPlan:
    """What every worker of one run needs to know (picklable: process workers get it too)."""

    params: BenchParams
    name: str
    io: int
    rep: int
    budgets: tuple[int | None, ...]
    forced: dict[str, str]        # the settings that force the path (mode, O_DIRECT policy)
    settings: dict[str, object]   # every other engine setting, for workers in other processes

    @property
    def on_device(self) -> bool:
        return self.name in GPU_PATHS

    @property
    def cold(self) -> bool:
        return self.params.cache is not Cache.HOT


def run_counters(plan: RunPlan) -> dict[str, int] | None:
    """cuFile's counters for a cufile run's device (None for other paths, or where cuFile has none)."""
    if plan.name != "cufile":
        return None
    from gdskit.engine.backends.cufile import counters_now  # noqa: PLC0415 - import time

    return counters_now(plan.params.device)


def open_worker(plan: RunPlan, w: int, slice_: tuple[str, int, int],
                stack: contextlib.ExitStack) -> tuple[gdskit.File, object]:
    """One worker's buffer and file (released by ``stack``), after one warm-up I/O outside the
    window, so cuFile handle registration and the engine's pinned ring are set up before the clock."""
    params, io = plan.params, plan.io
    b = allocate(plan.on_device, io, params.device, params.huge_pages)
    stack.callback(b.free)
    try:
        f = gdskit.open(slice_[0], "r" if params.op.is_read else "r+")
        stack.callback(f.close)  # runs before the buffer is freed
        if not params.op.is_read:
            b.load(pattern(slice_[1], io, params.seed))
        (f.read if params.op.is_read else f.write)(b.obj, io, slice_[1])
    except DirectPathUnavailable as exc:
        raise PathUnavailableError(f"the {plan.name} path cannot run on {slice_[0]}: {exc}",
                                   plan.name, exc.reason) from exc
    return f, b


def work(plan: RunPlan, w: int, slice_: tuple[str, int, int], f: gdskit.File, b: object,
         out: WorkerOut, stop: threading.Event, end: float) -> None:
    """One worker's timed loop: I/Os over its slice until its budget, ``end`` or ``stop``."""
    params, io = plan.params, plan.io
    path_w, start_w, length_w = slice_
    call = f.read if params.op.is_read else f.write
    offsets = _offsets(params, io, start_w, length_w, w, plan.rep)
    budget = plan.budgets[w]
    lat = out.latencies
    batched = params.op.is_read and not params.verify
    per_batch = max(1, min(64, _BATCH_BYTES // io))  # about 1 MiB per call: deadlines stay sharp
    zeros = [0] * per_batch
    batches = _offset_batches(params, io, start_w, length_w, w, plan.rep, per_batch)
    while not stop.is_set() and (budget is None or out.ops < budget):
        if end and time.perf_counter() >= end:
            break
        if batched:
            # Small reads in batches (File.read_batch): each is still one blocking read at a
            # time, as in fio's psync engine, without a Python call per read around it.
            k = per_batch if budget is None else min(per_batch, budget - out.ops)
            offs = next(batches)[:k]
            counts = f.read_batch(b.obj, offs, io, zeros if k == per_batch else zeros[:k],  # type: ignore[attr-defined]
                                  latencies_ns=lat)
            if counts.count(io) != k:  # at C speed; the loop only to name the short one
                n, off = next((n, o) for n, o in zip(counts, offs) if n != io)
                raise GdskitIOError(5, f"short read of {n} of {io} bytes at {off}", path_w)
            out.nbytes += k * io
            out.ops += k
            continue
        off = next(offsets)
        if params.verify and not params.op.is_read:
            b.load(pattern(off, io, params.seed))  # type: ignore[attr-defined]
        t0 = time.perf_counter_ns()
        n = call(b.obj, io, off)  # type: ignore[attr-defined]
        lat.append(time.perf_counter_ns() - t0)
        if n != io:
            raise GdskitIOError(5, f"short {params.op.value} of {n} of {io} bytes at {off}", path_w)
        out.nbytes += n
        out.ops += 1
        if params.verify and params.op.is_read:
            _check(b, pattern(off, io, params.seed), out, off, path_w)


@dataclass
class RunWindow:
    """What a run measured around its timed window, however its workers ran."""

    outs: list[WorkerOut]
    wall_s: float
    cpu: cpu_mod.CpuCost
    ledger: gdskit.Stats
    counters: dict[str, int] | None


def counter_delta(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int] | None:
    if before is None or after is None:
        return None
    return {k: after[k] - before.get(k, 0) for k in after}
