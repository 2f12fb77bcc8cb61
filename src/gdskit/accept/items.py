"""The seven items of the production acceptance checklist, one function each.

Every function takes the shared :class:`~gdskit.accept.context.AcceptContext`
and returns an :class:`~gdskit.accept.result.ItemResult`: pass, fail or n/a,
with its evidence and, on failure, the fix. Items 1 and 2 read ``gdskit check``'s
report; the others measure (see the modules each one names).
"""

from __future__ import annotations

import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from gdskit.accept import measure
from gdskit.accept.context import AcceptContext
from gdskit.accept.result import FAIL, NA, PASS, Artifact, ItemResult, not_applicable, result, write_json
from gdskit.settings import format_size

CHECK_ARTIFACT = Artifact("json", "check.json", "gdskit check report (JSON)")
_NO_GPU = "no GPU on this machine"
_CAPTURED = "a captured tree (--root) was judged: measurements on this machine would not describe it"


class _Checks:
    """Sub-checks of one item: each a status, a detail and (on failure) a fix."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, name: str, status: str, detail: str, fix: str | None = None) -> None:
        self.rows.append({"check": name, "status": status, "detail": detail, "fix": fix if status == FAIL else None})

    @property
    def status(self) -> str:
        states = {r["status"] for r in self.rows}
        return FAIL if FAIL in states else PASS if PASS in states else NA

    def lines(self) -> list[str]:
        return [f"{r['status'].upper():4s} {r['check']}: {r['detail']}" for r in self.rows]

    def fixes(self) -> str | None:
        out = list(dict.fromkeys(r["fix"] for r in self.rows if r["fix"]))
        return "\n".join(out) if out else None


def _findings(report: Any, *ids: str) -> list[Any]:
    return [f for f in report.findings if f.id in ids]


def _fix_of(report: Any, *ids: str) -> str | None:
    fixes = list(dict.fromkeys(f.fix for f in _findings(report, *ids) if f.fix))
    return " ".join(fixes) if fixes else None


def _size(n: int | None) -> str:
    return "unknown" if n is None else format_size(n)


# --------------------------------------------------------------------------- item 1
def item_platform(ctx: AcceptContext) -> ItemResult:
    """nvidia-fs loaded (or PCI P2PDMA), no ACS blockage, BAR1 and RDMA ready (from ``gdskit check``)."""
    rep = ctx.check_report()
    gpu, gds = rep.gpu, rep.gds
    if not gpu.gpus:
        why = _NO_GPU + (f" ({gpu.nvml_error})" if gpu.nvml_error else "")
        return not_applicable(1, why, evidence=[f"gdskit check: {f.title}" for f in _findings(rep, "gpu.none")],
                              artifacts=[CHECK_ARTIFACT])
    c = _Checks()
    c.add("GPUs", PASS, ", ".join(f"{g.index}: {g.name} ({g.pci_bus_id})" for g in gpu.gpus)
          + (f"; driver {gpu.driver_version} ({gpu.kernel_module or 'kernel module unknown'})" if gpu.driver_version else ""))
    if gds.cufile.found:
        c.add("libcufile", PASS, f"libcufile {gds.cufile.version or '(version unknown)'}")
    else:
        c.add("libcufile", FAIL, "libcufile not found", _fix_of(rep, "gds.cufile_missing"))

    nvfs, p2p = gds.nvidia_fs, gds.p2pdma
    if nvfs.loaded:
        c.add("kernel route", PASS, f"nvidia-fs loaded{f' ({nvfs.version})' if nvfs.version else ''}")
    elif p2p.available:
        c.add("kernel route", PASS, "PCI P2PDMA available and enabled (nvidia-fs not loaded: single NVMe only)")
    else:
        titles = [f.title for f in _findings(rep, "gds.nvidia_fs_missing", "gds.p2pdma_unavailable",
                                             "gds.p2pdma_disabled")]
        c.add("kernel route", FAIL, "; ".join(titles) or "neither nvidia-fs nor PCI P2PDMA",
              _fix_of(rep, "gds.p2pdma_disabled", "gds.nvidia_fs_missing"))  # the latter names P2PDMA too

    links = rep.topology.links
    blocking = [(link, b) for link in links for b in link.acs_blocking]
    unknown = [link for link in links if link.acs_unknown]
    if blocking:
        c.add("ACS", FAIL, "; ".join(f"ACS redirect on {b.bdf} between GPU {link.gpu_index} and {link.peer}"
                                     for link, b in blocking), _fix_of(rep, "topology.acs"))
    elif unknown:
        c.add("ACS", FAIL, "ACS state of the bridges between "
              + ", ".join(f"GPU {link.gpu_index} and {link.peer}" for link in unknown) + " could not be read",
              "Run gdskit accept as root so that the bridges' ACS capability can be read.")
    elif links:
        c.add("ACS", PASS, "no ACS redirect between the GPUs and " + ", ".join(sorted({link.peer for link in links})))
    else:
        c.add("ACS", PASS, "no NVMe or RDMA device shares a PCIe path with a GPU: nothing for ACS to block")

    if gds.iommu.state == "translated":
        c.add("IOMMU", FAIL, "IOMMU remaps DMA (translated mode)", _fix_of(rep, "platform.iommu"))
    else:
        c.add("IOMMU", PASS, f"IOMMU {gds.iommu.state}")

    small = [g for g in gpu.gpus if g.bar1_small]
    bar1 = ", ".join(f"GPU {g.index} {_size(g.bar1_total)}" for g in gpu.gpus)
    if small:
        c.add("BAR1", FAIL, f"BAR1 too small: {bar1}", _fix_of(rep, "gpu.bar1_small"))
    else:
        c.add("BAR1", PASS, f"BAR1 {bar1}")

    network = [m for m in rep.mounts if m.network]
    if not network:
        c.add("RDMA", NA, "no network filesystem among the targets: RDMA not needed")
    for m in network:
        if m.rdma is False:
            c.add("RDMA", FAIL, f"{m.mountpoint} ({m.fstype}) is mounted without RDMA", _fix_of(rep, "mount.no_rdma"))
        elif m.rdma is None:
            c.add("RDMA", PASS, f"{m.mountpoint} ({m.fstype}): RDMA use cannot be told from the mount options; "
                  "item 5 shows whether its bytes go direct")
        else:
            c.add("RDMA", PASS, f"{m.mountpoint} ({m.fstype}) uses RDMA")

    status = c.status
    summary = ("ready for the direct path" if status == PASS
               else "not ready: " + ", ".join(r["check"] for r in c.rows if r["status"] == FAIL))
    return result(1, status, summary, evidence=c.lines(), data={"checks": c.rows}, fix=c.fixes(),
                  artifacts=[CHECK_ARTIFACT])


# --------------------------------------------------------------------------- item 2
def _mount_fix(rep: Any, m: Any) -> str:
    subject = f"mount {m.mountpoint}"
    fixes = [f.fix for f in rep.findings if f.subject == subject and f.fix and f.severity != "ok"]
    platform = [f for f in rep.findings if f.subject == "platform" and f.reason in m.reasons
                and f.fix and f.severity != "ok"]
    if any(f.id == "gds.nvidia_fs_missing" for f in platform):  # its fix already offers P2PDMA
        platform = [f for f in platform if f.id != "gds.p2pdma_unavailable"]
    fixes += [f.fix for f in platform]
    fixes = list(dict.fromkeys(fixes))
    return f"{m.mountpoint}: " + " ".join(fixes) if fixes else f"{m.mountpoint}: see gdskit check {m.mountpoint}"


def item_mounts(ctx: AcceptContext) -> ItemResult:
    """Every target mount's verdict is ``direct``, not ``compat`` (from ``gdskit check``)."""
    rep = ctx.check_report()
    rows = [{"mountpoint": m.mountpoint, "requested": list(m.requested), "fstype": m.fstype,
             "device": m.device.describe() if m.device else m.source, "verdict": m.verdict, "route": m.route,
             "fallback": m.fallback, "reasons": list(m.reasons)} for m in rep.mounts]
    lines = [f"{r['mountpoint']} ({r['fstype']} on {r['device']}): {r['verdict']}"
             + (f" via {r['route']}" if r["route"] else
                f" — reasons: {', '.join(r['reasons'])}; gdskit falls back to {r['fallback']}")
             for r in rows]
    if not rep.gpu.gpus:
        return not_applicable(2, _NO_GPU + ": no mount can have a direct path", evidence=lines,
                              data={"mounts": rows}, artifacts=[CHECK_ARTIFACT])
    if not rep.mounts:
        return result(2, FAIL, "no mount was checked", fix="Name the directories that hold your data.",
                      artifacts=[CHECK_ARTIFACT])
    bad = [m for m in rep.mounts if m.verdict != "direct"]
    if not bad:
        return result(2, PASS, f"{len(rows)} mount(s), all direct", evidence=lines, data={"mounts": rows},
                      artifacts=[CHECK_ARTIFACT])
    summary = "; ".join(f"{m.mountpoint} is {m.verdict} ({', '.join(m.reasons)})" for m in bad)
    return result(2, FAIL, summary, evidence=lines, data={"mounts": rows},
                  fix="\n".join(_mount_fix(rep, m) for m in bad), artifacts=[CHECK_ARTIFACT])


