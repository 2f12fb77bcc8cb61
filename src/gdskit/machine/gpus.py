"""GPU facts: NVML (nvidia-ml-py) for the devices, /proc and /sys for the rest.

NVML is imported lazily so that inspection works on a machine without a driver.
The raw NVML facts are a plain dict (``query_nvml``); fixtures supply the same
dict as ``.gdskit-fixture/nvml.json``::

    {"available": true, "error": null, "driver_version": "570.86.15",
     "gpus": [{"index": 0, "name": "NVIDIA H200", "pci_bus_id": "00000000:17:00.0",
               "memory_total": ..., "bar1_total": ..., "bar1_used": ...,
               "pcie_gen": 5, "pcie_width": 16, "pcie_max_gen": 5, "pcie_max_width": 16}]}
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from gdskit.machine.root import SystemRoot

# Below this a BAR1 window cannot map the buffers a real workload registers, and
# cuFile stages I/O through its own bounce buffers in GPU memory.
SMALL_BAR1_BYTES = 1 << 30


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as the check reports it."""

    index: int
    name: str
    pci_bus_id: str                 # sysfs form, e.g. "0000:17:00.0"
    memory_total: int | None
    bar1_total: int | None
    bar1_used: int | None
    pcie_gen: int | None
    pcie_width: int | None
    pcie_max_gen: int | None
    pcie_max_width: int | None
    numa_node: int | None

    @property
    def bar1_small(self) -> bool:
        return self.bar1_total is not None and self.bar1_total < SMALL_BAR1_BYTES

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "pci_bus_id": self.pci_bus_id,
            "numa_node": self.numa_node,
            "memory_total_bytes": self.memory_total,
            "bar1_total_bytes": self.bar1_total,
            "bar1_used_bytes": self.bar1_used,
            "bar1_small": self.bar1_small,
            "pcie": {
                "gen": self.pcie_gen,
                "width": self.pcie_width,
                "max_gen": self.pcie_max_gen,
                "max_width": self.pcie_max_width,
            },
        }


@dataclass(frozen=True)
class GpuFacts:
    """NVML availability, the driver, and every GPU."""

    nvml_available: bool
    nvml_error: str | None
    driver_version: str | None
    kernel_module: str | None        # "open", "proprietary" or None (no driver loaded)
    gpus: list[GpuInfo] = field(default_factory=list)

    @property
    def driver_major(self) -> int | None:
        if not self.driver_version:
            return None
        m = re.match(r"(\d+)", self.driver_version)
        return int(m.group(1)) if m else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "nvml_available": self.nvml_available,
            "nvml_error": self.nvml_error,
            "driver_version": self.driver_version,
            "kernel_module": self.kernel_module,
            "count": len(self.gpus),
        }


def nvml_bus_id_to_sysfs(bus_id: str) -> str:
    """NVML writes ``00000000:17:00.0``; sysfs names it ``0000:17:00.0``."""
    bus_id = bus_id.strip().lower()
    m = re.fullmatch(r"([0-9a-f]+):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])", bus_id)
    if not m:
        return bus_id
    domain = int(m.group(1), 16)
    return f"{domain:04x}:{m.group(2)}:{m.group(3)}.{m.group(4)}"


def driver_kernel_module(root: SystemRoot) -> tuple[str | None, str | None]:
    """(kind, version) of the loaded NVIDIA kernel module from /proc/driver/nvidia/version."""
    text = root.read_text("/proc/driver/nvidia/version")
    if not text:
        return None, None
    first = text.splitlines()[0] if text.splitlines() else ""
    kind = "open" if "Open Kernel Module" in first else "proprietary"
    m = re.search(r"\b(\d+\.\d+(?:\.\d+)?)\b", first)
    return kind, (m.group(1) if m else None)


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def gpu_facts(root: SystemRoot) -> GpuFacts:
    """Collect GPU facts from the root's NVML source and its /proc, /sys."""
    kind, module_version = driver_kernel_module(root)
    raw = root.nvml_facts()
    if not raw or not raw.get("available", True):
        err = (raw or {}).get("error") or "NVML (the NVIDIA driver's management library) not found"
        return GpuFacts(False, str(err), module_version, kind, [])
    gpus = []
    for g in raw.get("gpus", []):
        bdf = nvml_bus_id_to_sysfs(str(g.get("pci_bus_id", "")))
        numa = _int_or_none(root.read_value(f"/sys/bus/pci/devices/{bdf}/numa_node"))
        gpus.append(
            GpuInfo(
                index=int(g.get("index", len(gpus))),
                name=str(g.get("name", "unknown")),
                pci_bus_id=bdf,
                memory_total=_int_or_none(g.get("memory_total")),
                bar1_total=_int_or_none(g.get("bar1_total")),
                bar1_used=_int_or_none(g.get("bar1_used")),
                pcie_gen=_int_or_none(g.get("pcie_gen")),
                pcie_width=_int_or_none(g.get("pcie_width")),
                pcie_max_gen=_int_or_none(g.get("pcie_max_gen")),
                pcie_max_width=_int_or_none(g.get("pcie_max_width")),
                numa_node=numa if numa is not None and numa >= 0 else None,
            )
        )
    version = raw.get("driver_version") or module_version
    return GpuFacts(True, None, version, kind, gpus)


def query_nvml() -> dict[str, Any]:
    """Ask NVML about every GPU. Never raises: failures become ``available: False``."""
    try:
        import pynvml  # noqa: PLC0415 - import time
    except ImportError:
        return {"available": False, "error": "nvidia-ml-py is not installed (pip install nvidia-ml-py)"}
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return {"available": False, "error": f"NVML unavailable: {exc}"}
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        if isinstance(driver, bytes):
            driver = driver.decode()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)

            def ask(fn, *args, _h=h):
                try:
                    return fn(_h, *args)
                except Exception:
                    return None

            name = ask(pynvml.nvmlDeviceGetName)
            pci = ask(pynvml.nvmlDeviceGetPciInfo)
            bus_id = getattr(pci, "busId", b"") if pci is not None else b""
            bar1 = ask(pynvml.nvmlDeviceGetBAR1MemoryInfo)
            mem = ask(pynvml.nvmlDeviceGetMemoryInfo)
            gpus.append(
                {
                    "index": i,
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "pci_bus_id": bus_id.decode() if isinstance(bus_id, bytes) else bus_id,
                    "memory_total": getattr(mem, "total", None),
                    "bar1_total": getattr(bar1, "bar1Total", None),
                    "bar1_used": getattr(bar1, "bar1Used", None),
                    "pcie_gen": ask(pynvml.nvmlDeviceGetCurrPcieLinkGeneration),
                    "pcie_width": ask(pynvml.nvmlDeviceGetCurrPcieLinkWidth),
                    "pcie_max_gen": ask(pynvml.nvmlDeviceGetMaxPcieLinkGeneration),
                    "pcie_max_width": ask(pynvml.nvmlDeviceGetMaxPcieLinkWidth),
                }
            )
        return {"available": True, "error": None, "driver_version": driver, "gpus": gpus}
    except Exception as exc:
        return {"available": False, "error": f"NVML query failed: {exc}"}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
