"""Mounts and the block devices under them, read from /proc/self/mountinfo and /sys.

A mount is resolved down to the physical devices that hold its data: through
partitions, device-mapper (LVM, crypt, multipath), md RAID and loop devices.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
from dataclasses import dataclass, field
from typing import Any

from gdskit.durable import create_temp_file, fd_path
from gdskit.machine.root import SystemRoot
from gdskit.machine.topology import place_from_sysfs_path

MOUNTINFO = "/proc/self/mountinfo"

# Kernel-internal filesystems: never hold user data a workload would read.
PSEUDO_FS = frozenset({
    "proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "debugfs", "tracefs", "securityfs",
    "pstore", "bpf", "configfs", "fusectl", "hugetlbfs", "autofs", "binfmt_misc", "devtmpfs",
    "rpc_pipefs", "nsfs", "efivarfs", "selinuxfs", "nfsd", "ramfs", "squashfs", "iso9660",
})
NETWORK_FS = frozenset({
    "nfs", "nfs4", "lustre", "beegfs", "gpfs", "wekafs", "cifs", "smb3", "ceph", "glusterfs",
    "9p", "virtiofs", "fuse.sshfs", "fuse.glusterfs", "fuse.s3fs", "fuse.juicefs", "orangefs", "afs",
})
# Where GDS has a direct path: local block filesystems and these network ones.
GDS_LOCAL_FS = frozenset({"ext4", "xfs"})
GDS_NETWORK_FS = frozenset({"nfs", "nfs4", "lustre", "beegfs", "gpfs", "wekafs"})
MEMORY_FS = frozenset({"tmpfs", "ramfs"})
STACKED_FS = frozenset({"overlay", "overlayfs", "aufs", "fuse-overlayfs"})

_OCTAL = re.compile(r"\\([0-7]{3})")


def unescape_mount_field(text: str) -> str:
    """Undo the kernel's octal escapes (``\\040`` for a space...) in mountinfo fields."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), text)


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo."""

    mount_id: int
    parent_id: int
    major: int
    minor: int
    root: str
    mountpoint: str
    options: tuple[str, ...]
    fstype: str
    source: str
    super_options: tuple[str, ...]

    @property
    def all_options(self) -> tuple[str, ...]:
        return self.options + tuple(o for o in self.super_options if o not in self.options)

    @property
    def read_only(self) -> bool:
        return "ro" in self.options

    def option(self, key: str) -> str | None:
        for o in self.all_options:
            if o == key:
                return ""
            if o.startswith(key + "="):
                return o.split("=", 1)[1]
        return None


def parse_mountinfo(text: str) -> list[MountEntry]:
    """Parse mountinfo text. Malformed lines are skipped (the kernel never writes them)."""
    out = []
    for line in text.splitlines():
        parts = line.split(" ")
        try:
            sep = parts.index("-", 6)
            major, minor = parts[2].split(":")
            out.append(MountEntry(
                mount_id=int(parts[0]), parent_id=int(parts[1]), major=int(major), minor=int(minor),
                root=unescape_mount_field(parts[3]), mountpoint=unescape_mount_field(parts[4]),
                options=tuple(parts[5].split(",")), fstype=parts[sep + 1],
                source=unescape_mount_field(parts[sep + 2]),
                super_options=tuple(parts[sep + 3].split(",")) if len(parts) > sep + 3 else (),
            ))
        except (ValueError, IndexError):
            continue
    return out


def read_mounts(root: SystemRoot) -> list[MountEntry]:
    return parse_mountinfo(root.read_text(MOUNTINFO) or "")


def is_listed_by_default(m: MountEntry) -> bool:
    """Local and network filesystems a workload could read; not kernel plumbing."""
    if m.fstype in PSEUDO_FS or (m.fstype.startswith("fuse.") and m.fstype not in NETWORK_FS):
        return False
    mp = m.mountpoint
    if any(mp == p or mp.startswith(p + "/") for p in ("/proc", "/sys", "/dev")):
        return False
    if m.fstype in MEMORY_FS and (mp == "/run" or mp.startswith("/run/")):
        return False
    return True


def mount_for_path(mounts: list[MountEntry], path: str) -> MountEntry | None:
    """The mount that holds ``path`` (longest mountpoint prefix; the last of stacked mounts)."""
    best: MountEntry | None = None
    for m in mounts:
        mp = m.mountpoint
        if path == mp or mp == "/" or path.startswith(mp.rstrip("/") + "/"):
            if best is None or len(mp) >= len(best.mountpoint):
                best = m
    return best


def mount_of(path: str, mountinfo_text: str | None = None) -> MountEntry | None:
    """The mount holding ``path`` on this machine (``mountinfo_text``: the text of
    ``/proc/self/mountinfo`` to use instead of reading it); None when it cannot be read."""
    try:
        if mountinfo_text is None:
            with open(MOUNTINFO) as fh:
                mountinfo_text = fh.read()
        real = os.path.realpath(path)
    except OSError:
        return None
    return mount_for_path(parse_mountinfo(mountinfo_text), real)


# --------------------------------------------------------------------------- block devices
@dataclass
class BlockNode:
    """A block device in the stack under a mount."""

    name: str
    kind: str                        # disk | partition | dm | md | loop
    detail: str | None = None        # raid level, dm target kind, loop backing file
    dev_type: str | None = None      # for disks: nvme | nvme-of | scsi | virtio | xen | mmc | ram | nbd | virtual | unknown
    pci_bus_id: str | None = None
    major: int | None = None
    minor: int | None = None
    multipath: bool = False
    children: list[BlockNode] = field(default_factory=list)

    def leaves(self) -> list[BlockNode]:
        if not self.children:
            return [self]
        return [leaf for c in self.children for leaf in c.leaves()]

    def walk(self) -> list[BlockNode]:
        return [self] + [n for c in self.children for n in c.walk()]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "detail": self.detail, "dev_type": self.dev_type,
                "pci_bus_id": self.pci_bus_id, "dev": f"{self.major}:{self.minor}" if self.major is not None else None,
                "multipath": self.multipath, "children": [c.to_dict() for c in self.children]}

    def describe(self) -> str:
        """``md0 (raid0) <- nvme0n1p1 (partition) <- nvme0n1 (nvme)`` style chain for people."""
        label = self.dev_type if self.kind == "disk" else (self.detail or self.kind)
        if self.kind == "partition":
            label = "partition"
        here = f"{self.name} ({label})"
        if not self.children:
            return here
        inner = " + ".join(c.describe() for c in self.children)
        return f"{here} <- {inner}" if len(self.children) == 1 else f"{here} <- [{inner}]"


def _dev_numbers(root: SystemRoot, name: str) -> tuple[int | None, int | None]:
    text = root.read_value(f"/sys/class/block/{name}/dev") or ""
    try:
        a, b = text.split(":")
        return int(a), int(b)
    except ValueError:
        return None, None


def _disk_type(root: SystemRoot, name: str, sys_path: str) -> tuple[str, bool]:
    base = f"/sys/class/block/{name}"
    if name.startswith("nvme"):
        transport = root.read_value(f"{base}/device/transport")
        paths = [p for p in root.listdir(f"{base}/multipath")]
        kind = "nvme" if transport in (None, "pcie") else "nvme-of"
        if "/nvme-fabrics/" in sys_path:
            kind = "nvme-of"
        return kind, len(paths) > 1
    driver = os.path.basename(root.readlink(f"{base}/device/driver") or "")
    if "virtio" in sys_path or driver.startswith("virtio"):
        return "virtio", False
    if name.startswith(("ram", "zram")) or driver == "brd":
        return "ram", False
    if name.startswith("nbd"):
        return "nbd", False
    if name.startswith("xvd") or "/xen/" in sys_path:
        return "xen", False
    if name.startswith("mmcblk"):
        return "mmc", False
    if name.startswith(("sd", "sr")) or driver == "sd" or "/target" in sys_path:
        return "scsi", False
    if "/virtual/" in sys_path:
        return "virtual", False
    return "unknown", False


def block_node(root: SystemRoot, name: str, mounts: list[MountEntry] | None = None, depth: int = 0) -> BlockNode:
    """Resolve one block device (by kernel name) down to its physical devices."""
    base = f"/sys/class/block/{name}"
    major, minor = _dev_numbers(root, name)
    node = BlockNode(name, "disk", major=major, minor=minor)
    if depth > 16:                   # a stack this deep is a loop in the data, not a real machine
        node.dev_type = "unknown"
        return node
    sys_path = root.realpath(base) if root.exists(base) else ""
    slaves = root.listdir(f"{base}/slaves")
    if root.exists(f"{base}/partition"):
        node.kind = "partition"
        parent = os.path.basename(os.path.dirname(sys_path)) if sys_path else None
        if parent:
            node.children = [block_node(root, parent, mounts, depth + 1)]
    elif root.exists(f"{base}/dm"):
        node.kind = "dm"
        uuid = (root.read_value(f"{base}/dm/uuid") or "").upper()
        node.detail = ("multipath" if uuid.startswith("MPATH-") else "lvm" if uuid.startswith("LVM-")
                       else "crypt" if uuid.startswith("CRYPT-") else "raid" if uuid.startswith("DMRAID-")
                       else "dm")
        node.multipath = node.detail == "multipath"
        node.children = [block_node(root, s, mounts, depth + 1) for s in slaves]
    elif root.exists(f"{base}/md"):
        node.kind = "md"
        node.detail = root.read_value(f"{base}/md/level") or "md"
        node.children = [block_node(root, s, mounts, depth + 1) for s in slaves]
    elif root.exists(f"{base}/loop") or name.startswith("loop"):
        node.kind = "loop"
        backing = root.read_value(f"{base}/loop/backing_file")
        node.detail = backing
        if backing and mounts:
            holder = mount_for_path(mounts, backing)
            if holder is not None and holder.major != 0:
                under = device_name(root, holder.major, holder.minor)
                if under:
                    node.children = [block_node(root, under, mounts, depth + 1)]
        if not node.children:
            node.dev_type = "virtual"
    else:
        node.dev_type, node.multipath = _disk_type(root, name, sys_path)
        place = place_from_sysfs_path(sys_path)
        node.pci_bus_id = place.bdf
    return node


def device_name(root: SystemRoot, major: int, minor: int) -> str | None:
    link = f"/sys/dev/block/{major}:{minor}"
    if not root.exists(link):
        return None
    return os.path.basename(root.realpath(link))


def mount_block_tree(root: SystemRoot, m: MountEntry, mounts: list[MountEntry]) -> BlockNode | None:
    """The block device stack under a mount, or ``None`` (network, memory, overlay...)."""
    name = device_name(root, m.major, m.minor) if m.major != 0 else None
    if name is None and m.source.startswith("/dev/"):
        # btrfs and a few others report an anonymous device number; the source names the disk.
        candidate = os.path.basename(root.realpath(m.source)) if root.exists(m.source) else os.path.basename(m.source)
        if root.exists(f"/sys/class/block/{candidate}"):
            name = candidate
    return block_node(root, name, mounts) if name else None


def network_rdma(m: MountEntry) -> bool | None:
    """Whether a network filesystem mount moves data over RDMA (None: cannot tell from the mount)."""
    if m.fstype in ("nfs", "nfs4"):
        return m.option("proto") == "rdma" or m.option("rdma") is not None
    if m.fstype == "lustre":
        if "@o2ib" in m.source:
            return True
        return False if "@tcp" in m.source else None
    if m.fstype == "wekafs":
        return True
    if m.fstype in ("cifs", "smb3"):
        return m.option("rdma") is not None
    if m.fstype in ("9p", "virtiofs", "ceph", "glusterfs") or m.fstype.startswith("fuse."):
        return False
    return None


# --------------------------------------------------------------------------- O_DIRECT
@dataclass(frozen=True)
class ODirectResult:
    status: str                      # supported | unsupported | not-probed | error
    detail: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "detail": self.detail}


def probe_odirect(directory: str) -> ODirectResult:
    """Create, write, read and remove a 4 KiB temp file with O_DIRECT in ``directory``."""
    if not hasattr(os, "O_DIRECT"):
        return ODirectResult("not-probed", "this platform has no O_DIRECT")
    if not os.access(directory, os.W_OK):
        return ODirectResult("not-probed", f"{directory} is not writable")
    try:
        fd0, tmp = create_temp_file(directory, ".gdskit-check-")
    except OSError as exc:
        return ODirectResult("not-probed", f"cannot create a temp file: {exc.strerror}")
    buf = mmap.mmap(-1, 4096)        # page-aligned, as O_DIRECT requires
    fd = -1
    try:
        buf.write(b"gdskit" * 600 + b"\0" * (4096 - 3600))
        fd = os.open(fd_path(fd0), os.O_RDWR | os.O_DIRECT)  # the file made above, whatever is at its name now
        if os.pwritev(fd, [buf], 0) != 4096:
            return ODirectResult("error", "short O_DIRECT write")
        back = mmap.mmap(-1, 4096)
        try:
            if os.preadv(fd, [back], 0) != 4096 or back[:] != buf[:]:
                return ODirectResult("error", "O_DIRECT read returned other bytes")
        finally:
            back.close()
        return ODirectResult("supported")
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return ODirectResult("unsupported", "the filesystem rejects O_DIRECT (EINVAL)")
        return ODirectResult("error", f"{exc.strerror} (errno {exc.errno})")
    finally:
        if fd >= 0:
            os.close(fd)
        os.close(fd0)
        buf.close()
        try:
            os.unlink(tmp)
        except OSError:
            pass


def odirect_dir_for(m: MountEntry, requested: list[str]) -> str | None:
    """A writable directory on this very mount to probe in (live machine only)."""
    try:
        dev = os.stat(m.mountpoint).st_dev
    except OSError:
        return None
    candidates = [p if os.path.isdir(p) else os.path.dirname(p) for p in requested]
    candidates += ["/var/tmp", "/tmp", m.mountpoint]
    for c in candidates:
        try:
            if os.stat(c).st_dev == dev and os.access(c, os.W_OK):
                return c
        except OSError:
            continue
    return None
