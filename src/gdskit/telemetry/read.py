"""Reading other processes' snapshots, and cleaning up after dead ones.

A snapshot is trusted only when its file is a regular file (not a link) owned
by the user the process runs as. Snapshots of processes that died without
removing theirs (killed, crashed), or whose pid now names another process, are
removed by whoever reads the directory next.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat

from gdskit.errors import (
    FormatError,
    GdskitPermissionError,
    NotPublishingError,
    ProcessNotFoundError,
)
from gdskit.settings import env_name
from gdskit.telemetry.location import (
    DIR_ENV,
    default_dirs,
    is_running,
    pid_of,
    process_command,
    process_environ,
    process_uid,
    snapshot_name,
    start_ticks,
    stats_dir,
    user_name,
)
from gdskit.telemetry.snapshot import Snapshot, validate

RUN_DIR_PREFIX = "run-"


def load_file(path: str, owner: int | None = None) -> dict:
    """Read and validate one snapshot file; ``owner`` is the uid the file must belong to."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except PermissionError:
        raise GdskitPermissionError(errno.EACCES, "gdskit stats snapshots are readable only by the user "
                                    "who runs the process (mode 0600)", path) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise GdskitPermissionError(errno.ELOOP, "refusing a snapshot that is a symbolic link", path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path}: not a regular file")
        if owner is not None and st.st_uid != owner:
            raise GdskitPermissionError(errno.EPERM, f"snapshot belongs to {user_name(st.st_uid)}, not to "
                                        f"{user_name(owner)} who runs the process; refused", path)
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read()
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw)
    except ValueError:
        raise FormatError(f"{path}: not valid JSON") from None
    return validate(doc, path)


def _unique(items: list[str]) -> list[str]:
    seen: set[str] = set()
    return [x for x in items if not (x in seen or seen.add(x))]


def _dirs_for(pid: int, owner: int, directory: str | None) -> list[str]:
    if directory:
        return [directory]
    dirs = []
    env = process_environ(pid)
    if env is not None:
        dirs.append(stats_dir(owner, env))
    if owner == os.geteuid():
        dirs.append(stats_dir())
    return _unique(dirs + default_dirs(owner))


def read_snapshot(pid: int, *, directory: str | None = None) -> Snapshot:
    """The figures ``pid`` publishes.

    Raises :class:`ProcessNotFoundError` (no such process), :class:`GdskitPermissionError`
    (another user's process) or :class:`NotPublishingError` (it publishes nothing).
    """
    owner = process_uid(pid)
    me = os.geteuid()
    if owner != me and me != 0:
        raise GdskitPermissionError(
            errno.EACCES, f"process {pid} belongs to {user_name(owner)}: gdskit figures are readable only by "
            f"the user who runs the process (snapshots are mode 0600); run gdskit stats as that user", None)
    ticks = start_ticks(pid)
    if ticks is None:
        raise ProcessNotFoundError(f"no process with pid {pid}")
    for d in _dirs_for(pid, owner, directory):
        path = os.path.join(d, snapshot_name(pid))
        try:
            doc = load_file(path, owner)
        except FileNotFoundError:
            continue
        if doc.get("start_ticks") not in (None, ticks) or doc.get("pid") != pid:
            _remove(path)  # left by an earlier process that had this pid
            continue
        return Snapshot(doc, path)
    raise NotPublishingError(_not_publishing_message(pid))


def _not_publishing_message(pid: int) -> str:
    cmd = process_command(pid)
    who = f"process {pid}" + (f" ({cmd[:80]})" if cmd else "")
    env = process_environ(pid) or {}
    var = env_name("stats_level")
    if env.get(var, "0") not in ("", "0", "off", "false", "no"):
        return (f"{who} has {var}={env[var]} but publishes no figures: it has not imported gdskit (yet), "
                f"or it publishes elsewhere ({DIR_ENV})")
    return (f"{who} is not publishing gdskit figures: start it with {var}=1 (2 or 3 for more detail), "
            f"or run it under `gdskit run`, or call gdskit.settings.set(stats_level=1) in it")


def list_snapshots(*, directory: str | None = None, clean: bool = True) -> list[Snapshot]:
    """The snapshots of this user's publishing processes, by pid (stale ones removed first)."""
    if directory:
        dirs = [directory]
    elif os.environ.get(DIR_ENV):
        dirs = [os.environ[DIR_ENV]]
    else:
        dirs = _unique([stats_dir()] + default_dirs(os.geteuid()))
    found: dict[int, Snapshot] = {}
    for d in dirs:
        if clean:
            clean_stale(d, snapshots=False)  # the snapshots themselves are judged below, each read once
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for name in names:
            pid = pid_of(name)
            if pid is None or pid in found:
                continue
            path = os.path.join(d, name)
            try:
                doc = load_file(path, os.geteuid())
            except (OSError, FormatError):
                continue
            if is_running(pid, doc.get("start_ticks")):
                found[pid] = Snapshot(doc, path)
            elif clean:
                _remove(path)  # a dead process's snapshot (load_file checked it is this user's)
    return [found[p] for p in sorted(found)]


def clean_stale(directory: str, *, snapshots: bool = True) -> list[str]:
    """Remove what dead processes left in ``directory``: snapshots (unless ``snapshots`` is
    False), temporary files, run directories.

    Only this user's entries are touched. Returns the paths removed.
    """
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    me = os.geteuid()
    for name in names:
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != me or (not snapshots and pid_of(name) is not None and stat.S_ISREG(st.st_mode)):
            continue
        if _is_stale(path, name, st):
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path, ignore_errors=True)
            else:
                _remove(path)
            removed.append(path)
    return removed


def _is_stale(path: str, name: str, st: os.stat_result) -> bool:
    pid = pid_of(name)
    if pid is not None and stat.S_ISREG(st.st_mode):
        try:
            with open(path, "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError):
            return False  # unreadable: leave it to its owner
        # Only gdskit's own snapshots: GDSKIT_STATS_DIR may name a directory that holds other files.
        if not isinstance(doc, dict) or not str(doc.get("schema", "")).startswith("gdskit.stats/"):
            return False
        return not is_running(pid, doc.get("start_ticks"))
    if name.startswith(".") and name.endswith(".tmp"):
        writer = name[:-len(".tmp")].rsplit(".", 1)[-1]  # .<file>.<pid>.tmp
        return writer.isdigit() and start_ticks(int(writer)) is None
    if name.startswith(RUN_DIR_PREFIX) and stat.S_ISDIR(st.st_mode):
        return not run_dir_owner_alive(name)
    return False


def run_dir_name(pid: int, ticks: int | None, token: str) -> str:
    """A run directory's name: the runner's pid and start time say when it is stale."""
    return f"{RUN_DIR_PREFIX}{pid}-{ticks or 0}-{token}"


def run_dir_owner_alive(name: str) -> bool:
    parts = name[len(RUN_DIR_PREFIX):].split("-")
    if len(parts) < 3 or not parts[0].isdigit() or not parts[1].isdigit():
        return True  # not ours to judge
    ticks = int(parts[1]) or None
    return is_running(int(parts[0]), ticks)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
