"""Turn inspected facts into findings and a verdict per mount.

A verdict says what cuFile would do with a file on that mount:

- ``direct``: a true direct route exists (``cufile-nvfs`` or ``cufile-p2pdma``);
- ``compat``: cuFile works, but through its own POSIX fallback (``cufile-compat``);
- ``unsupported``: cuFile cannot serve the mount at all (no GPU, no libcufile,
  handle registration would fail, or compat mode is disabled where direct is impossible).

Every reason is a word of :class:`gdskit.Reason`; every finding says what it
costs and how to fix it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gdskit.machine.gds import GdsStack, udev_fs_usage
from gdskit.machine.gpus import GpuFacts
from gdskit.machine.mounts import (
    GDS_LOCAL_FS, GDS_NETWORK_FS, MEMORY_FS, NETWORK_FS, STACKED_FS, BlockNode, MountEntry, ODirectResult,
)
from gdskit.machine.root import SystemRoot
from gdskit.machine.topology import Link, Topology
from gdskit.vocabulary import Path, Reason

SEVERITIES = ("ok", "info", "warning", "error")
VERDICTS = ("direct", "compat", "unsupported")
DIRECT_DEVICE_TYPES = frozenset({"nvme", "nvme-of"})
NVFS_MD_LEVELS = frozenset({"raid0", "raid1"})

_DEVICE_WHY = {
    "virtio": "virtio-blk is a paravirtual disk: the hypervisor moves the data, so there is no PCIe "
              "storage device the GPU could exchange DMA with",
    "scsi": "SCSI/SATA/SAS disks are not GPUDirect Storage targets",
    "xen": "Xen paravirtual disks have no PCIe device for the GPU to reach",
    "ram": "a RAM disk lives in host memory; there is no device to DMA from",
    "nbd": "a network block device is served by a user-space daemon",
    "mmc": "MMC/SD storage is not a GPUDirect Storage target",
}


@dataclass(frozen=True)
class Finding:
    """One thing the check found, with what it costs and how to fix it."""

    id: str
    severity: str                    # ok | info | warning | error
    subject: str                     # "platform", "GPU 0", "mount /data", "bridge 0000:02:00.0"...
    title: str
    consequence: str = ""
    fix: str = ""
    reason: str | None = None        # a gdskit.Reason word where one applies

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "severity": self.severity, "subject": self.subject, "title": self.title,
                "consequence": self.consequence, "fix": self.fix, "reason": self.reason}


@dataclass
class MountCheck:
    """The check of one mount."""

    mountpoint: str
    requested: list[str]
    fstype: str
    source: str
    options: list[str]
    device: BlockNode | None
    network: bool
    rdma: bool | None
    odirect: ODirectResult
    udev_entry: bool | None
    verdict: str = "unsupported"
    route: str | None = None         # the direct path when verdict == "direct"
    fallback: str = Path.HOST.value  # what gdskit itself uses when the route is not direct
    reasons: list[str] = field(default_factory=list)
    probe: dict[str, Any] | None = None

    @property
    def raid_or_multipath(self) -> bool:
        return self.device is not None and any(
            n.kind == "md" or n.multipath for n in self.device.walk())

    def to_dict(self) -> dict[str, Any]:
        leaves = self.device.leaves() if self.device else []
        return {
            "mountpoint": self.mountpoint, "requested": list(self.requested), "fstype": self.fstype,
            "source": self.source, "options": list(self.options),
            "device": self.device.to_dict() if self.device else None,
            "device_chain": self.device.describe() if self.device else None,
            "physical_devices": [{"name": n.name, "dev_type": n.dev_type, "pci_bus_id": n.pci_bus_id}
                                 for n in leaves],
            "raid_or_multipath": self.raid_or_multipath, "network": self.network, "rdma": self.rdma,
            "odirect": self.odirect.to_dict(), "udev_entry": self.udev_entry,
            "verdict": self.verdict, "route": self.route, "fallback": self.fallback,
            "reasons": list(self.reasons), "probe": self.probe,
        }


class _Reasons(list):
    def add(self, reason: Reason) -> None:
        if reason.value not in self:
            self.append(reason.value)


# --------------------------------------------------------------------------- platform findings
@dataclass(frozen=True)
class _Platform:
    """The facts every platform rule reads."""

    gpu: GpuFacts
    gds: GdsStack
    topo: Topology


PlatformRule = Callable[[_Platform], Iterator[Finding]]


def _gpu_present(p: _Platform) -> Iterator[Finding]:
    if not p.gpu.gpus:
        yield Finding(
            "gpu.none", "error", "platform", "No NVIDIA GPU found"
            + (f" ({p.gpu.nvml_error})" if p.gpu.nvml_error else ""),
            "No GPU memory to move data into: only the host path exists; gdskit reads and writes "
            "host buffers with parallel POSIX I/O (O_DIRECT where the filesystem allows).",
            "Run on a machine with an NVIDIA GPU and its driver loaded (nvidia-smi must list it).",
            Reason.NO_GPU.value)
    if p.gpu.driver_version:
        yield Finding("gpu.driver", "ok", "platform",
                      f"NVIDIA driver {p.gpu.driver_version} ({p.gpu.kernel_module or 'kernel module unknown'})")


def _cufile_library(p: _Platform) -> Iterator[Finding]:
    lib = p.gds.cufile
    if lib.found:
        yield Finding("gds.cufile", "ok", "platform",
                      f"libcufile {lib.version or '(version unknown)'} loads" + (f" from {lib.path}" if lib.path else ""))
        return
    yield Finding(
        "gds.cufile_missing", "error", "platform", "libcufile (cuFile, the GDS user-space library) not found",
        "No cuFile path at all: device buffers go through gdskit's pinned bounce path "
        "(bounce-direct / bounce-cached).",
        "Install GDS user space for your CUDA version (the nvidia-gds / libcufile package, or the "
        "nvidia-cufile pip wheel) so that libcufile.so.0 is on the loader path.",
        Reason.CUFILE_MISSING.value)


def _nvidia_fs(p: _Platform) -> Iterator[Finding]:
    nvfs, p2p = p.gds.nvidia_fs, p.gds.p2pdma
    if nvfs.loaded:
        yield Finding("gds.nvidia_fs", "ok", "platform",
                      f"nvidia-fs kernel module loaded{f' ({nvfs.version})' if nvfs.version else ''}")
        return
    yield Finding(
        "gds.nvidia_fs_missing", "info" if p2p.available else "error", "platform", "nvidia-fs kernel module not loaded",
        ("PCI P2PDMA still gives a direct path for a single local NVMe, but RAID (md), multipath "
         "and network filesystems need nvidia-fs." if p2p.available else
         "Without nvidia-fs (and without PCI P2PDMA) cuFile has no direct route: every read and write "
         "runs in cuFile's POSIX compat mode through host memory."),
        "Install the nvidia-fs driver matching your NVIDIA driver (nvidia-fs-dkms / nvidia-gds) and "
        "run `modprobe nvidia_fs`; or use PCI P2PDMA (kernel >= 6.2, open driver >= 570).",
        Reason.NVIDIA_FS_MISSING.value)


def _p2pdma_missing(p: _Platform) -> list[str]:
    """What keeps PCI P2PDMA from this platform, in words."""
    p2p, gpu = p.gds.p2pdma, p.gpu
    missing = []
    if not p2p.kernel_symbol:
        missing.append("the kernel lacks PCI P2PDMA (no p2pdma_pgmap_ops in /proc/kallsyms"
                       + (", kallsyms unreadable" if p2p.kernel_symbol is None else "") + ")")
    if not p2p.kernel_version_ok:
        missing.append(f"kernel {p.gds.kernel_release or 'unknown'} is older than 6.2")
    if not p2p.driver_ok:
        missing.append("the NVIDIA driver is not the open kernel module 570 or newer"
                       + (f" (found {gpu.kernel_module or 'a kernel module of unknown kind'}, {gpu.driver_version})"
                          if gpu.driver_version else " (no driver loaded)"))
    return missing


def _p2pdma(p: _Platform) -> Iterator[Finding]:
    nvfs, p2p, cfg = p.gds.nvidia_fs, p.gds.p2pdma, p.gds.config
    if p2p.available:
        yield Finding("gds.p2pdma", "ok", "platform", "PCI P2PDMA available and enabled in cufile.json")
    elif p2p.platform_capable:
        yield Finding(
            "gds.p2pdma_disabled", "warning" if not nvfs.loaded else "info", "platform",
            "The platform supports PCI P2PDMA but cufile.json does not enable it",
            "cuFile will not use the P2PDMA route"
            + ("" if nvfs.loaded else "; with no nvidia-fs it falls back to compat mode") + ".",
            f'Set "properties": {{"use_pci_p2pdma": true}} in {cfg.path} (or CUFILE_USE_PCIP2PDMA=1).',
            Reason.P2PDMA_UNAVAILABLE.value)
    else:
        yield Finding(
            "gds.p2pdma_unavailable", "info" if nvfs.loaded else "warning", "platform",
            "PCI P2PDMA unavailable: " + "; ".join(_p2pdma_missing(p)),
            "No upstream-kernel direct route" + (" (nvidia-fs provides one)." if nvfs.loaded else
                                                  "; with no nvidia-fs either, cuFile can only run in compat mode."),
            "Use kernel >= 6.2 built with CONFIG_PCI_P2PDMA and the open NVIDIA kernel module >= 570, then "
            "set properties.use_pci_p2pdma in cufile.json; or load nvidia-fs.",
            Reason.P2PDMA_UNAVAILABLE.value)


def _udev(p: _Platform) -> Iterator[Finding]:
    if p.gds.udev.database:
        yield Finding("gds.udev", "ok", "platform", "udev database readable (/run/udev/data)")
        return
    yield Finding(
        "gds.udev_missing", "error", "platform", "udev database missing (/run/udev/data not readable)",
        "libcufile identifies filesystems through udev; without it cuFileHandleRegister fails "
        "(\"udev property not found: ID_FS_USAGE\") for every local file, so cuFile cannot be used at all.",
        "In a container, mount the host's udev database read-only (e.g. docker run -v /run/udev:/run/udev:ro); "
        "in a VM or bare host, run systemd-udevd so /run/udev/data is populated.",
        Reason.UDEV_MISSING.value)


def _iommu(p: _Platform) -> Iterator[Finding]:
    state = p.gds.iommu.state
    if state == "translated":
        yield Finding(
            "platform.iommu", "warning", "platform", "IOMMU in translated (DMA remapping) mode",
            "Peer-to-peer DMA between GPU and storage is remapped or blocked; GDS through nvidia-fs "
            "requires the IOMMU off or in pass-through.",
            "Boot with iommu=pt (Intel: intel_iommu=on iommu=pt; AMD: amd_iommu=on iommu=pt) or disable the IOMMU.")
    elif state in ("passthrough", "off"):
        yield Finding("platform.iommu", "ok", "platform", f"IOMMU {state}")


def _virtual_machine(p: _Platform) -> Iterator[Finding]:
    if p.gds.virtualization:
        yield Finding(
            "platform.vm", "info", "platform", f"Running in a virtual machine ({p.gds.virtualization})",
            "A direct path inside a VM needs the NVMe drive passed through (VFIO) next to the GPU; "
            "paravirtual disks (virtio) never give one.",
            "Pass an NVMe controller through to the VM, or run on bare metal, for GPUDirect Storage.")


def _cufile_config(p: _Platform) -> Iterator[Finding]:
    cfg = p.gds.config
    if not cfg.found:
        yield Finding("config.missing", "info", "platform", f"No cuFile configuration at {cfg.path}",
                      "cuFile runs with its built-in defaults (compat mode allowed, P2PDMA off).",
                      "Copy the cufile.json shipped with GDS to /etc/cufile.json (or set CUFILE_ENV_PATH_JSON).")
    elif cfg.error:
        yield Finding("config.invalid", "error", "platform", cfg.error,
                      "cuFile cannot read its configuration; the driver open may fail or run on defaults.",
                      f"Fix the syntax of {cfg.path} (JSON with // comments).")
    if cfg.force_compat_mode:
        yield Finding("config.force_compat", "warning", "platform",
                      "cuFile is forced into compat mode (force_compat_mode)",
                      "Every cuFile read and write runs through POSIX in host memory, even where a direct route exists.",
                      f"Set properties.force_compat_mode to false in {cfg.path} (and unset CUFILE_FORCE_COMPAT_MODE).",
                      Reason.FORCED_BY_SETTING.value)
    if not cfg.allow_compat_mode:
        yield Finding("config.compat_disabled", "info", "platform",
                      "cuFile compat mode is disabled (allow_compat_mode false)",
                      "Where no direct route exists cuFile returns an error instead of falling back; "
                      "gdskit then uses its bounce path.",
                      "Leave it disabled to catch silent fallbacks; enable it to let cuFile fall back by itself.")
    if cfg.posix_gds_min_kb:
        pairs = ", ".join(f"{k}={v} KiB" for k, v in sorted(cfg.posix_gds_min_kb.items()))
        yield Finding("config.posix_gds_min_kb", "info", "platform", f"posix_gds_min_kb: {pairs}",
                      "Requests below these sizes go through POSIX instead of the direct route.",
                      "Set the cut-off from a measured knee (gdskit bench sweep), not from intuition.")


def _gpu_links(p: _Platform) -> Iterator[Finding]:
    for g in p.gpu.gpus:
        subj = f"GPU {g.index}"
        if g.bar1_small:
            yield Finding(
                "gpu.bar1_small", "warning", subj,
                f"BAR1 window is only {g.bar1_total // (1 << 20)} MiB",
                "cuFile can map only that much GPU memory for DMA; larger buffers are staged through "
                "cuFile's internal bounce buffers and lose most of the direct path's benefit.",
                "Enable a large BAR1 (resizable BAR / 'Above 4G decoding' in firmware, or a data-center GPU "
                "mode with a full BAR1).")
        if g.pcie_width and g.pcie_max_width and g.pcie_width < g.pcie_max_width:
            yield Finding(
                "gpu.pcie_width", "warning", subj,
                f"PCIe link runs at x{g.pcie_width} of x{g.pcie_max_width}",
                "The GPU's link bandwidth is reduced for every path, direct or not.",
                "Reseat the card or check the slot and riser; check lspci -vv LnkSta.")


def _topology(p: _Platform) -> Iterator[Finding]:
    for link in p.topo.links:
        subj = f"GPU {link.gpu_index} <-> {link.peer}"
        for b in link.acs_blocking:
            yield Finding(
                "topology.acs", "error" if link.peer_kind == "nvme" else "warning", f"bridge {b.bdf}",
                f"ACS P2P redirect enabled on {b.port_type or 'bridge'} {b.bdf} between GPU {link.gpu_index} "
                f"and {link.peer} ({'/'.join(b.acs.enabled) if b.acs else ''})",
                "Peer-to-peer requests are forced up to the root complex: PCI P2PDMA refuses the pair and "
                "nvidia-fs traffic loses bandwidth or fails.",
                f"Disable ACS on {b.bdf} (firmware setting, or setpci -s {b.bdf} ECAP_ACS+6.w=0 at boot) "
                "or move the devices under one switch without ACS.")
        if link.relation == "across-root-complexes":
            yield Finding(
                "topology.cross_root_complex", "warning", subj,
                f"GPU {link.gpu_index} and {link.peer} sit under different root complexes"
                + (" on different NUMA nodes" if link.cross_numa else ""),
                "Peer traffic crosses the CPU interconnect: lower bandwidth, and PCI P2PDMA may refuse "
                "the pair unless the host bridges are on the kernel's allow list.",
                "Put the data on an NVMe (or use a NIC) under the same PCIe switch or root port as the GPU.")
        if link.acs_unknown:
            yield Finding("topology.acs_unknown", "info", subj,
                          "ACS state of the bridges between them could not be read",
                          "Reading the extended PCI config space needs root.",
                          "Run gdskit check as root to inspect ACS.")


#: The platform's rules, in the order their findings are reported.
PLATFORM_RULES: tuple[PlatformRule, ...] = (
    _gpu_present, _cufile_library, _nvidia_fs, _p2pdma, _udev, _iommu, _virtual_machine, _cufile_config,
    _gpu_links, _topology,
)


def platform_findings(gpu: GpuFacts, gds: GdsStack, topo: Topology) -> list[Finding]:
    facts = _Platform(gpu, gds, topo)
    return [finding for rule in PLATFORM_RULES for finding in rule(facts)]


# --------------------------------------------------------------------------- mount verdicts
def _links_for(topo: Topology, leaves: list[BlockNode]) -> list[Link]:
    buses = {n.pci_bus_id for n in leaves if n.pci_bus_id}
    peers = {p.name for p in topo.peers if p.pci_bus_id in buses}
    return [link for link in topo.links if link.peer in peers]


@dataclass
class _Judgement:
    """One mount's facts, and what its rules have found so far."""

    m: MountEntry
    mc: MountCheck
    gpu: GpuFacts
    gds: GdsStack
    topo: Topology
    findings: list[Finding] = field(default_factory=list)
    reasons: _Reasons = field(default_factory=_Reasons)
    blocked: bool = False            # cuFile cannot serve this mount at all
    nvfs_route: bool = False         # nvidia-fs would serve it directly
    p2p_route: bool = False          # PCI P2PDMA would serve it directly

    @property
    def subject(self) -> str:
        return f"mount {self.m.mountpoint}"

    @property
    def leaves(self) -> list[BlockNode]:
        return self.mc.device.leaves() if self.mc.device else []

    def note(self, fid: str, severity: str, title: str, consequence: str, fix: str,
             reason: Reason | None = None) -> None:
        """A finding that is not by itself a reason the mount falls short."""
        self.findings.append(Finding(fid, severity, self.subject, title, consequence, fix,
                                     reason.value if reason else None))

    def flag(self, reason: Reason, fid: str, severity: str, title: str, consequence: str, fix: str) -> None:
        """A finding that is also a reason the mount falls short of the direct path."""
        self.reasons.add(reason)
        self.note(fid, severity, title, consequence, fix, reason)


