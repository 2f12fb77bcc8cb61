"""The GPUDirect Storage stack: libcufile, nvidia-fs, PCI P2PDMA, IOMMU, udev, cufile.json.

Everything here reads through a :class:`SystemRoot`; nothing is changed.

The facts are named tuples, not dataclasses: the engine imports this module in a fresh process's
first GPU read (:mod:`gdskit.engine.direct_path`), where making seven frozen dataclasses took most of its
6.5 ms import on the development VM.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from gdskit.machine.root import SystemRoot

# Upstream PCI P2PDMA for GDS needs kernel 6.2+ and the open NVIDIA module 570+.
P2PDMA_MIN_KERNEL = (6, 2)
P2PDMA_MIN_DRIVER = 570
P2PDMA_SYMBOL = "p2pdma_pgmap_ops"
DEFAULT_CUFILE_JSON = "/etc/cufile.json"
UDEV_DATA = "/run/udev/data"


# --------------------------------------------------------------------------- libcufile
def cufile_version_text(code: int) -> str:
    """``cuFileGetVersion``'s number (1000 * major + 10 * minor + patch) as ``major.minor[.patch]``."""
    text = f"{code // 1000}.{(code % 1000) // 10}"
    return text + (f".{code % 10}" if code % 10 else "")


class CufileLibrary(NamedTuple):
    """Whether libcufile loads, and its version (``1000*major + 10*minor``)."""

    found: bool
    version_code: int | None = None
    path: str | None = None
    error: str | None = None

    @property
    def version(self) -> str | None:
        return None if self.version_code is None else cufile_version_text(self.version_code)

    def to_dict(self) -> dict[str, Any]:
        return {"found": self.found, "version": self.version, "version_code": self.version_code,
                "path": self.path, "error": self.error}


def query_cufile_library() -> dict[str, Any]:
    """Load libcufile through cuda.bindings and ask its version. Never raises."""
    path = None
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib  # noqa: PLC0415 - import time

        path = getattr(load_nvidia_dynamic_lib("cufile"), "abs_path", None)
    except Exception as exc:
        return {"found": False, "error": f"libcufile not found: {exc}"}
    try:
        from cuda.bindings import cufile  # noqa: PLC0415 - import time

        return {"found": True, "version": int(cufile.get_version()), "path": path}
    except Exception as exc:
        return {"found": True, "version": None, "path": path, "error": f"cuFileGetVersion failed: {exc}"}


def cufile_library(root: SystemRoot) -> CufileLibrary:
    raw = root.cufile_facts()
    if not raw:
        return CufileLibrary(False, error="libcufile not found")
    version = raw.get("version")
    return CufileLibrary(
        found=bool(raw.get("found")),
        version_code=int(version) if isinstance(version, int) else None,
        path=raw.get("path"),
        error=raw.get("error"),
    )


# --------------------------------------------------------------------------- kernel
def parse_kernel_version(release: str | None) -> tuple[int, int] | None:
    """``"6.18.0-rc1+"`` -> ``(6, 18)``."""
    if not release:
        return None
    m = re.match(r"(\d+)\.(\d+)", release.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def loaded_modules(root: SystemRoot) -> set[str]:
    return {line.split(" ", 1)[0] for line in root.iter_lines("/proc/modules") if line.strip()}


def kallsyms_has(root: SystemRoot, symbol: str) -> bool | None:
    """Whether ``symbol`` is in /proc/kallsyms (None when the file is unreadable).

    The file has about 200,000 lines; it is searched as bytes in one pass, not split line by line.
    """
    data = root.read_bytes("/proc/kallsyms", limit=-1)
    if data is None:
        return None
    # A line is "address type name" and, for a module's symbol, "\t[module]".
    return re.search(rb" " + re.escape(symbol.encode()) + rb"(?:[\t\n]|\Z)", data) is not None


class NvidiaFs(NamedTuple):
    loaded: bool
    version: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"loaded": self.loaded, "version": self.version}


def nvidia_fs(root: SystemRoot, modules: set[str]) -> NvidiaFs:
    proc = root.is_dir("/proc/driver/nvidia-fs")
    version = None
    text = root.read_text("/proc/driver/nvidia-fs/version")
    if text:
        m = re.search(r"version\s*:\s*(\S+)", text, re.IGNORECASE)
        version = m.group(1) if m else text.strip().splitlines()[0]
    return NvidiaFs(loaded=("nvidia_fs" in modules) or proc, version=version)


class P2pdma(NamedTuple):
    """Upstream PCI P2PDMA: kernel support, driver support, and cuFile's switch."""

    kernel_symbol: bool | None
    kernel_version_ok: bool
    driver_ok: bool
    enabled_in_config: bool

    @property
    def platform_capable(self) -> bool:
        return bool(self.kernel_symbol) and self.kernel_version_ok and self.driver_ok

    @property
    def available(self) -> bool:
        """cuFile would use P2PDMA: the platform can and cufile.json asks for it."""
        return self.platform_capable and self.enabled_in_config

    def to_dict(self) -> dict[str, Any]:
        return {"available": self.available, "platform_capable": self.platform_capable,
                "kernel_symbol": self.kernel_symbol, "kernel_version_ok": self.kernel_version_ok,
                "driver_ok": self.driver_ok, "enabled_in_config": self.enabled_in_config}


