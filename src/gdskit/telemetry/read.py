"""Reading other processes' snapshots, and cleaning up after dead ones.

Nothing here trusts a file. A directory is read only when it belongs to the
process's user and no one else can write into it (:func:`location.open_dir`);
a snapshot only when it is a regular file (not a link, FIFO or device: it is
checked before it is opened, and opened without following links or blocking)
owned by that user and at most :data:`schema.MAX_SNAPSHOT_BYTES` long; then
its contents are checked field by field (:mod:`gdskit.telemetry.schema`).
Snapshots of processes that died without removing theirs (killed, crashed), or
whose pid now names another process, are removed by whoever reads the
directory next.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Callable

from gdskit.errors import (
    FormatError,
    GdskitError,
    GdskitPermissionError,
    NotPublishingError,
    ProcessNotFoundError,
    from_os_error,
)
from gdskit.settings import env_name
from gdskit.telemetry.location import (
    DIR_ENV,
    StatsDir,
    candidate_dirs,
    is_decimal,
    is_running,
    open_dir,
    pid_of,
    process_command,
    process_environ,
    process_uid,
    snapshot_name,
    start_ticks,
    unique,
    user_name,
)
from gdskit.telemetry.schema import MAX_SNAPSHOT_BYTES, parse
from gdskit.telemetry.snapshot import Snapshot

RUN_DIR_PREFIX = "run-"

#: What a listing refused: (path, the error).
Refusals = list[tuple[str, GdskitError]]


def load_at(dir_fd: int, name: str, owner: int | None, label: str) -> dict:
    """Read and check the snapshot ``name`` in the directory open as ``dir_fd``.

    ``owner`` is the uid the file must belong to; ``label`` names it in errors.
    A missing file is a ``FileNotFoundError``; anything else wrong a :class:`GdskitError`.
    """
    try:
        before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as exc:
        raise from_os_error(exc, label) from None
    _check_file(before, owner, label)  # before opening: opening a FIFO or a device may block or act
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except PermissionError:
        raise GdskitPermissionError(errno.EACCES, "gdskit stats snapshots are readable only by the user "
                                    "who runs the process (mode 0600)", label) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise GdskitPermissionError(errno.ELOOP, "refusing a snapshot that is a symbolic link", label) from None
        raise from_os_error(exc, label) from None
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise FormatError(f"{label}: replaced while being opened")
        _check_file(st, owner, label)
        raw = _read_at_most(fd, MAX_SNAPSHOT_BYTES + 1, label)
    finally:
        os.close(fd)
    return parse(raw, label)


def _check_file(st: os.stat_result, owner: int | None, label: str) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise GdskitPermissionError(errno.ELOOP, "refusing a snapshot that is a symbolic link", label)
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{label}: not a regular file")
    if owner is not None and st.st_uid != owner:
        raise GdskitPermissionError(errno.EPERM, f"snapshot belongs to {user_name(st.st_uid)}, not to "
                                    f"{user_name(owner)} who runs the process; refused", label)
    if st.st_size > MAX_SNAPSHOT_BYTES:
        raise FormatError(f"{label}: {st.st_size} bytes, more than the {MAX_SNAPSHOT_BYTES} a snapshot may be")


def _read_at_most(fd: int, limit: int, label: str) -> bytes:
    parts = []
    left = limit
    while left > 0:
        try:
            chunk = os.read(fd, min(left, 1 << 20))
        except OSError as exc:
            raise from_os_error(exc, label) from None
        if not chunk:
            break
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def load_file(path: str, owner: int | None = None) -> dict:
    """Read and check one snapshot file; ``owner`` is the uid the file (and its directory) must belong to.

    The directory is held to the rule for a named one (closed to other users' writes).
    """
    directory, name = os.path.split(path)
    fd = open_dir(StatsDir(directory or ".", private=False), os.geteuid() if owner is None else owner)
    try:
        return load_at(fd, name, owner, path)
    finally:
        os.close(fd)


def load_dir(place: StatsDir, owner: int, want: Callable[[str], bool],
             refused: Refusals | None = None) -> list[tuple[str, dict]]:
    """The snapshots in ``place`` whose names ``want`` takes, by name.

    An absent directory holds none; a directory not trusted, and files refused, are
    left out (and added to ``refused`` when given).
    """
    try:
        fd = open_dir(place, owner)
    except FileNotFoundError:
        return []
    except GdskitError as exc:
        if refused is not None:
            refused.append((place.path, exc))
        return []
    out = []
    try:
        for name in sorted(os.listdir(fd)):
            if not want(name):
                continue
            path = os.path.join(place.path, name)
            try:
                out.append((name, load_at(fd, name, owner, path)))
            except FileNotFoundError:
                continue  # removed meanwhile: its process ended
            except GdskitError as exc:
                if refused is not None:
                    refused.append((path, exc))
    except OSError:
        pass  # the directory went away while being read
    finally:
        os.close(fd)
    return out


def reader_dirs(owner: int, environ: dict[str, str] | None) -> list[StatsDir]:
    """Where to look for a snapshot of a process of ``owner`` whose environment is ``environ``.

    First where the process itself publishes, in its order; then, where its environment
    cannot be read or names other places than ours, where we would publish; then the defaults.
    """
    dirs: list[StatsDir] = []
    if environ is not None:
        dirs += candidate_dirs(owner, environ)
    if owner == os.geteuid():
        dirs += candidate_dirs(owner)
    return unique(dirs + candidate_dirs(owner, {}))


def read_snapshot(pid: int, *, directory: str | None = None) -> Snapshot:
    """The figures ``pid`` publishes.

    Raises :class:`ProcessNotFoundError` (no such process), :class:`GdskitPermissionError`
    (another user's process, or a snapshot file that is not to be trusted),
    :class:`FormatError` (a malformed snapshot) or :class:`NotPublishingError` (it publishes nothing).
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
    places = [StatsDir(directory, private=False)] if directory else reader_dirs(owner, process_environ(pid))
    untrusted: list[str] = []
    for place in places:
        try:
            fd = open_dir(place, owner)
        except FileNotFoundError:
            continue
        except GdskitPermissionError as exc:
            untrusted.append(f"{place.path} ({exc.strerror})")
            continue
        path = os.path.join(place.path, snapshot_name(pid))
        try:
            doc = load_at(fd, snapshot_name(pid), owner, path)
        except FileNotFoundError:
            continue
        finally:
            os.close(fd)
        if doc.get("start_ticks") not in (None, ticks) or doc["pid"] != pid:
            _remove(path)  # left by an earlier process that had this pid
            continue
        return Snapshot(doc, path)
    message = _not_publishing_message(pid)
    if untrusted:
        message += "; not looked in: " + "; ".join(untrusted)
    raise NotPublishingError(message)


def _not_publishing_message(pid: int) -> str:
    cmd = process_command(pid)
    who = f"process {pid}" + (f" ({cmd[:80]})" if cmd else "")
    env = process_environ(pid) or {}
    var = env_name("stats_level")
    if env.get(var, "0") not in ("", "0", "off", "false", "no"):
        return (f"{who} has {var}={env[var][:20]} but publishes no figures: it has not imported gdskit (yet), "
                f"or it publishes elsewhere ({DIR_ENV})")
    return (f"{who} is not publishing gdskit figures: start it with {var}=1 (2 or 3 for more detail), "
            f"or run it under `gdskit run`, or call gdskit.settings.set(stats_level=1) in it")


def list_dirs() -> list[StatsDir]:
    """Where this user's processes publish (as :func:`list_snapshots` looks)."""
    if os.environ.get(DIR_ENV):
        return candidate_dirs()
    return unique(candidate_dirs() + candidate_dirs(environ={}))


def list_snapshots(*, directory: str | None = None, clean: bool = True,
                   refused: Refusals | None = None) -> list[Snapshot]:
    """The snapshots of this user's publishing processes, by pid (stale ones removed first).

    Files that cannot be trusted or read are left out; ``refused`` (a list) collects them.
    """
    places = [StatsDir(directory, private=False)] if directory else list_dirs()
    me = os.geteuid()
    found: dict[int, Snapshot] = {}
    for place in places:
        if clean:
            clean_stale(place.path, snapshots=False, private=place.private)  # the snapshots are judged below
        for name, doc in load_dir(place, me, lambda n: pid_of(n) is not None, refused):
            pid = pid_of(name)
            path = os.path.join(place.path, name)
            if pid in found:
                continue
            if doc["pid"] == pid and is_running(pid, doc.get("start_ticks")):
                found[pid] = Snapshot(doc, path)
            elif clean:
                _remove(path)  # a dead process's snapshot, or one under a name not its own (ours: checked)
    return [found[p] for p in sorted(found)]


def clean_stale(directory: str, *, snapshots: bool = True, private: bool = False) -> list[str]:
    """Remove what dead processes left in ``directory``: snapshots (unless ``snapshots`` is
    False), temporary files, run directories.

    Only this user's entries are touched, and only in a directory that is this user's and
    closed to others (``private``: of mode 0700). Returns the paths removed.
    """
    me = os.geteuid()
    removed: list[str] = []
    try:
        fd = open_dir(StatsDir(directory, private=private), me)
    except OSError:
        return removed
    try:
        for name in os.listdir(fd):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if st.st_uid != me or (not snapshots and pid_of(name) is not None and stat.S_ISREG(st.st_mode)):
                continue
            if _is_stale(fd, directory, name, st):
                path = os.path.join(directory, name)
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(path, ignore_errors=True)  # in our own directory: no one else can swap it
                else:
                    _remove(path)
                removed.append(path)
    except OSError:
        pass
    finally:
        os.close(fd)
    return removed


def _is_stale(dir_fd: int, directory: str, name: str, st: os.stat_result) -> bool:
    pid = pid_of(name)
    if pid is not None and stat.S_ISREG(st.st_mode):
        try:
            doc = load_at(dir_fd, name, os.geteuid(), os.path.join(directory, name))
        except (OSError, GdskitError):
            return False  # not a gdskit snapshot (GDSKIT_STATS_DIR may hold other files), or unreadable
        return doc["pid"] != pid or not is_running(pid, doc.get("start_ticks"))
    if name.startswith(".") and name.endswith(".tmp") and stat.S_ISREG(st.st_mode):
        writer = name[:-len(".tmp")].rsplit(".", 1)[-1]  # .<file>.<pid>.tmp
        return is_decimal(writer) and start_ticks(int(writer)) is None
    if name.startswith(RUN_DIR_PREFIX) and stat.S_ISDIR(st.st_mode):
        return not run_dir_owner_alive(name)
    return False


def run_dir_name(pid: int, ticks: int | None, token: str) -> str:
    """A run directory's name: the runner's pid and start time say when it is stale."""
    return f"{RUN_DIR_PREFIX}{pid}-{ticks or 0}-{token}"


def run_dir_owner_alive(name: str) -> bool:
    parts = name[len(RUN_DIR_PREFIX):].split("-")
    if len(parts) < 3 or not is_decimal(parts[0]) or not is_decimal(parts[1], 20):
        return True  # not ours to judge
    ticks = int(parts[1]) or None
    return is_running(int(parts[0]), ticks)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
