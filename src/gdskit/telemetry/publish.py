"""Publishing this process's ledger for ``gdskit stats`` and ``gdskit run``.

With ``GDSKIT_STATS`` >= 1 (or ``settings.set(stats_level=...)``) a daemon thread
writes a snapshot of the ledger every ``settings.stats_interval`` seconds, when
the ledger changed, to ``<stats dir>/<pid>.json`` (mode 0600, written to a
temporary file and renamed, so readers never see half a file). The I/O hot path
is untouched: the thread takes the ledger's own lock once per tick.

At exit the file is removed. A process started by ``gdskit run`` (its
environment names a session and a run directory) first leaves its final
snapshot in the run directory for the runner to sum. Forked children publish
under their own pid, only what they did after the fork.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
import warnings

from gdskit.ledger import Stats, ledger
from gdskit.settings import settings
from gdskit.telemetry import cufile_counters
from gdskit.telemetry.location import (
    RUN_DIR_ENV,
    SESSION_ENV,
    ensure_private_dir,
    snapshot_name,
    start_ticks,
    stats_dir,
)
from gdskit.telemetry.snapshot import build

_start_lock = threading.Lock()
_publisher: Publisher | None = None
_hooks_installed = False
_warned = False


def write_private(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, readable by this user only (0600)."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a leftover temporary file keeps its old mode through O_TRUNC
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, path)


def final_name(pid: int, ticks: int | None) -> str:
    """A final snapshot's file name in a run directory (the start time keeps reused pids apart)."""
    return f"{pid}-{ticks or 0}.json"


class Publisher:
    """Publishes one process's ledger; rebinds itself to the child after a fork."""

    def __init__(self) -> None:
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bind(None, None)

    def _bind(self, baseline: Stats | None, cufile_baseline: dict[int, dict[str, int]] | None) -> None:
        self.pid = os.getpid()
        self.ticks = start_ticks(self.pid)
        self.locate()
        self.started_at = time.time()
        self.baseline = baseline
        self.cufile_baseline = cufile_baseline
        self.cufile_last: dict[int, dict[str, int]] | None = None
        self._cufile_seen = False
        self._seq = 0
        self._published: tuple[int, int] | None = None  # (ledger version, level) last written
        self.started = False
        self.closed = False

    def locate(self) -> None:
        """Where to publish, from the environment as it is now (read again at each start)."""
        self.session = os.environ.get(SESSION_ENV) or None
        self.run_dir = os.environ.get(RUN_DIR_ENV) or None
        self.directory = stats_dir()
        self.file = os.path.join(self.directory, snapshot_name(self.pid))

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        ensure_private_dir(self.directory)
        self.publish(force=True)  # at once: `gdskit stats -p` finds the process as soon as it publishes
        self.started = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gdskit-stats", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        stop = self._stop
        while not stop.wait(settings.stats_interval):
            with _start_lock:
                if settings.stats_level <= 0:  # switched off: withdraw the snapshot and end the thread
                    self._thread = None
                    self.remove_live()
                    return
            try:
                self.publish()
            except OSError:
                pass  # e.g. the directory was removed under us: publish() recreates it next time

    def _cufile(self) -> dict[int, dict[str, int]] | None:
        per_gpu = cufile_counters.read_per_gpu()
        if per_gpu is None:
            return self.cufile_last  # cuFile closes at exit before our final snapshot: keep its last counters
        if not self._cufile_seen:
            self._cufile_seen = True
            _run_before_cufile_closes()
        self.cufile_last = cufile_counters.subtract(per_gpu, self.cufile_baseline)
        return self.cufile_last

    def publish(self, force: bool = False, final: bool = False, target: str | None = None) -> None:
        with self._write_lock:
            level = settings.stats_level
            if final:
                level = max(level, 1)
            if level <= 0:
                return
            state = (ledger.version, level)
            if not force and state == self._published:
                return  # nothing happened since the last snapshot
            self._seq += 1
            doc = build(level=level, pid=self.pid, ticks=self.ticks, started_at=self.started_at,
                        interval_s=settings.stats_interval, session=self.session, final=final, seq=self._seq,
                        baseline=self.baseline, gpus=ledger.device_snapshot() if level >= 3 else None,
                        cufile=self._cufile() if level >= 3 else None)
            data = json.dumps(doc, separators=(",", ":")).encode()
            path = target or self.file
            try:
                write_private(path, data)
            except FileNotFoundError:
                if target is not None:
                    raise
                ensure_private_dir(self.directory)
                write_private(path, data)
            if target is None:
                self._published = state

    def remove_live(self) -> None:
        with self._write_lock:
            self._published = None
            try:
                os.unlink(self.file)
            except OSError:
                pass

    def close(self) -> None:
        """At exit: stop the thread, leave the final snapshot for `gdskit run`, withdraw the live one."""
        if self.closed or os.getpid() != self.pid:
            return
        self.closed = True
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)
        if self.run_dir and self.started:
            try:
                self.publish(force=True, final=True, target=os.path.join(self.run_dir, final_name(self.pid, self.ticks)))
            except OSError:
                pass  # the runner is gone: nobody to collect it
        if self.started:
            self.remove_live()


