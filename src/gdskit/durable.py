"""Small pieces of crash-safe file handling shared by the engine and the checkpoint writers.

A file is written under a hidden temporary name beside its destination, fsynced and
renamed over the destination: a reader sees the old file or the new one, never half of
one. A writer killed before its rename (``kill -9``, a crash, a lost node) leaves its
temporary behind, up to the full size of the file. Writers therefore hold an advisory
lock (``flock``) on their temporary for as long as they write it; the lock goes with the
process, however it ends. :func:`remove_stale_temps` removes the temporaries of a
destination whose lock it can take: no live process is writing them.

Files are opened through :func:`open_file_fd`, which never waits on a FIFO: a listed file
swapped for one by another user would otherwise hang the reader until someone writes.

Every temporary file gdskit makes is made by :func:`create_new_file` (through
:func:`create_temp_file` or :func:`create_locked_temp`): a name no one can guess, fresh for each
file, created only if nothing is there (never through a symbolic link someone planted) and
written through its descriptor, never reopened by name.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass

from gdskit.errors import GdskitIOError, GdskitIsADirectoryError, InvalidArgumentError, NotAFileError, from_os_error

#: Files being written carry this ending (and a leading dot) until they are complete.
TEMP_SUFFIX = ".gdskit-tmp"
#: How every new file is opened: made here or not at all (a name someone planted, a symbolic
#: link included, is an error, never followed), and not inherited by programs started later.
_NEW_FILE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def unguessable_token() -> str:
    """16 random hex digits, fresh on every call: what tells one temporary file's name from another's."""
    return secrets.token_hex(8)


def create_new_file(path: str, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
    """Create the file ``path`` (in the directory open as ``dir_fd``, if given) for reading and
    writing and return its descriptor: the one place gdskit's new files are opened. Raises
    FileExistsError where anything is at ``path`` (a planted symbolic link too: never followed)."""
    return os.open(path, _NEW_FILE_FLAGS, mode, dir_fd=dir_fd)


def create_temp_file(directory: str | os.PathLike[str], prefix: str, suffix: str = "",
                     mode: int = 0o600) -> tuple[int, str]:
    """A new file ``directory/prefix<random>suffix`` made by :func:`create_new_file`:
    its descriptor and path (a name someone planted first is passed over for another).

    Use the descriptor, or :func:`fd_path` of it, never the name again: another user who can
    write ``directory`` can swap what is at the name.
    """
    directory = os.fspath(directory)
    for _attempt in range(16):
        path = os.path.join(directory, f"{prefix}{unguessable_token()}{suffix}")
        try:
            return create_new_file(path, mode), path
        except FileExistsError:
            continue
    raise from_os_error(FileExistsError(errno.EEXIST, "could not make a temporary file"),
                        os.path.join(directory, prefix))


def fd_path(fd: int) -> str:
    """A path that opens the very file open as ``fd`` (``/proc/self/fd/N``), whatever has happened
    to its name since: for code that can only be given a path (an engine file, a plot's save)."""
    return f"/proc/self/fd/{fd}"


def _kind(mode: int) -> str:
    """What a file of ``mode`` is, in words, for an error that refuses it."""
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a file"


def open_file_fd(path: str, flags: int, mode: int = 0o666) -> tuple[int, os.stat_result]:
    """``os.open(path, flags, mode)`` of a file, with its ``fstat``, for positional I/O.

    Opened with ``O_NONBLOCK`` so that a FIFO answers at once instead of waiting for its
    other end, and the flag is cleared again for the file. A directory raises
    :class:`GdskitIsADirectoryError`, a FIFO, socket or terminal :class:`NotAFileError`;
    files and block and memory devices are kept. OS errors are :class:`GdskitIOError`\\ s
    naming ``path``; nothing is left open after an error.
    """
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as exc:
        raise from_os_error(exc, path) from exc
    try:
        st = os.fstat(fd)
        kind = st.st_mode
        if not stat.S_ISREG(kind):  # a file needs no more questions (this runs for every file opened)
            if stat.S_ISDIR(kind):
                raise GdskitIsADirectoryError(errno.EISDIR, "Is a directory", path)
            if stat.S_ISFIFO(kind) or stat.S_ISSOCK(kind) or os.isatty(fd):
                what = "a terminal" if stat.S_ISCHR(kind) else _kind(kind)
                raise NotAFileError(errno.ESPIPE, f"is {what}, not a file (gdskit reads and writes at offsets)", path)
        if not flags & os.O_NONBLOCK:
            # F_SETFL takes only the status flags (O_APPEND, O_DIRECT, ...) of those given: one call.
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    except BaseException as exc:
        os.close(fd)
        if isinstance(exc, OSError):
            raise from_os_error(exc, path) from exc
        raise
    return fd, st


def replacement_target(path: str) -> str:
    """The file a write of ``path`` whole (a temporary renamed over it) replaces: ``path`` with its
    symbolic links followed, so that a link keeps pointing where it did.

    Raises :class:`GdskitIsADirectoryError` for a directory and :class:`NotAFileError` for a device,
    FIFO or socket: a rename would replace it with a file (``/dev/null`` gone, as root).
    """
    real = os.path.realpath(path)
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        return real
    except OSError as exc:
        raise from_os_error(exc, path) from exc
    if stat.S_ISDIR(mode):
        raise GdskitIsADirectoryError(errno.EISDIR, "Is a directory", path)
    if not stat.S_ISREG(mode):
        raise NotAFileError(errno.ESPIPE, f"is {_kind(mode)}: a file written whole would replace it", path)
    return real


def read_whole_file(path: str) -> bytes:
    """Every byte of the file at ``path``, opened as :func:`open_file_fd` opens it (a FIFO is
    refused, never waited on); OS errors are :class:`GdskitIOError`\\ s naming ``path``."""
    fd, st = open_file_fd(path, os.O_RDONLY)
    try:
        parts, got = [], 0
        while True:
            part = os.read(fd, max(st.st_size - got, 0) + 65536)  # to the end, even if the file grew
            if not part:
                return b"".join(parts)
            parts.append(part)
            got += len(part)
    finally:
        os.close(fd)


# What :func:`temp_name` puts between the name and the suffix (random or given hex).
_TOKEN = re.compile(r"[0-9a-f]{1,32}")


def temp_name(name: str, token: str | None = None) -> str:
    """The hidden name a file called ``name`` has while it is being written (``token``
    tells writers apart; a random one by default)."""
    return f".{name}.{token or unguessable_token()}{TEMP_SUFFIX}"


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is one of :func:`temp_name`'s (left behind by a writer that died)."""
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def is_temp_of(entry: str, name: str) -> bool:
    """Whether directory entry ``entry`` is a :func:`temp_name` of destination ``name``
    (and of no other destination: ``.a.pt.<hex>.gdskit-tmp`` belongs to ``a.pt``, not ``a``)."""
    prefix = f".{name}."
    if not (entry.startswith(prefix) and entry.endswith(TEMP_SUFFIX)):
        return False
    return _TOKEN.fullmatch(entry[len(prefix):-len(TEMP_SUFFIX)]) is not None


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename or a new name in ``directory`` durable.

    Filesystems that cannot fsync a directory (they answer EINVAL) are skipped; any
    other failure is raised, because the caller's data would not be durable.
    """
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def remove_if_present(path: str | os.PathLike[str]) -> bool:
    """Delete ``path``; False when it was not there."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


@dataclass
class OwnedTemp:
    """A temporary file this process is writing: ``path``, and ``fd``, the descriptor
    whose open file holds the lock (other descriptors of the file may come and go).

    Call :meth:`close` once the file has been renamed into place, or :meth:`discard`
    on failure: both release the descriptor at once, so that no error path keeps a
    deleted file's space in use until the garbage collector runs.
    """

    path: str
    fd: int

    @property
    def fd_path(self) -> str:
        """A path that opens this very file whatever happens to its name (:func:`fd_path`)."""
        return fd_path(self.fd)

    def publish(self, destination: str | os.PathLike[str]) -> None:
        """Rename the file over ``destination``, if the name still holds this file: someone who
        swapped it (a link to another file) gets an error, never a rename of what they put there."""
        try:
            ours = _same_file(os.stat(self.path, follow_symlinks=False), os.fstat(self.fd))
        except FileNotFoundError:
            ours = False
        if not ours:
            raise GdskitIOError(errno.EEXIST, "the temporary file was replaced by something else", self.path)
        os.replace(self.path, destination)

    def close(self) -> None:
        """Release the descriptor (and with it the lock)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def discard(self) -> None:
        """Remove the file, then release the descriptor; raises nothing."""
        try:
            remove_if_present(self.path)
        except OSError:
            pass
        finally:
            try:
                self.close()
            except OSError:
                pass


def create_locked_temp(directory: str | os.PathLike[str], name: str, *, mode: int = 0o666) -> OwnedTemp:
    """Create ``directory``/:func:`temp_name` (``name``) by :func:`create_new_file`, under a fresh
    random name, and lock it for as long as the returned descriptor stays open.

    A concurrent :func:`remove_stale_temps` can take the lock of a new file in the instant
    between its creation and the lock; the file is then gone by the time the lock is ours,
    which is checked, and another one is made. On filesystems without ``flock`` the file is
    made unlocked, and no sweep ever removes it.
    """
    directory = os.fspath(directory)
    for _attempt in range(16):
        path = os.path.join(directory, temp_name(name))
        try:
            fd = create_new_file(path, mode)
        except FileExistsError:
            continue  # someone put something at this name: never touched, another name taken
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # waits only while a sweep looks at this very file
            except OSError as exc:
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                return OwnedTemp(path, fd)
            try:
                still_ours = _same_file(os.stat(path, follow_symlinks=False), os.fstat(fd))
            except FileNotFoundError:
                still_ours = False
            if still_ours:
                return OwnedTemp(path, fd)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # a sweep removed it before the lock was ours
    raise from_os_error(FileExistsError(errno.EEXIST, "could not make a temporary file"), os.path.join(directory, name))


def check_output_file(name: str, option: str) -> str:
    """Check, before any work starts, that the output file a command-line ``option`` names can be
    made: a file (new, or one to replace whole) in a directory that exists, or a character device
    to write into (``/dev/null``); never a directory, FIFO, socket or block device (a report
    written over a disk). Symbolic links are followed. Returns ``name``.

    Raises :class:`~gdskit.errors.InvalidArgumentError` naming the option.
    """
    try:
        mode = os.stat(name).st_mode
    except OSError:
        mode = None
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
        raise InvalidArgumentError(f"{option} {name!r} is {_kind(mode)}; name a file")
    folder = os.path.dirname(os.path.realpath(name))
    if not os.path.isdir(folder):
        raise InvalidArgumentError(f"{option} {name!r}: the directory {folder!r} does not exist")
    return name


def write_whole(path: str | os.PathLike[str], fill: Callable[[str], None]) -> None:
    """Have ``fill(tmp)`` write a new file at ``tmp``, a path to a hidden temporary file beside ``path``,
    then rename it over ``path``: a reader sees the old file or the new one, never part of one.
    On any error the temporary is removed and ``path`` is left as it was.

    A symbolic link is followed: what it points to is replaced, the link stays. A character
    device (``/dev/null``, a terminal) is written into by ``fill(path)``, never replaced by a
    file; anything else that is not a file is refused (:func:`check_output_file`).
    """
    real = os.path.realpath(os.fspath(path))
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        check_output_file(real, "the output")
        fill(real)
        return
    folder, name = os.path.split(real)
    owned = create_locked_temp(folder, name)
    try:
        fill(owned.fd_path)  # the file itself, whatever is put at its name meanwhile
        owned.publish(real)
    except BaseException:
        owned.discard()
        raise
    owned.close()


def write_text_whole(path: str | os.PathLike[str], text: str) -> None:
    """``text`` (UTF-8) as the whole of the file ``path``, by :func:`write_whole`."""
    def fill(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)

    write_whole(path, fill)


def remove_stale_temps(directory: str | os.PathLike[str], name: str) -> list[str]:
    """Remove the temporaries of destination ``name`` in ``directory`` that no live
    process is writing; returns their paths.

    Each candidate (a regular file named by :func:`temp_name` for ``name``) is locked
    without waiting: a live writer holds its lock, so only the leftovers of writers that
    died give it up. Anything that cannot be opened, locked or checked is left alone.
    """
    directory = os.fspath(directory)
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for entry in entries:
        if not is_temp_of(entry, name):
            continue
        path = os.path.join(directory, entry)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live writer holds it (or the filesystem cannot say)
            if _same_file(os.stat(path, follow_symlinks=False), st) and remove_if_present(path):
                removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


# -- caches kept between processes ------------------------------------------------
#
# What a process learns once and later processes may reuse (compiled kernels, parsed headers)
# lives in ``$XDG_CACHE_HOME/gdskit/<kind>``. A cached file is used only where its folder and
# itself are this user's alone: whoever else could write it could make this process run or
# trust what they wrote. A cache that cannot be read or written is no error: the work is done
# again.

def cache_folder(kind: str) -> str:
    """``$XDG_CACHE_HOME/gdskit/<kind>`` (``~/.cache`` without the variable)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gdskit", kind)


def _private(st: os.stat_result) -> bool:
    """Owned by this user and writable by no one else."""
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def open_private_folder(folder: str, *, make: bool) -> int | None:
    """A descriptor of the cache ``folder``, or None where it is not this user's alone.

    Everything after goes through the descriptor (``dir_fd``): whoever can change a folder above
    it cannot redirect a read or a write once the folder itself was found private, and a link at
    the folder's own name is refused (``O_NOFOLLOW``)."""
    try:
        if make:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if _private(os.fstat(fd)):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def read_private(path: str, max_bytes: int) -> bytes | None:
    """The bytes of the regular file ``path`` where it and its folder are this user's alone and it
    holds at most ``max_bytes``; None otherwise (or where it cannot be read)."""
    folder = open_private_folder(os.path.dirname(path), make=False)
    if folder is None:
        return None
    try:
        fd = os.open(os.path.basename(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     dir_fd=folder)
    except OSError:
        return None
    finally:
        os.close(folder)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not _private(st) or st.st_size > max_bytes:
            return None
        data = os.pread(fd, st.st_size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) == st.st_size else None


def write_private(path: str, data: bytes, *, durable: bool = True) -> None:
    """Keep ``data`` at ``path`` for later processes: a new file of random name in the private
    folder (made where missing), written whole (and fsynced, unless ``durable`` is False: for
    data that carries its own checksum, whose torn copy after a crash its reader refuses), then
    renamed over ``path`` within that folder; nothing is written where the folder is not this
    user's alone."""
    folder = open_private_folder(os.path.dirname(path), make=True)
    if folder is None:
        return
    tmp = temp_name(os.path.basename(path))
    try:
        fd = create_new_file(tmp, 0o600, dir_fd=folder)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, os.path.basename(path), src_dir_fd=folder, dst_dir_fd=folder)
    except OSError:
        _unlink_quietly(tmp, folder)
    finally:
        os.close(folder)


def _unlink_quietly(name: str, folder: int) -> None:
    try:
        os.unlink(name, dir_fd=folder)
    except OSError:
        pass  # gone already, or never written


def remove_private(path: str) -> None:
    """Remove the cached file ``path`` (only a file in the private folder, by its name there)."""
    folder = open_private_folder(os.path.dirname(path), make=False)
    if folder is None:
        return
    try:
        _unlink_quietly(os.path.basename(path), folder)
    finally:
        os.close(folder)


def trim_private(folder: str, prefix: str, keep: int) -> None:
    """Where the private ``folder`` holds more than ``keep`` files named ``prefix...``, remove the
    oldest (by modification time) down to three quarters of ``keep``; and temporaries of such
    files left by a writer that died, once an hour old."""
    fd = open_private_folder(folder, make=False)
    if fd is None:
        return
    try:
        names = os.listdir(fd)
        kept = [n for n in names if n.startswith(prefix)]
        stale = [n for n in names if is_temp_name(n) and n[1:].startswith(prefix)]
        if len(kept) <= keep and not stale:
            return
        ages = {}
        for name in kept + stale:
            try:
                ages[name] = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mtime
            except OSError:
                continue
        now = time.time()
        doomed = [n for n in stale if n in ages and now - ages[n] > 3600]
        if len(kept) > keep:
            doomed += sorted((n for n in kept if n in ages), key=ages.__getitem__)[:len(kept) - keep * 3 // 4]
        for name in doomed:
            _unlink_quietly(name, fd)
    finally:
        os.close(fd)
