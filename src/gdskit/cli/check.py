"""`gdskit check`: is the direct path active here, and if not, exactly why and how to fix it.

The command only renders a :class:`gdskit.probe.CheckReport`: a grouped table for
people, or the documented JSON (``--json``, docs/check.md) for fleet automation.
"""

from __future__ import annotations

import enum
import json
import sys
from typing import Any, Optional

import typer

from gdskit.errors import GdskitError
from gdskit.settings import format_size

SEVERITY_STYLE = {"ok": "green", "info": "cyan", "warning": "yellow", "error": "bold red"}
VERDICT_STYLE = {"direct": "bold green", "compat": "yellow", "unsupported": "bold red"}


class Requirement(str, enum.Enum):
    direct = "direct"
    compat = "compat"


def _size(n: int | None) -> str:
    return "?" if n is None else format_size(n)


def _yes(v: Any, yes: str = "yes", no: str = "no") -> str:
    return "unknown" if v is None else yes if v else no


def _text(cell: Any) -> Any:
    """A cell as rich Text: report strings are shown as they are, never read as markup
    (a finding's ``[reason]`` would otherwise vanish as an unknown style tag)."""
    from rich.text import Text  # noqa: PLC0415 - import time

    return Text(cell) if isinstance(cell, str) else cell


def _row(table: Any, *cells: Any) -> None:
    table.add_row(*map(_text, cells))


def _print_table(console: Any, table: Any) -> None:
    """Print ``table`` with widths that cut no word; where the console is too narrow for that,
    each row as a block of ``column  value`` lines instead. Rich's own fitting can squeeze a
    column below its longest word and end the cell with an ellipsis."""
    widths = _word_safe_widths(console, table)
    if widths is None:
        _print_blocks(console, table)
        return
    for column, width in zip(table.columns, widths):
        column.width = width
    console.print(table)


