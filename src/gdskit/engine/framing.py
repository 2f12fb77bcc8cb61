"""Messages over a Unix stream socket, framed as ``<u32 length><u8 kind><payload>``: the one
framing of gdskit's own local wires (reader processes, the resident loader). Standard library
only: a client that imports it pays nothing else."""

from __future__ import annotations

import array
import os
import socket
import struct

_FRAME = struct.Struct("<IB")
#: Largest message a receiver accepts unless told otherwise.
MAX_MESSAGE = 64 << 20


def send_message(sock: socket.socket, kind: bytes, payload: bytes) -> None:
    sock.sendall(_FRAME.pack(len(payload), kind[0]) + payload)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly ``n`` bytes; EOFError where the other side closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("the other side closed the connection")
        got += k
    return buf


def recv_message(sock: socket.socket, limit: int = MAX_MESSAGE) -> tuple[bytes, bytearray]:
    """The next message's kind and payload; EOFError where the other side has closed,
    ValueError for a message longer than ``limit``."""
    length, kind = _FRAME.unpack(recv_exact(sock, _FRAME.size))
    if length > limit:
        raise ValueError(f"a message of {length} bytes (at most {limit})")
    return bytes((kind,)), recv_exact(sock, length) if length else bytearray()


def send_with_fds(sock: socket.socket, kind: bytes, payload: bytes, fds: list[int]) -> None:
    """A message whose first bytes carry the open files ``fds`` (SCM_RIGHTS): the receiver gets
    its own descriptors of the same open files, so it reads what this process may read."""
    data = _FRAME.pack(len(payload), kind[0]) + payload
    sent = socket.send_fds(sock, [data], fds)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_with_fds(sock: socket.socket, limit: int = MAX_MESSAGE, max_fds: int = 1) -> tuple[bytes, bytearray, list[int]]:
    """The inverse of :func:`send_with_fds`: kind, payload and the descriptors that came with it
    (close-on-exec; at most ``max_fds``, any others are closed). The caller owns them."""
    got = array.array("i")
    head, ancillary, _flags, _addr = sock.recvmsg(_FRAME.size, socket.CMSG_SPACE((max_fds + 1) * got.itemsize),
                                                  socket.MSG_CMSG_CLOEXEC)
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got.frombytes(data[:len(data) - len(data) % got.itemsize])
    for extra in got[max_fds:]:
        _close_quietly(extra)
    fds = list(got[:max_fds])
    try:
        if not head:
            raise EOFError("the other side closed the connection")
        if len(head) < _FRAME.size:
            head = bytes(head) + bytes(recv_exact(sock, _FRAME.size - len(head)))
        length, kind = _FRAME.unpack(head)
        if length > limit:
            raise ValueError(f"a message of {length} bytes (at most {limit})")
        return bytes((kind,)), recv_exact(sock, length) if length else bytearray(), fds
    except BaseException:
        for fd in fds:
            _close_quietly(fd)
        raise


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
