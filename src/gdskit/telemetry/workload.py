"""``gdskit run``: run a workload with publication on, then sum what its processes did.

The runner gives the workload a session token and a private run directory in
its environment. Every gdskit process of the workload (children that inherit
the environment too) publishes with the token and, at exit, leaves its final
snapshot in the run directory. When the workload ends, the runner sums the
final snapshots, plus the last live snapshot of any process that did not leave
one (killed, or still running), and removes the run directory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from gdskit.errors import (
    GdskitFileNotFoundError,
    InvalidArgumentError,
    WorkloadTimeoutError,
    from_os_error,
)
from gdskit.engine.ledger import Stats
from gdskit.settings import env_name
from gdskit.telemetry.location import (
    RUN_DIR_ENV,
    SESSION_ENV,
    StatsDir,
    descendants,
    is_running,
    pid_of,
    start_ticks,
)
from gdskit.telemetry.publish import publication_dir
from gdskit.telemetry.read import load_dir, run_dir_name
from gdskit.telemetry.snapshot import Snapshot
from gdskit.telemetry.verdict import split, verdict

SCHEMA = "gdskit.run/1"
_GRACE_S = 5.0  # after SIGTERM on timeout, before SIGKILL


@dataclass(frozen=True)
class WorkloadReport:
    """What a workload's gdskit processes did, summed over its whole life.

    ``posix_bytes`` counts every byte not on a direct path; ``all_direct`` is True
    only when bytes moved and all were direct. ``processes`` is how many gdskit
    processes published; ``partial`` says some ended without a final snapshot
    (killed), so their last periodic snapshot (at most ``stats_interval`` old) was used.
    """

    argv: list[str]
    returncode: int
    duration_s: float
    stats: Stats
    cufile_counters: dict[str, int] | None
    processes: int = 0
    partial: bool = False

    @property
    def direct_bytes(self) -> int:
        return split(self.stats)[0]

    @property
    def posix_bytes(self) -> int:
        return split(self.stats)[1]

    @property
    def all_direct(self) -> bool:
        direct, posix = split(self.stats)
        return direct > 0 and posix == 0

    @property
    def verdict(self) -> str:
        return verdict(self.stats)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "argv": list(self.argv),
            "returncode": self.returncode,
            "duration_s": round(self.duration_s, 6),
            "direct_bytes": self.direct_bytes,
            "posix_bytes": self.posix_bytes,
            "all_direct": self.all_direct,
            "verdict": self.verdict,
            "processes": self.processes,
            "partial": self.partial,
            "stats": self.stats.to_dict(),
            "cufile_counters": None if self.cufile_counters is None else dict(self.cufile_counters),
        }


def run_workload(argv: list[str], *, level: int = 3, env: dict[str, str] | None = None,
                 timeout: float | None = None, cwd: str | None = None, stdout: Any = None) -> WorkloadReport:
    """Run ``argv`` with gdskit publication on (``GDSKIT_STATS=level``) and report its path split.

    ``env`` adds variables to this process's environment for the workload; ``stdout``
    (a file or descriptor, as for ``subprocess.Popen``) takes its output instead of ours.
    Signals meant for the runner (SIGINT, SIGTERM, SIGHUP) are passed on to the
    workload, whose end is then reported as usual. Past ``timeout`` seconds the
    workload is stopped (SIGTERM, then SIGKILL) and :class:`WorkloadTimeoutError`
    is raised, carrying the report in ``.report``.
    """
    argv = [os.fspath(a) for a in argv]
    if not argv:
        raise InvalidArgumentError("run_workload needs a command to run")
    if level not in (1, 2, 3):
        raise InvalidArgumentError(f"level must be 1, 2 or 3, got {level!r}")
    child_env = dict(os.environ)
    child_env.update(env or {})
    live = publication_dir(child_env)  # where the workload's processes will publish: they choose alike
    token = secrets.token_hex(8)
    run_dir = os.path.join(live.path, run_dir_name(os.getpid(), start_ticks(os.getpid()), token))
    os.mkdir(run_dir, 0o700)
    os.chmod(run_dir, 0o700)  # mkdir's mode passes through the umask
    child_env.update({env_name("stats_level"): str(level), SESSION_ENV: token, RUN_DIR_ENV: run_dir})
    timed_out = False
    try:
        t0 = time.monotonic()
        # Forwarding starts before the workload does: a Ctrl-C while it is being started is
        # passed on once it exists, instead of ending the runner and leaving the workload behind.
        with _forward_signals() as forward_to:
            try:
                proc = subprocess.Popen(argv, env=child_env, cwd=cwd, stdout=stdout)
            except FileNotFoundError as exc:
                raise GdskitFileNotFoundError(errno.ENOENT, "command not found", argv[0]) from exc
            except OSError as exc:
                raise from_os_error(exc, argv[0]) from exc
            forward_to(proc)
            try:
                returncode = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                returncode = _stop(proc)
        duration = time.monotonic() - t0
        snapshots, partial = collect(token, run_dir, live)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    report = make_report(argv, returncode, duration, snapshots, partial)
    if timed_out:
        raise WorkloadTimeoutError(f"{argv[0]} ran past its {timeout:g} s timeout and was stopped", report)
    return report


def collect(token: str, run_dir: str, live: StatsDir | str) -> tuple[list[Snapshot], bool]:
    """Every snapshot of the session ``token``: final ones, else the last live one. Also: any not final?"""
    me = os.geteuid()
    live = live if isinstance(live, StatsDir) else StatsDir(live, private=False)
    found: dict[tuple[int, Any], Snapshot] = {}
    # Live snapshots first: a process leaves its final snapshot before it withdraws its live one,
    # so reading in this order cannot miss a process that ends meanwhile.
    live_snaps = [Snapshot(doc, os.path.join(live.path, name))
                  for name, doc in load_dir(live, me, lambda n: pid_of(n) is not None)]
    live_snaps = [snap for snap in live_snaps if snap.session == token]
    for name, doc in load_dir(StatsDir(run_dir, private=False), me, lambda n: n.endswith(".json")):
        snap = Snapshot(doc, os.path.join(run_dir, name))
        if snap.session == token:
            found[(snap.pid, snap.doc.get("start_ticks"))] = snap
    partial = False
    for snap in live_snaps:
        key = (snap.pid, snap.doc.get("start_ticks"))
        if key in found:
            continue
        found[key] = snap
        partial = True
        if not is_running(snap.pid, snap.doc.get("start_ticks")):
            with contextlib.suppress(OSError):
                os.unlink(snap.file)  # a killed process's leftover: nobody else will want it
    return [found[k] for k in sorted(found, key=lambda k: (k[0], k[1] or 0))], partial


def make_report(argv: list[str], returncode: int, duration_s: float, snapshots: list[Snapshot],
                partial: bool = False) -> WorkloadReport:
    stats = Stats()
    counters: dict[str, int] | None = None
    for snap in snapshots:
        stats = stats + snap.stats
        cu = snap.cufile_totals
        if cu is not None:
            counters = counters or {}
            for k, v in cu.items():
                counters[k] = counters.get(k, 0) + v
    return WorkloadReport(list(argv), returncode, duration_s, stats, counters, len(snapshots), partial)


def _stop(proc: subprocess.Popen) -> int:
    """Stop the workload and every process it started (a shell's or a launcher's children
    would otherwise run on, and keep publishing): SIGTERM, then SIGKILL after a grace period."""
    family = descendants(proc.pid)
    proc.terminate()
    _signal_all(family, signal.SIGTERM)
    try:
        code = proc.wait(_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    deadline = time.monotonic() + _GRACE_S
    while any(is_running(p, t) for p, t in family) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal_all(family, signal.SIGKILL)
    return code


def _signal_all(family: list[tuple[int, int | None]], sig: int) -> None:
    for pid, ticks in family:
        if is_running(pid, ticks):  # not a pid reused since
            with contextlib.suppress(OSError):
                os.kill(pid, sig)


def _terminal_reached(proc: subprocess.Popen) -> bool:
    """Whether a Ctrl-C at the terminal reached the workload itself (same foreground process group)."""
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd):
                group = os.getpgrp()
                return os.tcgetpgrp(fd) == group and os.getpgid(proc.pid) == group
        except OSError:
            return False
    return False


@contextlib.contextmanager
def _forward_signals() -> Iterator[Callable[[subprocess.Popen], None]]:
    """Pass SIGINT, SIGTERM and SIGHUP on to the workload while it runs (main thread only).

    Yields ``forward_to(proc)``, to be called once the workload is started: a signal that came
    before it is passed on then.
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda proc: None
        return
    target: list[subprocess.Popen] = []
    held: list[int] = []  # signals that came before the workload existed

    def send(proc: subprocess.Popen, signum: int) -> None:
        if signum == signal.SIGINT and _terminal_reached(proc):
            return  # the terminal sent it to the workload as well: once is enough
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    def forward(signum: int, _frame: Any) -> None:
        if target:
            send(target[0], signum)
        else:
            held.append(signum)

    def forward_to(proc: subprocess.Popen) -> None:
        target.append(proc)
        while held:
            send(proc, held.pop(0))

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, forward)
    try:
        yield forward_to
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not target:  # no workload was started: the signals are the runner's own after all
            for sig in dict.fromkeys(held):
                signal.raise_signal(sig)
