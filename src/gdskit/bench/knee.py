"""Find the I/O size from which the direct path pays, from a sweep's repetitions.

Pure functions over numbers: no I/O, no GPU. The *knee* is the smallest swept
I/O size ``k`` such that at ``k`` **and every larger size** the direct path is
at least as fast as the CPU path, noise considered. "At least as fast, noise
considered" means the direct path's median throughput is not below the slowest
repetition of the CPU path (times ``1 - tolerance``): a direct median inside
the CPU path's spread is a tie, and a tie is enough to go direct, since the
direct path also spares the CPU. Requiring every larger size too keeps one
lucky small size from pulling the cut-off down.

The recommendation is the knee itself: requests of at least ``k`` bytes take
the direct path, smaller ones the CPU path. It is given three ways:

* gdskit's setting ``GDSKIT_DIRECT_THRESHOLD`` (``settings.direct_threshold``),
* a per-mount profile (see :mod:`gdskit.bench.profile`) the engine's ``auto`` mode reads,
* the cufile.json fragment ``{"fs": {"<fs>": {"posix_gds_min_kb": N}}}``. libcufile
  reads that key only for the filesystems it lists under ``fs`` with it (lustre,
  beegfs, scatefs in libcufile 1.15); for others (ext4, xfs on NVMe, ...) there is
  no cufile.json equivalent and the fragment is omitted with a note.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence

from gdskit.engine.profiles import DIRECT_NEVER  # the store's value for "the direct path never paid"

#: Filesystems whose cufile.json ``fs`` section takes ``posix_gds_min_kb``.
CUFILE_MIN_KB_FILESYSTEMS = ("lustre", "beegfs", "scatefs")


@dataclasses.dataclass(frozen=True)
class SizeVerdict:
    """The comparison at one I/O size."""

    io_size: int
    direct_median: float
    cpu_median: float
    cpu_min: float
    cpu_max: float
    direct_min: float
    direct_max: float
    direct_as_fast: bool


@dataclasses.dataclass(frozen=True)
class KneeResult:
    """Where the direct path starts to pay, and what to configure.

    Attributes
    ----------
    direct_path, cpu_path : str
        The bench path names compared (e.g. ``cufile`` vs ``bounce``).
    knee : int | None
        Smallest I/O size (bytes) from which the direct path is at least as fast;
        None when it never is within the sweep.
    threshold : int
        Recommended ``GDSKIT_DIRECT_THRESHOLD``: ``knee``, or :data:`DIRECT_NEVER`.
    verdicts : tuple[SizeVerdict, ...]
        The comparison at every swept size, ascending.
    fstype : str | None
        Filesystem the sweep ran on (for the cufile.json fragment).
    cufile_json : dict | None
        The cufile.json fragment, when libcufile has a key for this filesystem.
    note : str
        One sentence for people.
    """

    direct_path: str
    cpu_path: str
    knee: int | None
    threshold: int
    verdicts: tuple[SizeVerdict, ...]
    fstype: str | None
    cufile_json: dict | None
    note: str

    @property
    def direct_pays(self) -> bool:
        return self.knee is not None

    @property
    def gdskit_setting(self) -> str:
        """The environment line that applies the recommendation."""
        if self.knee is None:
            return "GDSKIT_MODE=bounce"
        return f"GDSKIT_DIRECT_THRESHOLD={_size_text(self.knee)}"

    def as_dict(self) -> dict:
        return {
            "direct_path": self.direct_path,
            "cpu_path": self.cpu_path,
            "knee_bytes": self.knee,
            "direct_pays": self.direct_pays,
            "threshold_bytes": self.threshold,
            "gdskit_setting": self.gdskit_setting,
            "fstype": self.fstype,
            "cufile_json": self.cufile_json,
            "note": self.note,
            "verdicts": [dataclasses.asdict(v) for v in self.verdicts],
        }


def _size_text(n: int) -> str:
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def cufile_fragment(fstype: str | None, knee: int | None) -> dict | None:
    """The cufile.json fragment for ``fstype``, or None where libcufile has no such key."""
    if fstype is None or fstype not in CUFILE_MIN_KB_FILESYSTEMS:
        return None
    if knee is None:
        # cuFile has no "never" value; a cut-off above any I/O it splits into
        # (max_direct_io_size_kb defaults to 16 MiB) keeps every request on POSIX.
        kb = 2**31 - 1
    else:
        kb = -(-knee // 1024)
    return {"fs": {fstype: {"posix_gds_min_kb": kb}}}


def _as_fast(direct: Sequence[float], cpu: Sequence[float], tolerance: float) -> bool:
    return statistics.median(direct) >= min(cpu) * (1.0 - tolerance)


def find_knee(
    direct: Mapping[int, Sequence[float]],
    cpu: Mapping[int, Sequence[float]],
    *,
    direct_path: str = "cufile",
    cpu_path: str = "bounce",
    fstype: str | None = None,
    tolerance: float = 0.0,
) -> KneeResult:
    """Find the knee from throughputs per I/O size (any unit, same for both).

    Parameters
    ----------
    direct, cpu
        ``{io_size: [throughput of each repetition]}`` for the direct and the CPU
        path. Only sizes present in both with at least one repetition count.
    tolerance
        Extra relative slack below the CPU path's slowest repetition still
        counted as a tie (0.02 = 2 %); 0 by default.
    """
    if tolerance < 0 or tolerance >= 1:
        raise ValueError("tolerance must be in [0, 1)")
    sizes = sorted(s for s in direct if s in cpu and len(direct[s]) and len(cpu[s]))
    verdicts = tuple(
        SizeVerdict(
            io_size=s,
            direct_median=float(statistics.median(direct[s])),
            cpu_median=float(statistics.median(cpu[s])),
            cpu_min=float(min(cpu[s])), cpu_max=float(max(cpu[s])),
            direct_min=float(min(direct[s])), direct_max=float(max(direct[s])),
            direct_as_fast=_as_fast(direct[s], cpu[s], tolerance),
        )
        for s in sizes
    )
    knee: int | None = None
    for v in reversed(verdicts):  # walk down from the largest size while the direct path keeps up
        if not v.direct_as_fast:
            break
        knee = v.io_size

    if not verdicts:
        note = "no I/O size was measured on both paths; no recommendation"
    elif knee is None:
        note = (f"{direct_path} was slower than {cpu_path} at every size up to "
                f"{_size_text(verdicts[-1].io_size)}: keep the direct path off on this mount")
    elif knee == verdicts[0].io_size:
        note = (f"{direct_path} kept up with {cpu_path} from the smallest size swept "
                f"({_size_text(knee)}) upward")
    else:
        note = (f"{direct_path} is at least as fast as {cpu_path} from {_size_text(knee)} upward; "
                f"send smaller requests through {cpu_path}")
    return KneeResult(
        direct_path=direct_path, cpu_path=cpu_path, knee=knee,
        threshold=DIRECT_NEVER if knee is None else knee, verdicts=verdicts, fstype=fstype,
        cufile_json=cufile_fragment(fstype, knee) if verdicts else None, note=note,
    )
