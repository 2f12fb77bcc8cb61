"""What ``gdskit accept`` produces: one :class:`ItemResult` per checklist item, and the report.

``AcceptReport.to_dict()`` is the documented JSON (docs/accept.md); keys are only
ever added within one ``schema_version``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from gdskit import __version__
from gdskit.durable import write_text_whole

SCHEMA = "gdskit.accept"
SCHEMA_VERSION = 1

PASS = "pass"
FAIL = "fail"
NA = "n/a"
STATUSES = (PASS, FAIL, NA)


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A file written next to the report: ``path`` is relative to the report directory."""

    kind: str          # "plot" (PNG, embedded in the HTML page), "json", "csv"
    path: str
    title: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "title": self.title}


@dataclasses.dataclass
class ItemResult:
    """The outcome of one checklist item.

    ``evidence`` holds the lines a person reads; ``data`` the same facts for machines.
    ``fix`` is set when the item fails (and may say what to do when it is n/a).
    """

    id: int
    key: str
    title: str
    status: str
    summary: str
    evidence: list[str] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    fix: str | None = None
    artifacts: list[Artifact] = dataclasses.field(default_factory=list)
    duration_s: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, not {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "key": self.key, "title": self.title, "status": self.status,
            "summary": self.summary, "evidence": list(self.evidence), "data": self.data,
            "fix": self.fix, "artifacts": [a.to_dict() for a in self.artifacts],
            "duration_s": round(self.duration_s, 3),
        }


#: The checklist: each item's title and its key in the JSON report.
TITLES = {
    1: "GDS platform ready: nvidia-fs or PCI P2PDMA, no ACS blockage, BAR1 and RDMA",
    2: "Every target mount has a direct verdict",
    3: "A/B benchmark: direct path against the CPU path, same parameters",
    4: "I/O-size sweep 4 KiB to 1 MiB and the cut-off it implies",
    5: "Real workload: direct bytes grow, POSIX bytes stay flat",
    6: "Checkpoint round trip: plain torch.load and safetensors read gdskit's files",
    7: "Fault injection: without the direct path the workload degrades and completes",
}
KEYS = {1: "platform", 2: "mounts", 3: "ab_benchmark", 4: "io_size_sweep", 5: "workload",
        6: "checkpoint_round_trip", 7: "fault_injection"}


def result(item: int, status: str, summary: str, **kw: Any) -> ItemResult:
    """Item ``item``'s outcome, under its key and title."""
    return ItemResult(item, KEYS[item], TITLES[item], status, summary, **kw)


def not_applicable(item: int, why: str, **kw: Any) -> ItemResult:
    return result(item, NA, f"not applicable: {why}", **kw)


@dataclasses.dataclass
class AcceptReport:
    """Everything one ``gdskit accept`` run found."""

    created: str
    machine: dict[str, Any]
    options: dict[str, Any]
    items: list[ItemResult]
    notes: list[str] = dataclasses.field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(1 for i in self.items if i.status == status)

    @property
    def failed(self) -> list[ItemResult]:
        return [i for i in self.items if i.status == FAIL]

    @property
    def exit_code(self) -> int:
        """0 when no item failed, 1 otherwise (n/a items do not fail a run)."""
        return 1 if self.failed else 0

    @property
    def verdict(self) -> str:
        """``accepted`` only when every item passed; ``incomplete`` when none failed but some were n/a."""
        if self.failed:
            return "not accepted"
        return "accepted" if self.count(PASS) == len(self.items) else "incomplete"

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "gdskit_version": __version__,
            "created": self.created,
            "machine": self.machine,
            "options": self.options,
            "items": [i.to_dict() for i in self.items],
            "summary": {
                "pass": self.count(PASS), "fail": self.count(FAIL), "n/a": self.count(NA),
                "failed_items": [i.id for i in self.failed],
                "verdict": self.verdict, "exit_code": self.exit_code,
            },
            "notes": list(self.notes),
        }


def write_json(path: str, data: Any) -> None:
    """One report file: indented JSON, anything else as its string, the directory made if missing;
    written whole (a temporary renamed over it)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_text_whole(path, json.dumps(data, indent=2, default=str) + "\n")

