"""The A/B runner: the same work through each path, interleaved, repeated.

For each I/O size, for each repetition, for each path in order, one *run*:
``W`` workers (threads of this process, or with ``--processes`` processes of their
own: :mod:`gdskit.bench.procs`), each with its own :class:`gdskit.File` and buffer, issue
I/Os of one size over their own slice of the data (sequentially, or at random
aligned offsets drawn from a seed shared by all paths) through the engine with
the path forced by ``gdskit.settings.set(mode=...)``. Interleaving (A B A B ...)
spreads drift (page-cache state, thermal, other load) over all paths evenly.

Around each run the runner takes the ledger (``gdskit.stats()``), cuFile's own
counters when cuFile runs, and the CPU counters, so a run reports the path its
bytes really took and what it cost the CPU.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

import gdskit
from gdskit.engine import cuda
from gdskit.bench import cpu as cpu_mod, profile
from gdskit.bench import machine
from gdskit.bench.knee import KneeResult, find_knee
from gdskit.bench.memory import THP_SETTING, DeviceBuffer, pattern, transparent_huge_pages
from gdskit.bench.params import GPU_PATHS, GiB, MiB, PATH_NAMES, BenchParams, Cache, PathUnavailableError
from gdskit.bench.report import EXPECTED_PATHS, BenchReport, EngineResult, RunResult, VerifyResult, size_text
from gdskit.bench.worker import (RunPlan, RunWindow, Targets, WorkerOut, counter_delta, make_cold, open_worker,
                                 run_counters, work)
from gdskit.durable import create_new_file, create_temp_file, fd_path
from gdskit.engine.direct_path import direct_route
from gdskit.errors import GdskitIOError, InvalidArgumentError, NoSpaceError, from_os_error
from gdskit.settings import format_size
from gdskit.threads import start_thread
from gdskit.vocabulary import Reason

if TYPE_CHECKING:
    from gdskit.bench.procs import WorkerProcesses

#: Engine mode that forces each bench path.
ENGINE_MODE = {"cufile": "cufile", "bounce": "bounce", "host": "host"}

#: Data set of the no-argument run: big enough to pass caches' edge effects, small enough to be quick.
DEFAULT_SIZE_GPU = 1024 * MiB
DEFAULT_SIZE_HOST = 256 * MiB

#: A sweep run without -T or a byte count stops after this many seconds (or one pass, if sooner).
SWEEP_RUN_SECONDS = 1.0

_FILL_CHUNK = 8 * MiB
_TEMP_PREFIX = ".gdskit-bench-"

ProgressFn = Callable[[int, int, str], None]


def default_size() -> int:
    """The no-argument run's data set size: 1 GiB with a GPU, 256 MiB without."""
    return DEFAULT_SIZE_GPU if cuda.device_count() > 0 else DEFAULT_SIZE_HOST


# -- which paths can run here ---------------------------------------------------
def static_availability(device: int) -> dict[str, str | None]:
    """``{path: None}`` when it may run, else the reason it cannot (before any file exists)."""
    n = cuda.device_count()
    out: dict[str, str | None] = {"cufile": None, "bounce": None, "host": None}
    if n == 0:
        out["cufile"] = out["bounce"] = Reason.NO_GPU.value
        return out
    if device >= n:
        raise InvalidArgumentError(f"GPU index (-d) {device} does not exist; this machine has {n} GPU(s)")
    try:
        from gdskit.engine.backends.cufile import cufile_library  # noqa: PLC0415 - test seam
        if not cufile_library().available():
            out["cufile"] = Reason.CUFILE_MISSING.value
    except Exception:
        out["cufile"] = Reason.CUFILE_MISSING.value
    return out


def choose_paths(params: BenchParams) -> tuple[list[str], dict[str, str]]:
    """The paths to run and those left out with their reason; an asked-for path that cannot run raises."""
    avail = static_availability(params.device)
    wanted = list(params.paths) or list(PATH_NAMES)
    chosen, left_out = [], {}
    for p in wanted:
        reason = avail[p]
        if reason is None:
            chosen.append(p)
        elif params.paths_explicit:
            what = "a sweep on the" if params.sweep else "the"
            raise PathUnavailableError(f"{what} {p} path cannot run here: {reason}", p, reason)
        else:
            left_out[p] = reason
    return chosen, left_out


