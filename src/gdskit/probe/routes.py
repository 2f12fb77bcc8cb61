"""Routing facts from sysfs: how far each GPU sits from each storage device (or NIC), which
GPUs reach each other peer to peer, and the route table ``gdskit check`` prints.

The distance between two PCI functions comes from where they hang in the PCIe tree
(:class:`gdskit.probe.topology.PciPlace`) and their NUMA nodes; the decision that uses it is
:func:`gdskit.routing.decide`, the engine's own. :func:`live_storage_facts` is the fact
source ``import gdskit`` hands the engine (:func:`gdskit.routing.use_facts`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gdskit.probe.mounts import NETWORK_FS, block_node, device_name, mount_block_tree, network_rdma, read_mounts
from gdskit.probe.root import SystemRoot
from gdskit.probe.topology import PciPlace, PeerDevice, Topology, pci_place, rdma_devices
from gdskit.probe.numa_facts import numa_of
from gdskit.routing import (
    UNKNOWN_PEER, Distance, PeerLink, RouteDecision, RouteWhy, StorageFacts, decide,
)
from gdskit.vocabulary import Routing

if TYPE_CHECKING:
    from gdskit.probe.gpus import GpuFacts
    from gdskit.probe.verdict import Finding, MountCheck


# --------------------------------------------------------------------------- distance
def distance(a: PciPlace | None, a_numa: int | None, b: PciPlace | None, b_numa: int | None) -> Distance:
    """The PCIe distance class between two PCI functions (see :class:`gdskit.routing.Distance`)."""
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
    """The PCI devices under a block device stack (a :class:`gdskit.probe.mounts.BlockNode`)."""
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


# --------------------------------------------------------------------------- peer access
def _fixture_peers(root: SystemRoot) -> dict[frozenset[str], PeerLink] | None:
    raw = root.peer_facts()
    if raw is None:
        return None
    out = {}
    for pair in raw.get("pairs", []):
        a, b = (str(x).lower() for x in pair.get("gpus", ("", "")))
        out[frozenset((a, b))] = PeerLink(pair.get("access"), pair.get("nvlink"))
    return out


def _live_peers(bus_ids: Sequence[str]) -> dict[frozenset[str], PeerLink]:
    """Peer access from the CUDA driver; NVLink from NVML where it answers."""
    from gdskit import cuda  # noqa: PLC0415 - only when there are GPUs to ask about

    out: dict[frozenset[str], PeerLink] = {}
    try:
        ordinal = {cuda.device_pci_bus_id(d): d for d in range(cuda.device_count())}
    except Exception:  # noqa: BLE001 - no driver to ask: not known
        return out
    nvlink = _nvlink_pairs(bus_ids)
    for i, a in enumerate(bus_ids):
        for b in bus_ids[i + 1:]:
            access = None
            if a in ordinal and b in ordinal:
                try:
                    access = cuda.can_access_peer(ordinal[a], ordinal[b]) and cuda.can_access_peer(ordinal[b], ordinal[a])
                except Exception:  # noqa: BLE001
                    access = None
            out[frozenset((a, b))] = PeerLink(access, nvlink.get(frozenset((a, b))))
    return out


def _nvlink_pairs(bus_ids: Sequence[str]) -> dict[frozenset[str], bool]:
    try:
        import pynvml  # noqa: PLC0415 - nvidia-ml-py, optional
    except ImportError:
        return {}
    out: dict[frozenset[str], bool] = {}
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001
        return {}
    try:
        handles = {b: pynvml.nvmlDeviceGetHandleByPciBusId(b.encode()) for b in bus_ids}
        for i, a in enumerate(bus_ids):
            for b in bus_ids[i + 1:]:
                status = pynvml.nvmlDeviceGetP2PStatus(handles[a], handles[b], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                out[frozenset((a, b))] = status == pynvml.NVML_P2P_STATUS_OK
    except Exception:  # noqa: BLE001 - an NVML without the query: not known
        return out
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return out


def peer_links(root: SystemRoot, bus_ids: Sequence[str]) -> dict[frozenset[str], PeerLink]:
    """Each pair of GPUs' peer access, by their PCI addresses (missing pairs: not known)."""
    if len(bus_ids) < 2:
        return {}
    if root.is_live:
        return _live_peers(bus_ids)
    return _fixture_peers(root) or {}


