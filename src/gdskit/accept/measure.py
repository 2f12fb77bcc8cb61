"""Items 3 and 4: the A/B benchmark and the I/O-size sweep, through ``gdskit bench``'s runner.

Both compare the ``cufile`` path (the direct path, when the machine has one)
with the ``bounce`` path (gdskit's pinned CPU path) under identical parameters,
cold page cache, interleaved repetitions. The full bench reports are archived as
JSON and CSV next to the acceptance report; the sweep's plot is bench's own.
"""

from __future__ import annotations

import io
import json
from typing import Any

from gdskit.accept import plots
from gdskit.accept.context import AcceptContext
from gdskit.accept.result import FAIL, PASS, Artifact, ItemResult, result, write_json
from gdskit.durable import write_text_whole

#: The two paths compared: the direct path and the CPU path it must beat.
AB_PATHS = "cufile,bounce"
SWEEP_RANGE = "4K:1M"
WORKERS = 4


def _run(ctx: AcceptContext, item: int, **params: Any) -> tuple[Any, ItemResult | None]:
    """Run one benchmark; on a path that cannot run, the failing :class:`ItemResult` instead."""
    from gdskit.bench import runner  # noqa: PLC0415 - import time
    from gdskit.bench.params import PathUnavailableError, make_params  # noqa: PLC0415 - import time

    p = make_params(paths=AB_PATHS, workers=WORKERS, cache="cold", device=ctx.options.device, **params)
    try:
        return runner.run_benchmark(p, workdir=ctx.work_dir), None
    except PathUnavailableError as exc:
        reason = str(getattr(exc.reason, "value", exc.reason))
        return None, result(item, FAIL, f"the {exc.path} path cannot run on {ctx.work_dir}: {reason}",
                            evidence=[str(exc)], data={"path": exc.path, "reason": reason},
                            fix=_fix_for_reason(ctx, reason))


def _fix_for_reason(ctx: AcceptContext, reason: str) -> str:
    rep = ctx.check_report()
    fixes = list(dict.fromkeys(f.fix for f in rep.findings if f.reason == reason and f.fix and f.severity != "ok"))
    return " ".join(fixes) if fixes else f"See gdskit check {ctx.work_dir} for why ({reason})."


def _archive(ctx: AcceptContext, report: Any, stem: str, what: str) -> list[Artifact]:
    from gdskit.bench.report import write_csv  # noqa: PLC0415 - import time

    write_json(ctx.artifact(f"{stem}.json"), report.to_dict())
    rows = io.StringIO()
    write_csv(report.runs, rows)
    write_text_whole(ctx.artifact(f"{stem}.csv"), rows.getvalue())
    return [Artifact("json", f"{stem}.json", f"{what}: full gdskit bench report (JSON)"),
            Artifact("csv", f"{stem}.csv", f"{what}: one row per run (CSV)")]


def _fell_back_lines(report: Any) -> list[str]:
    return [f"note: {w}" for w in report.warnings]


