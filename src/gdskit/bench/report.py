"""Results of ``gdskit bench`` as dataclasses, and their renderings.

* :meth:`BenchReport.to_dict` is the stable JSON schema (``schema_version``;
  fields are only ever added within one version),
* :func:`write_csv` one row per run,
* :func:`render_table` the table for people (rich),
* :func:`plot` throughput and CPU cost against I/O size (matplotlib, optional).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import statistics
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

from gdskit.bench.cpu import CpuCost
from gdskit.bench.knee import KneeResult
from gdskit.durable import check_output_file, write_whole
from gdskit.errors import InvalidArgumentError, MissingDependencyError

SCHEMA_VERSION = 1

#: Which ledger paths count as "the path asked for" for each bench path name.
EXPECTED_PATHS = {
    "cufile": ("cufile-nvfs", "cufile-p2pdma"),
    "bounce": ("bounce-cached", "bounce-direct"),
    "host": ("host",),
}


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """Outcome of ``-V``: bytes compared against the pattern, and what differed."""

    checked_bytes: int
    mismatched_bytes: int
    first_bad_offset: int | None
    first_bad_file: str | None = None

    @property
    def ok(self) -> bool:
        return self.mismatched_bytes == 0


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One run: one path, one I/O size, one repetition.

    Attributes
    ----------
    path : str
        Bench path asked for (``cufile``, ``bounce``, ``host``).
    io_size, repetition : int
        The I/O size and the 0-based repetition index.
    op : str
        ``read``, ``write``, ``randread`` or ``randwrite``.
    bytes, ops : int
        What the run moved, counted by the workers.
    wall_s : float
        From the first I/O issued to the last one finished.
    gib_per_s : float
        ``bytes / wall_s`` in GiB/s.
    latency_avg_us, latency_p50_us, latency_p99_us : float | None
        Per-I/O latency.
    cpu : CpuCost
        CPU use over the same window.
    taken : dict[str, int]
        Bytes per path from the ledger: the path actually taken.
    reasons : dict[str, int]
        Bytes per reason from the ledger.
    path_taken : str | None
        The ledger path that moved the most bytes.
    fell_back : bool
        The ledger shows bytes on a path other than the one asked for.
    fallback_reason : str | None
        Why, in the vocabulary's words.
    verify : VerifyResult | None
        Present when the run verified data.
    cufile_counters : dict | None
        cuFile's own counters for the run, when the engine reports them.
    """

    path: str
    io_size: int
    repetition: int
    op: str
    bytes: int
    ops: int
    wall_s: float
    gib_per_s: float
    latency_avg_us: float | None
    latency_p50_us: float | None
    latency_p99_us: float | None
    cpu: CpuCost
    taken: dict[str, int]
    reasons: dict[str, int]
    path_taken: str | None
    fell_back: bool
    fallback_reason: str | None
    verify: VerifyResult | None = None
    cufile_counters: dict[str, Any] | None = None

    @property
    def cpu_s_per_gib(self) -> float | None:
        return self.cpu.cpu_s_per_gib(self.bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path, "io_size": self.io_size, "repetition": self.repetition, "op": self.op,
            "bytes": self.bytes, "ops": self.ops, "wall_s": self.wall_s, "gib_per_s": self.gib_per_s,
            "latency_us": {"avg": self.latency_avg_us, "p50": self.latency_p50_us,
                           "p99": self.latency_p99_us},
            "cpu": {"user_pct": self.cpu.user_pct, "system_pct": self.cpu.system_pct,
                    "iowait_pct": self.cpu.iowait_pct, "busy_pct": self.cpu.busy_pct,
                    "process_cpu_s": self.cpu.process_cpu_s,
                    "process_user_s": self.cpu.process_user_s,
                    "process_system_s": self.cpu.process_system_s,
                    "cpu_s_per_gib": self.cpu_s_per_gib},
            "ledger": {"paths": dict(self.taken), "reasons": dict(self.reasons)},
            "path_taken": self.path_taken, "fell_back": self.fell_back,
            "fallback_reason": self.fallback_reason,
            "verify": None if self.verify is None else {**dataclasses.asdict(self.verify),
                                                        "ok": self.verify.ok},
            "cufile_counters": self.cufile_counters,
        }


