"""Which NUMA node a PCI device sits on, and that node's CPUs, from sysfs.

Its own module, apart from :mod:`gdskit.machine.storage`: the engine asks it as the first device
lane is made, on the way to a first read, where the storage readers' imports (mounts, topology)
would cost more than the answer (benchmarks/RESULTS.md, "A first load's lanes").
"""

from __future__ import annotations

from dataclasses import dataclass

from gdskit.machine.root import SystemRoot


@dataclass(frozen=True)
class NumaPlace:
    """A GPU's NUMA node and that node's CPUs (``node`` None: not known)."""

    node: int | None
    cpus: frozenset[int] = frozenset()


UNKNOWN = NumaPlace(None)


def parse_cpulist(text: str) -> frozenset[int]:
    """``"0-3,8-11"`` (sysfs ``cpulist``) as a set of CPU numbers; malformed parts are skipped."""
    out: set[int] = set()
    for part in text.strip().split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            if sep:
                out.update(range(int(lo), int(hi) + 1))
            elif lo:
                out.add(int(lo))
        except ValueError:
            continue
    return frozenset(out)


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
    """The engine's NUMA fact source on the running machine (gdskit.engine.numa)."""
    return numa_place(SystemRoot("/"), bdf)