def _fmt(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def ab_item(ctx: AcceptContext) -> ItemResult:
    s = ctx.sizes
    report, failed = _run(ctx, 3, size=s.ab_size, io_size="1M", repeat=s.ab_repeat)
    if failed is not None:
        return failed
    arts = _archive(ctx, report, "bench-ab", "A/B benchmark")
    p = report.params
    ev = [f"parameters (identical for both paths): {p['op']}, 1 MiB I/O, {p['workers']} workers, "
          f"{p['size'] >> 20} MiB data set, cache {p['cache']}, {p['repeat']} interleaved repetitions, "
          f"on {report.machine.get('filesystem')} ({report.machine.get('mount_source')})"]
    rows = []
    for sm in report.summaries:
        taken = ", ".join(sm.paths_taken) or "-"
        if sm.fell_back:
            taken += f" (FELL BACK: {sm.fallback_reason})"
        ev.append(f"{sm.path}: {sm.gib_per_s_median:.2f} GiB/s [{sm.gib_per_s_min:.2f}-{sm.gib_per_s_max:.2f}], "
                  f"latency avg/p50/p99 {_fmt(sm.latency_avg_us)}/{_fmt(sm.latency_p50_us)}/"
                  f"{_fmt(sm.latency_p99_us)} µs, CPU {_fmt(sm.cpu_s_per_gib, '.3f')} CPU-s/GiB "
                  f"(%usr {sm.user_pct:.0f}, %sys {sm.system_pct:.0f}), path taken: {taken}")
        rows.append(sm.to_dict())
    ev += _fell_back_lines(report)
    ran = {sm.path for sm in report.summaries}
    if not {"cufile", "bounce"} <= ran:
        return result(3, FAIL, "the benchmark did not run both paths", evidence=ev, data={"summaries": rows},
                      fix="See gdskit bench -x cufile,bounce for the error.", artifacts=arts)
    png = plots.ab_chart(report, ctx.artifact("ab.png"))
    if png:
        arts.insert(0, Artifact("plot", "ab.png", "A/B: throughput, latency and CPU cost per path"))
    else:
        ev.append("no plot: matplotlib is not installed (pip install 'gdskit[plot]')")
    cu = next(sm for sm in report.summaries if sm.path == "cufile")
    bo = next(sm for sm in report.summaries if sm.path == "bounce")
    summary = (f"cufile {cu.gib_per_s_median:.2f} GiB/s at {_fmt(cu.cpu_s_per_gib, '.3f')} CPU-s/GiB, "
               f"bounce {bo.gib_per_s_median:.2f} GiB/s at {_fmt(bo.cpu_s_per_gib, '.3f')} CPU-s/GiB"
               + (f"; cufile fell back to {', '.join(cu.paths_taken)}" if cu.fell_back else ""))
    return result(3, PASS, summary, evidence=ev, data={"summaries": rows, "warnings": report.warnings},
                  artifacts=arts)


def sweep_item(ctx: AcceptContext) -> ItemResult:
    from gdskit.bench.report import size_text  # noqa: PLC0415 - import time

    s = ctx.sizes
    report, failed = _run(ctx, 4, size=s.sweep_size, io_size=SWEEP_RANGE, repeat=s.sweep_repeat,
                          duration=s.sweep_seconds, sweep=True)
    if failed is not None:
        return failed
    arts = _archive(ctx, report, "sweep", "I/O-size sweep")
    try:
        from gdskit.bench.report import plot  # noqa: PLC0415 - import time

        plot(report, ctx.artifact("sweep.png"))
        arts.insert(0, Artifact("plot", "sweep.png", "Sweep: throughput and CPU cost against I/O size"))
        plotted = True
    except ImportError:  # MissingDependencyError: matplotlib absent
        plotted = False
    knee = report.knee
    sizes = sorted({r.io_size for r in report.runs})
    ev = [f"swept {size_text(sizes[0])} to {size_text(sizes[-1])} ({len(sizes)} sizes), "
          f"{report.params['repeat']} repetitions of {report.params['duration']} s per path and size, cache cold"]
    if not plotted:
        ev.append("no plot: matplotlib is not installed (pip install 'gdskit[plot]')")
    if knee is None:
        return result(4, FAIL, "no cut-off: the sweep did not compare both paths", evidence=ev + report.warnings,
                      fix="See gdskit bench --sweep -x cufile,bounce.", artifacts=arts)
    for v in knee.verdicts:
        ev.append(f"{size_text(v.io_size):>5s}: cufile {v.direct_median:.3f} GiB/s, bounce {v.cpu_median:.3f} GiB/s "
                  f"[{v.cpu_min:.3f}-{v.cpu_max:.3f}] -> {'direct as fast' if v.direct_as_fast else 'bounce faster'}")
    ev.append(f"cut-off: {knee.note}")
    ev.append(f"setting: {knee.gdskit_setting}")
    if knee.cufile_json is not None:
        ev.append(f"cufile.json: {json.dumps(knee.cufile_json)}")
    else:
        ev.append(f"cufile.json: no posix_gds_min_kb key for {knee.fstype or 'this filesystem'}")
    ev += _fell_back_lines(report)
    covered = sizes[0] <= 4096 and sizes[-1] >= 1 << 20
    if not covered:
        return result(4, FAIL, "the sweep did not cover 4 KiB to 1 MiB", evidence=ev, fix="Run the full sweep.",
                      artifacts=arts)
    summary = (f"cut-off {size_text(knee.knee)} ({knee.gdskit_setting})" if knee.knee is not None
               else f"the direct path never kept up up to {size_text(sizes[-1])} ({knee.gdskit_setting})")
    return result(4, PASS, summary, evidence=ev, data={"knee": knee.as_dict()}, artifacts=arts)