@dataclasses.dataclass(frozen=True)
class Summary:
    """Repetitions of one path at one I/O size, reduced: median with min and max."""

    path: str
    io_size: int
    repetitions: int
    gib_per_s_median: float
    gib_per_s_min: float
    gib_per_s_max: float
    latency_avg_us: float | None
    latency_p50_us: float | None
    latency_p99_us: float | None
    user_pct: float
    system_pct: float
    iowait_pct: float
    cpu_s_per_gib: float | None
    paths_taken: tuple[str, ...]
    fell_back: bool
    fallback_reason: str | None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["paths_taken"] = list(self.paths_taken)
        return d


def _median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(statistics.median(vals)) if vals else None


def summarize(runs: Sequence[RunResult]) -> list[Summary]:
    """One :class:`Summary` per (path, I/O size), in first-seen path order, ascending size."""
    order: list[str] = []
    groups: dict[tuple[str, int], list[RunResult]] = {}
    for r in runs:
        if r.path not in order:
            order.append(r.path)
        groups.setdefault((r.path, r.io_size), []).append(r)
    out = []
    for key in sorted(groups, key=lambda k: (k[1], order.index(k[0]))):
        rs = groups[key]
        tput = [r.gib_per_s for r in rs]
        taken: list[str] = []
        for r in rs:
            for p, n in sorted(r.taken.items(), key=lambda kv: -kv[1]):
                if n > 0 and p not in taken:
                    taken.append(p)
        reasons = [r.fallback_reason for r in rs if r.fell_back and r.fallback_reason]
        out.append(Summary(
            path=key[0], io_size=key[1], repetitions=len(rs),
            gib_per_s_median=float(statistics.median(tput)), gib_per_s_min=min(tput),
            gib_per_s_max=max(tput),
            latency_avg_us=_median(r.latency_avg_us for r in rs),
            latency_p50_us=_median(r.latency_p50_us for r in rs),
            latency_p99_us=_median(r.latency_p99_us for r in rs),
            user_pct=float(statistics.median(r.cpu.user_pct for r in rs)),
            system_pct=float(statistics.median(r.cpu.system_pct for r in rs)),
            iowait_pct=float(statistics.median(r.cpu.iowait_pct for r in rs)),
            cpu_s_per_gib=_median(r.cpu_s_per_gib for r in rs),
            paths_taken=tuple(taken), fell_back=any(r.fell_back for r in rs),
            fallback_reason=reasons[0] if reasons else None,
        ))
    return out


@dataclasses.dataclass(frozen=True)
class EngineResult:
    """What an application gets from the engine on the same file: ``File.read`` of the benchmark's
    file into GPU memory at the engine's own settings (large chunks, every worker), one pass per
    repetition, beside the gdsio-style rows of one I/O at a time per worker.

    Attributes
    ----------
    bytes : int
        Bytes each pass read (the data set, up to a cap).
    gib_per_s : tuple[float, ...]
        Each pass's rate.
    mode, chunk_size, threads : str, int, int
        The engine's settings the passes ran at.
    cpu_s_per_gib : float | None
        The benchmark process's CPU-seconds per GiB, median of the passes.
    taken : dict[str, int]
        Bytes per ledger path, all passes.
    path_taken : str | None
        The ledger path that moved the most bytes.
    note : str
        Why the rows of one I/O per worker at a time are slower, in one sentence.
    """

    bytes: int
    gib_per_s: tuple[float, ...]
    mode: str
    chunk_size: int
    threads: int
    cpu_s_per_gib: float | None
    taken: dict[str, int]
    path_taken: str | None
    note: str

    @property
    def gib_per_s_median(self) -> float:
        return float(statistics.median(self.gib_per_s))

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "gib_per_s": list(self.gib_per_s), "gib_per_s_median": self.gib_per_s_median,
                "gib_per_s_min": min(self.gib_per_s), "gib_per_s_max": max(self.gib_per_s), "mode": self.mode,
                "chunk_size": self.chunk_size, "threads": self.threads, "cpu_s_per_gib": self.cpu_s_per_gib,
                "ledger": {"paths": dict(self.taken)}, "path_taken": self.path_taken, "note": self.note}


