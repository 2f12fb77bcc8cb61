"""Which NUMA node a PCI device sits on, and that node's CPUs, from sysfs.

Its own module, apart from :mod:`gdskit.probe.routes`: the engine asks it as the first device
lane is made, on the way to a first read, where the storage probes' imports (mounts, topology)
would cost more than the answer (benchmarks/RESULTS.md, "A first load's lanes").
"""

from __future__ import annotations

from gdskit.numa import UNKNOWN, NumaPlace, parse_cpulist
from gdskit.probe.root import SystemRoot


def numa_of(root: SystemRoot, bdf: str) -> int | None:
    """The NUMA node of the PCI function ``bdf``, or None where sysfs does not say."""
    try:
        v = int(root.read_value(f"/sys/bus/pci/devices/{bdf}/numa_node") or "")
    except ValueError:
        return None
    return v if v >= 0 else None


def numa_place(root: SystemRoot, bdf: str) -> NumaPlace:
    """The NUMA node of the PCI function ``bdf`` and that node's CPUs (sysfs)."""
    node = numa_of(root, bdf)
    if node is None:
        return UNKNOWN
    return NumaPlace(node, parse_cpulist(root.read_value(f"/sys/devices/system/node/node{node}/cpulist") or ""))


def live_numa_place(bdf: str) -> NumaPlace:
    """The engine's NUMA fact source on the running machine (gdskit.numa)."""
    return numa_place(SystemRoot("/"), bdf)
