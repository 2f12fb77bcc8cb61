"""Dynamic routing: whether a read into one GPU goes through another, nearer the storage.

When the target GPU sits far from a file's storage device in the PCIe tree (behind another
root complex, on another socket) and a GPU strictly nearer that device reaches the target
peer to peer (NVLink or PCIe P2P), the bytes are read into the nearer GPU and copied device
to device to the target (:mod:`gdskit.engine.via_gpu` does the reading). This module holds the
facts' types, the one decision (:func:`decide`), and what the engine asks per file and GPU
(:func:`route_for_read`).

The facts about the machine are read by :mod:`gdskit.machine.storage` (:func:`use_facts` is
the test seam that puts another source in its place); the engine decides, it reads no sysfs.
"""

from __future__ import annotations

import enum
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import gdskit.engine.cuda as cuda
from gdskit.engine.backends.base import OpenFile
from gdskit.engine.buffers import BufferView
from gdskit.engine.cuda import MemoryKind
from gdskit.machine.distance import UNKNOWN_PEER, Distance, PeerLink, StorageFacts
from gdskit.vocabulary import Routing


class RouteWhy(str, enum.Enum):
    """Why a read into a GPU is routed, or is not."""

    NEARER_GPU = "nearer_gpu"              # routed: a GPU strictly nearer the storage reaches the target
    FORCED = "forced"                      # routed: settings.routing is force
    OFF = "off"                            # settings.routing is off
    ONE_GPU = "one_gpu"                    # fewer than two GPUs: nothing to route through
    TARGET_NEAREST = "target_nearest"      # no GPU is strictly nearer the storage than the target
    DISTANCE_UNKNOWN = "distance_unknown"  # the target's place relative to the storage is not known
    NO_PEER_ACCESS = "no_peer_access"      # the nearer GPUs cannot reach the target peer to peer
    NO_DIRECT_PATH = "no_direct_path"      # the bytes pass through host memory anyway (bounce path)
    STORAGE_UNKNOWN = "storage_unknown"    # no PCI storage device or NIC found under the file

    @property
    def routed(self) -> bool:
        return self in (RouteWhy.NEARER_GPU, RouteWhy.FORCED)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class RouteDecision:
    """The route of reads into GPU ``target`` from one storage device: through ``via`` (a GPU)
    or straight (``via`` None), and why. ``distances`` holds every GPU's distance to the storage."""

    target: int
    via: int | None
    why: RouteWhy
    distances: tuple[tuple[int, Distance], ...] = ()
    peer: PeerLink | None = None     # between target and via (routed), or the nearer GPU refused

    @property
    def routed(self) -> bool:
        return self.via is not None

    @property
    def target_distance(self) -> Distance:
        return dict(self.distances).get(self.target, Distance.UNKNOWN)

    @property
    def nearest(self) -> tuple[int, ...]:
        """The GPUs nearest the storage (several on a tie; none when no distance is known)."""
        known = [(d.rank, g) for g, d in self.distances if d.rank is not None]
        if not known:
            return ()
        best = min(r for r, _g in known)
        return tuple(sorted(g for r, g in known if r == best))

    @property
    def nearest_distance(self) -> Distance:
        near = self.nearest
        return dict(self.distances)[near[0]] if near else Distance.UNKNOWN

    def to_dict(self) -> dict[str, Any]:
        return {"gpu": self.target, "distance": self.target_distance.value, "routed": self.routed,
                "via": self.via, "why": self.why.value, "peer": self.peer.to_dict() if self.peer else None}


PeerFacts = Callable[[int, int], PeerLink]