@dataclasses.dataclass
class BenchReport:
    """Everything one ``gdskit bench`` invocation measured.

    Attributes
    ----------
    params : dict
        The parameters (:meth:`BenchParams.as_dict`).
    machine : dict
        Machine facts (:class:`gdskit.bench.machine.MachineFacts`).
    paths : list[str]
        Paths compared, in run order.
    unavailable : dict[str, str]
        Paths left out because they cannot run here, with the reason.
    runs : list[RunResult]
        Every run, in the order it ran.
    knee : KneeResult | None
        The sweep's knee, when a sweep compared a direct and a CPU path.
    engine : EngineResult | None
        The engine's own rate on the same file (``File.read`` into GPU memory), for read
        benchmarks that ran a GPU path.
    warnings : list[str]
        Things a reader must not miss (fall-backs, verification failures).
    created : str
        UTC time the benchmark started (ISO 8601).
    """

    params: dict[str, Any]
    machine: dict[str, Any]
    paths: list[str]
    unavailable: dict[str, str]
    runs: list[RunResult]
    knee: KneeResult | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    created: str = ""
    profile_saved: dict[str, Any] | None = None
    engine: EngineResult | None = None

    @property
    def summaries(self) -> list[Summary]:
        return summarize(self.runs)

    @property
    def verify_ok(self) -> bool | None:
        checked = [r.verify for r in self.runs if r.verify is not None]
        if not checked:
            return None
        return all(v.ok for v in checked)

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON form (see ``schema_version``)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": "gdskit.bench",
            "created": self.created,
            "params": self.params,
            "machine": self.machine,
            "paths": list(self.paths),
            "unavailable": dict(self.unavailable),
            "summaries": [s.to_dict() for s in self.summaries],
            "runs": [r.to_dict() for r in self.runs],
            "knee": None if self.knee is None else self.knee.as_dict(),
            "profile_saved": self.profile_saved,
            "engine": None if self.engine is None else self.engine.to_dict(),
            "verify_ok": self.verify_ok,
            "warnings": list(self.warnings),
        }


# -- CSV ---------------------------------------------------------------------
CSV_COLUMNS = (
    "path", "io_size", "repetition", "op", "bytes", "ops", "wall_s", "gib_per_s",
    "latency_avg_us", "latency_p50_us", "latency_p99_us", "user_pct", "system_pct", "iowait_pct",
    "process_cpu_s", "cpu_s_per_gib", "path_taken", "fell_back", "fallback_reason", "verify_ok",
)