def start_publishing() -> bool:
    """Publish this process's ledger from now on (``settings.stats_level`` must be >= 1).

    Idempotent. Returns False when publication is off or cannot start (the reason
    is warned once: e.g. a stats directory that other users can write into).
    """
    global _publisher, _warned
    with _start_lock:
        if settings.stats_level <= 0:
            return False
        _install_hooks()
        if _publisher is None or _publisher.pid != os.getpid():
            _publisher = Publisher()
        if _publisher.running:
            return True
        _publisher.locate()
        try:
            _publisher.start()
        except OSError as exc:
            if not _warned:
                _warned = True
                warnings.warn(f"gdskit: cannot publish stats: {exc}", RuntimeWarning, stacklevel=2)
            return False
        return True


def publish_now() -> None:
    """Write this process's snapshot now instead of at the next tick (no-op when not publishing)."""
    p = _publisher
    if p is not None and p.started and not p.closed and p.pid == os.getpid():
        p.publish(force=True)


def _at_exit() -> None:
    p = _publisher
    if p is not None:
        p.close()


def _run_before_cufile_closes() -> None:
    # atexit runs last-registered first; libcufile registered its close after we registered ours,
    # so register again to read cuFile's counters for the final snapshot before it closes.
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)


def _before_fork() -> None:
    _start_lock.acquire()
    if _publisher is not None:
        _publisher._write_lock.acquire()


def _after_fork_parent() -> None:
    if _publisher is not None:
        _publisher._write_lock.release()
    _start_lock.release()


def _after_fork_child() -> None:
    p = _publisher
    if p is not None:
        p._write_lock.release()
    _start_lock.release()
    if p is None:
        return
    was_running = p._thread is not None
    p._thread = None
    # Publish only what this child does: its ledger starts as a copy of the parent's.
    p._bind(ledger.snapshot(), p.cufile_last)
    if was_running and settings.stats_level > 0:
        try:
            p.start()
        except OSError:
            pass
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:
        # multiprocessing's fork children leave through os._exit, past atexit, but run its finalizers.
        mp_util.register_after_fork(p, _finalize_in_mp_child)


def _finalize_in_mp_child(p: Publisher) -> None:
    mp_util = sys.modules["multiprocessing.util"]
    mp_util.Finalize(None, _at_exit, exitpriority=0)


def _install_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:
        _hooks_installed = True
        atexit.register(_at_exit)
        # Also in the ordered exit, before the workers stop and cuFile closes: the thread
        # must not be inside a cuFile counter query when the driver goes.
        from gdskit import shutdown as exit_order  # noqa: PLC0415

        exit_order.at_exit(exit_order.STOP_WORK, _at_exit)
        os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent,
                            after_in_child=_after_fork_child)
