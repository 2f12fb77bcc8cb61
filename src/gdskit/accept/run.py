"""Run the checklist: every item in order, the report written however an item ends.

``run_accept`` is the whole of ``gdskit accept`` as a library call. An item that
raises is recorded as failed with the error as its evidence: the report is always
written, and one broken item never hides the others.
"""

from __future__ import annotations

import json
import os
import platform
import time
import traceback
from collections.abc import Callable
from typing import Any

from gdskit import __version__
from gdskit.accept.context import ALL_ITEMS, AcceptContext, AcceptOptions
from gdskit.accept.items import ITEMS
from gdskit.accept.report import write_report
from gdskit.accept.result import (FAIL, SCHEMA, TITLES, AcceptReport, ItemResult, not_applicable, result,
                                  write_json)
from gdskit.durable import read_whole_file
from gdskit.errors import InvalidArgumentError

#: ``progress(item, title, result)``: called with ``result=None`` when an item starts, then with its result.
ProgressFn = Callable[[int, str, "ItemResult | None"], None]


def default_report_dir(now: float | None = None) -> str:
    return os.path.abspath(time.strftime("gdskit-accept-%Y%m%d-%H%M%S", time.localtime(now)))


def claim_report_dir(path: str) -> None:
    """Make the report directory, or check that it may be written: new, empty, or holding an
    earlier ``gdskit accept`` report (its files are then written over). Anything else holds
    files of someone else's that report.md, check.json and the rest would replace.

    Raises :class:`~gdskit.errors.InvalidArgumentError`, before any item runs.
    """
    if os.path.lexists(path) and not os.path.isdir(path):
        raise InvalidArgumentError(f"--report {path!r} exists and is not a directory")
    try:
        entries = os.listdir(path)
    except FileNotFoundError:
        entries = []
    except OSError as exc:
        raise InvalidArgumentError(f"--report {path!r} cannot be read: {exc}") from None
    if entries and not _holds_a_report(path):
        raise InvalidArgumentError(
            f"--report {path!r} holds other files ({', '.join(sorted(entries)[:3])}"
            f"{', ...' if len(entries) > 3 else ''}), and gdskit accept writes report.md, report.json, "
            "check.json and more there: name a new or empty directory")
    os.makedirs(path, exist_ok=True)


def _holds_a_report(path: str) -> bool:
    try:
        doc = json.loads(read_whole_file(os.path.join(path, "report.json")))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("schema") == SCHEMA


def _machine(ctx: AcceptContext) -> dict[str, Any]:
    rep = ctx.check_report()
    gpu, gds = rep.gpu, rep.gds
    return {
        "hostname": platform.node() if ctx.live else f"captured tree {ctx.options.root}",
        "kernel": gds.kernel_release, "virtualization": gds.virtualization,
        "gpus": [f"{g.index}: {g.name}" for g in gpu.gpus],
        "driver": f"{gpu.driver_version} ({gpu.kernel_module})" if gpu.driver_version else None,
        "cufile": gds.cufile.version if gds.cufile.found else None,
        "nvidia_fs": gds.nvidia_fs.loaded, "p2pdma": gds.p2pdma.available,
        "python": platform.python_version(), "gdskit_version": __version__,
    }


def _crashed(item: int, exc: BaseException) -> ItemResult:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return result(item, FAIL, f"the item could not run: {type(exc).__name__}: {exc}",
                  evidence=[ln.rstrip() for chunk in tb[-6:] for ln in chunk.splitlines()],
                  fix="Fix the error above (a bad target, a full disk, a missing permission), or report it.")


def run_accept(options: AcceptOptions, progress: ProgressFn | None = None) -> AcceptReport:
    """Run the selected checklist items and write the report into ``options.report_dir``.

    Raises
    ------
    gdskit.errors.GdskitError
        Bad arguments found before any item ran (a path outside a captured tree, ...).
    """
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    claim_report_dir(options.report_dir)
    ctx = AcceptContext(options)
    check = ctx.check_report()  # bad targets surface here, as argument errors, before anything runs
    write_json(ctx.artifact("check.json"), check.to_dict())

    items: list[ItemResult] = []
    for item in ALL_ITEMS:
        if item not in options.items:
            items.append(not_applicable(item, "not selected (--items)"))
            continue
        if progress is not None:
            progress(item, TITLES[item], None)
        t0 = time.perf_counter()
        try:
            r = ITEMS[item](ctx)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # recorded as the item's failure; the other items still run
            r = _crashed(item, exc)
        r.duration_s = time.perf_counter() - t0
        items.append(r)
        if progress is not None:
            progress(item, TITLES[item], r)

    notes = []
    if not ctx.has_gpu and ctx.live:
        notes.append("No GPU on this machine: the GPU items are not applicable; the report proves only what "
                     "runs without one (checkpoint formats, the host path).")
    if not ctx.live:
        notes.append("Items 1 and 2 judge the captured tree given with --root; items 3 to 7 measure a live "
                     "machine and do not apply to it.")
    report = AcceptReport(created=created, machine=_machine(ctx), options=options.to_dict(), items=items,
                          notes=notes)
    write_report(report, options.report_dir)
    return report


class ConsoleProgress:
    """A rich spinner while an item runs, and one line per finished item."""

    STYLE = {"pass": "bold green", "fail": "bold red", "n/a": "dim"}

    def __init__(self, console: Any) -> None:
        self.console = console
        self._status: Any = None

    def __call__(self, item: int, title: str, r: ItemResult | None) -> None:
        if r is None:
            self._status = self.console.status(f"[bold]item {item}/{len(ALL_ITEMS)}[/bold] {title} ...")
            self._status.start()
            return
        if self._status is not None:
            self._status.stop()
            self._status = None
        style = self.STYLE[r.status]
        self.console.print(f"[{style}]{r.status.upper():4s}[/{style}] {item}. {title} "
                           f"[dim]({r.duration_s:.1f} s)[/dim]\n     {r.summary}", highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
