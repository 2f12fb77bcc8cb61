"""``gdskit bench``: the direct path against the CPU paths, same parameters, CPU cost included.

Options follow NVIDIA's gdsio where they can (``-f -D -d -s -i -w -x -I -T -V``);
``-x`` takes gdskit's path names instead of numbers. Exit status: 0 done,
1 verification failed, 2 bad arguments or an unusable target, 130 interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any, Optional

import typer

from gdskit.cli import cli_errors
from gdskit.vocabulary import Reason

_HELP = (
    "Compare the direct path (cuFile) with the CPU paths (bounce, host) under identical parameters.\n\n"
    "With no arguments: a temporary file in the current directory (1 GiB with a GPU, 256 MiB without), "
    "every path available here, sequential 1 MiB reads, hot page cache, 3 repetitions; prints the table "
    "and removes the file.\n\n"
    "Runs of different paths are interleaved (A B A B ...); each row is the median of the repetitions "
    "with min and max. Every run reports the path its bytes really took (gdskit's ledger, cuFile's "
    "counters) and the CPU it cost.\n\n"
    "With an object URL (gdskit bench s3://bucket/key): the object read whole into host memory at each "
    "part size (--part-sizes) and concurrency (--concurrency) of a small grid, cells interleaved, "
    "--repeat times; GB/s, GETs and retries per cell."
)


def register(app: typer.Typer) -> None:
    app.command("bench", help=_HELP, no_args_is_help=False)(bench)


def bench(
    target: Optional[str] = typer.Argument(None, metavar="[URL]", help="An object URL (s3://bucket/key) to benchmark instead of a file."),
    part_sizes: Optional[str] = typer.Option(None, "--part-sizes", help="With an object URL: part sizes to compare, e.g. 8M,64M (default: a quarter of s3_part_size and s3_part_size)."),
    concurrency: Optional[str] = typer.Option(None, "--concurrency", help="With an object URL: GETs in flight to compare, e.g. 4,16 (default: a quarter of s3_concurrency and s3_concurrency)."),
    buffer: str = typer.Option("1G", "--buffer", help="With an object URL: the host buffer it is read into (a larger object is read a buffer at a time)."),
    file: Optional[str] = typer.Option(None, "-f", "--file", help="Target file, shared by all workers (each owns a slice)."),
    directory: Optional[str] = typer.Option(None, "-D", "--dir", help="Directory with one file per worker."),
    device: int = typer.Option(0, "-d", "--device", help="GPU index for device buffers."),
    size: Optional[str] = typer.Option(None, "-s", "--size", help="Data set size (file size; each worker's file with -D). Default: an existing -f file's size, else 1G; 1G/256M for the no-argument run."),
    io_size: Optional[str] = typer.Option(None, "-i", "--io-size", help="I/O size (default 1M), or MIN:MAX to sweep powers of two."),
    workers: int = typer.Option(4, "-w", "--workers", help="Workers issuing I/O (threads; processes with --processes)."),
    processes: bool = typer.Option(False, "--processes", help="Each worker in its own process, as fio's jobs are: small I/O then measures the storage rather than Python's interpreter lock."),
    huge_pages: bool = typer.Option(False, "--huge-pages", help="Host buffers on 2 MiB transparent huge pages: the same physical layout in every run (ordinary pages leave how O_DIRECT requests are split to chance)."),
    paths: Optional[str] = typer.Option(None, "-x", "--paths", help="Paths to compare, e.g. cufile,bounce,host (default: every path available here)."),
    op: str = typer.Option("read", "-I", "--op", help="read, write, randread or randwrite (gdsio's 0-3 work too)."),
    duration: Optional[float] = typer.Option(None, "-T", "--duration", help="Seconds per run (workers wrap around their slice)."),
    total: Optional[str] = typer.Option(None, "--total", help="Bytes per run (default: one pass over the data set)."),
    verify: bool = typer.Option(False, "-V", "--verify", help="Write a known pattern, read it back, check every byte."),
    force: bool = typer.Option(False, "--force", help="Let -V, write runs and a read target smaller than -s write over an existing -f/-D file (without it an existing file is only read, as it is)."),
    cache: Optional[str] = typer.Option(None, "--cache", help="cold (evict the file, O_DIRECT; default), drop (also drop the page cache; root), hot (default of the no-argument run)."),
    repeat: int = typer.Option(3, "--repeat", help="Repetitions per path (and per size in a sweep)."),
    sweep: bool = typer.Option(False, "--sweep", help="Sweep I/O sizes 4K..16M (or -i MIN:MAX) and find the knee."),
    save_profile: bool = typer.Option(False, "--save-profile", help="Store the sweep's cut-off as this mount's profile for auto mode."),
    seed: int = typer.Option(0, "--seed", help="Seed of random offsets and of the verify pattern."),
    engine: bool = typer.Option(True, "--engine/--no-engine", help="After a read benchmark with a GPU path, also measure File.read of the file into GPU memory at the engine's settings (large chunks, every worker): what an application gets."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON (stable schema)."),
    csv_file: Optional[str] = typer.Option(None, "--csv", help="Write one CSV row per run to this file ('-' for stdout)."),
    plot_file: Optional[str] = typer.Option(None, "--plot", metavar="FILE", help="Plot throughput and CPU cost against I/O size to this PNG (given a directory: a new gdskit-bench.png in it; needs gdskit\\[plot])."),
) -> None:
    from gdskit.bench import runner  # noqa: PLC0415 - import time
    from gdskit.bench.params import make_params  # noqa: PLC0415 - import time
    from gdskit.bench.report import plot, plot_target, render_table, save_csv, write_csv  # noqa: PLC0415 - import time
    from gdskit.durable import check_output_file  # noqa: PLC0415 - import time

    if target is not None:
        _bench_object(target, part_sizes, concurrency, buffer, repeat, as_json,
                      others=file is not None or directory is not None or sweep or save_profile or plot_file is not None
                      or csv_file is not None)
        return
    default_run = file is None and directory is None
    plot_path = None
    with cli_errors("bench", "interrupted; temporary files removed"):
        # Where the outputs go is settled before the benchmark runs, not found wrong after it.
        plot_path = plot_target(plot_file) if plot_file is not None else None
        if csv_file is not None and csv_file != "-":
            check_output_file(csv_file, "--csv")
        if size is None:
            held = runner.existing_size(file) if file and os.path.isfile(file) else None
            size = str(held) if held else str(runner.default_size()) if default_run else "1G"
        params = make_params(
            file=file, directory=directory, device=device, size=size,
            io_size=io_size, workers=workers, paths=paths, op=op, duration=duration, total=total,
            verify=verify, cache=cache if cache is not None else ("hot" if default_run else "cold"),
            repeat=repeat, sweep=sweep, seed=seed, processes=processes,
            huge_pages=huge_pages, force=force, engine=engine,
        )
        with _progress(enabled=not as_json and sys.stderr.isatty()) as progress, _sigterm_as_interrupt():
            report = runner.run_benchmark(params, progress=progress, save_profile=save_profile)
        if plot_path is not None:
            plot(report, plot_path)
        if csv_file == "-":
            write_csv(report.runs, sys.stdout)
        elif csv_file is not None:
            save_csv(report.runs, csv_file)

    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    elif csv_file != "-":
        from rich.console import Console  # noqa: PLC0415 - import time
        render_table(report, Console(width=None if sys.stdout.isatty() else 160))
        note = no_gpu_note(report)
        if note:
            typer.echo(note)
    if plot_path is not None:  # on stderr when stdout carries JSON or CSV
        typer.echo(f"plot written to {plot_path}", err=as_json or csv_file == "-")
    if report.verify_ok is False:
        raise typer.Exit(1)


def _bench_object(url: str, part_sizes: str | None, concurrency: str | None, buffer: str, repeat: int,
                  as_json: bool, others: bool) -> None:
    """``gdskit bench s3://bucket/key``: the grid of part sizes and concurrencies, rendered."""
    from gdskit.bench.objects import run_object_bench  # noqa: PLC0415 - import time
    from gdskit.errors import InvalidArgumentError  # noqa: PLC0415 - import time
    from gdskit.settings import format_size, parse_size  # noqa: PLC0415 - import time

    with cli_errors("bench"):
        if others:
            raise InvalidArgumentError("an object URL is benchmarked with --part-sizes, --concurrency, --buffer, "
                                       "--repeat and --json only")
        parts = [parse_size(p) for p in part_sizes.split(",")] if part_sizes else None
        concs = [_whole(c, "--concurrency") for c in concurrency.split(",")] if concurrency else None
        with _progress(enabled=not as_json and sys.stderr.isatty()) as progress, _sigterm_as_interrupt():
            report = run_object_bench(url, parts, concs, repeat=repeat, buffer_bytes=parse_size(buffer),
                                      progress=progress)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        typer.echo(f"{report.url}: {format_size(report.object_bytes)} at {report.endpoint}, "
                   f"read whole {report.repeat}x per cell into a {format_size(report.buffer_bytes)} host buffer")
        typer.echo(f"{'part size':>10} {'GETs in flight':>15} {'GB/s':>8} {'min':>8} {'max':>8} {'GETs':>6} {'retries':>8}")
        for c in report.cells:
            typer.echo(f"{format_size(c.part_size):>10} {c.concurrency:>15} {c.gb_s:8.3f} {c.gb_s_min:8.3f} "
                       f"{c.gb_s_max:8.3f} {c.gets:6d} {c.retries:8d}")
        best = report.best
        if best is not None:
            size_text = f"{best.part_size >> 20}MiB" if best.part_size % (1 << 20) == 0 else str(best.part_size)
            typer.echo(f"fastest: {format_size(best.part_size)} parts, {best.concurrency} in flight "
                       f"(GDSKIT_S3_PART_SIZE={size_text} GDSKIT_S3_CONCURRENCY={best.concurrency})")
        if not report.whole:
            typer.echo("not every cell read the whole object, the same bytes", err=True)
    if not report.whole:
        raise typer.Exit(1)