# -- the files ---------------------------------------------------------------------
class TargetTooSmallError(InvalidArgumentError):
    """A read benchmark's existing target holds fewer bytes than the data set size (``-s``).

    Reads use an existing file as it is: gdskit bench never writes into a file it did not create
    unless told to (``force``). ``path``, ``size`` (what it holds) and ``needed`` say which and how much.
    """

    def __init__(self, path: str, size: int, needed: int) -> None:
        super().__init__(f"{path} holds {format_size(size)} ({size} bytes), less than the data set size (-s) "
                         f"of {format_size(needed)} ({needed} bytes); give a smaller -s, or --force to let the "
                         f"benchmark fill it")
        self.path, self.size, self.needed = path, size, needed


class TargetExistsError(GdskitIOError, FileExistsError):
    """The benchmark would write into an existing file (``-V``'s pattern, a write run) without ``force``."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(errno.EEXIST, f"{path} exists and {why} would write over it; pass --force to allow "
                                       f"that, or name a file that does not exist yet", path)

    def __str__(self) -> str:
        return str(self.strerror)


class NotEnoughSpaceError(NoSpaceError):
    """The test files would not fit: ``needed`` bytes are to be written where only ``free`` are free."""

    def __init__(self, where: str, needed: int, free: int) -> None:
        super().__init__(errno.ENOSPC, f"the test files need {format_size(needed, 1)} ({needed} bytes) on "
                                       f"{where}, which has {format_size(free, 1)} ({free} bytes) free; "
                                       f"give a smaller -s", where)
        self.needed, self.free = needed, free

    def __str__(self) -> str:
        return str(self.strerror)


def _slices(params: BenchParams, files: list[str], io_max: int) -> list[tuple[str, int, int]]:
    if params.directory:
        usable = params.size - params.size % io_max
        return [(files[i], 0, usable) for i in range(params.workers)]
    per = params.size // params.workers
    per -= per % io_max
    return [(files[0], i * per, per) for i in range(params.workers)]


def fill_file(path: str, size: int, seed: int, stop: threading.Event | None = None) -> None:
    """Write the ``-V`` pattern over ``size`` bytes of ``path`` (created if missing), then fsync."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:
        raise from_os_error(exc, path) from exc
    try:
        off = 0
        while off < size:
            n = min(_FILL_CHUNK, size - off)
            data = pattern(off, n - n % 8, seed)
            view = memoryview(data)
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], off + done)
            off += n
        os.ftruncate(fd, max(size, os.fstat(fd).st_size))
        os.fsync(fd)
    except OSError as exc:
        raise from_os_error(exc, path) from exc
    finally:
        os.close(fd)


def existing_size(path: str) -> int | None:
    """Bytes an existing file (or block device) holds; None when there is nothing at ``path``.

    Raises :class:`InvalidArgumentError` for anything else there (a FIFO, a character device).
    """
    try:  # O_NONBLOCK: a FIFO must not hang the benchmark before it has started
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise from_os_error(exc, path) from exc
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISBLK(mode)):
            raise InvalidArgumentError(f"{path} is neither a regular file nor a block device")
        return os.lseek(fd, 0, os.SEEK_END)  # st_size is 0 for a block device
    except OSError as exc:
        raise from_os_error(exc, path) from exc
    finally:
        os.close(fd)


def ensure_free_space(where: str, needed: int) -> None:
    """Raise :class:`NotEnoughSpaceError` unless the filesystem holding ``where`` has ``needed`` bytes free."""
    if needed <= 0:
        return
    try:
        free = shutil.disk_usage(where).free  # what an unprivileged writer may use (f_bavail)
    except OSError as exc:
        raise from_os_error(exc, where) from exc
    if free < needed:
        raise NotEnoughSpaceError(where, needed, free)


