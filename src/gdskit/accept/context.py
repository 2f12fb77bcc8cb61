"""The options of one ``gdskit accept`` run and the facts its items share.

Sizes default small enough for the whole checklist to finish in a couple of
minutes; ``quick`` shrinks them further (CI, smoke tests). The ``gdskit check``
report is computed once and shared by the items that need it.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from typing import Any

from gdskit.errors import InvalidArgumentError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

#: Every item, in checklist order.
ALL_ITEMS = (1, 2, 3, 4, 5, 6, 7)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How much data each measuring item moves."""

    ab_size: int           # item 3: data set of the A/B benchmark
    ab_repeat: int
    sweep_size: int        # item 4: data set of the sweep
    sweep_seconds: float   # item 4: seconds per run
    sweep_repeat: int
    workload: int          # item 5: the default workload's checkpoint
    checkpoint: int        # item 6: the round-trip checkpoint
    fault: int             # item 7: bytes each fault child writes and reads back

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FULL = Sizes(ab_size=256 * MiB, ab_repeat=3, sweep_size=64 * MiB, sweep_seconds=0.25, sweep_repeat=3,
             workload=2 * GiB, checkpoint=64 * MiB, fault=64 * MiB)
QUICK = Sizes(ab_size=64 * MiB, ab_repeat=2, sweep_size=16 * MiB, sweep_seconds=0.1, sweep_repeat=2,
              workload=256 * MiB, checkpoint=8 * MiB, fault=16 * MiB)


@dataclasses.dataclass
class AcceptOptions:
    """What ``gdskit accept`` was asked to do.

    Attributes
    ----------
    targets : list[str]
        Files or directories whose mounts must be direct; the first one is where the
        measuring items write their temporary files. Default: the current directory.
    report_dir : str
        Where the report and its artifacts go.
    root : str | None
        A captured tree standing for ``/`` (``gdskit check --root``): only items 1
        and 2 apply; the measuring items are n/a.
    quick : bool
        Smaller sizes everywhere.
    size : int | None
        The default workload's checkpoint size (item 5); default 2 GiB (256 MiB quick).
    workload : str | None
        A command line to run as item 5's workload instead of the default one.
    device : int
        GPU index.
    items : tuple[int, ...]
        The items to run; the others are listed as n/a ("not selected").
    timeout : float
        Seconds a child process (workload, fault case) may run.
    """

    targets: list[str]
    report_dir: str
    root: str | None = None
    quick: bool = False
    size: int | None = None
    workload: str | None = None
    device: int = 0
    items: tuple[int, ...] = ALL_ITEMS
    timeout: float = 600.0

    def __post_init__(self) -> None:
        bad = [i for i in self.items if i not in ALL_ITEMS]
        if bad:
            raise InvalidArgumentError(f"no checklist item {bad[0]}; items are 1 to 7")
        if self.size is not None and self.size <= 0:
            raise InvalidArgumentError("--size must be positive")
        if not self.timeout > 0:
            raise InvalidArgumentError(f"--timeout must be positive, got {self.timeout}")
        if self.device < 0:
            raise InvalidArgumentError(f"GPU index must be >= 0, got {self.device}")
        if self.workload is not None:
            try:
                words = shlex.split(self.workload)
            except ValueError as exc:
                raise InvalidArgumentError(f"--workload {self.workload!r} is not a command line: {exc}") from None
            if not words:
                raise InvalidArgumentError("--workload names no command")
        if self.root is None:
            for t in self.targets:
                if not os.path.exists(t):
                    raise InvalidArgumentError(f"target {t!r} does not exist")
        elif not os.path.isdir(self.root):
            raise InvalidArgumentError(f"--root {self.root!r} is not a directory")

    @property
    def sizes(self) -> Sizes:
        base = QUICK if self.quick else FULL
        return dataclasses.replace(base, workload=self.size) if self.size else base

    def to_dict(self) -> dict[str, Any]:
        return {"targets": list(self.targets), "report_dir": self.report_dir, "root": self.root,
                "quick": self.quick, "workload": self.workload, "device": self.device,
                "items": list(self.items), "timeout_s": self.timeout, "sizes": self.sizes.to_dict()}


class AcceptContext:
    """Options plus facts computed once: the check report, the GPU count, the work directory."""

    def __init__(self, options: AcceptOptions) -> None:
        self.options = options
        self.sizes = options.sizes
        self._check: Any = None
        self._gpus: int | None = None

    @property
    def live(self) -> bool:
        """False when items 1-2 judge a captured tree: the measuring items cannot apply."""
        return self.options.root is None

    @property
    def gpu_count(self) -> int:
        if self._gpus is None:
            from gdskit.engine import cuda  # noqa: PLC0415 - import time

            self._gpus = cuda.device_count()
        return self._gpus

    @property
    def has_gpu(self) -> bool:
        return self.gpu_count > self.options.device

    def check_report(self) -> Any:
        """``gdskit check`` of the targets (or of every listed mount of a captured tree)."""
        if self._check is None:
            from gdskit.probe import run_check  # noqa: PLC0415 - import time

            self._check = run_check(self.options.targets or None, root=self.options.root, require="direct")
        return self._check

    @property
    def work_dir(self) -> str:
        """The directory of the first target: where temporary files of the measuring items go."""
        first = os.path.abspath(self.options.targets[0]) if self.options.targets else os.getcwd()
        return first if os.path.isdir(first) else os.path.dirname(first)

    def artifact(self, name: str) -> str:
        """Absolute path of an artifact file in the report directory."""
        return os.path.join(self.options.report_dir, name)
