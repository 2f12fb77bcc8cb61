"""PCIe topology from sysfs: where GPUs, NVMe controllers and RDMA NICs sit, and
whether a bridge between them redirects peer-to-peer traffic (ACS).

The PCI hierarchy is read from the resolved ``/sys/bus/pci/devices/<bdf>`` links
(``/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/...``); ACS comes from each
bridge's binary ``config`` file (complete only when read as root).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from typing import Any

from gdskit.machine.root import SystemRoot

BDF_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
HOST_BRIDGE_RE = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")

EXT_CAP_START = 0x100
EXT_CAP_ACS = 0x000D
CAP_PCIE = 0x10

# ACS control register bits (PCIe base spec, ACS Extended Capability).
ACS_BITS = {
    "SV": 1 << 0,   # source validation
    "TB": 1 << 1,   # translation blocking
    "RR": 1 << 2,   # P2P request redirect: peer requests go up to the root complex
    "CR": 1 << 3,   # P2P completion redirect
    "UF": 1 << 4,   # upstream forwarding
    "EC": 1 << 5,   # P2P egress control
    "DT": 1 << 6,   # direct translated P2P
}
# The bits that stop a transfer from going straight from one device to its peer.
ACS_P2P_BLOCKING = ("RR", "CR", "EC")

PORT_TYPES = {
    0x0: "endpoint", 0x1: "legacy endpoint", 0x4: "root port", 0x5: "switch upstream port",
    0x6: "switch downstream port", 0x7: "PCIe-to-PCI bridge", 0x8: "PCI-to-PCIe bridge",
    0x9: "root complex integrated endpoint", 0xA: "root complex event collector",
}


# --------------------------------------------------------------------------- config space
@dataclass(frozen=True)
class AcsState:
    """The ACS capability of one PCIe port (raw registers and the named bits)."""

    offset: int
    capability: int
    control: int

    @property
    def enabled(self) -> list[str]:
        return [name for name, bit in ACS_BITS.items() if self.control & bit]

    @property
    def blocks_p2p(self) -> bool:
        return any(self.control & ACS_BITS[name] for name in ACS_P2P_BLOCKING)

    def to_dict(self) -> dict[str, Any]:
        return {"offset": self.offset, "capability": self.capability, "control": self.control,
                "enabled": self.enabled, "blocks_p2p": self.blocks_p2p}


def parse_acs(config: bytes) -> AcsState | None:
    """Find the ACS extended capability in PCI config space.

    Returns ``None`` when the device has none (or only the first 256 bytes are
    visible). Robust against truncated or looping capability lists.
    """
    offset = EXT_CAP_START
    seen: set[int] = set()
    while EXT_CAP_START <= offset and offset + 8 <= len(config) and offset not in seen:
        seen.add(offset)
        (header,) = struct.unpack_from("<I", config, offset)
        if header in (0, 0xFFFFFFFF):
            return None
        cap_id = header & 0xFFFF
        if cap_id == EXT_CAP_ACS:
            cap, ctrl = struct.unpack_from("<HH", config, offset + 4)
            return AcsState(offset, cap, ctrl)
        offset = (header >> 20) & 0xFFC
    return None


def parse_port_type(config: bytes) -> str | None:
    """The PCIe device/port type from the PCI Express capability (standard list)."""
    if len(config) < 0x40:
        return None
    ptr = config[0x34] & 0xFC
    seen: set[int] = set()
    while ptr >= 0x40 and ptr + 4 <= len(config) and ptr not in seen:
        seen.add(ptr)
        cap_id, nxt = config[ptr], config[ptr + 1]
        if cap_id == CAP_PCIE:
            (flags,) = struct.unpack_from("<H", config, ptr + 2)
            return PORT_TYPES.get((flags >> 4) & 0xF, "other")
        ptr = nxt & 0xFC
    return None


# --------------------------------------------------------------------------- hierarchy
@dataclass(frozen=True)
class PciPlace:
    """Where a device sits: its host bridge and the chain of PCI functions down to it."""

    host_bridge: str | None          # e.g. "pci0000:00" (one root complex)
    chain: tuple[str, ...]           # BDFs from the root port down to the device itself

    @property
    def bdf(self) -> str | None:
        return self.chain[-1] if self.chain else None


def place_from_sysfs_path(path: str) -> PciPlace:
    """Parse a resolved sysfs device path into a :class:`PciPlace`."""
    host = None
    chain: list[str] = []
    for part in path.split("/"):
        if HOST_BRIDGE_RE.match(part):
            host, chain = part, []
        elif BDF_RE.match(part):
            chain.append(part)
    return PciPlace(host, tuple(chain))


def pci_place(root: SystemRoot, bdf: str) -> PciPlace | None:
    link = f"/sys/bus/pci/devices/{bdf}"
    if not root.exists(link):
        return None
    place = place_from_sysfs_path(root.realpath(link))
    return place if place.chain else None


@dataclass(frozen=True)
class Bridge:
    bdf: str
    port_type: str | None
    acs: AcsState | None
    acs_readable: bool               # False: config space truncated (not root) -> ACS unknown

    def to_dict(self) -> dict[str, Any]:
        return {"bdf": self.bdf, "port_type": self.port_type, "acs_readable": self.acs_readable,
                "acs": self.acs.to_dict() if self.acs else None}


def read_bridge(root: SystemRoot, bdf: str) -> Bridge:
    config = root.read_bytes(f"/sys/bus/pci/devices/{bdf}/config", 4096) or b""
    return Bridge(bdf, parse_port_type(config), parse_acs(config), len(config) > EXT_CAP_START)


# --------------------------------------------------------------------------- peers
@dataclass(frozen=True)
class PeerDevice:
    """A storage or network device a GPU would exchange data with directly."""

    kind: str                        # "nvme" or "rdma"
    name: str                        # nvme0, mlx5_0
    pci_bus_id: str | None
    place: PciPlace | None
    numa_node: int | None
    netdevs: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "pci_bus_id": self.pci_bus_id,
                "numa_node": self.numa_node, "netdevs": list(self.netdevs)}


def _numa(root: SystemRoot, bdf: str | None) -> int | None:
    if not bdf:
        return None
    try:
        v = int(root.read_value(f"/sys/bus/pci/devices/{bdf}/numa_node") or "")
    except ValueError:
        return None
    return v if v >= 0 else None


def _peer(root: SystemRoot, kind: str, name: str, device_link: str, netdevs: tuple[str, ...] = ()) -> PeerDevice:
    place = None
    if root.exists(device_link):
        p = place_from_sysfs_path(root.realpath(device_link))
        place = p if p.chain else None
    bdf = place.bdf if place else None
    return PeerDevice(kind, name, bdf, place, _numa(root, bdf), netdevs)


def nvme_controllers(root: SystemRoot) -> list[PeerDevice]:
    out = []
    for name in root.listdir("/sys/class/nvme"):
        out.append(_peer(root, "nvme", name, f"/sys/class/nvme/{name}/device"))
    return out


def rdma_devices(root: SystemRoot) -> list[PeerDevice]:
    out = []
    for name in root.listdir("/sys/class/infiniband"):
        nets = tuple(root.listdir(f"/sys/class/infiniband/{name}/device/net"))
        out.append(_peer(root, "rdma", name, f"/sys/class/infiniband/{name}/device", nets))
    return out


@dataclass(frozen=True)
class Link:
    """The PCIe relation between one GPU and one peer device."""

    gpu_index: int
    gpu_bus_id: str
    peer: str                        # name of the peer device (nvme0, mlx5_0)
    peer_kind: str
    relation: str                    # same-switch | same-root-complex | across-root-complexes | unknown
    common_bridge: str | None
    bridges: list[Bridge] = field(default_factory=list)
    cross_numa: bool = False

    @property
    def acs_blocking(self) -> list[Bridge]:
        return [b for b in self.bridges if b.acs is not None and b.acs.blocks_p2p]

    @property
    def acs_unknown(self) -> bool:
        return any(not b.acs_readable for b in self.bridges)

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu_index, "gpu_pci_bus_id": self.gpu_bus_id, "peer": self.peer,
            "peer_kind": self.peer_kind, "relation": self.relation, "common_bridge": self.common_bridge,
            "cross_numa": self.cross_numa, "bridges": [b.to_dict() for b in self.bridges],
            "acs_blocking": [b.bdf for b in self.acs_blocking], "acs_unknown": self.acs_unknown,
        }


def relate(root: SystemRoot, gpu_index: int, gpu_place: PciPlace | None, gpu_bdf: str,
           gpu_numa: int | None, peer: PeerDevice, bridges: dict[str, Bridge] | None = None) -> Link:
    """How traffic between a GPU and a peer would cross the PCIe tree. ``bridges`` caches
    bridges already read (their config space is read once however many links cross them)."""
    bridges = {} if bridges is None else bridges
    if gpu_place is None or peer.place is None:
        return Link(gpu_index, gpu_bdf, peer.name, peer.kind, "unknown", None)
    a, b = gpu_place.chain, peer.place.chain
    common = 0
    if gpu_place.host_bridge == peer.place.host_bridge:
        while common < min(len(a), len(b)) - 1 and a[common] == b[common]:
            common += 1
    between = list(a[common:-1]) + [x for x in b[common:-1] if x not in a]
    if gpu_place.host_bridge != peer.place.host_bridge:
        relation = "across-root-complexes"
    elif common > 0:
        relation = "same-switch"
    else:
        relation = "same-root-complex"
    cross_numa = gpu_numa is not None and peer.numa_node is not None and gpu_numa != peer.numa_node
    for bdf in between:
        if bdf not in bridges:
            bridges[bdf] = read_bridge(root, bdf)
    return Link(gpu_index, gpu_bdf, peer.name, peer.kind, relation, a[common - 1] if common else None,
                [bridges[bdf] for bdf in between], cross_numa)


@dataclass(frozen=True)
class Topology:
    peers: list[PeerDevice]
    links: list[Link]

    def to_dict(self) -> dict[str, Any]:
        return {"peers": [p.to_dict() for p in self.peers], "links": [link.to_dict() for link in self.links]}


def topology(root: SystemRoot, gpus: list[Any]) -> Topology:
    """Relate every GPU (``GpuInfo``) to every NVMe controller and RDMA device."""
    peers = nvme_controllers(root) + rdma_devices(root)
    links = []
    bridges: dict[str, Bridge] = {}
    for g in gpus:
        place = pci_place(root, g.pci_bus_id)
        for p in peers:
            links.append(relate(root, g.index, place, g.pci_bus_id, g.numa_node, p, bridges))
    return Topology(peers, links)
