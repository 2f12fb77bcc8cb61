"""The route table ``gdskit check`` prints: for each mount, how far each GPU sits from its
storage (:mod:`gdskit.machine.storage`), which GPUs reach each other peer to peer, and the
engine's own decision for each GPU.

The distance between two PCI functions comes from where they hang in the PCIe tree
(:class:`gdskit.machine.topology.PciPlace`) and their NUMA nodes; the decision that uses it is
:func:`gdskit.engine.gpu_routing.decide`, the engine's own.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gdskit.machine.mounts import NETWORK_FS, block_node, device_name, mount_block_tree, network_rdma, read_mounts
from gdskit.machine.root import SystemRoot
from gdskit.machine.topology import PciPlace, PeerDevice, Topology, pci_place, rdma_devices
from gdskit.machine.numa import numa_of
from gdskit.engine import RouteDecision, RouteWhy, cuda_layer, decide
from gdskit.machine.distance import UNKNOWN_PEER, Distance, PeerLink
from gdskit.machine.storage import Storage, block_storage, is_network, network_storage, storage_of_device
from gdskit.vocabulary import Routing

if TYPE_CHECKING:
    from gdskit.machine.gpus import GpuFacts
    from gdskit.probe.verdict import Finding, MountCheck


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
    cuda = cuda_layer()

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
        import pynvml  # noqa: PLC0415 - import time
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
    from gdskit.probe.verdict import Finding  # noqa: PLC0415 - import time

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