def decide(target: int, distances: Mapping[int, Distance], peers: PeerFacts, policy: Routing,
           gpu_count: int | None = None, *, direct: bool = True, storage_known: bool = True) -> RouteDecision:
    """The one routing decision (the engine's and ``gdskit check``'s).

    Parameters
    ----------
    target:
        The GPU the bytes are for.
    distances:
        Each GPU's distance to the storage device (every GPU of the machine; ``UNKNOWN`` allowed).
    peers:
        ``peers(a, b)``: whether GPUs ``a`` and ``b`` reach each other's memory directly.
    policy:
        ``auto``: through the nearest GPU strictly nearer than the target that reaches it peer
        to peer; ``off``: never; ``force``: through the nearest other GPU whenever there are two
        (ties and unknown distances broken by GPU number, peer-capable GPUs first).
    gpu_count:
        GPUs on the machine (default: those in ``distances``).
    direct:
        Whether the bytes would reach the target along the direct path (cuFile). Without one,
        ``auto`` does not route: a bounce read's bytes pass through host memory, where the
        storage's distance to the GPU does not decide their speed.
    storage_known:
        Whether the storage's PCI devices are known at all (``auto`` does not route otherwise).
    """
    table = tuple(sorted(distances.items()))
    count = len(table) if gpu_count is None else gpu_count
    if policy is Routing.OFF:
        return RouteDecision(target, None, RouteWhy.OFF, table)
    if count < 2:
        return RouteDecision(target, None, RouteWhy.ONE_GPU, table)
    mine = distances.get(target, Distance.UNKNOWN)
    if policy is Routing.AUTO and not direct:
        return RouteDecision(target, None, RouteWhy.NO_DIRECT_PATH, table)
    if policy is Routing.AUTO and not storage_known:
        return RouteDecision(target, None, RouteWhy.STORAGE_UNKNOWN, table)
    if policy is Routing.FORCE:
        others = [g for g in range(count) if g != target]

        def order(g: int) -> tuple[int, int, int]:
            rank = distances.get(g, Distance.UNKNOWN).rank
            return (0 if peers(target, g).access else 1, len(Distance) if rank is None else rank, g)

        via = min(others, key=order)
        return RouteDecision(target, via, RouteWhy.FORCED, table, peers(target, via))
    if mine.rank is None:
        return RouteDecision(target, None, RouteWhy.DISTANCE_UNKNOWN, table)
    nearer = sorted((d.rank, g) for g, d in distances.items() if d.rank is not None and d.rank < mine.rank)
    if not nearer:
        return RouteDecision(target, None, RouteWhy.TARGET_NEAREST, table)
    refused: PeerLink | None = None
    for _rank, g in nearer:
        link = peers(target, g)
        if link.access:
            return RouteDecision(target, g, RouteWhy.NEARER_GPU, table, link)
        refused = refused or link
    return RouteDecision(target, None, RouteWhy.NO_PEER_ACCESS, table, refused)


# --------------------------------------------------------------------------- facts from above
#: ``source(st_dev, gpu_bus_ids)``: the storage facts of a file on device number ``st_dev``
#: (``os.stat().st_dev``), with distances to the GPUs at ``gpu_bus_ids``.
FactSource = Callable[[int, tuple[str, ...]], StorageFacts]



def _live_facts(st_dev: int, gpu_bus_ids: tuple[str, ...]) -> StorageFacts:
    """The file's storage facts read from this machine's sysfs (:mod:`gdskit.machine.storage`)."""
    from gdskit.machine.storage import live_storage_facts  # noqa: PLC0415 - import time

    return live_storage_facts(st_dev, gpu_bus_ids)


_source: FactSource | None = _live_facts
_lock = threading.Lock()
_version = 0                                   # bumped by use_facts: per-file caches start over
_bus_ids: tuple[str, ...] | None = None
_peer_cache: dict[tuple[int, int], PeerLink] = {}


class _Restore:
    def __init__(self, before: FactSource | None) -> None:
        self._before = before

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        use_facts(self._before)


def use_facts(source: FactSource | None) -> _Restore:
    """Take the machine's storage facts from ``source`` from now on (``None``: none known, so
    ``auto`` never routes); as a context manager, put the previous source back on exit. Also
    forgets what was learnt from the driver (GPU addresses, peer access): the test seam."""
    global _source, _version, _bus_ids
    with _lock:
        before = _source
        _source = source
        _version += 1
        _bus_ids = None
        _peer_cache.clear()
    return _Restore(before)


