"""CPU cost of a run, measured over exactly the run's wall-clock window.

Two views, both taken around the same window:

* system-wide ``%user``, ``%system``, ``%iowait`` (what ``iostat -c`` shows),
  from ``psutil.cpu_times()`` deltas. The CPU path's kernel copies show up in
  ``%system``; the direct path should leave it near idle.
* the benchmark process's own CPU seconds (user + system, all its threads,
  from ``getrusage(RUSAGE_SELF)``), which the report divides by GiB moved.
"""

from __future__ import annotations

import dataclasses
import resource
import time


@dataclasses.dataclass(frozen=True)
class CpuSample:
    """One reading of the counters (opaque; subtract two with :func:`cpu_cost`)."""

    wall: float
    system: dict[str, float]   # psutil.cpu_times() fields, seconds summed over CPUs
    proc_user: float
    proc_system: float


@dataclasses.dataclass(frozen=True)
class CpuCost:
    """CPU use between two samples.

    Attributes
    ----------
    user_pct, system_pct, iowait_pct : float
        System-wide shares of all CPU time in the window (0-100), as iostat reports them.
    busy_pct : float
        System-wide share that was not idle or iowait.
    process_cpu_s : float
        CPU seconds (user + system) the benchmark process spent, all threads.
    process_user_s, process_system_s : float
        The two parts of ``process_cpu_s``.
    wall_s : float
        Length of the window.
    """

    user_pct: float
    system_pct: float
    iowait_pct: float
    busy_pct: float
    process_cpu_s: float
    process_user_s: float
    process_system_s: float
    wall_s: float

    def cpu_s_per_gib(self, nbytes: int) -> float | None:
        """Process CPU seconds per GiB moved (None when nothing moved)."""
        if nbytes <= 0:
            return None
        return self.process_cpu_s / (nbytes / 2**30)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def _system_times() -> dict[str, float]:
    try:
        import psutil  # noqa: PLC0415 - import time
    except ImportError:  # psutil is a dependency; be robust anyway: no system view
        return {}
    return dict(psutil.cpu_times()._asdict())


def sample() -> CpuSample:
    """Read the counters now."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return CpuSample(wall=time.perf_counter(), system=_system_times(),
                     proc_user=ru.ru_utime, proc_system=ru.ru_stime)


def _pct(part: float, total: float) -> float:
    return 100.0 * part / total if total > 0 else 0.0


def cpu_cost(before: CpuSample, after: CpuSample) -> CpuCost:
    """What happened between two samples.

    ``%user`` includes ``nice`` (as iostat's ``%user`` plus ``%nice`` would), and
    ``%system`` includes time in interrupts (``irq``, ``softirq``) since storage
    completions are charged there.
    """
    d = {k: max(0.0, after.system.get(k, 0.0) - before.system.get(k, 0.0)) for k in after.system}
    total = sum(v for k, v in d.items() if k not in ("guest", "guest_nice"))  # guest is inside user
    user = d.get("user", 0.0) + d.get("nice", 0.0)
    system = d.get("system", 0.0) + d.get("irq", 0.0) + d.get("softirq", 0.0)
    iowait = d.get("iowait", 0.0)
    idle = d.get("idle", 0.0)
    pu = max(0.0, after.proc_user - before.proc_user)
    ps = max(0.0, after.proc_system - before.proc_system)
    return CpuCost(
        user_pct=_pct(user, total), system_pct=_pct(system, total), iowait_pct=_pct(iowait, total),
        busy_pct=_pct(max(0.0, total - idle - iowait), total),
        process_cpu_s=pu + ps, process_user_s=pu, process_system_s=ps,
        wall_s=max(0.0, after.wall - before.wall),
    )


class CpuMeter:
    """Context manager: ``with CpuMeter() as m: ...`` then ``m.cost``."""

    def __init__(self) -> None:
        self._before: CpuSample | None = None
        self.cost: CpuCost | None = None

    def __enter__(self) -> CpuMeter:
        self._before = sample()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._before is not None
        self.cost = cpu_cost(self._before, sample())