MountRule = Callable[[_Judgement], None]


def _memory_fs(j: _Judgement) -> None:
    j.flag(Reason.FS_UNSUPPORTED, "mount.memory_fs", "info", f"{j.m.fstype} keeps its data in host memory",
           "There is no storage device to DMA from: no direct path. Reads are page-cache copies, "
           "which gdskit's bounce-cached path already does at memory speed.",
           "Keep datasets meant for direct loading on ext4/xfs over NVMe.")


def _stacked_fs(j: _Judgement) -> None:
    j.flag(Reason.FS_UNSUPPORTED, "mount.overlay", "warning", f"{j.m.fstype} (a stacked filesystem) has no direct path",
           "cuFile does not see through overlay layers: I/O runs in compat mode at best.",
           "Bind-mount the data directory from an ext4/xfs volume on NVMe into the container.")


def _network_fs(j: _Judgement) -> None:
    fs = j.m.fstype
    if fs not in GDS_NETWORK_FS:
        j.flag(Reason.FS_UNSUPPORTED, "mount.network_fs", "warning", f"{fs} is not a GPUDirect Storage filesystem",
               "cuFile runs in compat mode on it.",
               "Use NFS over RDMA, Lustre (o2ib), BeeGFS, GPFS or WekaFS for a direct network path.")
    elif j.mc.rdma is False:
        j.flag(Reason.FS_UNSUPPORTED, "mount.no_rdma", "warning", f"{fs} is mounted without RDMA",
               "Network storage reaches GPU memory directly only over RDMA: this mount runs in "
               "compat mode through host memory.",
               "Mount over RDMA (NFS: -o proto=rdma,port=20049; Lustre: an o2ib LNet) with an "
               "RDMA NIC near the GPU.")
    else:
        if j.mc.rdma is None:
            j.note("mount.rdma_unknown", "info", f"RDMA use of this {fs} mount cannot be told from its options",
                   "The verdict assumes the client is configured for RDMA.",
                   "Confirm with the filesystem's client tools; prove it with gdskit check --probe.")
        if j.gds.nvidia_fs.loaded:
            j.nvfs_route = True
        else:
            j.reasons.add(Reason.NVIDIA_FS_MISSING)


