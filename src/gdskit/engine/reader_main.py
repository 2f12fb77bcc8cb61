"""A reader process of :mod:`gdskit.engine.reader_processes`: ``main([_, SOCKET, MEMFD, BYTES])`` in a fresh interpreter.

It maps the loader's shared staging (``MEMFD``, ``BYTES`` long), takes the loader's paths and
settings from the first message on ``SOCKET``, then reads each batch it is asked for with
:meth:`gdskit.File.read_batch` into the mapping and answers with the counts and the ledger
records of those reads (the engine's own, reset after each batch). It ends when the loader
closes the socket. Torch is never imported here.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import sys
from collections import OrderedDict
from typing import Any

import numpy as np

from gdskit.engine.buffers import adapt
import gdskit.engine.cuda as cuda
from gdskit.engine.file import open as open_file
from gdskit.engine.ledger import ledger
from gdskit.engine.ledger_inbox import as_row
from gdskit.engine.reader_processes import (KIND_DONE, KIND_ERROR, KIND_INIT, KIND_READ, pack_done, recv_message,
                                            send_message, unpack_read)
from gdskit.settings import settings
from gdskit.threads import take_signals_back
from gdskit.vocabulary import Reason

#: Files kept open at once (the least recently used is closed first), as in the loader.
OPEN_FILES = 64


def _error(exc: BaseException, path: str | None) -> dict[str, Any]:
    code = getattr(exc, "errno", None)
    return {"type": type(exc).__name__, "errno": code if isinstance(code, int) else None,
            "message": (getattr(exc, "strerror", None) or str(exc)) if isinstance(code, int) else str(exc),
            "path": getattr(exc, "filename", None) or path}


def serve(sock: socket.socket, view: Any) -> None:
    kind, payload = recv_message(sock)
    if kind != KIND_INIT:
        raise SystemExit(f"gdskit reader process: expected the loader's first message, got {kind!r}")
    init = json.loads(bytes(payload))
    paths: list[str] = init["paths"]
    loader_reason, no_gpu = str(init["host_reason"]), Reason.NO_GPU.value  # see the wire's "I" message
    settings.set(**{**init["settings"], "stats_level": 0})  # the loader's settings; it publishes the figures
    cuda.no_gpu_here()  # host memory only: the CUDA driver is never loaded here (a tenth of a second or more)
    files: OrderedDict[int, Any] = OrderedDict()

    def file(index: int) -> Any:
        f = files.get(index)
        if f is not None:
            files.move_to_end(index)
            return f
        f = files[index] = open_file(paths[index], "r")
        while len(files) > OPEN_FILES:
            files.popitem(last=False)[1].close()
        return f

    while True:
        try:
            kind, payload = recv_message(sock)
        except EOFError:
            return
        if kind != KIND_READ:
            raise SystemExit(f"gdskit reader process: a message of kind {kind!r}")
        path = None
        try:
            base, groups = unpack_read(payload)
            ledger.reset()
            counts = []
            for index, size, offsets, places in groups:
                path = paths[index]
                counts.append(file(index).read_batch(view, offsets, size, [base + p for p in places]))
            rows = [as_row(e) for e in ledger.snapshot().entries]
            for row in rows:
                if row[1] == no_gpu:
                    row[1] = loader_reason
            send_message(sock, KIND_DONE, pack_done(counts, rows))
        except Exception as exc:  # noqa: BLE001 - the loader raises it in its caller's place
            send_message(sock, KIND_ERROR, json.dumps(_error(exc, path)).encode())


def main(argv: list[str]) -> int:
    take_signals_back()  # the loader's SIGTERM ends this process, whichever thread started it
    sock_fd, mem_fd, nbytes = (int(a) for a in argv[1:4])
    sock = socket.socket(fileno=sock_fd)
    shared = mmap.mmap(mem_fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(mem_fd)
    try:
        serve(sock, adapt(np.frombuffer(shared, dtype=np.uint8)))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the loader went away mid-answer: nothing is waiting for this one
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