# --------------------------------------------------------------------------- items 3 and 4
def _measuring_precondition(item: int, ctx: AcceptContext) -> ItemResult | None:
    if not ctx.live:
        return not_applicable(item, _CAPTURED)
    if not ctx.has_gpu:
        return not_applicable(item, _NO_GPU + ": there is no direct path to measure")
    return None


def item_ab(ctx: AcceptContext) -> ItemResult:
    """The direct path against the CPU path with identical parameters (``gdskit bench``)."""
    return _measuring_precondition(3, ctx) or measure.ab_item(ctx)


def item_sweep(ctx: AcceptContext) -> ItemResult:
    """I/O sizes 4 KiB to 1 MiB on both paths, and the cut-off (``gdskit bench --sweep``)."""
    return _measuring_precondition(4, ctx) or measure.sweep_item(ctx)


# --------------------------------------------------------------------------- item 5
def run_workload(argv: list[str], **kw: Any) -> Any:
    """``gdskit.telemetry.run_workload``, imported when item 5 runs (ImportError when it is missing)."""
    from gdskit.telemetry import run_workload as run  # noqa: PLC0415 - import time

    return run(argv, **kw)


def default_workload_argv(directory: str, nbytes: int, device: int) -> list[str]:
    return [sys.executable, "-m", "gdskit.accept.workload", "--dir", directory, "--size", str(nbytes),
            "--device", str(device)]