def _make_directory(directory: str, t: Targets) -> None:
    """Make ``-D``'s directory when missing: its last component only, never a tree of parents."""
    if os.path.isdir(directory):
        return
    try:
        os.mkdir(directory, 0o755)
    except FileExistsError:
        return  # made meanwhile (or a file: opening the files inside says so)
    except OSError as exc:
        raise from_os_error(exc, directory) from exc
    t.dir_made = directory


def _plan_target(path: str, params: BenchParams) -> tuple[int | None, bool]:
    """(bytes it holds or None, whether the pattern must be written); refuses to change a user's file."""
    size = existing_size(path)
    if size is None:
        return None, True
    if not params.op.is_read or params.verify:
        if not params.force:
            why = "-V's pattern" if params.verify else f"a {params.op.value} benchmark"
            raise TargetExistsError(path, why)
        if not os.access(path, os.W_OK):
            raise from_os_error(OSError(errno.EACCES, "Permission denied"), path)
        return size, params.verify or size < params.size
    if size < params.size:
        if not params.force:
            raise TargetTooSmallError(path, size, params.size)
        if not os.access(path, os.W_OK):
            raise from_os_error(OSError(errno.EACCES, "Permission denied"), path)
        return size, True
    return size, False  # a read of a large enough file: used as it is


def prepare_targets(params: BenchParams, workdir: str | None = None) -> Targets:
    """Create or check the files; fill them with the pattern where needed.

    With no ``-f``/``-D`` a temporary file is made in ``workdir`` (default: the
    current directory) and always removed. Files made for ``-f``/``-D`` are kept
    for the next run unless the benchmark fails or is interrupted. An existing
    file is never changed without ``params.force``: a read uses it as it is
    (:class:`TargetTooSmallError` when it is smaller than ``-s``), a write or
    ``-V`` is refused (:class:`TargetExistsError`). Everything is checked, free
    space included (:class:`NotEnoughSpaceError`), before anything is written.
    """
    io_max = max(params.io_sizes)
    t = Targets(files=[], slices=[])
    try:
        if params.file is None and params.directory is None:
            where = workdir or os.getcwd()
            ensure_free_space(where, params.size)
            try:
                fd, path = create_temp_file(where, _TEMP_PREFIX, ".tmp", 0o644)
            except OSError as exc:
                raise from_os_error(exc, where) from exc
            t.remove_always.append(path)
            t.files = [path]
            try:
                fill_file(fd_path(fd), params.size, params.seed)  # the file made here, not what is at its name
            finally:
                os.close(fd)
        else:
            if params.file is not None:
                t.files = [params.file]
            else:
                t.files = [os.path.join(params.directory, f"gdskit-bench.{i}")  # type: ignore[arg-type]
                           for i in range(params.workers)]
            plans = [(path, *_plan_target(path, params)) for path in t.files]  # every check before any write
            needed = sum(params.size - min(size or 0, params.size) for _, size, fill in plans if fill)
            where = os.path.dirname(os.path.abspath(t.files[0]))
            if params.directory is not None and not os.path.isdir(where):
                where = os.path.dirname(where)  # -D's directory is made below: its parent holds it
            if not os.path.isdir(where):
                raise from_os_error(OSError(errno.ENOENT, "No such file or directory"), where)
            ensure_free_space(where, needed)
            if params.directory is not None:
                _make_directory(params.directory, t)
            for path, size, fill in plans:
                if size is None:
                    # fail early and clearly on an unwritable place (root squashes, read-only mounts)
                    try:
                        os.close(create_new_file(path, 0o644))
                    except OSError as exc:
                        raise from_os_error(exc, path) from exc
                    t.remove_on_failure.append(path)
                if fill:
                    fill_file(path, params.size, params.seed)
        t.slices = _slices(params, t.files, io_max)
    except BaseException:
        t.cleanup(failed=True)
        raise
    return t


