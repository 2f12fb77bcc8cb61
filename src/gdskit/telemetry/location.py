"""Where snapshots live, and who a process is.

One directory per user, private to that user (0700): ``$GDSKIT_STATS_DIR`` if
set, else ``$XDG_RUNTIME_DIR/gdskit``, else ``/dev/shm/gdskit-<uid>``, else
``<tempdir>/gdskit-<uid>``. A process publishes ``<pid>.json`` there. A pid
alone does not name a process for long (pids are reused), so a snapshot also
carries the process's start time (``/proc/<pid>/stat``, clock ticks since boot).
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Mapping

from gdskit.errors import GdskitPermissionError, ProcessNotFoundError

DIR_ENV = "GDSKIT_STATS_DIR"          # where to publish (and look), overriding the defaults
SESSION_ENV = "GDSKIT_STATS_SESSION"  # set by `gdskit run`: the token its processes write into their snapshots
RUN_DIR_ENV = "GDSKIT_STATS_RUN_DIR"  # set by `gdskit run`: where they leave their final snapshots
SNAPSHOT_SUFFIX = ".json"


def stats_dir(uid: int | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The snapshot directory of ``uid`` (default: this user) for a process with ``environ``."""
    environ = os.environ if environ is None else environ
    uid = os.geteuid() if uid is None else uid
    if environ.get(DIR_ENV):
        return environ[DIR_ENV]
    xdg = environ.get("XDG_RUNTIME_DIR")
    if xdg and _is_dir_of(xdg, uid):
        return os.path.join(xdg, "gdskit")
    if os.path.isdir("/dev/shm"):
        return f"/dev/shm/gdskit-{uid}"
    return os.path.join(tempfile.gettempdir(), f"gdskit-{uid}")


def default_dirs(uid: int) -> list[str]:
    """Every place a process of ``uid`` publishes when no ``GDSKIT_STATS_DIR`` is set."""
    out = []
    run_user = f"/run/user/{uid}"
    if _is_dir_of(run_user, uid):
        out.append(os.path.join(run_user, "gdskit"))
    out.append(f"/dev/shm/gdskit-{uid}")
    out.append(os.path.join(tempfile.gettempdir(), f"gdskit-{uid}"))
    return out


def _is_dir_of(path: str, uid: int) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid


def ensure_private_dir(path: str) -> str:
    """Create ``path`` (0700) or check that the existing one is ours and not writable by others.

    A directory someone else can write into would let them swap our snapshots, so it is refused.
    An existing directory's mode is never changed (it may be a shared one named by GDSKIT_STATS_DIR).
    """
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # mkdir's mode passes through the umask
        return path
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return ensure_private_dir(path)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise GdskitPermissionError(errno.ENOTDIR, "the gdskit stats directory is not a directory", path)
    if st.st_uid != os.geteuid():
        raise GdskitPermissionError(errno.EPERM, f"the gdskit stats directory belongs to uid {st.st_uid}", path)
    if st.st_mode & 0o022:
        raise GdskitPermissionError(errno.EPERM, "the gdskit stats directory is writable by other users; "
                                    "point GDSKIT_STATS_DIR at a private one", path)
    return path


def snapshot_name(pid: int) -> str:
    return f"{pid}{SNAPSHOT_SUFFIX}"


def pid_of(filename: str) -> int | None:
    """The pid a live snapshot's file name stands for (``None`` for anything else)."""
    stem = filename[:-len(SNAPSHOT_SUFFIX)] if filename.endswith(SNAPSHOT_SUFFIX) else ""
    return int(stem) if stem.isdigit() else None


def _stat_field(pid: int, index: int) -> int | None:
    """Field ``index + 3`` of ``/proc/<pid>/stat`` (proc(5) numbering), or ``None`` when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # Field 2 (the command) may hold spaces and parentheses: count fields from the last ')'.
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        return int(fields[index])
    except (IndexError, ValueError):
        return None


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot), or ``None`` when there is no such process."""
    return _stat_field(pid, 19)  # field 22 of proc(5), starttime


def descendants(pid: int) -> list[tuple[int, int | None]]:
    """Every process below ``pid`` (children, their children...), each with its start time."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            ppid = _stat_field(int(name), 1)  # field 4 of proc(5), ppid
            if ppid is not None:
                parents[int(name)] = ppid
    found: list[int] = []
    level = {pid}
    while level:
        level = {child for child, parent in parents.items() if parent in level}
        found += sorted(level)
    return [(p, start_ticks(p)) for p in found]


def is_running(pid: int, ticks: int | None) -> bool:
    """Whether ``pid`` is still the process that started at ``ticks`` (not dead, not a reused pid)."""
    now = start_ticks(pid)
    if now is None:
        return False
    return ticks is None or now == ticks


def process_uid(pid: int) -> int:
    """The user a process runs as; :class:`ProcessNotFoundError` when there is none."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except FileNotFoundError:
        raise ProcessNotFoundError(f"no process with pid {pid}") from None


def process_environ(pid: int) -> dict[str, str] | None:
    """The environment ``pid`` was started with (``None`` where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def process_command(pid: int) -> str:
    """The command line of ``pid``, for messages ("" when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
    except OSError:
        return ""


def user_name(uid: int) -> str:
    try:
        import pwd  # noqa: PLC0415 - Unix only

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"
