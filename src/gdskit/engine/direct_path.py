"""Is there a direct storage-to-GPU route on this machine at all? (asked once per process)

The engine's ``auto`` mode asks this before it tries cuFile: without nvidia-fs
and without upstream PCI P2PDMA that cuFile is configured to use, cuFile can
only run its POSIX compat mode, which gdskit's own bounce path beats. The facts
come from the same readers ``gdskit check`` uses (gdskit.machine.gds); the check
explains them at length.

Cheap facts first: /proc/kallsyms (tens of milliseconds to read) is only
scanned when cufile.json turns P2PDMA on, so a first read does not pay for it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from gdskit.vocabulary import Path, Reason


@dataclass(frozen=True)
class DirectRoute:
    """``route`` is the direct path cuFile would take (``None``: none), ``reason`` why not."""

    route: Path | None
    reason: Reason | None
    nvidia_fs: bool
    p2pdma: bool
    udev: bool


def udev_database_present() -> bool:
    from gdskit.machine.gds import udev  # noqa: PLC0415 - import time
    from gdskit.machine.root import SystemRoot  # noqa: PLC0415 - import time

    return udev(SystemRoot("/")).database


_route_lock = threading.Lock()
_route: DirectRoute | None = None
_overrides: list[override] = []  # the one made last holds


def direct_route() -> DirectRoute:
    """The direct route of this machine, worked out once per process (or the one an
    :func:`override` names).

    Threads that ask while it is being worked out (a loader's background warm-up and its
    first reads) wait for that answer instead of each reading the facts again.
    """
    global _route
    with _route_lock:
        if _overrides:
            return _overrides[-1].route
        if _route is None:
            from gdskit.machine.root import SystemRoot  # noqa: PLC0415 - import time

            _route = route_of(SystemRoot("/"))
        return _route


class override:  # noqa: N801 - used like a function, as settings.set is
    """Make every part of gdskit (routing, the cuFile backend's evidence, the benchmark) see
    ``route`` as this machine's direct route: from now on, or, used as a context manager,
    until the block ends.

    For tests and fault injection (``gdskit accept``'s "a direct route exists but cuFile
    refuses the file"): the machine's facts are not read while an override holds.
    """

    def __init__(self, route: DirectRoute) -> None:
        if not isinstance(route, DirectRoute):
            raise TypeError(f"override takes a DirectRoute, not {type(route).__name__}")
        self.route = route
        with _route_lock:
            _overrides.append(self)

    def __enter__(self) -> DirectRoute:
        return self.route

    def __exit__(self, *exc: object) -> None:
        with _route_lock:
            if self in _overrides:  # wherever it is: an override made later without ``with`` stays
                _overrides.remove(self)


def route_of(root: Any) -> DirectRoute:
    """The direct route of the machine seen through ``root`` (a :class:`gdskit.machine.root.SystemRoot`)."""
    from gdskit.machine import gds  # noqa: PLC0415 - import time

    nvfs = gds.nvidia_fs(root, gds.loaded_modules(root)).loaded
    config = gds.cufile_config(root)
    has_udev = gds.udev(root).database
    p2p = False
    if not nvfs and config.use_pci_p2pdma and not config.force_compat_mode:
        p2p = bool(gds.kallsyms_has(root, "p2pdma_pgmap_ops"))
    if config.force_compat_mode:
        return DirectRoute(None, Reason.FORCED_BY_SETTING, nvfs, p2p, has_udev)
    if nvfs:
        return DirectRoute(Path.CUFILE_NVFS, None if has_udev else Reason.UDEV_MISSING, nvfs, p2p, has_udev)
    if p2p:
        return DirectRoute(Path.CUFILE_P2PDMA, None if has_udev else Reason.UDEV_MISSING, nvfs, p2p, has_udev)
    return DirectRoute(None, Reason.NVIDIA_FS_MISSING, nvfs, p2p, has_udev)
