"""`gdskit check` as a library call: inspect platform, GPUs, topology and mounts.

``run_check`` is the whole of ``gdskit check`` as a library call; it returns a
:class:`CheckReport` and never changes the system (the O_DIRECT probe creates and
removes one temporary file on writable mounts of the live machine).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from gdskit.engine import io_uring_availability
from gdskit.errors import GdskitFileNotFoundError, InvalidArgumentError
from gdskit.machine.gds import gds_stack, query_cufile_library
from gdskit.machine.gpus import gpu_facts, query_nvml
from gdskit.machine.mounts import (
    MountEntry, ODirectResult, is_listed_by_default, mount_block_tree, mount_for_path, network_rdma,
    odirect_dir_for, probe_odirect, read_mounts,
)
from gdskit.probe.report import REQUIREMENTS, CheckReport, IoUringResult
from gdskit.machine.root import SystemRoot
from gdskit.probe.routes import route_findings, route_table
from gdskit.machine.topology import topology
from gdskit.probe.live import live_probe
from gdskit.probe.verdict import Finding, MountCheck, is_network, judge_mount, platform_findings, udev_entry_for
from gdskit.settings import settings

__all__ = ["CheckReport", "Finding", "MountCheck", "SystemRoot", "run_check"]


def _group_paths(root: SystemRoot, mounts: list[MountEntry], paths: Sequence[str]) -> list[tuple[MountEntry, list[str]]]:
    groups: dict[str, tuple[MountEntry, list[str]]] = {}
    for p in paths:
        if root.is_live:
            real = os.path.realpath(p)
            if not os.path.exists(real):
                raise GdskitFileNotFoundError(2, "no such file or directory", p)
        else:
            if not p.startswith("/"):
                raise InvalidArgumentError(f"paths inside a captured root must be absolute: {p!r}")
            real = os.path.normpath(p)
        m = mount_for_path(mounts, real)
        if m is None:
            raise InvalidArgumentError(f"no mount holds {p!r} (mountinfo under {root.prefix} lists none)")
        groups.setdefault(m.mountpoint, (m, []))[1].append(real)
    return list(groups.values())


def _odirect(root: SystemRoot, m: MountEntry, requested: list[str], enabled: bool) -> ODirectResult:
    if not root.is_live:
        injected = (root.odirect_results() or {}).get(m.mountpoint)
        if isinstance(injected, str):
            return ODirectResult(injected, "recorded in the captured tree")
        return ODirectResult("not-probed", "captured tree, not the live machine")
    if not enabled:
        return ODirectResult("not-probed", "probing disabled")
    if m.read_only:
        return ODirectResult("not-probed", "mounted read-only")
    directory = odirect_dir_for(m, requested)
    if directory is None:
        return ODirectResult("not-probed", "no writable directory on this mount")
    return probe_odirect(directory)


def _io_uring(root: SystemRoot) -> IoUringResult:
    """Whether this process can read batches through io_uring (the live machine only)."""
    if not root.is_live:
        return IoUringResult("not-probed", "captured tree, not the live machine")
    known = io_uring_availability()
    return IoUringResult("usable" if known.usable else "unavailable", known.detail)


def run_check(
    paths: Sequence[str] | None = None,
    *,
    root: SystemRoot | str | None = None,
    require: str | None = None,
    probe: bool = False,
    odirect: bool = True,
) -> CheckReport:
    """Inspect the machine (or a captured tree) and judge each mount.

    Parameters
    ----------
    paths:
        Files or directories whose mounts to judge; default every local and network filesystem.
    root:
        ``SystemRoot`` or a directory standing for ``/`` (captured trees, tests). Default: the live machine.
    require:
        ``"direct"`` or ``"compat"``: the report's ``exit_code`` is 1 when a checked mount falls short.
    probe:
        Also move a small aligned block through gdskit on each path (live machine only).
    odirect:
        Probe O_DIRECT with a temporary file on writable mounts (live machine only).
    """
    if require is not None and require not in REQUIREMENTS:
        raise InvalidArgumentError(f"require must be one of {REQUIREMENTS}, not {require!r}")
    if not isinstance(root, SystemRoot):
        root = SystemRoot(root or "/")
    if root.is_live:
        root = root.with_sources(nvml=query_nvml, cufile=query_cufile_library)
    if not os.path.isdir(root.prefix):
        raise InvalidArgumentError(f"root {root.prefix!r} is not a directory")
    gpu = gpu_facts(root)
    gds = gds_stack(root, gpu.kernel_module, gpu.driver_major)
    topo = topology(root, gpu.gpus)
    findings = platform_findings(gpu, gds, topo)

    mounts = read_mounts(root)
    if paths:
        targets = _group_paths(root, mounts, paths)
    else:
        by_mp: dict[str, MountEntry] = {}
        for m in mounts:
            if is_listed_by_default(m):
                by_mp[m.mountpoint] = m          # a later mount over the same point hides the earlier
        targets = [(m, []) for m in by_mp.values()]

    checks: list[MountCheck] = []
    for m, requested in targets:
        tree = mount_block_tree(root, m, mounts)
        network = is_network(m.fstype)
        mc = MountCheck(
            mountpoint=m.mountpoint, requested=requested, fstype=m.fstype, source=m.source,
            options=list(m.all_options), device=tree, network=network,
            rdma=network_rdma(m) if network else None,
            odirect=_odirect(root, m, requested, odirect),
            udev_entry=udev_entry_for(root, tree, gds),
        )
        findings.extend(judge_mount(m, mc, gpu, gds, topo))
        checks.append(mc)

    routes = route_table(root, gpu, topo, checks, settings.routing)
    findings.extend(route_findings(routes))
    report = CheckReport(root=root.prefix, gpu=gpu, gds=gds, topology=topo, mounts=checks,
                         findings=findings, require=require, routes=routes, io_uring=_io_uring(root))
    if probe:
        live_probe(report, root)
    return report
