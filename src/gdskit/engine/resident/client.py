"""A load's side of the resident loader: hand it the open files and the destinations, take back
progress, the ledger rows, or why it did not serve.

Light on purpose (the standard library and ctypes): a fresh process that loads through the
resident loader never imports the engine's reading modules or the driver's bindings.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

from gdskit.engine import ledger_inbox
from gdskit.engine.framing import recv_message, send_with_fds
from gdskit.engine.resident import ipc
from gdskit.engine.objects.url import is_object_url
from gdskit.engine.resident import HOST, socket_dir, socket_path
from gdskit.engine.resident.wire import (KIND_DONE, KIND_ERROR, KIND_PROGRESS, KIND_REQUEST, MAX_FILES, MAX_REPLY,
                                         STALL_S, pack_request, peer_uid, private_dir_problem, unpack_json,
                                         unpack_progress)
from gdskit.errors import GdskitError, InvalidArgumentError, ResidentLoaderError, TruncatedFileError, from_os_error
from gdskit.settings import settings
from gdskit.vocabulary import Resident

OnBytes = Callable[[int], None]


def read_to_gpu(files: Sequence[tuple[str, int]], targets: Sequence[tuple[int, int, int, int]], *,
                on_bytes: OnBytes | None = None) -> str | None:
    """Read each ``(pointer, bytes, file, file offset)`` into this process's GPU memory through
    the resident loader of that GPU: ``file`` indexes ``files``, each ``(path, bytes as its header
    said)``. One request, or one for each :data:`~gdskit.engine.resident.wire.MAX_FILES` files
    (one after another).

    Returns None once every byte has landed (the loader's ledger rows are added to this
    process's ledger), else why it was not served: the caller then reads every byte itself (a
    loader that went away mid-load, or refused a read of the request's later part or a later
    request, may have written some; progress reported by ``on_bytes`` is the caller's to take
    back). With ``settings.resident`` ``require`` that reason is raised instead, as
    :class:`~gdskit.errors.ResidentLoaderError`. Raises the files' own errors
    (``TruncatedFileError``, ``GdskitFileNotFoundError``...) as a read in this process would,
    and ResidentLoaderError where the loader failed after writing began or stopped answering.
    The caller has waited for any work queued on the destinations.
    """
    mode = settings.snapshot().resident  # a bad GDSKIT_RESIDENT raises here, as for every request
    if mode is Resident.OFF:
        return "off (GDSKIT_RESIDENT=off)"
    if not targets:
        return _not_served(mode, "nothing to read")
    requests = []
    try:
        gpu = ipc.device_uuid(targets[0][0])
        for part, mine in _requests(files, targets):
            segments = ipc.Segments()
            reads = []
            for ptr, nbytes, k, offset in mine:
                seg, at = segments.place(ptr, nbytes)
                reads.append((k, seg, at, offset, nbytes))
            requests.append((part, segments.handles, reads))
    except ipc.IpcUnavailable as exc:
        return _not_served(mode, f"the destinations cannot be shared with another process: {exc}")
    for part, handles, reads in requests:
        why_not = _exchange(socket_path(gpu), part, gpu, handles, reads, [], on_bytes, mode)
        if why_not is not None:
            return why_not
    return None


def read_to_shared(files: Sequence[tuple[str, int]], memfd: int, reads: Sequence[tuple[int, int, int, int]], *,
                   on_bytes: OnBytes | None = None) -> str | None:
    """As :func:`read_to_gpu`, into the shared mapping ``memfd`` (host memory, ``(place in it,
    bytes, file, file offset)`` each), through the loader that serves no GPU (``gdskit serve --host``)."""
    mode = settings.snapshot().resident  # a bad GDSKIT_RESIDENT raises here, as for every request
    if mode is Resident.OFF:
        return "off (GDSKIT_RESIDENT=off)"
    if not reads:
        return _not_served(mode, "nothing to read")
    for part, mine in _requests(files, reads):
        quints = [(k, 0, place, offset, nbytes) for place, nbytes, k, offset in mine]
        why_not = _exchange(socket_path(HOST), part, None, ["memfd"], quints, [memfd], on_bytes, mode)
        if why_not is not None:
            return why_not
    return None


def _requests(files: Sequence[tuple[str, int]], items: Sequence[tuple[int, int, int, int]]
              ) -> list[tuple[list[tuple[str, int]], list[tuple[int, int, int, int]]]]:
    """``files`` cut into requests of at most MAX_FILES, each with its ``(place, bytes, file,
    file offset)`` items (``file`` counted within its request); requests with nothing to read
    are left out."""
    files = list(files)
    if any(not 0 <= k < len(files) for _p, _n, k, _o in items):
        raise InvalidArgumentError(f"a read names a file outside the {len(files)} given")
    out = []
    for first in range(0, len(files), MAX_FILES):
        mine = [(p, n, k - first, o) for p, n, k, o in items if first <= k < first + MAX_FILES]
        if mine:
            out.append((files[first:first + MAX_FILES], mine))
    return out


def _not_served(mode: Resident, reason: str) -> str:
    if mode is Resident.REQUIRE:
        raise ResidentLoaderError(f"the load could not go through the resident loader (GDSKIT_RESIDENT=require): "
                                  f"{reason}", reason)
    return reason


def _exchange(where: str, files: list[tuple[str, int]], gpu: str | None, segments: list[str],
              reads: list[tuple[int, int, int, int, int]], fds: list[int], on_bytes: OnBytes | None,
              mode: Resident) -> str | None:
    """One request: ``reads`` are ``(file, segment, offset in it, file offset, bytes)``."""
    if any(is_object_url(path) for path, _n in files):
        return _not_served(mode, "an object in a store is read in the process")
    total = sum(r[4] for r in reads)
    problem = private_dir_problem(socket_dir())
    if problem is not None:
        return _not_served(mode, f"no resident loader ({problem})")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(STALL_S)
        try:
            sock.connect(where)
        except (FileNotFoundError, ConnectionRefusedError):
            return _not_served(mode, f"no resident loader is listening at {where}")
        except OSError as exc:
            return _not_served(mode, f"cannot reach the resident loader at {where}: {exc.strerror or exc}")
        if peer_uid(sock) != os.getuid():
            return _not_served(mode, f"the resident loader at {where} runs as another user")
        opened: list[int] = []
        try:
            for path, file_size in files:
                try:
                    opened.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
                except OSError as exc:
                    raise from_os_error(exc, path) from None
                size = os.fstat(opened[-1]).st_size
                if size != file_size:
                    raise TruncatedFileError(f"changed size after its header was read ({file_size} -> {size} bytes)",
                                             path=path)
            payload = pack_request([(os.path.abspath(p), n) for p, n in files], gpu, segments, reads)
            try:
                send_with_fds(sock, KIND_REQUEST, payload, [*opened, *fds])
            except OSError as exc:  # it went away between connect and request: nothing was written
                return _not_served(mode, f"the resident loader at {where} closed the connection ({exc})")
        finally:
            for fd in opened:
                os.close(fd)
        return _answer(sock, where, [p for p, _n in files], total, on_bytes, mode)
    finally:
        sock.close()


def _answer(sock: socket.socket, where: str, paths: list[str], total: int, on_bytes: OnBytes | None,
            mode: Resident) -> str | None:
    path = paths[0] if len(paths) == 1 else f"{paths[0]} and {len(paths) - 1} more files"
    landed = 0
    while True:
        try:
            kind, payload = recv_message(sock, MAX_REPLY)
        except TimeoutError:
            raise ResidentLoaderError(f"the resident loader at {where} stopped answering for {STALL_S:.0f} s "
                                      f"during a load of {path}", "stopped answering") from None
        except (EOFError, ConnectionResetError):
            # The loader ends a connection only once its reads for it have stopped (or it died,
            # and its copies with it): reading everything again here is safe.
            return _not_served(mode, "the resident loader went away mid-load")
        except ValueError as exc:
            raise ResidentLoaderError(f"the resident loader at {where} answered something that is not an "
                                      f"answer ({exc})", "bad answer") from None
        try:
            if kind == KIND_PROGRESS:
                now = unpack_progress(payload)
                if on_bytes is not None and landed < now <= total:
                    on_bytes(now - landed)
                    landed = now
                continue
            if kind == KIND_DONE:
                reply = unpack_json(payload, ("bytes", "rows"))
                if reply["bytes"] != total:
                    raise ResidentLoaderError(f"the resident loader landed {reply['bytes']} of {total} bytes "
                                              f"of {path}", "short")
                ledger_inbox.take(reply["rows"])
                if on_bytes is not None and landed < total:
                    on_bytes(total - landed)
                return None
            if kind == KIND_ERROR:
                err = unpack_json(payload, ("type", "message", "refused"))
                if err["refused"]:
                    return _not_served(mode, f"the resident loader refused: {err['message']}")
                raise _remote_error(err, paths)
        except (ValueError, TypeError) as exc:
            if isinstance(exc, GdskitError):
                raise
            raise ResidentLoaderError(f"the resident loader at {where} answered something that is not an "
                                      f"answer ({exc})", "bad answer") from None
        raise ResidentLoaderError(f"the resident loader at {where} sent a message of kind {kind!r}", "bad answer")


def _remote_error(err: dict[str, Any], paths: list[str]) -> Exception:
    """The loader's error as the read in this process would have raised it, naming the file at
    fault where the loader said which."""
    kind, message, code = str(err["type"]), str(err["message"]), err.get("errno")
    k = err.get("file")
    at_fault = isinstance(k, int) and not isinstance(k, bool) and 0 <= k < len(paths)
    path = paths[k] if at_fault else paths[0] if len(paths) == 1 else ", ".join(paths)
    if kind == "TruncatedFileError":
        return TruncatedFileError(message, path=path)
    if isinstance(code, int) and not isinstance(code, bool) and code > 0:
        return from_os_error(OSError(code, message), path)
    return ResidentLoaderError(f"the resident loader failed reading {path}: {kind}: {message}", "failed")