def _no_block_device(j: _Judgement) -> None:
    j.flag(Reason.FS_UNSUPPORTED, "mount.no_block_device", "info",
           f"{j.m.fstype} on {j.m.source} has no block device gdskit can resolve",
           "No direct path is known for it; cuFile runs in compat mode at best.",
           "Keep data for direct loading on ext4/xfs over NVMe.")


# -- a local block device: each rule looks at one layer of it ---------------------------------

def _udev_entry(j: _Judgement) -> None:
    # libcufile looks the mount's own device up in udev before it registers a handle.
    tree = j.mc.device
    assert tree is not None
    if j.gds.udev.database and j.mc.udev_entry is False:
        j.note("mount.udev_entry", "error", f"udev has no ID_FS_USAGE for {tree.name} ({tree.major}:{tree.minor})",
               "cuFileHandleRegister fails for files on this mount.",
               "Re-trigger udev (udevadm trigger --subsystem-match=block) so the device's "
               "properties are recorded.", Reason.UDEV_MISSING)
    if not j.gds.udev.database or j.mc.udev_entry is False:
        j.reasons.add(Reason.UDEV_MISSING)
        j.blocked = True


def _local_fs_ok(j: _Judgement) -> bool:
    fs = j.m.fstype
    if fs not in GDS_LOCAL_FS:
        j.flag(Reason.FS_UNSUPPORTED, "mount.fs_unsupported", "warning", f"{fs} is not supported by GPUDirect Storage",
               "cuFile runs in compat mode on it (POSIX through host memory).",
               "Use ext4 (data=ordered) or xfs for data loaded directly into GPU memory.")
        return False
    if fs == "ext4" and j.m.option("data") == "journal":
        j.flag(Reason.FS_UNSUPPORTED, "mount.ext4_data_journal", "warning", "ext4 mounted with data=journal",
               "Data journaling bypasses direct I/O: cuFile falls back to compat mode.",
               "Remount with data=ordered (the default).")
        return False
    return True