def write_csv(runs: Sequence[RunResult], out: TextIO) -> None:
    """One row per run with the columns of :data:`CSV_COLUMNS`."""
    w = csv.writer(out, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in runs:
        w.writerow([
            r.path, r.io_size, r.repetition, r.op, r.bytes, r.ops, f"{r.wall_s:.6f}",
            f"{r.gib_per_s:.6f}", _fmt(r.latency_avg_us), _fmt(r.latency_p50_us),
            _fmt(r.latency_p99_us), f"{r.cpu.user_pct:.2f}", f"{r.cpu.system_pct:.2f}",
            f"{r.cpu.iowait_pct:.2f}", f"{r.cpu.process_cpu_s:.6f}", _fmt(r.cpu_s_per_gib),
            r.path_taken or "", int(r.fell_back), r.fallback_reason or "",
            "" if r.verify is None else int(r.verify.ok),
        ])


def save_csv(runs: Sequence[RunResult], path: str) -> None:
    """:func:`write_csv` into the file ``path``, whole or not at all (a temporary file renamed over it)."""
    write_whole(path, lambda tmp: _write_csv_file(runs, tmp))


def _write_csv_file(runs: Sequence[RunResult], path: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        write_csv(runs, fh)


#: The name of the plot ``--plot DIR`` writes into DIR (numbered when taken: nothing is written over).
PLOT_NAME = "gdskit-bench"


def plot_target(name: str) -> str:
    """The file :func:`plot` is to write for ``--plot NAME``.

    NAME itself when it names a file in a format matplotlib writes (PNG, SVG, PDF...);
    NAME.png without an extension; in an existing directory, a new ``gdskit-bench.png``
    there (``gdskit-bench-2.png``, ... when taken).

    Raises
    ------
    MissingDependencyError
        matplotlib is not installed.
    InvalidArgumentError
        A format matplotlib cannot write, or a directory that does not exist.
    """
    plt = _pyplot()
    if os.path.isdir(name):
        n = 1
        path = os.path.join(name, f"{PLOT_NAME}.png")
        while os.path.lexists(path):
            n += 1
            path = os.path.join(name, f"{PLOT_NAME}-{n}.png")
        return path
    ext = os.path.splitext(name)[1].lower().lstrip(".")
    if not ext:
        name, ext = name + ".png", "png"
    fig = plt.figure()
    try:
        formats = fig.canvas.get_supported_filetypes()
    finally:
        plt.close(fig)
    if ext not in formats:
        raise InvalidArgumentError(f"--plot {name!r}: matplotlib cannot write .{ext} files; "
                                   f"use one of {', '.join('.' + f for f in sorted(formats))}")
    return check_output_file(name, "--plot")


def _pyplot() -> Any:
    try:
        import matplotlib  # noqa: PLC0415 - optional dependency (matplotlib)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 - optional dependency (matplotlib)
    except ImportError as exc:
        raise MissingDependencyError(
            "--plot needs matplotlib: pip install 'gdskit[plot]'") from exc
    return plt


def csv_text(runs: Sequence[RunResult]) -> str:
    buf = io.StringIO()
    write_csv(runs, buf)
    return buf.getvalue()


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "" if v is None else format(v, spec)


# -- table -------------------------------------------------------------------
def size_text(n: int) -> str:
    for unit, factor in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def render_table(report: BenchReport, console: Any = None) -> None:
    """Print the report for people (rich)."""
    from rich.console import Console  # noqa: PLC0415 - import time
    from rich.table import Table  # noqa: PLC0415 - import time

    console = console or Console()
    p = report.params
    m = report.machine
    gpu = (m.get("gpu") or {}).get("name")
    where = ", ".join(x for x in (
        f"{m.get('filesystem')} on {m.get('mount_source')}" if m.get("filesystem") else None,
        f"GPU {gpu} (driver {m['gpu'].get('driver')})" if gpu else "no GPU",
        f"libcufile {m['cufile_version']}" if m.get("cufile_version") else None,
    ) if x)
    kind = "worker processes" if p.get("processes") else "workers"
    if p.get("huge_pages"):
        kind += ", host buffers on huge pages"
    console.print(f"[bold]gdskit bench[/bold]: {p.get('op')}, {p.get('workers')} {kind}, "
                  f"cache {p.get('cache')}, {p.get('repeat')} repetitions, "
                  f"data set {size_text(int(p.get('size', 0)))} — {where}")
    t = Table(show_lines=False)
    for col, just in (("path", "left"), ("I/O", "right"), ("GiB/s median [min–max]", "right"),
                      ("latency µs avg/p50/p99", "right"), ("%usr/%sys/%iowait", "right"),
                      ("CPU-s/GiB", "right"), ("path taken (ledger)", "left")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for s in report.summaries:
        taken = ", ".join(s.paths_taken) or "-"
        if s.fell_back:
            taken = f"[bold red]{taken} FELL BACK ({s.fallback_reason or 'unknown'})[/bold red]"
        t.add_row(s.path, size_text(s.io_size),
                  f"{s.gib_per_s_median:.2f} [{s.gib_per_s_min:.2f}–{s.gib_per_s_max:.2f}]",
                  f"{_fmt(s.latency_avg_us, '.0f')}/{_fmt(s.latency_p50_us, '.0f')}/"
                  f"{_fmt(s.latency_p99_us, '.0f')}",
                  f"{s.user_pct:.0f}/{s.system_pct:.0f}/{s.iowait_pct:.0f}",
                  _fmt(s.cpu_s_per_gib, ".2f"), taken)
    e = report.engine
    if e is not None:
        t.add_row("File.read", f"{size_text(e.chunk_size)} ×{e.threads}",
                  f"{e.gib_per_s_median:.2f} [{min(e.gib_per_s):.2f}–{max(e.gib_per_s):.2f}]", "-", "-",
                  _fmt(e.cpu_s_per_gib, ".2f"), e.path_taken or "-")
    console.print(t)
    if e is not None:
        console.print(f"File.read: {e.note}")
    for name, reason in report.unavailable.items():
        console.print(f"[dim]{name}: not available here ({reason})[/dim]")
    if report.knee is not None:
        k = report.knee
        console.print(f"[bold]knee[/bold]: {k.note}")
        console.print(f"  gdskit: {k.gdskit_setting}")
        if k.cufile_json is not None:
            console.print(f"  cufile.json: {json.dumps(k.cufile_json)}")
        elif k.verdicts:
            console.print(f"  cufile.json: no posix_gds_min_kb key for {k.fstype or 'this filesystem'}"
                          " (libcufile reads it for lustre, beegfs, scatefs only)")
    if report.profile_saved is not None:
        console.print(f"profile saved for {report.profile_saved.get('mount_point')} "
                      f"({report.profile_saved.get('dev')})")
    if report.verify_ok is True:
        console.print("[green]verify: every byte matched[/green]")
    for w in report.warnings:
        console.print(f"[bold red]WARNING[/bold red]: {w}")


# -- plot --------------------------------------------------------------------
def plot(report: BenchReport, filename: str) -> str:
    """Throughput and CPU cost against I/O size, one line per path, to ``filename``; returns it.

    The format follows the file's extension (PNG without one); :func:`plot_target`
    turns what a user typed into the name to give here. The file is written whole
    or not at all.

    Raises
    ------
    MissingDependencyError
        matplotlib is not installed.
    """
    plt = _pyplot()
    fmt = os.path.splitext(filename)[1].lower().lstrip(".") or "png"

    sums = report.summaries
    paths = [p for p in report.paths if any(s.path == p for s in sums)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for path in paths:
        ss = [s for s in sums if s.path == path]
        xs = [s.io_size for s in ss]
        med = [s.gib_per_s_median for s in ss]
        lo = [s.gib_per_s_median - s.gib_per_s_min for s in ss]
        hi = [s.gib_per_s_max - s.gib_per_s_median for s in ss]
        taken = ",".join(sorted({t for s in ss for t in s.paths_taken}))
        label = f"{path} (took {taken})" if taken else path
        ax1.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=label)
        cpu = [(s.io_size, s.cpu_s_per_gib) for s in ss if s.cpu_s_per_gib is not None]
        if cpu:
            ax2.plot([c[0] for c in cpu], [c[1] for c in cpu], marker="o", label=path)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("I/O size")
        ticks = sorted({s.io_size for s in sums})
        ax.set_xticks(ticks)
        ax.set_xticklabels([size_text(t) for t in ticks], rotation=45)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax1.set_ylabel("throughput (GiB/s, median; bars: min–max)")
    ax1.set_title("Throughput")
    ax2.set_ylabel("benchmark process CPU-seconds per GiB moved")
    ax2.set_title("CPU cost (lower is better)")
    cpu_vals = [s.cpu_s_per_gib for s in sums if s.cpu_s_per_gib]
    if cpu_vals and max(cpu_vals) > 20 * min(cpu_vals):
        ax2.set_yscale("log")  # small I/O costs orders of magnitude more per GiB
    else:
        ax2.set_ylim(bottom=0)
    ax1.set_ylim(bottom=0)
    if report.knee is not None and report.knee.knee is not None:
        for ax in (ax1, ax2):
            ax.axvline(report.knee.knee, color="grey", linestyle="--")
        ax1.annotate(f"knee {size_text(report.knee.knee)}", (report.knee.knee, 0),
                     textcoords="offset points", xytext=(4, 8), color="grey")
    p = report.params
    m = report.machine
    gpu = (m.get("gpu") or {}).get("name") or "no GPU"
    kind = "worker processes" if p.get("processes") else "workers"
    fig.suptitle(f"gdskit bench: {p.get('op')}, {p.get('workers')} {kind}, cache {p.get('cache')}, "
                 f"{m.get('filesystem') or '?'} on {m.get('mount_source') or '?'}, {gpu}")
    fig.tight_layout()
    try:
        write_whole(filename, lambda tmp: fig.savefig(tmp, dpi=110, format=fmt))
    finally:
        plt.close(fig)
    return filename
