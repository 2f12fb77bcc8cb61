"""The resident loader's wire: who may use its socket, and its messages.

One Unix stream socket per GPU, ``<dir>/resident-<GPU UUID>.sock``, in a directory only this
user can enter: ``$XDG_RUNTIME_DIR/gdskit``, else ``<tmp>/gdskit-<uid>``. A directory that is not
ours, or that others can enter, is refused on both sides; each side also checks the other's
user (``SO_PEERCRED``). Messages are framed by :mod:`gdskit.engine.framing`:

* ``Q`` (to the loader, carrying each file's descriptor in order, and a ``memfd`` for host
  memory): ``<u32 n>`` then ``n`` bytes of JSON ``{"version", "files", "device", "segments"}``,
  then the reads as little-endian int64 quintuples ``(file, segment, offset in it, file offset,
  bytes)``. ``files`` is ``[[path, size], ...]`` (the size its header said; at most
  :data:`MAX_FILES`), ``device`` the GPU's UUID (or ``null`` for host memory); a segment is a
  CUDA IPC handle in hex (or ``"memfd"``: the shared mapping sent with the request).
* ``P`` (from it, while reading): ``<u64>`` bytes landed so far.
* ``D`` (from it, the end): JSON ``{"bytes", "rows"}``: every byte landed, and the ledger rows
  of these reads.
* ``E`` (from it, the end): JSON ``{"type", "message", "refused", "errno", "file"}``;
  ``refused`` means the client reads every byte itself (nothing is in flight; the first part of
  the reads may have landed); ``file``: the index of the file at fault, where known.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
from array import array
from typing import Any

from gdskit.engine.resident import GPU_UUID
from gdskit.errors import GdskitPermissionError

VERSION = 2
KIND_REQUEST, KIND_PROGRESS, KIND_DONE, KIND_ERROR = b"Q", b"P", b"D", b"E"
#: The largest request the loader takes: 40 bytes a read, about 1.6 million reads.
MAX_REQUEST = 64 << 20
#: Files in one request: their descriptors travel in one message (the kernel's limit is 253).
MAX_FILES = 128
_FIELDS = 5
#: A reply is a few ledger rows.
MAX_REPLY = 16 << 20
#: Seconds a client waits for any message (progress comes every PROGRESS_S while bytes land)
#: before it takes the loader for stuck.
STALL_S = 120.0
PROGRESS_S = 0.25
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_UCRED = struct.Struct("3i")
#: A Unix socket's path must fit ``sockaddr_un``.
MAX_SOCKET_PATH = 107


def private_dir_problem(path: str) -> str | None:
    """Why ``path`` is not a directory only this user can enter; None where it is."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{path} does not exist"
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.getuid():
        return f"{path} belongs to user {st.st_uid}, not to this one ({os.getuid()})"
    if st.st_mode & 0o077:
        return f"{path} can be entered by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def make_private_dir(path: str) -> None:
    """Create ``path`` (mode 0700) where it is missing; GdskitPermissionError where it exists and is
    not this user's alone (never changed: someone else may have made it)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise GdskitPermissionError(f"cannot make the resident loader's directory {path}: {exc.strerror}") from None
    problem = private_dir_problem(path)
    if problem is not None:
        raise GdskitPermissionError(f"the resident loader's directory is refused: {problem}")


def peer_uid(sock: socket.socket) -> int:
    _pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return uid


# -- messages -------------------------------------------------------------------------------------

def pack_request(files: list[tuple[str, int]], device: str | None, segments: list[str],
                 reads: list[tuple[int, int, int, int, int]]) -> bytes:
    head = json.dumps({"version": VERSION, "files": [[p, n] for p, n in files], "device": device,
                       "segments": segments}, separators=(",", ":")).encode()
    flat = array("q", [v for r in reads for v in r])
    if flat.itemsize != 8:  # pragma: no cover - every Linux platform gdskit runs on
        raise RuntimeError("int64 arrays are not 8 bytes here")
    return _U32.pack(len(head)) + head + flat.tobytes()


class Request:
    """A request as the loader received it, its fields checked for type and shape (the loader
    then checks them against the files and the memory). ``reads`` are ``(file, segment, offset
    in it, file offset, bytes)``, ``file`` an index into ``files``."""

    __slots__ = ("files", "device", "segments", "reads")

    def __init__(self, files: list[tuple[str, int]], device: str | None, segments: list[str],
                 reads: list[tuple[int, int, int, int, int]]) -> None:
        self.files, self.device, self.segments, self.reads = files, device, segments, reads


def unpack_request(payload: bytes | bytearray) -> Request:
    """ValueError, saying what, for anything :func:`pack_request` would not make."""
    if len(payload) < _U32.size:
        raise ValueError("a request too short for its header")
    (n,) = _U32.unpack_from(payload, 0)
    if n > len(payload) - _U32.size:
        raise ValueError("a request shorter than its header says")
    try:
        head = json.loads(bytes(payload[_U32.size:_U32.size + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"a request whose header is not JSON ({exc})") from None
    if not isinstance(head, dict) or head.get("version") != VERSION:
        raise ValueError(f"a request of another version ({head.get('version') if isinstance(head, dict) else None!r};"
                         f" this loader speaks {VERSION})")
    files, device, segments = head.get("files"), head.get("device"), head.get("segments")
    if not (isinstance(files, list) and 0 < len(files) <= MAX_FILES
            and all(isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) and _whole(f[1]) and f[1] >= 0
                    for f in files)):
        raise ValueError(f"a request without 1 to {MAX_FILES} files, each a path and a size")
    if device is not None and not (isinstance(device, str) and GPU_UUID.match(device)):
        raise ValueError(f"a request for a device that is not a GPU UUID: {device!r}")
    if not isinstance(segments, list) or not all(isinstance(s, str) for s in segments):
        raise ValueError("a request whose segments are not strings")
    body = bytes(payload[_U32.size + n:])
    if len(body) % (8 * _FIELDS):
        raise ValueError("a request whose reads are not whole quintuples")
    flat = array("q")
    flat.frombytes(body)
    reads = [tuple(flat[i:i + _FIELDS]) for i in range(0, len(flat), _FIELDS)]
    return Request([(p, size) for p, size in files], device, segments, reads)  # type: ignore[misc]


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def pack_progress(nbytes: int) -> bytes:
    return _U64.pack(nbytes)


def unpack_progress(payload: bytes | bytearray) -> int:
    if len(payload) != _U64.size:
        raise ValueError("a progress message of the wrong size")
    return int(_U64.unpack(payload)[0])


def pack_json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def unpack_json(payload: bytes | bytearray, keys: tuple[str, ...]) -> dict[str, Any]:
    try:
        value = json.loads(bytes(payload))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"a reply that is not JSON ({exc})") from None
    if not isinstance(value, dict) or any(k not in value for k in keys):
        raise ValueError(f"a reply without {', '.join(keys)}")
    return value