def fact_source() -> FactSource | None:
    return _source


def _leave_driver() -> None:
    """Before gdskit moves to another CUDA driver: what was learnt of this one (its GPUs'
    addresses, their peer access, the decisions made with them) is forgotten."""
    use_facts(_source)


cuda.on_driver_change(_leave_driver)


def _bus_id(device: int) -> str:
    try:
        return cuda.device_pci_bus_id(device)
    except Exception:  # noqa: BLE001 - an address the driver cannot give: that GPU's place is unknown
        return ""


def gpu_bus_ids() -> tuple[str, ...]:
    """Every GPU's PCI address, by CUDA device number (asked of the driver once; "" where it
    cannot say)."""
    global _bus_ids
    found = _bus_ids
    if found is None:
        found = tuple(_bus_id(d) for d in range(cuda.device_count()))
        with _lock:
            _bus_ids = found
    return found


def peer_link(a: int, b: int) -> PeerLink:
    """Whether GPUs ``a`` and ``b`` reach each other's memory directly (the driver, both ways)."""
    key = (min(a, b), max(a, b))
    link = _peer_cache.get(key)
    if link is None:
        try:
            link = PeerLink(cuda.can_access_peer(a, b) and cuda.can_access_peer(b, a))
        except Exception:  # noqa: BLE001 - a driver that cannot say: not known, so never used
            link = UNKNOWN_PEER
        _peer_cache[key] = link
    return link


class _FileRoutes:
    """One file's storage facts and decisions, worked out on first use."""

    def __init__(self, f: OpenFile) -> None:
        self._f = f
        self._lock = threading.Lock()
        self._version = -1
        self._facts: StorageFacts | None = None
        self._decisions: dict[tuple[int, Routing, bool], RouteDecision] = {}

    def facts(self) -> StorageFacts:
        with self._lock:
            if self._facts is None or self._version != _version:
                self._version = _version
                self._decisions.clear()
                source = _source
                if source is None:
                    self._facts = StorageFacts(detail="no fact source")
                else:
                    try:
                        self._facts = source(os.fstat(self._f.fd).st_dev, gpu_bus_ids())
                    except Exception as exc:  # noqa: BLE001 - facts that cannot be read: not known
                        self._facts = StorageFacts(detail=f"{type(exc).__name__}: {exc}")
            return self._facts

    def decision(self, target: int, policy: Routing, direct: bool) -> RouteDecision:
        if policy is Routing.AUTO and not direct:  # decided without reading any fact
            return decide(target, {}, peer_link, policy, cuda.device_count(), direct=False)
        facts = self.facts()
        key = (target, policy, direct)
        found = self._decisions.get(key)
        if found is not None:
            return found
        ids = gpu_bus_ids()
        found = decide(target, distances_by_gpu(facts, ids), peer_link, policy, len(ids), direct=direct,
                       storage_known=facts.known)
        with self._lock:
            self._decisions[key] = found
        return found


def route_for_read(f: OpenFile, target: BufferView, direct: bool, policy: Routing) -> RouteDecision | None:
    """The route of a read from ``f`` into the device memory ``target``; ``None`` when it goes
    straight there without asking anything (routing off, one GPU, managed memory: the common
    case costs nothing).

    ``direct``: whether the engine would read these bytes into the target along the direct
    path (cuFile). Without one, ``auto`` does not route: a bounce read's bytes pass through
    host memory, where the storage's distance to the GPU does not decide their speed.
    """
    if policy is Routing.OFF or target.kind is not MemoryKind.DEVICE or target.device is None:
        return None
    if cuda.device_count() < 2:
        return None
    return f.routing.get(lambda: _FileRoutes(f)).decision(target.device, policy, direct)


def distances_by_gpu(facts: StorageFacts, bus_ids: Iterable[str]) -> dict[int, Distance]:
    """``facts``' distances by GPU number, for GPUs listed in ``bus_ids`` order."""
    return {g: facts.distances.get(bus, Distance.UNKNOWN) for g, bus in enumerate(bus_ids)}
