"""NUMA placement of the bounce path: pinned staging on the target GPU's NUMA node, and the
workers that fill it running on that node's CPUs.

On a machine with several sockets, a GPU hangs off one of them. A bounce read moves each byte
through host memory more than once (the read into the stage, the copy to the GPU), so a stage
on the other socket's memory sends every byte across the CPUs' interconnect twice. The lanes
of a device (:mod:`gdskit.engine.pool`) are therefore made with the calling thread's memory policy
set to prefer the GPU's node (``set_mempolicy(MPOL_PREFERRED)``: where that node is full the
kernel takes another, so nothing fails for want of it), and a worker holding such a lane runs
on that node's CPUs (``sched_setaffinity``) until it gives the lane back.

A process whose memory policy or CPU affinity someone chose already (``numactl``, ``taskset``)
keeps it: its policy is left alone, its affinity only narrowed where it overlaps the node.
Where the node is unknown (a VM's ``numa_node`` of -1, no sysfs) nothing changes.

Where each GPU sits is a machine fact (:mod:`gdskit.machine.numa`); :func:`use_facts` is the
test seam that puts another source in its place.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import gdskit.engine.cuda as cuda
from gdskit.engine.residency import libc
from gdskit.machine.numa import UNKNOWN, NumaPlace, live_numa_place, parse_cpulist


#: ``source(pci_bus_id)``: the NUMA place of the GPU at that PCI address.
PlaceSource = Callable[[str], NumaPlace]



def _live_place(pci_bus_id: str) -> NumaPlace:
    """The GPU's place read from this machine's sysfs (:mod:`gdskit.machine.numa`)."""
    return live_numa_place(pci_bus_id)


_source: PlaceSource | None = _live_place
_places: dict[int, NumaPlace] = {}
_lock = threading.Lock()
_asking = threading.Lock()  # a first call's lanes ask at once: one reads the place, the others wait


class _Restore:
    def __init__(self, before: PlaceSource | None) -> None:
        self._before = before

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        use_facts(self._before)


def use_facts(source: PlaceSource | None) -> _Restore:
    """Take the GPUs' NUMA places from ``source`` from now on (``None``: none known); as a
    context manager, put the previous source back on exit. The test seam."""
    global _source
    with _lock:
        before, _source = _source, source
        _places.clear()
    return _Restore(before)


def place_of(device: int) -> NumaPlace:
    """Where GPU ``device`` (a CUDA number) sits, asked once per device."""
    found = _places.get(device)
    if found is not None:
        return found
    with _asking:
        found = _places.get(device)
        if found is not None:
            return found
        source = _source
        place = UNKNOWN
        if source is not None:
            try:
                place = source(cuda.device_pci_bus_id(device))
            except Exception:  # noqa: BLE001 - a place that cannot be read: not known
                place = UNKNOWN
        _places[device] = place
    return place


def _leave_driver() -> None:
    """Another CUDA driver numbers its GPUs its own way: their places are asked again."""
    with _lock:
        _places.clear()


cuda.on_driver_change(_leave_driver)



# --------------------------------------------------------------------------- memory policy
MPOL_DEFAULT, MPOL_PREFERRED = 0, 1
_SYSCALLS = {"x86_64": (238, 239), "aarch64": (237, 236)}  # (set_mempolicy, get_mempolicy)
_MASK_WORDS = 16                                            # room for 1024 nodes
_ULONG_BITS = 8 * ctypes.sizeof(ctypes.c_ulong)


def _syscalls() -> tuple[int, int] | None:
    return _SYSCALLS.get(platform.machine())


def current_policy() -> tuple[int, frozenset[int]] | None:
    """The calling thread's memory policy mode and nodes; None where it cannot be asked."""
    calls = _syscalls()
    if calls is None:
        return None
    mode = ctypes.c_int(0)
    mask = (ctypes.c_ulong * _MASK_WORDS)()
    if libc.syscall(calls[1], ctypes.byref(mode), mask, ctypes.c_ulong(_MASK_WORDS * _ULONG_BITS),
                    ctypes.c_void_p(0), ctypes.c_ulong(0)) != 0:
        return None
    nodes = frozenset(i * _ULONG_BITS + b for i, w in enumerate(mask) for b in range(_ULONG_BITS) if w >> b & 1)
    return mode.value, nodes


def _set_policy(mode: int, nodes: frozenset[int]) -> bool:
    calls = _syscalls()
    if calls is None:
        return False
    mask = (ctypes.c_ulong * _MASK_WORDS)()
    for n in nodes:
        if not 0 <= n < _MASK_WORDS * _ULONG_BITS:
            return False
        mask[n // _ULONG_BITS] |= 1 << (n % _ULONG_BITS)
    arg = mask if nodes else None
    # maxnode counts one past the last bit the kernel reads.
    return libc.syscall(calls[0], ctypes.c_int(mode), arg, ctypes.c_ulong(_MASK_WORDS * _ULONG_BITS + 1)) == 0


@contextlib.contextmanager
def memory_on(node: int | None) -> Iterator[bool]:
    """Memory the calling thread faults in inside the block comes from ``node`` where it can;
    yields whether the policy was set. A thread with a policy of its own keeps it."""
    before = current_policy() if node is not None else None
    if before is None or before[0] != MPOL_DEFAULT or not _set_policy(MPOL_PREFERRED, frozenset({node})):
        yield False
        return
    try:
        yield True
    finally:
        _set_policy(MPOL_DEFAULT, frozenset())


# --------------------------------------------------------------------------- CPU affinity
def run_on(cpus: frozenset[int]) -> frozenset[int] | None:
    """Run the calling thread on ``cpus`` (those of them it may use); returns the affinity to
    put back with :func:`restore_cpus`, or None where nothing changed."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        before = frozenset(os.sched_getaffinity(0))
        mine = before & cpus
        if not mine or mine == before:
            return None
        os.sched_setaffinity(0, mine)
    except OSError:
        return None
    return before


def restore_cpus(before: frozenset[int] | None) -> None:
    if before is not None:
        try:
            os.sched_setaffinity(0, before)
        except OSError:
            pass