# --------------------------------------------------------------------------- IOMMU
class Iommu(NamedTuple):
    state: str                       # "off", "passthrough", "translated", "on" (mode unknown)
    units: list[str]
    groups: int
    cmdline: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "units": self.units, "groups": self.groups, "cmdline": self.cmdline}


def iommu(root: SystemRoot) -> Iommu:
    units = root.listdir("/sys/class/iommu")
    groups = root.listdir("/sys/kernel/iommu_groups")
    cmdline = [t for t in (root.read_value("/proc/cmdline") or "").split() if "iommu" in t]
    if not units and not groups:
        return Iommu("off", units, 0, cmdline)
    types = {root.read_value(f"/sys/kernel/iommu_groups/{g}/type") for g in groups}
    types.discard(None)
    if types and types <= {"identity"}:
        state = "passthrough"
    elif types:
        state = "translated"
    else:
        state = "on"
    return Iommu(state, units, len(groups), cmdline)


# --------------------------------------------------------------------------- udev
class Udev(NamedTuple):
    database: bool                   # /run/udev/data exists and is readable
    path: str = UDEV_DATA

    def to_dict(self) -> dict[str, Any]:
        return {"database": self.database, "path": self.path}


def udev(root: SystemRoot) -> Udev:
    return Udev(root.is_dir(UDEV_DATA) and root.readable(UDEV_DATA))


def udev_fs_usage(root: SystemRoot, major: int, minor: int) -> bool:
    """Whether udev recorded ``ID_FS_USAGE`` for a block device (what libcufile looks up)."""
    text = root.read_text(f"{UDEV_DATA}/b{major}:{minor}") or ""
    return any(line.startswith("E:ID_FS_USAGE=") for line in text.splitlines())


# --------------------------------------------------------------------------- cufile.json
_JSON_STRING = r'"(?:\\.|[^"\\])*"'
_COMMENT = re.compile(_JSON_STRING + r"|//[^\n]*|/\*.*?(?:\*/|\Z)", re.S)
_TRAILING_COMMA = re.compile(_JSON_STRING + r"|,(?=\s*[}\]])")


def strip_json_comments(text: str) -> str:
    """Remove ``//`` and ``/* */`` comments and trailing commas, leaving strings intact.

    cufile.json is JSON with comments; URLs or paths inside strings may hold
    ``//`` and must survive. Each pattern matches whole strings first, so what it
    removes is never inside one.
    """
    def comment(m: re.Match[str]) -> str:
        t = m.group(0)
        return t if t[0] == '"' else (" " if t.startswith("/*") else "")

    text = _COMMENT.sub(comment, text)
    return _TRAILING_COMMA.sub(lambda m: m.group(0) if m.group(0)[0] == '"' else "", text)


def parse_cufile_json(text: str) -> dict[str, Any]:
    """Parse cufile.json text (comments allowed). Raises ``ValueError`` when malformed, nested
    deeper than Python's parser goes included (the path may come from the environment)."""
    try:
        data = json.loads(strip_json_comments(text))
    except RecursionError:
        raise ValueError("cufile.json is nested too deep to read") from None
    if not isinstance(data, dict):
        raise ValueError("cufile.json must hold a JSON object")
    return data


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _env_bool(value: str | None) -> bool | None:
    if value is None:
        return None
    v = value.strip().lower()
    return True if v in _TRUE else False if v in _FALSE else None


