"""Where snapshots live, which directories are trusted, and who a process is.

``$GDSKIT_STATS_DIR`` when set is the one place a process publishes (and where
readers look first): it must belong to the user and not be writable by others.
Otherwise a process publishes in the first usable of :func:`candidate_dirs`:
``$XDG_RUNTIME_DIR/gdskit``, ``/run/user/<uid>/gdskit``, ``/dev/shm/gdskit-<uid>``,
``$TMPDIR/gdskit-<uid>`` (``/tmp`` without ``TMPDIR``), ``~/.cache/gdskit/stats-<uid>``;
each must be a directory (not a link) of the user with mode 0700, or one the
publisher can create so. A path someone else created first is passed over, not
fought over. Readers look in the same places in the same order and never read a
directory the process's user does not own or that another user can write.

A process publishes ``<pid>.json``. A pid alone does not name a process for long
(pids are reused), so a snapshot also carries the process's start time
(``/proc/<pid>/stat``, clock ticks since boot).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from gdskit.errors import GdskitPermissionError, ProcessNotFoundError, from_os_error

DIR_ENV = "GDSKIT_STATS_DIR"          # where to publish (and look), overriding the defaults
SESSION_ENV = "GDSKIT_STATS_SESSION"  # set by `gdskit run`: the token its processes write into their snapshots
RUN_DIR_ENV = "GDSKIT_STATS_RUN_DIR"  # set by `gdskit run`: where they leave their final snapshots
SNAPSHOT_SUFFIX = ".json"

# The system directories of the defaults; tests point them elsewhere with system_dirs().
_system = {"shm": "/dev/shm", "run_user": "/run/user"}


@contextlib.contextmanager
def system_dirs(*, shm: str | None = None, run_user: str | None = None) -> Iterator[None]:
    """Test seam: use ``shm`` instead of ``/dev/shm`` and ``run_user`` instead of ``/run/user``."""
    before = dict(_system)
    _system.update({k: v for k, v in (("shm", shm), ("run_user", run_user)) if v is not None})
    try:
        yield
    finally:
        _system.clear()
        _system.update(before)


@dataclass(frozen=True)
class StatsDir:
    """A place for snapshots.

    ``private``: a default location, which must have mode 0700; otherwise (``GDSKIT_STATS_DIR``,
    a run directory) it need only be closed to other users' writes, and its mode is the user's
    business. ``make_parents``: a publisher may create the missing directories above it.
    """

    path: str
    private: bool = True
    make_parents: bool = False


def candidate_dirs(uid: int | None = None, environ: Mapping[str, str] | None = None) -> list[StatsDir]:
    """Where a process of ``uid`` with ``environ`` publishes: the first of these it can use.

    The one decision of where snapshots go; readers call it too, with the process's environment.
    """
    environ = os.environ if environ is None else environ
    uid = os.geteuid() if uid is None else uid
    named = environ.get(DIR_ENV)
    if named:
        return [StatsDir(named, private=False, make_parents=True)]
    out = []
    xdg = environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg) and _is_dir_of(xdg, uid):
        out.append(StatsDir(os.path.join(xdg, "gdskit")))
    run_user = os.path.join(_system["run_user"], str(uid))
    if _is_dir_of(run_user, uid):
        out.append(StatsDir(os.path.join(run_user, "gdskit")))
    if os.path.isdir(_system["shm"]):
        out.append(StatsDir(os.path.join(_system["shm"], f"gdskit-{uid}")))
    tmp = environ.get("TMPDIR")
    out.append(StatsDir(os.path.join(tmp if tmp and os.path.isabs(tmp) else "/tmp", f"gdskit-{uid}")))
    home = environ.get("HOME") or _home_of(uid)
    if home and os.path.isabs(home):
        out.append(StatsDir(os.path.join(home, ".cache", "gdskit", f"stats-{uid}"), make_parents=True))
    return unique(out)


def unique(dirs: list[StatsDir]) -> list[StatsDir]:
    """``dirs`` without repeated paths (the first one stays)."""
    seen: set[str] = set()
    return [d for d in dirs if not (d.path in seen or seen.add(d.path))]


def stats_dir(uid: int | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The first place a process of ``uid`` with ``environ`` would publish (if it can use it)."""
    return candidate_dirs(uid, environ)[0].path


def _home_of(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_dir
    except (ImportError, KeyError):
        return None


def _is_dir_of(path: str, uid: int) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid


def dir_problem(st: os.stat_result, uid: int, private: bool) -> str | None:
    """Why a directory with status ``st`` cannot hold ``uid``'s snapshots (``None``: it can)."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != uid:
        return f"belongs to {user_name(st.st_uid)}, not to {user_name(uid)}"
    mode = stat.S_IMODE(st.st_mode)
    if private and mode != 0o700:
        return f"has mode {mode:04o}, not 0700"
    if mode & 0o022:
        return f"is writable by other users (mode {mode:04o})"
    return None


def open_dir(place: StatsDir, uid: int) -> int:
    """A descriptor of ``place`` once it is known to be ``uid``'s and closed to others.

    Everything read or written there goes through the descriptor, so the checked
    directory is the one used even if its path changes meanwhile. Raises
    :class:`GdskitPermissionError` for a link or a directory that is not trusted, a
    ``FileNotFoundError`` where there is none.
    """
    try:
        fd = os.open(place.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW | O_DIRECTORY on a link gives ENOTDIR
            what = "is a symbolic link" if os.path.islink(place.path) else "is not a directory"
            raise GdskitPermissionError(exc.errno, f"the gdskit stats directory {what}; refused",
                                        place.path) from None
        raise from_os_error(exc, place.path) from None
    problem = dir_problem(os.fstat(fd), uid, place.private)
    if problem is not None:
        os.close(fd)
        raise GdskitPermissionError(errno.EPERM, f"the gdskit stats directory {problem}; refused", place.path)
    return fd


def snapshot_name(pid: int) -> str:
    return f"{pid}{SNAPSHOT_SUFFIX}"


def pid_of(filename: str) -> int | None:
    """The pid a live snapshot's file name stands for (``None`` for anything else)."""
    stem = filename[:-len(SNAPSHOT_SUFFIX)] if filename.endswith(SNAPSHOT_SUFFIX) else ""
    return int(stem) if is_decimal(stem) else None


def is_decimal(text: str, digits: int = 10) -> bool:
    """Whether ``text`` is a number as gdskit writes one in a file name (ASCII digits, no leading 0)."""
    return 0 < len(text) <= digits and text.isascii() and text.isdigit() and (text == "0" or text[0] != "0")


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
        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"