# --------------------------------------------------------------------------- the check's table
POOR = (Distance.CROSS_ROOT_COMPLEX, Distance.CROSS_SOCKET)

PAIRING_FIX = ("Pair drives and NICs with GPUs by slot: move the NVMe drive (or RDMA NIC) to a slot under each "
               "GPU's own PCIe switch or root port, or re-cable the drive backplane to it.")
PEER_FIX = " Meanwhile GPUs with peer access (NVLink) let the nearest one read for the others."

_WHY_WORDS = {
    RouteWhy.OFF: "routing is off",
    RouteWhy.ONE_GPU: "one GPU, nothing to route through",
    RouteWhy.TARGET_NEAREST: "no GPU is nearer the storage",
    RouteWhy.DISTANCE_UNKNOWN: "its place relative to the storage is unknown",
    RouteWhy.NO_PEER_ACCESS: "no nearer GPU reaches it peer to peer",
    RouteWhy.NO_DIRECT_PATH: "no direct path: bounce reads pass through host memory",
    RouteWhy.STORAGE_UNKNOWN: "the storage's PCI device is unknown",
}


def describe(decision: RouteDecision) -> str:
    """One line for people: where reads into the decision's GPU go, and why."""
    if decision.routed:
        link = decision.peer
        over = " over NVLink" if link and link.nvlink else " over PCIe" if link and link.nvlink is False else ""
        if decision.why is RouteWhy.FORCED:
            return f"through GPU {decision.via}{over} (forced: routing=force)"
        return f"through GPU {decision.via}{over} (nearer the storage)"
    return f"straight ({_WHY_WORDS.get(decision.why, decision.why.value)})"


@dataclass
class MountRoutes:
    """The route table of one mount: each GPU's distance to its storage and its route."""

    mountpoint: str
    storage: Storage
    direct: bool
    routes: list[RouteDecision] = field(default_factory=list)

    @property
    def nearest(self) -> tuple[int, ...]:
        return self.routes[0].nearest if self.routes else ()

    @property
    def nearest_distance(self) -> Distance:
        return self.routes[0].nearest_distance if self.routes else Distance.UNKNOWN

    @property
    def applies(self) -> bool:
        return any(r.routed for r in self.routes)

    @property
    def poor_pairing(self) -> bool:
        """Some GPU's direct path to this storage crosses root complexes or sockets."""
        return self.direct and any(r.target_distance in POOR for r in self.routes)

    def to_dict(self, gpu_ids: dict[int, str]) -> dict[str, Any]:
        return {
            "mountpoint": self.mountpoint, "storage": self.storage.to_dict(),
            "storage_unknown": self.storage.why_unknown or None, "direct": self.direct,
            "nearest_gpus": list(self.nearest), "nearest_distance": self.nearest_distance.value,
            "applies": self.applies, "poor_pairing": self.poor_pairing,
            "gpus": [{**r.to_dict(), "pci_bus_id": gpu_ids.get(r.target)} for r in self.routes],
        }


@dataclass
class RouteTable:
    """``gdskit check``'s route table: the policy, the GPUs' peer links, each mount's routes."""

    policy: Routing
    gpus: dict[int, str]                                  # GPU number (NVML's) -> PCI address
    peers: dict[tuple[int, int], PeerLink]
    mounts: list[MountRoutes]

    @property
    def why(self) -> RouteWhy | None:
        """Why routing is a no-op on the whole machine, if it is."""
        if self.policy is Routing.OFF:
            return RouteWhy.OFF
        if len(self.gpus) < 2:
            return RouteWhy.ONE_GPU
        return None

    @property
    def applies(self) -> bool:
        return any(m.applies for m in self.mounts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy.value, "gpu_count": len(self.gpus), "applies": self.applies,
            "why": self.why.value if self.why else None,
            "peers": [{"gpus": [a, b], **link.to_dict()} for (a, b), link in sorted(self.peers.items())],
            "mounts": [m.to_dict(self.gpus) for m in self.mounts],
        }