def _devices_ok(j: _Judgement) -> bool:
    leaves = j.leaves
    bad_types = sorted({n.dev_type or "unknown" for n in leaves if n.dev_type not in DIRECT_DEVICE_TYPES})
    for t in bad_types:
        names = ", ".join(n.name for n in leaves if (n.dev_type or "unknown") == t)
        j.flag(Reason.FS_UNSUPPORTED, f"mount.device_{t}", "error" if t == "virtio" else "warning",
               f"backed by {t} storage ({names}), not NVMe",
               _DEVICE_WHY.get(t, f"{t} devices are not GPUDirect Storage targets") + ".",
               "Put the data on a local NVMe drive (passed through to the VM, if any) or on "
               "RDMA network storage.")
    return not bad_types


def _block_device(j: _Judgement) -> None:
    """A filesystem on a local block device: each layer from the filesystem down to the drives."""
    assert j.mc.device is not None
    _udev_entry(j)
    fs_ok = _local_fs_ok(j)
    dev_ok = _devices_ok(j)
    nodes = j.mc.device.walk()
    loops = [n for n in nodes if n.kind == "loop"]
    dms = [n for n in nodes if n.kind == "dm" and n.detail != "multipath"]
    mds = [n for n in nodes if n.kind == "md"]
    multipath = [n for n in nodes if n.multipath]
    if loops:
        j.flag(Reason.FS_UNSUPPORTED, "mount.loop", "warning", f"on a loop device ({loops[0].detail or loops[0].name})",
               "Loop devices route I/O through the backing file: no direct path.",
               "Mount the filesystem from the block device itself.")
    if dms:
        j.flag(Reason.FS_UNSUPPORTED, "mount.device_mapper", "warning",
               f"on device-mapper ({', '.join(f'{n.name} {n.detail}' for n in dms)})",
               "GPUDirect Storage does not pass through LVM or dm-crypt: compat mode.",
               "Use a plain partition or md RAID0 for GDS data.")
    md_ok = all(n.detail in NVFS_MD_LEVELS for n in mds)
    if mds and not md_ok:
        j.flag(Reason.RAID_OR_MULTIPATH, "mount.md_level", "warning",
               f"md RAID level {', '.join(sorted({n.detail or '?' for n in mds}))} is not supported",
               "Only md RAID0/RAID1 (with nvidia-fs) have a direct path.",
               "Use md RAID0 or RAID1 over NVMe for GDS data.")
    nvfs, p2p = j.gds.nvidia_fs.loaded, j.gds.p2pdma.available
    stack_plain = not (loops or dms or mds or multipath)
    base_ok = fs_ok and dev_ok and not loops and not dms
    acs = [b for link in _links_for(j.topo, j.leaves) for b in link.acs_blocking]
    j.nvfs_route = nvfs and base_ok and md_ok
    j.p2p_route = p2p and base_ok and stack_plain and not acs
    if not nvfs and base_ok:
        if not stack_plain and p2p:
            what = ", ".join(f"{n.name} ({n.detail or 'multipath'})" for n in mds + multipath)
            j.flag(Reason.RAID_OR_MULTIPATH, "mount.raid_p2pdma", "error", f"{what} under PCI P2PDMA without nvidia-fs",
                   "PCI P2PDMA serves single NVMe devices only: RAID and multipath run in compat mode.",
                   "Load nvidia-fs (it supports md RAID0/RAID1), or put the data on a single NVMe.")
        if p2p and acs and stack_plain:
            j.flag(Reason.P2PDMA_UNAVAILABLE, "mount.acs_p2pdma", "error",
                   f"ACS on {', '.join(sorted({b.bdf for b in acs}))} blocks P2PDMA to the GPU",
                   "The kernel refuses P2PDMA between this NVMe and the GPU: compat mode.",
                   "Disable ACS on the named bridge(s) or load nvidia-fs.")
    if not nvfs and not p2p:
        # Neither kernel route exists: name both, whatever else stands in the way.
        j.reasons.add(Reason.NVIDIA_FS_MISSING)
        j.reasons.add(Reason.P2PDMA_UNAVAILABLE)


