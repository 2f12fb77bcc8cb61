"""The gdskit exception hierarchy.

Every error gdskit raises on purpose is a :class:`GdskitError`. Each concrete
class also subclasses the built-in exception a Python programmer would expect
(``FileNotFoundError``, ``ValueError``, ...), so ``except ValueError`` keeps
working. Callers branch on the class or on attributes, never on message text.
"""

from __future__ import annotations

import errno as _errno
import os as _os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from gdskit.vocabulary import Reason

_T = TypeVar("_T")


class GdskitError(Exception):
    """Base class of every error gdskit raises on purpose."""


class InvalidArgumentError(GdskitError, ValueError):
    """An argument is out of range or of the wrong shape (negative offset, bad mode...)."""


class BufferTooSmallError(InvalidArgumentError):
    """The buffer cannot hold the requested number of bytes."""


class UnsupportedBufferError(GdskitError, TypeError):
    """The object passed as a buffer exposes no usable memory (or not the kind asked for)."""


class ReadOnlyBufferError(GdskitError, TypeError):
    """A read was asked to land in a read-only buffer."""


class ClosedFileError(GdskitError, ValueError):
    """The :class:`gdskit.File` has been closed (``ValueError`` as for closed Python files)."""


class UnsupportedOperationError(GdskitError, OSError):
    """Reading a file opened for writing only, or writing one opened read-only.

    Also an ``io.UnsupportedOperation`` look-alike: it subclasses ``OSError``.
    """


class GdskitIOError(GdskitError, OSError):
    """An operating-system I/O error; ``errno`` and ``filename`` are kept."""


class GdskitFileNotFoundError(GdskitIOError, FileNotFoundError):
    """The file (or its directory) does not exist."""


class GdskitIsADirectoryError(GdskitIOError, IsADirectoryError):
    """A directory was given where a regular file is needed."""


class NotAFileError(GdskitIOError):
    """A FIFO, socket or other non-file was given where a file is needed (``errno`` ESPIPE:
    gdskit reads and writes at offsets). It is refused when opened, never waited on."""


class GdskitPermissionError(GdskitIOError, PermissionError):
    """The file cannot be opened with the requested access."""


class ObjectStoreError(GdskitIOError):
    """An object store (``s3://``) request failed for good: the endpoint unreachable, or throttled
    or cut off past ``settings.s3_max_retries`` retries. ``filename`` is the object's URL."""


class ObjectChangedError(ObjectStoreError):
    """An object changed while it was read (its ETag is not the one its first request saw) or
    held fewer bytes than it said: the read stops rather than mix two versions' bytes."""


class NoCredentialsError(GdskitPermissionError):
    """No credentials were found for an object store: neither the ``AWS_*`` environment variables,
    nor a profile in the AWS config files, nor a container or instance role."""


class NoSpaceError(GdskitIOError):
    """The filesystem is full (ENOSPC) or the quota is exceeded (EDQUOT)."""


class DirectPathUnavailable(GdskitError, RuntimeError):
    """The cuFile path was required (``mode="cufile"``) and cannot be used.

    ``reason`` is a :class:`gdskit.Reason` naming why.
    """

    def __init__(self, message: str, reason: Reason) -> None:
        super().__init__(message)
        self.reason = reason


class CudaError(GdskitError, RuntimeError):
    """A CUDA call failed; ``code`` is the CUDA error name."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class ConfigError(InvalidArgumentError):
    """A setting or ``GDSKIT_*`` environment variable holds an invalid value."""


class EnvironmentVariableError(ConfigError):
    """A ``GDSKIT_*`` environment variable holds a value its setting does not take.

    ``variable`` names it, ``value`` is what it holds, ``accepts`` says in words what it takes.
    """

    def __init__(self, variable: str, value: str, accepts: str) -> None:
        shown = value if len(value) <= 80 else value[:77] + "..."
        super().__init__(f"{variable}={shown!r} is not valid; it takes {accepts}")
        self.variable, self.value, self.accepts = variable, value, accepts

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        return type(self), (self.variable, self.value, self.accepts)


class FormatError(GdskitError, ValueError):
    """A file does not follow the format it claims (safetensors, torch checkpoint...).

    ``path`` names the file at fault where it is known (one shard of a checkpoint, an
    index), else None; the message starts with it.
    """

    def __init__(self, *args: object, path: str | None = None) -> None:
        super().__init__(*args)
        self.path = path

    def __str__(self) -> str:
        text = super().__str__()
        return f"{self.path}: {text}" if self.path else text


class TruncatedFileError(FormatError):
    """The file is shorter than its header (or its digest manifest) says: truncated, or it
    shrank while being read."""


def with_path(exc: FormatError, path: str | _os.PathLike[str]) -> FormatError:
    """``exc`` naming ``path`` as the file at fault, unless it already names one."""
    if exc.path is None:
        exc.path = _os.fspath(path)
    return exc


class ChecksumMismatchError(GdskitError, ValueError):
    """Bytes read do not have the digest recorded for them: the file (or the copy of it that
    landed in memory) is not what was digested.

    ``path`` names the file, ``tensor`` the tensor (None for a byte range of a raw file),
    ``byte_range`` the ``(start, end)`` file offsets checked, ``expected`` and ``actual`` the
    two digests (``"blake3:<hex>"`` or ``"sha256:<hex>"``). After ``load_into``, ``filled``
    names the targets whose bytes were checked and match, ``unfilled`` those that may hold
    anything (as :class:`~gdskit.formats.into_plan.PartialLoadError`); both are empty otherwise.
    """

    def __init__(self, message: str, *, path: str, tensor: str | None, byte_range: tuple[int, int] | None,
                 expected: str, actual: str, filled: Iterable[str] = (), unfilled: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.path, self.tensor, self.byte_range = path, tensor, byte_range
        self.expected, self.actual = expected, actual
        self.filled, self.unfilled = tuple(filled), tuple(unfilled)

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_mismatch, (type(self), str(self), dict(self.__dict__))


def _rebuild_mismatch(cls: type[ChecksumMismatchError], message: str, state: dict[str, Any]) -> ChecksumMismatchError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    exc.__dict__.update(state)
    return exc


class StaleManifestError(GdskitError, ValueError):
    """A digest manifest describes another version of the file: its size differs, or its
    modification time differs and its bytes no longer match. Not corruption: digest it again
    (``gdskit digest``). ``path`` names the file, ``manifest`` the manifest."""

    def __init__(self, message: str, *, path: str, manifest: str) -> None:
        super().__init__(message)
        self.path, self.manifest = path, manifest

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_mismatch, (type(self), str(self), dict(self.__dict__))


class UnverifiableRangeError(InvalidArgumentError):
    """``File.read(..., verify=...)`` of a byte range the manifest's chunk digests do not cover
    whole (it must start on a chunk boundary and end on one or at the end of the file)."""


class NothingToVerifyError(GdskitError, LookupError):
    """``verify=True`` was asked and the file has no digests to verify against: none in its
    header, no manifest beside it. ``path`` names the file."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_mismatch, (type(self), str(self), dict(self.__dict__))