def _workload_fix(ctx: AcceptContext) -> str:
    rep = ctx.check_report()
    bad = [m for m in rep.mounts if m.verdict != "direct"]
    if bad:
        return "The target has no direct path (item 2): " + " ".join(_mount_fix(rep, m) for m in bad)
    return ("The mount is direct but the workload's bytes were not: look at the reasons in workload.json "
            "(requests below GDSKIT_DIRECT_THRESHOLD, unaligned buffers or offsets, GDSKIT_MODE forcing "
            "another path, cuFile handle registration failing).")


#: The most of a workload's standard output that workload.json keeps (its end).
STDOUT_KEPT = 64 * 1024


def _tail(fh: Any) -> str:
    """The last :data:`STDOUT_KEPT` bytes written to the open file ``fh``, as text."""
    try:
        size = fh.seek(0, 2)
        fh.seek(max(0, size - STDOUT_KEPT))
        return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def item_workload(ctx: AcceptContext) -> ItemResult:
    """Under a real workload, cuFile's counters show direct bytes growing and POSIX bytes flat."""
    if not ctx.live:
        return not_applicable(5, _CAPTURED)
    if not ctx.has_gpu:
        return not_applicable(5, _NO_GPU + ": direct bytes cannot grow; the workload was not run")
    opts = ctx.options
    tmp = None
    if opts.workload:
        argv = shlex.split(opts.workload)
    else:
        tmp = tempfile.mkdtemp(prefix=".gdskit-accept-workload-", dir=ctx.work_dir)
        argv = default_workload_argv(tmp, ctx.sizes.workload, opts.device)
    out = tempfile.TemporaryFile()  # what the workload prints: archived in workload.json, not shown
    try:
        wr = run_workload(argv, level=3, timeout=opts.timeout, stdout=out)
    except ImportError as exc:
        return result(5, FAIL, "cannot observe the workload: gdskit.telemetry is not importable",
                      evidence=[f"{type(exc).__name__}: {exc}"],
                      fix="Install a gdskit that includes gdskit.telemetry (reinstall the package).")
    except Exception as exc:  # a timeout or a command that cannot start
        ev = [f"command: {shlex.join(argv)}"]
        partial = getattr(exc, "report", None)  # a timeout carries what the workload did until then
        if partial is not None:
            ev.append(f"until stopped: direct bytes {partial.direct_bytes}, POSIX bytes {partial.posix_bytes}")
        return result(5, FAIL, f"the workload did not run to the end: {type(exc).__name__}: {exc}",
                      evidence=ev, fix="Make the workload command run on its own first, or raise --timeout.")
    finally:
        printed = _tail(out)
        out.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    d = {**wr.to_dict(), "stdout": printed}
    write_json(ctx.artifact("workload.json"), d)
    art = [Artifact("json", "workload.json", "workload ledger and cuFile counters (JSON)")]
    ev = [f"command: {shlex.join(list(wr.argv))}", f"exit status {wr.returncode} after {wr.duration_s:.1f} s",
          f"direct bytes: {wr.direct_bytes}, POSIX bytes: {wr.posix_bytes}", f"verdict: {wr.verdict}"]
    if wr.cufile_counters:
        ev.append("cuFile counters: " + ", ".join(f"{k}={v}" for k, v in sorted(wr.cufile_counters.items())))
    else:
        ev.append("cuFile counters: none (cuFile did not run in the workload, or its statistics are off)")
    data = {"direct_bytes": wr.direct_bytes, "posix_bytes": wr.posix_bytes, "returncode": wr.returncode}
    if wr.returncode != 0:
        return result(5, FAIL, f"the workload exited with status {wr.returncode}", evidence=ev, data=data,
                      fix="Fix the workload so that it completes; its output is in workload.json.", artifacts=art)
    if wr.direct_bytes > 0 and wr.posix_bytes == 0:
        return result(5, PASS, f"{_size(wr.direct_bytes)} direct, no POSIX bytes", evidence=ev, data=data,
                      artifacts=art)
    return result(5, FAIL, f"direct bytes {_size(wr.direct_bytes)}, POSIX bytes {_size(wr.posix_bytes)}",
                  evidence=ev, data=data, fix=_workload_fix(ctx), artifacts=art)


