"""Facts about the machine a benchmark ran on, so results can be compared later.

Everything here is optional and never raises: a fact that cannot be read is
``None``. GPU facts come from NVML (``pynvml``), the libcufile version from
``cuda.bindings.cufile``; both are imported lazily.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from typing import Any

import gdskit


@dataclasses.dataclass(frozen=True)
class MountInfo:
    """The mount a path lives on (one line of ``/proc/self/mountinfo``)."""

    mount_point: str
    fstype: str
    source: str        # e.g. /dev/nvme0n1p1, or the server:/export of NFS
    dev: str           # "major:minor" of the filesystem


def _mount_info(m: Any) -> MountInfo:
    return MountInfo(mount_point=m.mountpoint, fstype=m.fstype, source=m.source, dev=f"{m.major}:{m.minor}")


def parse_mountinfo(text: str) -> list[MountInfo]:
    """Parse the text of ``/proc/self/mountinfo`` (malformed lines are skipped), as ``gdskit check`` does."""
    from gdskit.machine.mounts import parse_mountinfo as parse  # noqa: PLC0415 - import time

    return [_mount_info(m) for m in parse(text)]


def mount_for(path: str, mountinfo_text: str | None = None) -> MountInfo | None:
    """The mount holding ``path`` (the longest mount point that is a prefix; last one wins)."""
    from gdskit.machine.mounts import mount_of  # noqa: PLC0415 - import time

    m = mount_of(path, mountinfo_text)
    return None if m is None else _mount_info(m)


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def block_device_facts(dev: str, sys_root: str = "/sys") -> dict[str, Any]:
    """Model and queue facts of the block device ``major:minor`` (partitions resolved to the disk)."""
    facts: dict[str, Any] = {}
    base = os.path.join(sys_root, "dev", "block", dev)
    try:
        real = os.path.realpath(base)
    except OSError:
        return facts
    if not os.path.exists(real):
        return facts
    disk = real
    if os.path.exists(os.path.join(real, "partition")):
        disk = os.path.dirname(real)
    facts["name"] = os.path.basename(disk)
    facts["model"] = _read(os.path.join(disk, "device", "model"))
    rot = _read(os.path.join(disk, "queue", "rotational"))
    facts["rotational"] = None if rot is None else rot == "1"
    facts["scheduler"] = _read(os.path.join(disk, "queue", "scheduler"))
    slaves = os.path.join(disk, "slaves")
    facts["raid_or_multipath"] = bool(os.path.isdir(slaves) and os.listdir(slaves))
    return facts


def gpu_facts(index: int) -> dict[str, Any]:
    """Name, driver and PCIe facts of GPU ``index`` (NVML, asked the way ``gdskit check`` asks);
    empty without NVML."""
    from gdskit.machine.gpus import query_nvml  # noqa: PLC0415 - test seam

    raw = query_nvml()
    if not raw.get("available"):
        return {}
    gpus = raw.get("gpus", [])
    facts: dict[str, Any] = {"count": len(gpus), "driver": raw.get("driver_version")}
    if index < len(gpus):
        g = gpus[index]
        facts.update(index=index, name=g.get("name"), pcie_gen=g.get("pcie_gen"), pcie_width=g.get("pcie_width"),
                     bar1_total_bytes=g.get("bar1_total"))
    return facts


def cufile_version() -> str | None:
    """libcufile's version as ``major.minor.patch``, or None when it cannot be loaded."""
    try:
        from cuda.bindings import cufile  # noqa: PLC0415 - import time
        v = int(cufile.get_version())
    except Exception:
        return None
    from gdskit.machine.gds import cufile_version_text  # noqa: PLC0415 - import time

    return cufile_version_text(v)


@dataclasses.dataclass(frozen=True)
class MachineFacts:
    """What a result depends on besides the parameters."""

    hostname: str | None
    kernel: str | None
    cpu_model: str | None
    cpu_count: int | None
    memory_bytes: int | None
    python: str
    gdskit_version: str | None
    gpu: dict[str, Any]
    cufile_version: str | None
    filesystem: str | None
    mount_point: str | None
    mount_source: str | None
    block_device: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _cpu_model() -> str | None:
    text = _read("/proc/cpuinfo") or ""
    for line in text.splitlines():
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or None


def _memory() -> int | None:
    try:
        import psutil  # noqa: PLC0415 - import time
        return int(psutil.virtual_memory().total)
    except Exception:
        return None


def collect(target: str | None, gpu_index: int | None = 0) -> MachineFacts:
    """Gather the facts for a run on ``target`` (a file or directory) and GPU ``gpu_index``."""
    try:
        version = getattr(gdskit, "__version__", None)
    except Exception:
        version = None
    mount = mount_for(target) if target else None
    dev = mount.dev if mount else None
    try:
        uname = platform.uname()
        host, kernel = uname.node, uname.release
    except Exception:
        host = kernel = None
    return MachineFacts(
        hostname=host, kernel=kernel, cpu_model=_cpu_model(), cpu_count=os.cpu_count(),
        memory_bytes=_memory(), python=platform.python_version(), gdskit_version=version,
        gpu=gpu_facts(gpu_index) if gpu_index is not None else {},
        cufile_version=cufile_version() if gpu_index is not None else None,
        filesystem=mount.fstype if mount else None,
        mount_point=mount.mount_point if mount else None,
        mount_source=mount.source if mount else None,
        block_device=block_device_facts(dev) if dev else {},
    )