def _whole(text: str, option: str) -> int:
    from gdskit.errors import InvalidArgumentError  # noqa: PLC0415 - import time

    try:
        return int(text)
    except ValueError:
        raise InvalidArgumentError(f"{option} takes whole numbers, got {text!r:.40}") from None


def no_gpu_note(report: Any) -> str | None:
    """One line for a run whose GPU paths could not run for want of a GPU (``make run`` on a laptop,
    CI): what its ``host`` row is, and what the same command shows on a GPU machine."""
    gpu_paths = ("cufile", "bounce")
    if any(report.unavailable.get(p) != Reason.NO_GPU.value for p in gpu_paths):
        return None
    return ("No GPU here: the host row is gdskit's parallel POSIX I/O between the file and host memory, "
            "its path on any machine; on a GPU machine the table adds cufile (GPUDirect Storage) and "
            "bounce (pinned ring) rows moving the bytes to GPU memory, and File.read for reads.")


class _progress:
    """A rich progress bar on a terminal, shown once the benchmark has run for 2 seconds."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar: Any = None
        self._task: Any = None
        self._t0 = time.monotonic()

    def __enter__(self) -> Any:
        return self if self.enabled else None

    def __call__(self, done: int, total: int, label: str) -> None:
        if self._bar is None:
            if time.monotonic() - self._t0 < 2.0:
                return
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn  # noqa: PLC0415 - import time
            self._bar = Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.description}"), TimeRemainingColumn(), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(label, total=total)
        self._bar.update(self._task, completed=done, total=total, description=label)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


class _sigterm_as_interrupt:
    """Turn SIGTERM into KeyboardInterrupt while the benchmark runs, so its files get removed."""

    def __enter__(self) -> None:
        self._old = None
        if _main_thread():
            def handler(signum: int, frame: Any) -> None:
                raise KeyboardInterrupt
            self._old = signal.signal(signal.SIGTERM, handler)

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread() and os.name == "posix"