class CufileConfig(NamedTuple):
    """The effective cuFile configuration (file values, then environment overrides)."""

    path: str
    found: bool
    error: str | None
    allow_compat_mode: bool
    force_compat_mode: bool
    use_pci_p2pdma: bool
    max_direct_io_size_kb: int | None
    logging_dir: str | None
    logging_level: str | None
    posix_gds_min_kb: dict[str, int]
    env_overrides: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path, "found": self.found, "error": self.error,
            "allow_compat_mode": self.allow_compat_mode, "force_compat_mode": self.force_compat_mode,
            "use_pci_p2pdma": self.use_pci_p2pdma, "max_direct_io_size_kb": self.max_direct_io_size_kb,
            "logging_dir": self.logging_dir, "logging_level": self.logging_level,
            "posix_gds_min_kb": dict(self.posix_gds_min_kb), "env_overrides": dict(self.env_overrides),
        }


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def cufile_config(root: SystemRoot) -> CufileConfig:
    """Read the cuFile configuration the library would read (``CUFILE_ENV_PATH_JSON`` first)."""
    path = root.env.get("CUFILE_ENV_PATH_JSON") or DEFAULT_CUFILE_JSON
    text = root.read_text(path)
    data: dict[str, Any] = {}
    error = None
    if text is not None:
        try:
            data = parse_cufile_json(text)
        except ValueError as exc:
            error = f"cannot parse {path}: {exc}"
    props = data.get("properties") if isinstance(data.get("properties"), dict) else {}

    def flag(key: str, default: bool) -> bool:
        v = props.get(key)
        return v if isinstance(v, bool) else default

    modes = {"allow_compat_mode": flag("allow_compat_mode", True),
             "force_compat_mode": flag("force_compat_mode", False),
             "use_pci_p2pdma": flag("use_pci_p2pdma", False)}
    overrides: dict[str, str] = {}  # the environment wins over the file, as in libcufile
    for env_key, key in (("CUFILE_ALLOW_COMPAT_MODE", "allow_compat_mode"),
                         ("CUFILE_FORCE_COMPAT_MODE", "force_compat_mode"), ("CUFILE_USE_PCIP2PDMA", "use_pci_p2pdma")):
        b = _env_bool(root.env.get(env_key))
        if b is not None:
            modes[key], overrides[env_key] = b, root.env[env_key]
    min_kb: dict[str, int] = {}
    fs = data.get("fs") if isinstance(data.get("fs"), dict) else {}
    for fs_name, fs_conf in fs.items():
        v = _get(fs_conf, "posix_gds_min_kb")
        if isinstance(v, int) and not isinstance(v, bool):
            min_kb[str(fs_name)] = v
    mdio = props.get("max_direct_io_size_kb")
    log_dir = _get(data, "logging", "dir")
    level = root.env.get("CUFILE_LOGGING_LEVEL") or _get(data, "logging", "level")
    return CufileConfig(
        path=path,
        found=text is not None,
        error=error,
        **modes,
        max_direct_io_size_kb=mdio if isinstance(mdio, int) and not isinstance(mdio, bool) else None,
        logging_dir=log_dir if isinstance(log_dir, str) else None,
        logging_level=level if isinstance(level, str) else None,
        posix_gds_min_kb=min_kb,
        env_overrides=overrides,
    )


# --------------------------------------------------------------------------- together
class GdsStack(NamedTuple):
    kernel_release: str | None
    kernel_version: tuple[int, int] | None
    virtualization: str | None
    cufile: CufileLibrary
    nvidia_fs: NvidiaFs
    p2pdma: P2pdma
    iommu: Iommu
    udev: Udev
    config: CufileConfig

    def to_dict(self) -> dict[str, Any]:
        return {
            "kernel_release": self.kernel_release,
            "kernel_version": ".".join(map(str, self.kernel_version)) if self.kernel_version else None,
            "virtualization": self.virtualization,
            "cufile": self.cufile.to_dict(),
            "nvidia_fs": self.nvidia_fs.to_dict(),
            "p2pdma": self.p2pdma.to_dict(),
            "iommu": self.iommu.to_dict(),
            "udev": self.udev.to_dict(),
            "cufile_config": self.config.to_dict(),
        }


def virtualization(root: SystemRoot) -> str | None:
    """A short name of the hypervisor, ``None`` on bare metal (best effort)."""
    vendor = " ".join(
        filter(None, (root.read_value("/sys/class/dmi/id/sys_vendor"),
                      root.read_value("/sys/class/dmi/id/product_name")))
    ).lower()
    for needle, name in (("firecracker", "firecracker"), ("kvm", "kvm"), ("qemu", "qemu"),
                         ("vmware", "vmware"), ("virtualbox", "virtualbox"), ("microsoft", "hyper-v"),
                         ("amazon ec2", "kvm"), ("google compute", "kvm"), ("xen", "xen")):
        if needle in vendor:
            return name
    if "firecracker" in (root.read_value("/proc/cmdline") or ""):
        return "firecracker"
    cpuinfo = root.read_text("/proc/cpuinfo") or ""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return "vm" if " hypervisor" in line else None
    return None


def gds_stack(root: SystemRoot, driver_kind: str | None, driver_major: int | None) -> GdsStack:
    release = root.read_value("/proc/sys/kernel/osrelease")
    kver = parse_kernel_version(release)
    config = cufile_config(root)
    modules = loaded_modules(root)
    p2p = P2pdma(
        kernel_symbol=kallsyms_has(root, P2PDMA_SYMBOL),
        kernel_version_ok=kver is not None and kver >= P2PDMA_MIN_KERNEL,
        driver_ok=driver_kind == "open" and driver_major is not None and driver_major >= P2PDMA_MIN_DRIVER,
        enabled_in_config=config.use_pci_p2pdma,
    )
    return GdsStack(
        kernel_release=release,
        kernel_version=kver,
        virtualization=virtualization(root),
        cufile=cufile_library(root),
        nvidia_fs=nvidia_fs(root, modules),
        p2pdma=p2p,
        iommu=iommu(root),
        udev=udev(root),
        config=config,
    )
