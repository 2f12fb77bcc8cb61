"""Where a file's storage sits relative to each GPU, from sysfs: the PCI devices under a mount
(NVMe controllers, a disk's controller, RDMA NICs) and their PCIe distance to each GPU.

:func:`live_storage_facts` is what the engine's routing reads on the running machine;
:class:`FixtureFacts` reads a captured tree instead (tests, and ``gdskit check --root``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gdskit.machine.distance import Distance, StorageFacts
from gdskit.machine.mounts import NETWORK_FS, block_node, device_name, mount_block_tree, network_rdma, read_mounts
from gdskit.machine.numa import numa_of
from gdskit.machine.root import SystemRoot
from gdskit.machine.topology import PciPlace, PeerDevice, pci_place, rdma_devices


# --------------------------------------------------------------------------- distance
def distance(a: PciPlace | None, a_numa: int | None, b: PciPlace | None, b_numa: int | None) -> Distance:
    """The PCIe distance class between two PCI functions (see :class:`gdskit.engine.gpu_routing.Distance`)."""
    if a is None or b is None or not a.chain or not b.chain:
        return Distance.UNKNOWN
    if a.host_bridge != b.host_bridge:
        if a_numa is not None and b_numa is not None and a_numa != b_numa:
            return Distance.CROSS_SOCKET
        return Distance.CROSS_ROOT_COMPLEX
    x, y = a.chain, b.chain
    common = 0
    while common < min(len(x), len(y)) - 1 and x[common] == y[common]:
        common += 1
    if common == 0:
        return Distance.SAME_ROOT_COMPLEX
    # Below the deepest shared bridge each side passes at most one more (a switch's
    # downstream port): the two meet inside one switch.
    if len(x) - common - 1 <= 1 and len(y) - common - 1 <= 1:
        return Distance.SAME_SWITCH
    return Distance.SAME_ROOT_PORT


def _worst(ds: Iterable[Distance]) -> Distance:
    ds = list(ds)
    if not ds or any(d.rank is None for d in ds):
        return Distance.UNKNOWN
    return max(ds, key=lambda d: d.rank or 0)


def _best(ds: Iterable[Distance]) -> Distance:
    known = [d for d in ds if d.rank is not None]
    return min(known, key=lambda d: d.rank or 0) if known else Distance.UNKNOWN


@dataclass(frozen=True)
class Storage:
    """The PCI devices a mount's bytes come from. ``spread``: every device serves part of each
    read (RAID: the farthest one sets the pace); otherwise any one does (NICs: the nearest)."""

    devices: tuple[PeerDevice, ...] = ()
    spread: bool = True
    why_unknown: str = ""

    def distance_to(self, place: PciPlace | None, numa: int | None) -> Distance:
        each = (distance(place, numa, d.place, d.numa_node) for d in self.devices)
        return _worst(each) if self.spread else _best(each)

    def to_dict(self) -> list[dict[str, Any]]:
        return [{"name": d.name, "kind": d.kind, "pci_bus_id": d.pci_bus_id, "numa_node": d.numa_node}
                for d in self.devices]


def _device_at(root: SystemRoot, name: str, kind: str, bdf: str, known: Sequence[PeerDevice]) -> PeerDevice:
    for p in known:
        if p.pci_bus_id == bdf:
            return p
    return PeerDevice(kind, name, bdf, pci_place(root, bdf), numa_of(root, bdf))


def block_storage(root: SystemRoot, tree: Any, known: Sequence[PeerDevice] = ()) -> Storage:
    """The PCI devices under a block device stack (a :class:`gdskit.machine.mounts.BlockNode`)."""
    if tree is None:
        return Storage(why_unknown="no block device")
    leaves = tree.leaves()
    devices = []
    for leaf in leaves:
        if not leaf.pci_bus_id:
            return Storage(why_unknown=f"{leaf.name} sits on no PCI device")
        devices.append(_device_at(root, leaf.name, leaf.dev_type or "block", leaf.pci_bus_id, known))
    return Storage(tuple(devices), spread=True)


def is_network(fstype: str) -> bool:
    return fstype in NETWORK_FS or fstype.startswith("fuse.")


def network_storage(fstype: str, rdma: bool | None, nics: Sequence[PeerDevice]) -> Storage:
    """The RDMA NICs a network mount's bytes may come through (any of them)."""
    if rdma is False:
        return Storage(why_unknown=f"{fstype} without RDMA: the bytes come through the host's network stack")
    if not nics:
        return Storage(why_unknown="no RDMA NIC found")
    return Storage(tuple(nics), spread=False)


def storage_facts(root: SystemRoot, storage: Storage, gpu_bus_ids: Sequence[str]) -> StorageFacts:
    """``storage``'s distance to each GPU (by PCI address), for the engine."""
    if not storage.devices:
        return StorageFacts(detail=storage.why_unknown)
    out = {}
    for bus in gpu_bus_ids:
        out[bus] = storage.distance_to(pci_place(root, bus), numa_of(root, bus))
    return StorageFacts(tuple(d.pci_bus_id or d.name for d in storage.devices), out)


def storage_of_device(root: SystemRoot, major: int, minor: int) -> Storage:
    """The storage behind a file's device number: its block stack, or for a network
    filesystem (device major 0) the machine's RDMA NICs."""
    mounts = read_mounts(root)
    mount = next((m for m in reversed(mounts) if (m.major, m.minor) == (major, minor)), None)
    if mount is not None and is_network(mount.fstype):
        return network_storage(mount.fstype, network_rdma(mount), rdma_devices(root))
    if mount is not None:
        return block_storage(root, mount_block_tree(root, mount, mounts))
    name = device_name(root, major, minor) if major else None
    if name is None:
        return Storage(why_unknown=f"device {major}:{minor} is in no mount")
    return block_storage(root, block_node(root, name, mounts))


@functools.lru_cache(maxsize=64)
def _live(st_dev: int, gpu_bus_ids: tuple[str, ...]) -> StorageFacts:
    root = SystemRoot("/")
    return storage_facts(root, storage_of_device(root, os.major(st_dev), os.minor(st_dev)), gpu_bus_ids)


def live_storage_facts(st_dev: int, gpu_bus_ids: tuple[str, ...]) -> StorageFacts:
    """The engine's fact source on the running machine (read once per device number)."""
    return _live(st_dev, tuple(gpu_bus_ids))


class FixtureFacts:
    """A fact source over a captured tree, for tests: every file is taken to live on the
    device ``major:minor`` of that tree."""

    def __init__(self, root: SystemRoot | str, major: int, minor: int) -> None:
        self.root = root if isinstance(root, SystemRoot) else SystemRoot(root)
        self.storage = storage_of_device(self.root, major, minor)

    def __call__(self, st_dev: int, gpu_bus_ids: tuple[str, ...]) -> StorageFacts:
        return storage_facts(self.root, self.storage, gpu_bus_ids)