class DeviceUnavailableError(GdskitError, RuntimeError):
    """Tensors were asked for on a device this process cannot use (e.g. CUDA without a GPU)."""


class MissingDependencyError(GdskitError, ImportError):
    """An optional dependency is not installed; the message says what to install."""


_OS_ERROR_CLASSES: dict[int, type[GdskitIOError]] = {
    _errno.ENOENT: GdskitFileNotFoundError,
    _errno.EISDIR: GdskitIsADirectoryError,
    _errno.EACCES: GdskitPermissionError,
    _errno.EPERM: GdskitPermissionError,
    _errno.EROFS: GdskitPermissionError,
    _errno.ENOSPC: NoSpaceError,
    _errno.EDQUOT: NoSpaceError,
}


def from_os_error(exc: OSError, filename: str | None = None) -> GdskitIOError:
    """Wrap an ``OSError`` in the matching :class:`GdskitIOError` subclass."""
    if isinstance(exc, GdskitIOError):
        return exc
    cls = _OS_ERROR_CLASSES.get(exc.errno or 0, GdskitIOError)
    name = filename if filename is not None else exc.filename
    err = cls(exc.errno or _errno.EIO, exc.strerror or str(exc), name)
    err.__cause__ = exc
    return err


class ProcessNotFoundError(GdskitError, ProcessLookupError):
    """``gdskit stats -p PID``: there is no process with that pid."""


class NotPublishingError(GdskitError, FileNotFoundError):
    """The process exists but publishes no gdskit figures (it was not started with ``GDSKIT_STATS``)."""


class WorkloadTimeoutError(GdskitError, TimeoutError):
    """:func:`gdskit.telemetry.run_workload` stopped a workload that ran past its timeout.

    ``report`` holds what the workload had done by then.
    """

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report


class WorkerProcessError(GdskitError, RuntimeError):
    """A worker process (``gdskit bench --processes``) ended without finishing its work."""


class ReaderProcessError(GdskitError, RuntimeError):
    """A reader process of a dataset loader (``Loader(..., workers=N)``) could not be started,
    died (killed, out of memory), or answered something that is not an answer."""


class ResidentLoaderError(GdskitError, RuntimeError):
    """The resident loader (``gdskit serve``) could not serve a load that had to go through it
    (``GDSKIT_RESIDENT=require``), failed after writing began, stopped answering, or is not
    this user's; ``.reason`` says which in a few words."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class GroupError(GdskitError, RuntimeError):
    """A load over a process group (``process_group=``) failed on another rank, timed out waiting
    for one, or lost one; ``ranks`` names the ranks known to have failed (empty when unknown).

    The rank where the failure happened raises its own error (a ``FormatError``, a
    ``MemoryError``...); every other rank raises this. After a timeout or a lost rank the
    process group cannot be trusted: destroy it.
    """

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


def call_each(fn: Callable[[_T], object], items: Iterable[_T]) -> None:
    """``fn(item)`` for every item, whatever any call raises; then the first exception raised,
    if any (closing many files or freeing many buffers: one failure must not leak the rest)."""
    first: BaseException | None = None
    for item in items:
        try:
            fn(item)
        except BaseException as exc:  # noqa: BLE001 - the rest still run; the first is raised below
            if first is None:
                first = exc
    if first is not None:
        raise first