def _word_safe_widths(console: Any, table: Any) -> list[int] | None:
    """Each column at least as wide as its longest word, the room left shared out towards each
    column's longest line; None where even the longest words do not fit side by side."""
    from rich.cells import cell_len  # noqa: PLC0415 - import time
    from rich.measure import Measurement  # noqa: PLC0415 - import time

    shortest, longest = [], []
    for column in table.columns:
        texts = [_text(c).plain for c in (column.header if table.show_header else "", *column.cells)]
        shortest.append(max([cell_len(w) for t in texts for w in t.split()] or [1]))
        longest.append(max([cell_len(line) for t in texts for line in t.splitlines()] or [1]))
    for column, width in zip(table.columns, shortest):
        column.width = width
    unbounded = console.options.update_width(sum(longest) + 8 * len(longest) + 8)  # wider than the table
    spare = console.width - Measurement.get(console, unbounded, table).maximum
    if spare < 0:
        return None
    widths = list(shortest)
    while spare > 0:  # equal shares to the columns that still want room
        wanting = [i for i, (w, m) in enumerate(zip(widths, longest)) if w < m]
        if not wanting:
            break
        share = max(1, spare // len(wanting))
        for i in wanting[:spare]:
            grow = min(share, longest[i] - widths[i], spare)
            widths[i] += grow
            spare -= grow
    return widths


def _print_blocks(console: Any, table: Any) -> None:
    """``table`` for a narrow console: its title, then per row the first cell as a heading and
    the others below it, one ``column  value`` line each (a word longer than the line folds)."""
    from rich.padding import Padding  # noqa: PLC0415 - import time
    from rich.table import Table  # noqa: PLC0415 - import time
    from rich.text import Text  # noqa: PLC0415 - import time

    if table.title:
        console.print(Text(str(table.title), style="italic"))
    headers = [str(c.header) for c in table.columns]
    for row in zip(*(list(c.cells) for c in table.columns)):
        console.print(Text.assemble(Text(f"{headers[0]}: ", style="bold"), _text(row[0])))
        block = Table.grid(padding=(0, 2))
        block.add_column(style="bold", no_wrap=True)
        block.add_column(overflow="fold")
        for header, cell in zip(headers[1:], row[1:]):
            block.add_row(header, _text(cell))
        console.print(Padding(block, (0, 0, 0, 2)))


def render(report: Any, console: Any) -> None:
    """Print the report as grouped rich tables: platform, GPUs, topology, mounts, findings."""
    from rich.table import Table  # noqa: PLC0415 - import time
    from rich.text import Text  # noqa: PLC0415 - import time

    from gdskit.probe.verdict import SEVERITIES  # noqa: PLC0415 - import time

    d = report.to_dict()
    p = d["platform"]

    plat = Table(title="Platform", show_header=False, title_justify="left", expand=False)
    plat.add_column("item", style="bold")
    plat.add_column("value")
    drv = p["driver"]
    _row(plat, "kernel", f"{p['kernel_release'] or 'unknown'}"
                 + (f" ({p['virtualization']} guest)" if p["virtualization"] else ""))
    _row(plat, "NVIDIA driver", f"{drv['driver_version']} ({drv['kernel_module']} kernel module)"
                 if drv["driver_version"] else f"not loaded ({drv['nvml_error'] or 'no NVML'})")
    cu = p["cufile"]
    _row(plat, "libcufile", f"{cu['version'] or 'version unknown'} ({cu['path'] or 'path unknown'})"
                 if cu["found"] else "not found")
    nv = p["nvidia_fs"]
    _row(plat, "nvidia-fs", f"loaded {nv['version'] or ''}".strip() if nv["loaded"] else "not loaded")
    pp = p["p2pdma"]
    _row(plat, "PCI P2PDMA", "available and enabled" if pp["available"] else
                 f"kernel symbol {_yes(pp['kernel_symbol'])}, kernel >= 6.2 {_yes(pp['kernel_version_ok'])}, "
                 f"open driver >= 570 {_yes(pp['driver_ok'])}, use_pci_p2pdma {_yes(pp['enabled_in_config'])}")
    _row(plat, "IOMMU", p["iommu"]["state"])
    _row(plat, "udev database", "readable" if p["udev"]["database"] else "missing (/run/udev/data)")
    iou = p["io_uring"]
    _row(plat, "io_uring", f"{iou['status']}: {iou['detail']}" if iou["detail"] else iou["status"])
    cfg = p["cufile_config"]
    if cfg["found"]:
        bits = [f"allow_compat_mode={cfg['allow_compat_mode']}", f"force_compat_mode={cfg['force_compat_mode']}",
                f"use_pci_p2pdma={cfg['use_pci_p2pdma']}"]
        if cfg["max_direct_io_size_kb"] is not None:
            bits.append(f"max_direct_io_size_kb={cfg['max_direct_io_size_kb']}")
        if cfg["posix_gds_min_kb"]:
            bits.append("posix_gds_min_kb: " + ", ".join(f"{k}={v}" for k, v in sorted(cfg["posix_gds_min_kb"].items())))
        if cfg["logging_dir"]:
            bits.append(f"logging dir={cfg['logging_dir']}")
        _row(plat, "cufile.json", f"{cfg['path']}: " + ", ".join(bits) + (f" [{cfg['error']}]" if cfg["error"] else ""))
    else:
        _row(plat, "cufile.json", f"{cfg['path']} not found (cuFile defaults)")
    _print_table(console, plat)

    if d["gpus"]:
        gt = Table(title="GPUs", title_justify="left")
        for col in ("#", "name", "PCI", "NUMA", "PCIe", "BAR1 total", "BAR1 used"):
            gt.add_column(col)
        for g in d["gpus"]:
            pc = g["pcie"]
            _row(gt, str(g["index"]), g["name"], g["pci_bus_id"], str(g["numa_node"] if g["numa_node"] is not None else "-"),
                       f"Gen{pc['gen']} x{pc['width']} (max Gen{pc['max_gen']} x{pc['max_width']})",
                       Text(_size(g["bar1_total_bytes"]), style="yellow" if g["bar1_small"] else ""),
                       _size(g["bar1_used_bytes"]))
        _print_table(console, gt)
    else:
        console.print(Text("GPUs: none found", style="bold red"))

    if d["topology"]["links"]:
        tt = Table(title="Topology", title_justify="left")
        for col in ("GPU", "peer", "relation", "bridges in between", "ACS blocking"):
            tt.add_column(col)
        for link in d["topology"]["links"]:
            _row(tt, str(link["gpu"]), f"{link['peer']} ({link['peer_kind']})", link["relation"],
                       ", ".join(b["bdf"] for b in link["bridges"]) or "-",
                       Text(", ".join(link["acs_blocking"]) or ("unknown" if link["acs_unknown"] else "none"),
                            style="red" if link["acs_blocking"] else ""))
        _print_table(console, tt)

    mt = Table(title="Mounts", title_justify="left")
    for col in ("mount", "fs", "device", "O_DIRECT", "verdict", "path", "reasons"):
        mt.add_column(col)
    if report.probed:
        mt.add_column("probe")
    for m in d["mounts"]:
        dev = m["device_chain"] or m["source"]
        if m["network"]:
            dev += f" (RDMA: {_yes(m['rdma'])})"
        row = [m["mountpoint"], m["fstype"], dev, m["odirect"]["status"],
               Text(m["verdict"], style=VERDICT_STYLE[m["verdict"]]),
               m["route"] or f"{m['fallback']} (gdskit)", ", ".join(m["reasons"])]
        if report.probed:
            pr = m["probe"] or {}
            row.append(pr.get("summary", "-"))
        _row(mt, *row)
    _print_table(console, mt)

    if report.routes is not None:
        render_routes(report.routes, console)

    problems = [f for f in d["findings"] if f["severity"] != "ok"]
    if problems:
        ft = Table(title="Findings", title_justify="left", show_lines=True)
        for col in ("severity", "subject", "finding", "consequence", "fix"):
            ft.add_column(col)
        for f in sorted(problems, key=lambda f: -SEVERITIES.index(f["severity"])):  # worst first
            title = f["title"] + (f" [{f['reason']}]" if f["reason"] else "")
            _row(ft, Text(f["severity"], style=SEVERITY_STYLE[f["severity"]]), f["subject"], title,
                       f["consequence"], f["fix"])
        _print_table(console, ft)

    s = d["summary"]
    v = s["verdicts"]
    line = f"direct: {v['direct']}, compat: {v['compat']}, unsupported: {v['unsupported']}"
    if s["direct_possible_anywhere"]:
        console.print(Text(f"Direct path available ({line}).", style="green"))
    else:
        console.print(Text(f"Direct path unavailable on every checked mount ({line}).", style="bold red"))
    if s["require"]:
        if s["require_met"]:
            console.print(Text(f"Requirement '{s['require']}' met.", style="green"))
        else:
            console.print(Text(f"Requirement '{s['require']}' NOT met on: {', '.join(s['failing_mounts'])}",
                               style="bold red"))


def render_routes(table: Any, console: Any) -> None:
    """The route table: per mount, each GPU's distance to the storage and where its reads go."""
    from rich.table import Table  # noqa: PLC0415 - import time
    from rich.text import Text  # noqa: PLC0415 - import time

    from gdskit.probe.routes import describe  # noqa: PLC0415 - import time

    why = table.why
    if why is not None:
        words = {"one_gpu": f"{len(table.gpus)} GPU: nothing to route through, reads go straight (a no-op)",
                 "off": "off (settings.routing / GDSKIT_ROUTING): reads go straight"}
        console.print(Text(f"Routing: {words.get(why.value, why.value)}.", style="cyan"))
        return
    rt = Table(title=f"Routes (routing={table.policy.value})", title_justify="left")
    for col in ("mount", "storage", "nearest GPU(s)", "GPU", "distance", "reads go"):
        rt.add_column(col)
    for m in table.mounts:
        storage = ", ".join(f"{dev.name} ({dev.pci_bus_id})" for dev in m.storage.devices)
        if not m.storage.devices:
            _row(rt, m.mountpoint, Text(f"unknown: {m.storage.why_unknown}", style="yellow"), "-", "all", "-",
                       "straight")
            continue
        near = ", ".join(str(g) for g in m.nearest) or "unknown"
        near += f" ({m.nearest_distance.value})" if m.nearest else ""
        for i, r in enumerate(m.routes):
            far = r.target_distance.value in ("cross-root-complex", "cross-socket")
            _row(rt, m.mountpoint if i == 0 else "", storage if i == 0 else "", near if i == 0 else "",
                       str(r.target), Text(r.target_distance.value, style="yellow" if far else ""),
                       Text(describe(r), style="green" if r.routed else ""))
    _print_table(console, rt)
    if table.peers:
        pairs = ", ".join(f"{a}-{b}: " + ("NVLink" if link.nvlink else "peer access" if link.access else
                                         "no peer access" if link.access is False else "unknown")
                          for (a, b), link in sorted(table.peers.items()))
        console.print(Text(f"GPU peer links: {pairs}", style="cyan"))


def check(
    paths: Optional[list[str]] = typer.Argument(  # noqa: UP007 (typer needs Optional on 3.10)
        None, help="Files or directories whose mounts to check (default: every local and network filesystem), "
                   "or object URLs (s3://bucket/prefix/: the store, the credentials and one 64 MiB GET)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON (schema in docs/check.md)."),
    require: Optional[Requirement] = typer.Option(  # noqa: UP007
        None, "--require", help="Exit 1 unless every checked mount is 'direct' (or at least 'compat')."),
    probe: bool = typer.Option(False, "--probe",
                               help="Also read and write one small aligned block through gdskit on each path."),
    no_odirect: bool = typer.Option(False, "--no-odirect-probe",
                                    help="Do not create the temporary file that tests O_DIRECT."),
    root: Optional[str] = typer.Option(  # noqa: UP007
        None, "--root", metavar="PREFIX",
        help="Inspect a captured tree standing for / (offline analysis, tests) instead of this machine."),
) -> None:
    """Is the direct storage-to-GPU path active here? If not: why, what it costs, and how to fix it.

    Exit status: 0 the check ran (and --require is met); 1 --require is not met;
    2 bad arguments.
    """
    from gdskit.probe import run_check  # noqa: PLC0415 - import time

    urls = [p for p in paths or () if "://" in p]
    if urls:
        _check_objects(urls, len(urls) != len(paths or ()), as_json)
    try:
        report = run_check(paths or None, root=root, require=require.value if require else None,
                           probe=probe, odirect=not no_odirect)
    except GdskitError as exc:
        typer.echo(f"gdskit check: error: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
    else:
        from rich.console import Console  # noqa: PLC0415 - import time

        render(report, Console())
    raise typer.Exit(report.exit_code)


def _check_objects(urls: list[str], mixed: bool, as_json: bool) -> None:
    """``gdskit check s3://bucket/prefix ...``: each store's answer, credentials and one GET's rate.
    Exit status 0 where every URL checked out, 1 where one did not, 2 for bad arguments."""
    from gdskit.engine import is_object_url  # noqa: PLC0415 - import time
    from gdskit.probe.objects import check_object_store  # noqa: PLC0415 - import time

    bad = [u for u in urls if not is_object_url(u)]
    if mixed or bad:
        typer.echo("gdskit check: error: check object URLs (s3://bucket/prefix/) and local paths in separate runs"
                   if mixed else f"gdskit check: error: not an object URL: {bad[0]}", err=True)
        raise typer.Exit(2)
    results = [check_object_store(u) for u in urls]
    if as_json:
        sys.stdout.write(json.dumps({"objects": [r.to_dict() for r in results]}, indent=2) + "\n")
    else:
        for r in results:
            rate = r.rate_bytes_s
            typer.echo(f"{r.url}\n  endpoint     {r.endpoint} ({'reachable' if r.reachable else 'not reachable'})\n"
                       f"  credentials  {r.credentials}\n"
                       f"  objects      {_objects_seen(r)}")
            if rate is not None:
                typer.echo(f"  one GET      {format_size(r.probe_bytes)} of {r.probe_object} in "
                           f"{r.probe_seconds:.3f} s: {rate / 1e6:.0f} MB/s")
            if r.error:
                typer.echo(f"  problem      {r.error}")
    raise typer.Exit(0 if all(r.ok for r in results) else 1)


def _objects_seen(r: Any) -> str:
    if r.objects is None:
        return "unknown"
    return f"{r.objects} listed, more exist (the check lists no further)" if r.more_objects else str(r.objects)


def register(app: typer.Typer) -> None:
    """Add ``check`` to the ``gdskit`` command."""
    app.command(name="check")(check)
