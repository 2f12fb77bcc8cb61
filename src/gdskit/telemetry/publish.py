"""Publishing this process's ledger for ``gdskit stats`` and ``gdskit run``.

With ``GDSKIT_STATS`` >= 1 (or ``settings.set(stats_level=...)``) a daemon thread
writes a snapshot of the ledger every ``settings.stats_interval`` seconds, when
the ledger changed, to ``<stats dir>/<pid>.json`` (mode 0600, written to a
temporary file created afresh, never through a link, and renamed, so readers
never see half a file). The I/O hot path is untouched: the thread takes the
ledger's own lock once per tick.

The stats directory is the first usable of :func:`location.candidate_dirs`: a
default location someone else created first (or left open to others) is passed
over for the next, so publication does not stop because of it.

At exit the file is removed. A process started by ``gdskit run`` (its
environment names a session and a run directory) first leaves its final
snapshot in the run directory for the runner to sum. Forked children publish
under their own pid, only what they did after the fork.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import sys
import threading
import time
import warnings
from collections.abc import Mapping

from gdskit.durable import create_new_file, unguessable_token
from gdskit.errors import GdskitPermissionError, from_os_error
from gdskit.engine.ledger import Stats, ledger
from gdskit.settings import settings
from gdskit.shutdown import STOP_WORK, at_exit
from gdskit.telemetry import cufile_counters
from gdskit.telemetry.location import (
    RUN_DIR_ENV,
    SESSION_ENV,
    StatsDir,
    candidate_dirs,
    open_dir,
    snapshot_name,
    start_ticks,
)
from gdskit.telemetry.snapshot import build
from gdskit.threads import start_thread

_start_lock = threading.Lock()
_publisher: Publisher | None = None
_hooks_installed = False
_warned = False



def write_private(path: str, data: bytes, *, private: bool = False) -> None:
    """Write ``data`` to ``path`` atomically, readable by this user only (0600).

    The directory must be this user's and closed to others (``private``: mode 0700);
    the temporary file is created afresh next to ``path`` and renamed over it.
    """
    directory, name = os.path.split(path)
    dir_fd = open_dir(StatsDir(directory or ".", private=private), os.geteuid())
    try:
        write_at(dir_fd, name, data)
    finally:
        os.close(dir_fd)


def write_at(dir_fd: int, name: str, data: bytes) -> None:
    """Write ``data`` to ``name`` in the directory open as ``dir_fd``: temporary file, then rename.

    The temporary is ``.<name>.<random>.<pid>.tmp``: a fresh name no one can guess (made by
    :func:`gdskit.durable.create_new_file`, never through a link), ending in the writer's pid
    so that a reader can tell one left by a process that died.
    """
    tmp, fd = _new_temp(dir_fd, name)
    try:
        os.fchmod(fd, 0o600)  # the umask may have taken bits off
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        _unlink_at(tmp, dir_fd)
        raise
    os.close(fd)
    try:
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        _unlink_at(tmp, dir_fd)
        raise


def _new_temp(dir_fd: int, name: str) -> tuple[str, int]:
    """A new temporary for ``name`` in ``dir_fd``: its name and descriptor (a name someone put
    there first is passed over, never removed or followed)."""
    for _attempt in range(16):
        tmp = f".{name}.{unguessable_token()}.{os.getpid()}.tmp"
        try:
            return tmp, create_new_file(tmp, 0o600, dir_fd=dir_fd)
        except FileExistsError:
            continue
    raise from_os_error(FileExistsError(errno.EEXIST, "could not make a temporary file"), name)


def _unlink_at(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def prepare_dir(place: StatsDir, uid: int | None = None) -> None:
    """Make ``place`` (mode 0700) or check the one there; :class:`GdskitPermissionError` when it will not do.

    An existing directory's mode is never changed: a default one someone else made,
    or made open to others, is passed over rather than taken over.
    """
    uid = os.geteuid() if uid is None else uid
    created = False
    try:
        os.mkdir(place.path, 0o700)
        created = True
    except FileExistsError:
        pass
    except FileNotFoundError:
        if not place.make_parents:
            raise
        os.makedirs(os.path.dirname(place.path), 0o700, exist_ok=True)
        try:
            os.mkdir(place.path, 0o700)
            created = True
        except FileExistsError:
            pass
    if created:  # mkdir's mode passes through the umask; fix it through a descriptor of what we made
        fd = os.open(place.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_uid == uid:
                os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    os.close(open_dir(place, uid))


def publication_dir(environ: Mapping[str, str] | None = None) -> StatsDir:
    """The directory this process publishes in: the first of :func:`candidate_dirs` it can use.

    :class:`GdskitPermissionError`, saying what was wrong with each, when none will do.
    """
    problems = []
    for place in candidate_dirs(os.geteuid(), environ):
        try:
            prepare_dir(place)
            return place
        except OSError as exc:
            problems.append(f"{place.path}: {exc.strerror or exc}")
    raise GdskitPermissionError(errno.EPERM, "no usable gdskit stats directory (" + "; ".join(problems)
                                + "); set GDSKIT_STATS_DIR to a directory of yours that others cannot write", None)


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
        """Whom to publish for, from the environment as it is now (read again at each start);
        where is chosen as publication starts."""
        self.session = os.environ.get(SESSION_ENV) or None
        self.run_dir = os.environ.get(RUN_DIR_ENV) or None
        self.place: StatsDir | None = None

    @property
    def directory(self) -> str | None:
        return None if self.place is None else self.place.path

    @property
    def file(self) -> str | None:
        return None if self.place is None else os.path.join(self.place.path, snapshot_name(self.pid))

    def _choose_place(self) -> None:
        old = self.file
        self.place = publication_dir()
        if old is not None and old != self.file:
            _remove(old)  # its old directory would not do any more: leave nothing behind there

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._choose_place()
        self.publish(force=True)  # at once: `gdskit stats -p` finds the process as soon as it publishes
        self.started = True
        self._stop = threading.Event()
        self._thread = start_thread(self._loop, "gdskit-stats")

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
            if target is not None:
                write_private(target, data)
                return
            if self.place is None:
                self._choose_place()
            try:
                write_private(self.file, data, private=self.place.private)
            except (FileNotFoundError, GdskitPermissionError):
                self._choose_place()  # the directory was removed, or no longer fit: choose again
                write_private(self.file, data, private=self.place.private)
            self._published = state

    def remove_live(self) -> None:
        with self._write_lock:
            self._published = None
            if self.file is not None:
                _remove(self.file)

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


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def start_publishing() -> bool:
    """Publish this process's ledger from now on (``settings.stats_level`` must be >= 1).

    Idempotent. Returns False when publication is off or cannot start (the reason
    is warned once: e.g. a ``GDSKIT_STATS_DIR`` that other users can write into, or
    no default location this user can use).
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
        at_exit(STOP_WORK, _at_exit)
        os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent,
                            after_in_child=_after_fork_child)
