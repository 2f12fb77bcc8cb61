"""The formats' one door to the I/O engine (``gdskit.open``, ``gdskit.stats``).

Until the engine is importable this falls back to plain POSIX reads and writes
of host memory, which is enough to run the format code on CPU tensors.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any

from gdskit.errors import from_os_error


def open_file(path: str, mode: str = "r", *, atomic: bool = False) -> Any:
    """Open ``path`` through the engine (a :class:`gdskit.File`)."""
    import gdskit
    opener = getattr(gdskit, "open", None)
    if opener is not None:
        return opener(path, mode, atomic=atomic)
    return _PosixFile(path, mode, atomic=atomic)


def stats() -> Any:
    """A snapshot of the engine's ledger, or None without an engine."""
    import gdskit
    fn = getattr(gdskit, "stats", None)
    return fn() if fn is not None else None


def stats_delta(before: Any, after: Any) -> Any:
    if before is None or after is None:
        return None
    import gdskit
    return gdskit.stats_delta(before, after)


def _host_view(buf: Any) -> memoryview:
    if hasattr(buf, "numpy") and hasattr(buf, "device"):
        if buf.device.type != "cpu":
            raise TypeError("device memory needs the gdskit engine")
        buf = buf.numpy()
    return memoryview(buf).cast("B")


class _PosixFile:
    """A minimal host-memory stand-in with the engine's File interface."""

    _pool = concurrent.futures.ThreadPoolExecutor(max_workers=4)

    def __init__(self, path: str, mode: str, atomic: bool) -> None:
        self.path = os.fspath(path)
        self.mode = mode
        self._target = self.path
        self._atomic = atomic and mode == "w"
        if self._atomic:
            self.path = os.path.join(os.path.dirname(os.path.abspath(self._target)),
                                     f".{os.path.basename(self._target)}.tmp{os.getpid()}")
        flags = {"r": os.O_RDONLY, "w": os.O_RDWR | os.O_CREAT | os.O_TRUNC,
                 "r+": os.O_RDWR, "a": os.O_RDWR | os.O_CREAT}[mode]
        try:
            self._fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            raise from_os_error(exc, self.path) from None

    @property
    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def read(self, buf: Any, size: int | None = None, file_offset: int = 0, buf_offset: int = 0) -> int:
        mv = _host_view(buf)
        size = len(mv) - buf_offset if size is None else size
        return os.preadv(self._fd, [mv[buf_offset:buf_offset + size]], file_offset)

    def pread(self, *args: Any, **kw: Any) -> concurrent.futures.Future[int]:
        return self._pool.submit(self.read, *args, **kw)

    def write(self, buf: Any, size: int | None = None, file_offset: int | None = None,
              buf_offset: int = 0) -> int:
        mv = _host_view(buf)
        size = len(mv) - buf_offset if size is None else size
        off = self.size if file_offset is None else file_offset
        done = 0
        while done < size:
            done += os.pwrite(self._fd, mv[buf_offset + done:buf_offset + size], off + done)
        return done

    def pwrite(self, *args: Any, **kw: Any) -> concurrent.futures.Future[int]:
        return self._pool.submit(self.write, *args, **kw)

    def fsync(self) -> None:
        os.fsync(self._fd)

    def abort(self) -> None:
        os.close(self._fd)
        if self._atomic:
            os.unlink(self.path)
        self._fd = -1

    def close(self) -> None:
        if self._fd < 0:
            return
        if self._atomic:
            os.fsync(self._fd)
            os.close(self._fd)
            os.replace(self.path, self._target)
        else:
            os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> _PosixFile:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None and self._atomic and self._fd >= 0:
            self.abort()
        else:
            self.close()