def mount_storage(root: SystemRoot, mc: MountCheck, topo: Topology) -> Storage:
    if mc.network:
        return network_storage(mc.fstype, mc.rdma, [p for p in topo.peers if p.kind == "rdma"])
    return block_storage(root, mc.device, topo.peers)


def route_table(root: SystemRoot, gpu: GpuFacts, topo: Topology, mounts: Sequence[MountCheck],
                policy: Routing) -> RouteTable:
    """Every checked mount's routes, decided as the engine decides them."""
    gpus = sorted(gpu.gpus, key=lambda g: g.index)
    ids = {g.index: g.pci_bus_id for g in gpus}
    links = peer_links(root, [g.pci_bus_id for g in gpus])
    peers = {(a.index, b.index): links.get(frozenset((a.pci_bus_id, b.pci_bus_id)), UNKNOWN_PEER)
             for i, a in enumerate(gpus) for b in gpus[i + 1:]}

    def peer(a: int, b: int) -> PeerLink:
        return peers.get((min(a, b), max(a, b)), UNKNOWN_PEER)

    places = {g.index: (pci_place(root, g.pci_bus_id), g.numa_node) for g in gpus}
    out = []
    for mc in mounts:
        storage = mount_storage(root, mc, topo)
        direct = mc.verdict == "direct"
        distances = {g: storage.distance_to(*places[g]) if storage.devices else Distance.UNKNOWN for g in places}
        routes = [decide(g, distances, peer, policy, len(gpus), direct=direct, storage_known=bool(storage.devices))
                  for g in sorted(places)]
        out.append(MountRoutes(mc.mountpoint, storage, direct, routes))
    return RouteTable(policy, ids, peers, out)


def route_findings(table: RouteTable) -> list[Finding]:
    """A finding for each mount whose storage sits poorly for some GPU, with the fix."""
    from gdskit.probe.verdict import Finding  # noqa: PLC0415 - the engine's fact source needs none of it

    out: list[Finding] = []
    if len(table.gpus) < 2:
        return out  # one GPU: the topology findings already name a far drive or NIC
    for m in table.mounts:
        if not m.poor_pairing:
            continue  # without a direct path the bytes pass through host memory wherever the drive sits
        far = [r for r in m.routes if r.target_distance in POOR]
        names = ", ".join(d.name for d in m.storage.devices)
        routed = [r for r in far if r.routed]
        stuck = [r for r in far if not r.routed]
        parts = [f"GPU {r.target} ({r.target_distance.value})" for r in far]
        title = f"{names} sits far from {', '.join(parts)}"
        if routed and not stuck:
            consequence = ("Direct reads into " + ", ".join(f"GPU {r.target}" for r in routed)
                           + " cross the CPU interconnect; gdskit routes them through "
                           + ", ".join(f"GPU {r.via}" for r in routed) + " and a peer-to-peer copy.")
            severity = "info"
        else:
            consequence = ("Reads into " + ", ".join(f"GPU {r.target}" for r in stuck)
                           + " cross the CPU interconnect at reduced bandwidth; no route around it ("
                           + ", ".join(sorted({r.why.value for r in stuck})) + ").")
            severity = "warning"
        fix = PAIRING_FIX + (PEER_FIX if any(r.why is RouteWhy.NO_PEER_ACCESS for r in stuck) else "")
        out.append(Finding("routing.poor_pairing", severity, f"mount {m.mountpoint}", title, consequence, fix))
    return out
