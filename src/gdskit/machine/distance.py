"""What the engine's routing knows of the machine: how far each GPU sits from a file's storage
and whether two GPUs reach each other's memory. Plain types, read by :mod:`gdskit.machine.storage`
and decided on by :mod:`gdskit.engine.gpu_routing`."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class Distance(str, enum.Enum):
    """How far a GPU and a storage device (or NIC, or another GPU) are apart in the PCIe tree,
    nearest first (the classes of ``nvidia-smi topo -m``: PIX, PXB, PHB, NODE, SYS)."""

    SAME_SWITCH = "same-switch"                # one PCIe switch between them
    SAME_ROOT_PORT = "same-root-port"          # several switches, one root port
    SAME_ROOT_COMPLEX = "same-root-complex"    # through the host bridge of one root complex
    CROSS_ROOT_COMPLEX = "cross-root-complex"  # between root complexes of one socket (or NUMA unknown)
    CROSS_SOCKET = "cross-socket"              # between NUMA nodes, over the CPUs' interconnect
    UNKNOWN = "unknown"                        # a place is not known

    @property
    def rank(self) -> int | None:
        """0 nearest; ``None`` for :attr:`UNKNOWN`, which compares with nothing."""
        return None if self is Distance.UNKNOWN else _RANKS[self]

    def __str__(self) -> str:
        return self.value


_RANKS = {d: i for i, d in enumerate(Distance) if d.value != "unknown"}


@dataclass(frozen=True)
class PeerLink:
    """Whether two GPUs reach each other's memory directly; ``None``: not known."""

    access: bool | None              # the driver: cuDeviceCanAccessPeer, both ways
    nvlink: bool | None = None       # NVML: the link is NVLink (else PCIe), where asked

    def to_dict(self) -> dict[str, Any]:
        return {"access": self.access, "nvlink": self.nvlink}


UNKNOWN_PEER = PeerLink(None, None)


@dataclass(frozen=True)
class StorageFacts:
    """Where a file's storage sits: its PCI devices (NVMe controllers, the disk's controller,
    RDMA NICs) and each GPU's distance to it, by the GPU's PCI address (sysfs form)."""

    devices: tuple[str, ...] = ()
    distances: Mapping[str, Distance] = field(default_factory=dict)
    detail: str = ""

    @property
    def known(self) -> bool:
        return bool(self.devices)