# -- one run ----------------------------------------------------------------------------
def _verify_file_slices(slices: list[tuple[str, int, int]], seed: int) -> VerifyResult:
    """Read back every byte the workers may have written, with plain reads, and compare."""
    checked = mismatched = 0
    first_bad = first_file = None
    for path, start, length in slices:
        fd = os.open(path, os.O_RDONLY)
        try:
            off = start
            while off < start + length:
                n = min(_FILL_CHUNK, start + length - off)
                data = np.frombuffer(os.pread(fd, n, off), dtype=np.uint8)
                exp = pattern(off, n, seed)
                if data.size < n:
                    data = np.concatenate([data, np.zeros(n - data.size, np.uint8)])
                bad = np.flatnonzero(data != exp)
                checked += n
                if bad.size:
                    mismatched += int(bad.size)
                    if first_bad is None:
                        first_bad, first_file = off + int(bad[0]), path
                off += n
        finally:
            os.close(fd)
    return VerifyResult(checked, mismatched, first_bad, first_file)


def _fallback(name: str, taken: dict[str, int], reasons: dict[str, int]) -> tuple[bool, str | None]:
    expected = EXPECTED_PATHS[name]
    other = {p: n for p, n in taken.items() if p not in expected and n > 0}
    if not other:
        return False, None
    if "cufile-compat" in other:
        r = direct_route().reason
        return True, (r.value if r is not None else Reason.CUFILE_COMPAT_OBSERVED.value)
    told = sorted(((n, r) for r, n in reasons.items()
                   if r not in (Reason.FORCED_BY_SETTING.value, Reason.DIRECT.value)), reverse=True)
    return True, (told[0][1] if told else "unknown")