#: What kind of mount it is decides which rule judges its storage: the first that applies.
MOUNT_KINDS: tuple[tuple[Callable[[_Judgement], bool], MountRule], ...] = (
    (lambda j: j.m.fstype in MEMORY_FS, _memory_fs),
    (lambda j: j.m.fstype in STACKED_FS, _stacked_fs),
    (lambda j: j.mc.network, _network_fs),
    (lambda j: j.mc.device is None, _no_block_device),
    (lambda j: True, _block_device),
)


def _odirect(j: _Judgement) -> None:
    if j.mc.odirect.status == "unsupported" and (j.nvfs_route or j.p2p_route):
        j.nvfs_route = j.p2p_route = False
        j.flag(Reason.FS_UNSUPPORTED, "mount.odirect", "warning", "O_DIRECT opens fail on this mount",
               "cuFile needs O_DIRECT for the direct route: compat mode.",
               "Use a filesystem that supports O_DIRECT (ext4, xfs).")


def _verdict(j: _Judgement) -> None:
    """The verdict, the route and the fallback from what the rules found."""
    mc, cfg = j.mc, j.gds.config
    route = Path.CUFILE_NVFS.value if j.nvfs_route else Path.CUFILE_P2PDMA.value if j.p2p_route else None
    if route and cfg.force_compat_mode:
        j.reasons.add(Reason.FORCED_BY_SETTING)
        route = None
    if j.blocked:
        verdict, route = "unsupported", None
    elif route:
        verdict = "direct"
    elif not cfg.allow_compat_mode:
        verdict = "unsupported"
    else:
        verdict = "compat"
    mc.verdict, mc.route = verdict, route
    mc.reasons = list(j.reasons) if verdict != "direct" else [Reason.DIRECT.value]
    if not j.gpu.gpus:
        mc.fallback = Path.HOST.value
    elif j.m.fstype in MEMORY_FS or mc.odirect.status == "unsupported":
        mc.fallback = Path.BOUNCE_CACHED.value
    else:
        mc.fallback = Path.BOUNCE_DIRECT.value


def judge_mount(m: MountEntry, mc: MountCheck, gpu: GpuFacts, gds: GdsStack, topo: Topology) -> list[Finding]:
    """Fill ``mc.verdict``, ``route``, ``fallback`` and ``reasons``; return the mount's findings."""
    j = _Judgement(m, mc, gpu, gds, topo)
    if not gpu.gpus:
        j.reasons.add(Reason.NO_GPU)
        j.blocked = True
    if not gds.cufile.found:
        j.reasons.add(Reason.CUFILE_MISSING)
        j.blocked = True
    rule = next(rule for applies, rule in MOUNT_KINDS if applies(j))
    rule(j)
    _odirect(j)
    _verdict(j)
    return j.findings


def udev_entry_for(root: SystemRoot, tree: BlockNode | None, gds: GdsStack) -> bool | None:
    if tree is None or tree.major is None or tree.minor is None or not gds.udev.database:
        return None
    return udev_fs_usage(root, tree.major, tree.minor)


def is_network(fstype: str) -> bool:
    return fstype in NETWORK_FS or fstype.startswith("fuse.")
