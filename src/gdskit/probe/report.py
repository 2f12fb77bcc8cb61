"""The result of ``gdskit check``: one dataclass, one stable JSON schema (docs/check.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gdskit.machine.gds import GdsStack
from gdskit.machine.gpus import GpuFacts
from gdskit.probe.routes import RouteTable
from gdskit.machine.topology import Topology
from gdskit.version import __version__
from gdskit.probe.verdict import SEVERITIES, VERDICTS, Finding, MountCheck

SCHEMA = "gdskit.check"
SCHEMA_VERSION = 1
REQUIREMENTS = ("direct", "compat")


@dataclass(frozen=True)
class IoUringResult:
    """Whether batches of small host reads can go through io_uring here (one line of the check)."""

    status: str                      # usable | unavailable | not-probed
    detail: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "detail": self.detail}


@dataclass
class CheckReport:
    """Everything ``gdskit check`` found. ``to_dict()`` is the documented JSON."""

    root: str
    gpu: GpuFacts
    gds: GdsStack
    topology: Topology
    mounts: list[MountCheck]
    findings: list[Finding]
    require: str | None = None
    routes: RouteTable | None = None
    probed: bool = False
    notes: list[str] = field(default_factory=list)
    io_uring: IoUringResult = IoUringResult("not-probed", "captured tree, not the live machine")

    def meets(self, mc: MountCheck, requirement: str) -> bool:
        if requirement == "direct":
            return mc.verdict == "direct"
        return mc.verdict in ("direct", "compat")

    @property
    def failing_mounts(self) -> list[MountCheck]:
        """Mounts that do not meet ``require`` (empty when nothing is required)."""
        if self.require is None:
            return []
        return [mc for mc in self.mounts if not self.meets(mc, self.require)]

    @property
    def require_met(self) -> bool | None:
        # No mount checked proves nothing: a requirement is never met by an empty report.
        return None if self.require is None else bool(self.mounts) and not self.failing_mounts

    @property
    def worst_severity(self) -> str:
        return max((f.severity for f in self.findings), key=SEVERITIES.index, default="ok")

    @property
    def exit_code(self) -> int:
        """0: the check ran (and ``require`` is met); 1: ``require`` is not met."""
        return 1 if self.require_met is False else 0

    def summary(self) -> dict[str, Any]:
        counts = {v: sum(1 for m in self.mounts if m.verdict == v) for v in VERDICTS}
        return {
            "verdicts": counts,
            "findings": {s: sum(1 for f in self.findings if f.severity == s) for s in SEVERITIES},
            "worst_severity": self.worst_severity,
            "direct_possible_anywhere": counts["direct"] > 0,
            "require": self.require,
            "require_met": self.require_met,
            "failing_mounts": [m.mountpoint for m in self.failing_mounts],
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "gdskit_version": __version__,
            "root": self.root,
            "platform": {**self.gds.to_dict(), "driver": self.gpu.to_dict(), "io_uring": self.io_uring.to_dict()},
            "gpus": [g.to_dict() for g in self.gpu.gpus],
            "topology": self.topology.to_dict(),
            "mounts": [m.to_dict() for m in self.mounts],
            "routing": self.routes.to_dict() if self.routes is not None else None,
            "findings": [f.to_dict() for f in self.findings],
            "summary": self.summary(),
            "probed": self.probed,
            "notes": list(self.notes),
        }