# --------------------------------------------------------------------------- item 6
def item_checkpoint(ctx: AcceptContext) -> ItemResult:
    """gdskit's checkpoint files reload with plain torch.load and safetensors; the fallback path loads them."""
    if not ctx.live:
        return not_applicable(6, _CAPTURED)
    from gdskit.accept import checkpoint  # noqa: PLC0415 - import time

    try:
        import torch  # noqa: F401, PLC0415 - optional dependency (torch)
    except ImportError:
        return not_applicable(6, "torch is not installed (pip install 'gdskit[torch]')")
    device = f"cuda:{ctx.options.device}" if ctx.has_gpu else "cpu"
    tmp = tempfile.mkdtemp(prefix=".gdskit-accept-ckpt-", dir=ctx.work_dir)
    try:
        checks = checkpoint.round_trip(tmp, ctx.sizes.checkpoint, device)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    c = _Checks()
    for row in checks["checks"]:
        c.add(row["check"], row["status"], row["detail"],
              "A checkpoint written by gdskit did not come back identical: keep the files and report it "
              "with this evidence." if row["status"] == FAIL else None)
    where = "GPU" if ctx.has_gpu else "CPU (no GPU: this proves the formats, not the GPU path)"
    status = c.status
    summary = (f"{_size(checks['bytes'])} of tensors on {where}: every reload identical" if status == PASS
               else "some reloads failed or differ" if status == FAIL else "nothing could be checked")
    return result(6, status, summary, evidence=c.lines(), data=checks, fix=c.fixes())


# --------------------------------------------------------------------------- item 7
def item_faults(ctx: AcceptContext) -> ItemResult:
    """With the direct path made unavailable, the workload degrades to the CPU path and completes."""
    if not ctx.live:
        return not_applicable(7, _CAPTURED)
    from gdskit.accept import faults  # noqa: PLC0415 - import time

    cases = faults.run_cases(ctx)
    write_json(ctx.artifact("faults.json"), cases)
    art = [Artifact("json", "faults.json", "fault-injection children: ledgers and outcomes (JSON)")]
    c = _Checks()
    for case in cases:
        c.add(case["case"], case["status"], case["detail"], case.get("fix"))
    if c.status == FAIL:
        return result(7, FAIL, "a fault case crashed, lost data or still went direct", evidence=c.lines(),
                      data={"cases": cases}, fix=c.fixes(), artifacts=art)
    if not ctx.has_gpu:
        return not_applicable(7, _NO_GPU + ": there is no direct path to take away "
                              "(the tmpfs case ran on host memory: " + ("completed" if c.status == PASS else "skipped")
                              + ")", evidence=c.lines(), data={"cases": cases}, artifacts=art)
    return result(7, c.status, "every fault case degraded to the CPU path with identical data",
                  evidence=c.lines(), data={"cases": cases}, artifacts=art)


ITEMS: dict[int, Callable[[AcceptContext], ItemResult]] = {
    1: item_platform, 2: item_mounts, 3: item_ab, 4: item_sweep, 5: item_workload, 6: item_checkpoint,
    7: item_faults,
}