def make_plan(params: BenchParams, targets: Targets, name: str, io: int, rep: int) -> RunPlan:
    W = params.workers
    if params.total_bytes is not None:
        n_ops = math.ceil(params.total_bytes / io)
        budgets: list[int | None] = [n_ops // W + (1 if w < n_ops % W else 0) for w in range(W)]
    elif params.duration is not None:
        budgets = [None] * W
    else:
        budgets = [length // io for _, _, length in targets.slices]  # one pass over each slice
    forced = {"mode": ENGINE_MODE[name], "odirect": "always" if params.cache is not Cache.HOT else "auto"}
    return RunPlan(params, name, io, rep, tuple(budgets), forced, gdskit.settings.as_dict())


def _deadline_s(params: BenchParams) -> float | None:
    if params.duration is None and params.total_bytes is None and params.sweep:
        return SWEEP_RUN_SECONDS
    return params.duration


def _run_threads(plan: RunPlan, targets: Targets) -> RunWindow:
    """The run's workers as threads of this process."""
    params = plan.params
    W = params.workers
    outs = [WorkerOut() for _ in range(W)]
    stop = threading.Event()
    barrier = threading.Barrier(W + 1)
    deadline = [0.0]
    deadline_s = _deadline_s(params)
    with gdskit.settings.set(**plan.forced), contextlib.ExitStack() as stack:
        opened = [open_worker(plan, w, targets.slices[w], stack) for w in range(W)]
        if plan.cold:
            make_cold(targets.files, False)

        def worker(w: int) -> None:
            try:
                if plan.on_device:
                    cuda.set_device(params.device)  # a new thread starts on device 0
                barrier.wait()
                work(plan, w, targets.slices[w], *opened[w], outs[w], stop, deadline[0])
            except threading.BrokenBarrierError:
                pass
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                outs[w].error = exc
                stop.set()
                barrier.abort()  # a worker failing before the start must not leave the others waiting

        threads = [start_thread(functools.partial(worker, w), f"gdskit-bench-{w}") for w in range(W)]
        counters_before = run_counters(plan)
        ledger_before = gdskit.stats()
        try:
            cpu_before = cpu_mod.sample()
            deadline[0] = (time.perf_counter() + deadline_s) if deadline_s else 0.0
            t_start = time.perf_counter()
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                pass  # a worker failed before the start; its error is raised below
            for t in threads:
                t.join()
            if not params.op.is_read and plan.cold:
                for f, _ in opened:
                    f.fsync()  # cold writes count until the data is on the device
            t_end = time.perf_counter()
            cpu_after = cpu_mod.sample()
        except BaseException:
            stop.set()
            barrier.abort()
            for t in threads:
                t.join()
            raise
        ledger_after = gdskit.stats()
        counters_after = run_counters(plan)
    return RunWindow(outs, t_end - t_start, cpu_mod.cpu_cost(cpu_before, cpu_after), ledger_after - ledger_before,
                   counter_delta(counters_before, counters_after))


def run_once(params: BenchParams, targets: Targets, name: str, io: int, rep: int,
             processes: WorkerProcesses | None = None) -> RunResult:
    """One run of path ``name`` at I/O size ``io``; see the module docstring. With ``processes``
    the workers are those processes (``--processes``), else threads of this one."""
    plan = make_plan(params, targets, name, io, rep)
    if plan.cold:
        make_cold(targets.files, params.cache is Cache.DROP)
    if processes is not None:
        win = processes.run(plan, targets, _deadline_s(params))
    else:
        win = _run_threads(plan, targets)
    for out in win.outs:
        if out.error is not None:
            raise out.error

    outs = win.outs
    taken = {p: ps.bytes for p, ps in win.ledger.paths.items() if ps.bytes}
    reasons = {r: ps.bytes for r, ps in win.ledger.reasons.items() if ps.bytes}
    fell_back, why = _fallback(name, taken, reasons)
    nbytes = sum(o.nbytes for o in outs)
    wall = max(win.wall_s, 1e-9)
    lat = np.concatenate([np.asarray(o.latencies, dtype=np.int64) for o in outs]) if nbytes else None
    verify = None
    if params.verify:
        if params.op.is_read:
            bad = [o for o in outs if o.first_bad is not None]
            verify = VerifyResult(sum(o.checked for o in outs), sum(o.mismatched for o in outs),
                                  bad[0].first_bad if bad else None, bad[0].first_bad_file if bad else None)
        else:
            verify = _verify_file_slices(targets.slices, params.seed)
    return RunResult(
        path=name, io_size=io, repetition=rep, op=params.op.value, bytes=nbytes,
        ops=sum(o.ops for o in outs), wall_s=wall, gib_per_s=nbytes / wall / 2**30,
        latency_avg_us=float(lat.mean() / 1e3) if lat is not None and lat.size else None,
        latency_p50_us=float(np.percentile(lat, 50) / 1e3) if lat is not None and lat.size else None,
        latency_p99_us=float(np.percentile(lat, 99) / 1e3) if lat is not None and lat.size else None,
        cpu=win.cpu, taken=taken, reasons=reasons,
        path_taken=max(taken, key=taken.__getitem__) if taken else None,
        fell_back=fell_back, fallback_reason=why, verify=verify, cufile_counters=win.counters,
    )


# -- the engine's own rate ----------------------------------------------------------------
#: The engine's pass reads at most this much of the file, into a GPU buffer of at most ENGINE_BUFFER.
ENGINE_PASS_MAX = 4 * GiB
ENGINE_BUFFER = 1 * GiB


def engine_note(params: BenchParams, chunk_size: int, threads: int) -> str:
    """Why the rows of one I/O at a time per worker are slower than the engine's rate: one sentence."""
    io = f"{size_text_of(params.io_sizes[0])} I/O" if len(params.io_sizes) == 1 else "I/O of the row's size"
    return (f"the engine reading the same file into GPU memory; the gdsio-style rows above make one {io} "
            f"at a time per worker ({params.workers}), and on the bounce path each waits for its own read "
            f"into its one pinned stage and its copy to the GPU before the next starts, while File.read splits "
            f"a request into {size_text_of(chunk_size)} chunks on {threads} workers whose copies overlap the "
            f"next chunks' reads.")


def size_text_of(n: int) -> str:
    return size_text(n)


def engine_rate(params: BenchParams, targets: Targets, paths: list[str]) -> EngineResult | None:
    """``File.read`` of the benchmark's file into GPU memory at the engine's settings, one pass per
    repetition (the cache made cold before each where the runs' was): what an application gets.
    None where no GPU path ran a read benchmark."""
    if not params.op.is_read or not GPU_PATHS & set(paths) or cuda.device_count() == 0:
        return None
    path = targets.files[0]
    total = min(params.size, os.path.getsize(path), ENGINE_PASS_MAX)
    if total <= 0:
        return None
    cfg = gdskit.settings.snapshot()
    buf = DeviceBuffer(min(total, ENGINE_BUFFER), params.device)
    rates, costs = [], []
    taken: dict[str, int] = {}
    try:
        with gdskit.open(path) as f:
            cuda.set_device(params.device)
            gdskit.prepare(params.device)  # the set-up a loader makes ahead: not in the window
            for _ in range(params.repeat):
                if params.cache is not Cache.HOT:
                    make_cold(targets.files, params.cache is Cache.DROP)
                before, cpu_before = gdskit.stats(), cpu_mod.sample()
                t0 = time.perf_counter()
                done = 0
                while done < total:
                    n = f.read(buf.obj, min(buf.nbytes, total - done), done)
                    if n <= 0:
                        raise GdskitIOError(5, f"short read at {done} of {total} bytes", path)
                    done += n
                wall = max(time.perf_counter() - t0, 1e-9)
                cost = cpu_mod.cpu_cost(cpu_before, cpu_mod.sample())
                delta = gdskit.stats() - before
                rates.append(total / wall / 2**30)
                costs.append(cost.cpu_s_per_gib(total))
                for p, ps in delta.paths.items():
                    if ps.bytes:
                        taken[p] = taken.get(p, 0) + ps.bytes
    finally:
        buf.free()
    cpu_vals = sorted(c for c in costs if c is not None)
    return EngineResult(bytes=total, gib_per_s=tuple(rates), mode=cfg.mode.value, chunk_size=cfg.chunk_size,
                        threads=cfg.threads, cpu_s_per_gib=cpu_vals[len(cpu_vals) // 2] if cpu_vals else None,
                        taken=taken, path_taken=max(taken, key=taken.__getitem__) if taken else None,
                        note=engine_note(params, cfg.chunk_size, cfg.threads))


# -- the whole benchmark ----------------------------------------------------------------
#: I/O sizes up to this, from several worker threads, are bound by the interpreter lock; from
#: several worker processes, on the GPU paths, by the GPU's turns between the processes' contexts
#: (benchmarks/RESULTS.md, "Small reads into GPU memory, fewer layers").
SMALL_IO_FOR_THREADS = 64 * 1024


def _warnings(runs: list[RunResult], params: BenchParams) -> list[str]:
    out = []
    if params.workers > 1 and not params.processes and min(params.io_sizes) <= SMALL_IO_FOR_THREADS:
        out.append(f"{params.workers} worker threads share Python's interpreter lock between I/Os: at "
                   f"{min(params.io_sizes) // 1024} KiB that can cap the rate below the storage's; "
                   "--processes runs each worker in its own process (as fio's jobs) to measure the storage")
    gpu_paths = sorted({r.path for r in runs} & GPU_PATHS)
    if params.processes and params.workers > 1 and gpu_paths and min(params.io_sizes) <= SMALL_IO_FOR_THREADS:
        out.append(f"{params.workers} worker processes each have their own CUDA context, and without MPS the "
                   "GPU takes the contexts' work in turns: a small copy into GPU memory waits for its "
                   f"process's turn, so the {'/'.join(gpu_paths)} latency here grows with the processes "
                   "(threads of one process share one context)")
    if params.huge_pages and "host" in {r.path for r in runs} and transparent_huge_pages() in ("never", None):
        out.append("--huge-pages: transparent huge pages are off here (or unknown), so the host buffers "
                   f"are on ordinary pages ({THP_SETTING})")
    by_path: dict[str, list[RunResult]] = {}
    for r in runs:
        by_path.setdefault(r.path, []).append(r)
    for name, rs in by_path.items():
        fb = [r for r in rs if r.fell_back]
        if fb:
            took = sorted({p for r in fb for p in r.taken if p not in EXPECTED_PATHS[name]})
            out.append(f"{len(fb)} of {len(rs)} {name} runs asked for {'/'.join(EXPECTED_PATHS[name])} "
                       f"but took {', '.join(took)} (reason: {fb[0].fallback_reason}); their figures "
                       f"are for {', '.join(took)}, not for {name}")
        if params.cache is not Cache.HOT and params.op.is_read:
            cached = sum(r.taken.get("bounce-cached", 0) for r in rs)
            if cached:
                out.append(f"{name}: {cached} bytes came from the page cache although the cache policy is "
                           f"{params.cache.value}")
        bad = [r for r in rs if r.verify is not None and not r.verify.ok]
        for r in bad:
            v = r.verify
            out.append(f"verify FAILED on {name} at {r.io_size} bytes, repetition {r.repetition}: "
                       f"{v.mismatched_bytes} of {v.checked_bytes} bytes differ, first at offset "  # type: ignore[union-attr]
                       f"{v.first_bad_offset} of {v.first_bad_file}")  # type: ignore[union-attr]
    return out


def knee_of(runs: list[RunResult], fstype: str | None) -> KneeResult | None:
    """The knee of a sweep that ran both the cufile and the bounce path, else None."""
    direct: dict[int, list[float]] = {}
    cpu: dict[int, list[float]] = {}
    for r in runs:
        if r.path == "cufile":
            direct.setdefault(r.io_size, []).append(r.gib_per_s)
        elif r.path == "bounce":
            cpu.setdefault(r.io_size, []).append(r.gib_per_s)
    if not direct or not cpu:
        return None
    return find_knee(direct, cpu, direct_path="cufile", cpu_path="bounce", fstype=fstype)


def run_benchmark(params: BenchParams, *, workdir: str | None = None, progress: ProgressFn | None = None,
                  save_profile: bool = False) -> BenchReport:
    """Run the whole comparison and return its report.

    Raises
    ------
    PathUnavailableError
        A path named in ``params.paths`` cannot run here.
    InvalidArgumentError, GdskitIOError
        Bad arguments, or an unusable target.
    """
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if params.cache is Cache.DROP and os.geteuid() != 0:
        raise InvalidArgumentError("--cache drop needs root (it writes /proc/sys/vm/drop_caches); use cold")
    paths, left_out = choose_paths(params)
    if not paths:
        raise PathUnavailableError("no path can run here", "", Reason.NO_GPU)
    if save_profile and not ("cufile" in paths and "bounce" in paths and params.sweep):
        raise InvalidArgumentError("--save-profile needs a sweep (--sweep or -i MIN:MAX) of both the "
                                   "cufile and the bounce path")
    targets = prepare_targets(params, workdir)
    failed = True
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: targets.cleanup(failed=failed))  # runs last: after the processes ended
        processes = None
        if params.processes:
            from gdskit.bench.procs import WorkerProcesses  # noqa: PLC0415 - import time
            processes = stack.enter_context(WorkerProcesses(params.workers))
        facts = machine.collect(targets.files[0], params.device if cuda.device_count() else None)
        runs: list[RunResult] = []
        total = len(params.io_sizes) * params.repeat * len(paths)
        done = 0
        for io in params.io_sizes:
            for rep in range(params.repeat):
                for name in list(paths):
                    try:
                        runs.append(run_once(params, targets, name, io, rep, processes))
                    except PathUnavailableError as exc:
                        if params.paths_explicit:
                            raise
                        left_out[name] = str(exc.reason)
                        paths.remove(name)
                        total -= len(params.io_sizes) * params.repeat
                        continue
                    done += 1
                    if progress is not None:
                        progress(done, total, f"{name} {io} #{rep + 1}")
        report = BenchReport(params={**params.as_dict(), "cache": params.cache.value}, machine=facts.as_dict(),
                             paths=paths, unavailable=left_out, runs=runs, created=created,
                             engine=engine_rate(params, targets, paths) if params.engine else None)
        report.warnings = _warnings(runs, params)
        if params.sweep:
            report.knee = knee_of(runs, facts.filesystem)
            if report.knee is None:
                report.warnings.append("no knee: a sweep needs both the cufile and the bounce path")
            elif any(r.fell_back for r in runs if r.path == "cufile"):
                report.warnings.append("the knee compares cuFile's compat mode (POSIX inside libcufile) with "
                                       "the bounce path: there is no direct path on this machine")
        if save_profile and report.knee is not None:
            report.profile_saved = profile.save_profile(
                targets.files[0], report.knee,
                extra={"gpu": facts.gpu.get("name"), "cufile_version": facts.cufile_version,
                       "op": params.op.value, "cache": params.cache.value, "workers": params.workers})
        failed = False
        return report
