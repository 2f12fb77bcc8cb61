"""torch.save-compatible checkpoints straight to and from GPU memory.

>>> import gdskit.torch
>>> gdskit.torch.save(model.state_dict(), "ckpt.pt")     # plain torch.load reads it
>>> sd = gdskit.torch.load("ckpt.pt", map_location="cuda:0")

``save`` writes an ordinary torch.save zip archive whose storages start on 4 KiB
boundaries (torch's own ``storage_alignment`` setting and ``skip_data``), then
writes every storage's bytes at its record offset through the gdskit engine.
``load`` reads the archive's pickle (``weights_only`` by default), allocates each
storage on its target device and reads the bytes through the engine. It also
reads torch.save files written by anyone; files in the pre-1.6 format and
TorchScript archives are handed to ``torch.load``. Needs torch
(``pip install 'gdskit[torch]'``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import os
import pickle
import re
import stat
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

from gdskit.durable import (OwnedTemp, create_locked_temp, fsync_dir, open_file_fd, remove_stale_temps,
                            replacement_target)
from gdskit.errors import (ConfigError, DeviceUnavailableError, FormatError, GdskitError, GdskitIOError,
                           InvalidArgumentError, from_os_error)
from gdskit.formats import read_plan, require_torch, weights_pickle
from gdskit.formats.device import torch_device
from gdskit.formats.gc_pause import collector_paused
from gdskit.engine import is_object_url, open_file, open_object_stream, stats, stats_delta
from gdskit.formats.progress import Progress, ProgressArg
from gdskit.formats.safetensors_format import TruncatedFileError
from gdskit.threads import executor
from gdskit.formats.torch_zip import StorageRecord, StorageRecords
from gdskit.formats.verified import LoadChecks, Sha256Check, check_loaded, expectations, merged
from gdskit.verify import verify_mode

if TYPE_CHECKING:
    from gdskit.verify import Expectation, FileDigests

require_torch("gdskit.torch")  # without torch, fail here with the install hint, as every torch-facing module

__all__ = ["save", "load", "UnsafeCheckpointError", "DeviceUnavailableError", "STORAGE_ALIGNMENT"]

#: Storages in files written by :func:`save` start on this boundary.
STORAGE_ALIGNMENT = 4096
SMALL_STORAGE_BYTES = 1 << 20
MAX_GROUP_BYTES = 16 << 20
#: Zip local headers sit between storages; reading them along with small
#: neighbours is cheaper than another request.
MAX_GAP_BYTES = 8192

MapLocation = Any  # None | str | torch.device | dict[str, str] | Callable[[storage, str], storage | None]


class UnsafeCheckpointError(GdskitError, pickle.UnpicklingError):
    """The checkpoint needs objects that ``weights_only=True`` does not allow.

    Load it with ``weights_only=False`` only if you trust its source, or allow the
    classes with ``torch.serialization.add_safe_globals``.
    """


def _torch() -> Any:
    return require_torch("gdskit.torch")


# -- save -----------------------------------------------------------------------

def _recording_pickle_module(torch: Any, captured: dict[str, Any]) -> types.ModuleType:
    """A pickle module for ``torch.save(pickle_module=...)`` that records which storage got which key.

    torch.save names storages ``data/<key>`` in the order its pickler meets them;
    watching its own ``persistent_id`` answers is the one reliable way to know the
    mapping without re-implementing the archive writer.
    """

    class RecordingPickler(pickle._Pickler):  # type: ignore[name-defined]
        def save(self, obj: Any, save_persistent_id: bool = True) -> None:
            if save_persistent_id and (isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj)):
                pid = self.persistent_id(obj)
                if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
                    storage = obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj
                    captured[pid[2]] = storage
            super().save(obj, save_persistent_id)

    mod = types.ModuleType("gdskit_recording_pickle")
    mod.Pickler = RecordingPickler  # type: ignore[attr-defined]
    mod.Unpickler = pickle.Unpickler  # type: ignore[attr-defined]
    return mod


def save(obj: Any, path: str | os.PathLike[str], *, progress: ProgressArg = False, digests: bool = False) -> None:
    """Save ``obj`` like ``torch.save``, with 4 KiB-aligned storages written through the engine.

    ``digests=True`` also writes the file's digest manifest beside it (``PATH.gdskit-digest.json``,
    what ``gdskit digest`` computes from it: the file, its chunks, each storage record), hashed
    as the file is written, from the memory each byte is written from (a device storage's record
    digest on its GPU), never read back; written once the file is in place, never for a save
    that fails. ``load(..., verify=True)`` checks against it.

    The result is an ordinary torch.save archive: ``torch.load`` reads it. The write
    is atomic (a temporary file beside ``path``, locked while it is written, fsynced,
    then renamed); temporaries that earlier saves to ``path`` left behind when they
    were killed are removed first (:func:`gdskit.durable.remove_stale_temps`). Storages
    on the GPU are written straight from device memory. Changes the process-wide
    ``torch.utils.serialization.config.save.storage_alignment`` for the duration
    of the call, so do not run ``torch.save`` in other threads meanwhile.
    """
    torch = _torch()
    path = replacement_target(os.fspath(path))  # links followed; a directory or device refused
    directory = os.path.dirname(path)
    name = os.path.basename(path)
    remove_stale_temps(directory, name)
    try:
        tmp = create_locked_temp(directory, name)
    except OSError as exc:
        raise from_os_error(exc, path) from None
    try:
        captured: dict[str, Any] = {}
        pieces = _write_archive(torch, obj, tmp, captured, keep=digests)
        written = _fill_storages(torch, tmp, captured, progress, pieces)
        os.replace(tmp.path, path)
        fsync_dir(directory)
    except BaseException as exc:
        tmp.discard()  # its space comes back now, not when a traceback is collected
        io_error = _os_error_in(exc)
        if io_error is None:
            raise
        raise from_os_error(io_error, path) from exc
    tmp.close()
    if written is not None:
        from gdskit.formats.archive_digests import write_manifest_beside  # noqa: PLC0415 - import time
        write_manifest_beside(path, written)


def _os_error_in(exc: BaseException) -> OSError | None:
    """The operating-system error behind ``exc``: itself, or one it was raised while handling
    (torch.save reports a failed write as the RuntimeError of its archive's clean-up)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, GdskitError) and not isinstance(e, GdskitIOError):
            return None
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _write_archive(torch: Any, obj: Any, tmp: OwnedTemp, captured: dict[str, Any],
                   keep: bool = False) -> list[tuple[int, bytes]] | None:
    """torch.save ``obj`` into ``tmp`` with space reserved for every storage at a 4 KiB boundary;
    with ``keep``, the archive's own bytes as written, ``(offset, bytes)`` in order, for its digests.

    torch writes through a file object over a second descriptor of ``tmp``, closed here
    on every path: a writer torch opened itself would stay open, with the file's blocks,
    for as long as an error's traceback keeps its frames alive.
    """
    import torch.serialization as ser  # noqa: PLC0415 - optional dependency (torch)
    from torch.utils.serialization import config  # noqa: PLC0415 - optional dependency (torch)

    fh = os.fdopen(os.dup(tmp.fd), "wb", buffering=1 << 20)
    kept = None
    if keep:
        from gdskit.formats.archive_digests import KeptWrites  # noqa: PLC0415 - import time
        kept = KeptWrites(fh)
    old_alignment = config.save.storage_alignment
    try:
        config.save.storage_alignment = STORAGE_ALIGNMENT
        with ser.skip_data():
            torch.save(obj, kept or fh, pickle_module=_recording_pickle_module(torch, captured))
        fh.close()
        return kept.pieces if kept is not None else None
    except BaseException:
        try:
            fh.close()  # closes the descriptor even when the flush fails
        except OSError:
            pass
        raise
    finally:
        config.save.storage_alignment = old_alignment


def _storage_places(torch: Any, tmp: OwnedTemp,
                    captured: dict[str, Any]) -> tuple[list[tuple[int, int, Any, str]], list[tuple[str, int, int]]]:
    """``(offset, nbytes, storage, record name)`` of every storage with bytes to write, and
    ``(key, offset, nbytes)`` of every storage record (as ``gdskit digest`` places them), as the
    archive places them. torch's reader is let go of before returning or raising: it holds the
    file open."""
    records = StorageRecords.open(torch, tmp.path, os.fstat(tmp.fd).st_size, tmp.path)
    try:
        placed = records.spans()
    finally:
        records.close()
    if placed is None:
        raise FormatError(f"{tmp.path}: a storage record of the archive just written cannot be placed")
    where = {key: (offset, nbytes) for key, offset, nbytes in placed}
    jobs = []
    for key, storage in captured.items():
        offset, size = where.get(key, (0, -1))
        nbytes = storage.nbytes()
        if size != nbytes:
            raise FormatError(f"record data/{key} has {size} bytes, its storage {nbytes}")
        if nbytes and storage.device.type != "meta":
            jobs.append((offset, nbytes, storage, "data/" + key))
    return jobs, placed


def _fill_storages(torch: Any, tmp: OwnedTemp, captured: dict[str, Any], progress: ProgressArg,
                   pieces: list[tuple[int, bytes]] | None = None) -> FileDigests | None:
    """Write every storage's bytes into its hole; with ``pieces`` (the archive's own bytes as
    written), the digests of the whole file, fed in file order while the engine writes."""
    from gdskit.formats.torch_io import wait_for_all  # noqa: PLC0415 - import time
    jobs, placed = _storage_places(torch, tmp, captured)
    jobs.sort(key=lambda j: j[0])
    for d in {s.device for _o, _n, s, _k in jobs if s.device.type == "cuda"}:
        torch.cuda.synchronize(d)  # the engine reads device memory outside torch's streams
    sources = [(off, nbytes, _bytes_of(torch, storage, nbytes)) for off, nbytes, storage, _k in jobs]
    running = None
    if pieces is not None:
        from gdskit.formats.archive_digests import ArchiveDigests  # noqa: PLC0415 - import time
        running = ArchiveDigests(pieces, placed)
        running.give_device_digests([(name, src) for (_o, _n, _s, name), (_o2, _n2, src) in zip(jobs, sources)])
    futures: list[tuple[Any, int]] = []
    with open_file(tmp.path, "r+") as f, Progress(sum(n for _o, n, _s, _k in jobs), progress, "saving") as prog:
        try:
            for off, nbytes, src in sources:
                fut = f.pwrite(src, size=nbytes, file_offset=off)
                fut.add_done_callback(lambda _f, n=nbytes: prog.advance(n))
                futures.append((fut, nbytes))
                if running is not None:
                    running.feed_storage(off, src)  # hashed while the engine writes it
            for fut, nbytes in futures:
                if fut.result() != nbytes:
                    raise GdskitError(f"short write to {tmp.path}: {fut.result()} of {nbytes} bytes")
        finally:
            wait_for_all([fut for fut, _n in futures])
        f.fsync()
    return running.result(tmp.fd) if running is not None else None


# -- load -----------------------------------------------------------------------

# torch's deserializer for CUDA takes "cuda", "cuda:N" and "cudaN..." (then checks the index).
_CUDA_LOCATION = re.compile(r"cuda(:|[0-9]+)")


class _Target:
    """Where each storage goes, following torch.load's ``map_location`` rules.

    A location that comes from the file is restored by torch's own rule
    (``torch.serialization.default_restore_location``): exactly ``"cpu"``, exactly
    ``"meta"``, or a CUDA location whose device exists. Devices the caller names are read
    as ``torch.device`` reads them.
    """

    def __init__(self, torch: Any, map_location: MapLocation) -> None:
        self.torch = torch
        self.map_location = map_location
        self.eager = callable(map_location) and not isinstance(map_location, (str, bytes, dict, torch.device))
        self.single_device = isinstance(map_location, (str, bytes, torch.device))  # every storage goes there

    def device(self, location: str) -> Any:
        torch = self.torch
        ml = self.map_location
        if self.eager:
            return torch.device("cpu")  # the callable receives CPU storages, as with torch.load
        if ml is None or (isinstance(ml, dict) and location not in ml):
            return self._saved_device(location)
        name = ml[location] if isinstance(ml, dict) else ml.decode() if isinstance(ml, bytes) else ml
        try:
            dev = torch.device(name)
        except (RuntimeError, TypeError) as exc:
            raise DeviceUnavailableError(f"cannot map storage location {location!r} to {name!r}: {exc}") from None
        if dev.type == "cuda":
            dev = torch_device(torch, dev, argument="map_location")
        elif dev.type not in ("cpu", "meta"):
            raise DeviceUnavailableError(f"storage saved on {location!r} maps to {dev}: gdskit reads "
                                         "storages into CPU and CUDA memory only (use torch.load)")
        return dev

    def _saved_device(self, location: str) -> Any:
        torch = self.torch
        if location in ("cpu", "meta"):
            return torch.device(location)
        if location == "cuda" or _CUDA_LOCATION.match(location):
            try:
                return torch.device("cuda", torch.serialization.validate_cuda_device(location))
            except (RuntimeError, ValueError, TypeError, AssertionError) as exc:
                raise DeviceUnavailableError(f"storage saved on {location!r}: {exc}") from None
        raise DeviceUnavailableError(f"storage saved on {location!r}: gdskit reads storages into CPU and "
                                     "CUDA memory only (pass map_location, or use torch.load)")


def load(f: str | os.PathLike[str] | BinaryIO, map_location: MapLocation = None, weights_only: bool | None = None,
         *, mmap: bool | None = None, progress: ProgressArg = None, return_stats: bool = False,
         process_group: Any = None, verify: Any = False) -> Any:
    """Load a torch.save file, reading the storage bytes through the engine.

    Parameters
    ----------
    f : str, os.PathLike or binary file object
        As for ``torch.load``: a path, or a seekable binary file object holding the
        checkpoint from its current position (``io.BytesIO``, an open file). An open file
        of the file system is read through the engine by its descriptor; any other object
        is read through its own ``seek`` and ``read``.
    map_location : None, str, torch.device, dict or callable
        As for ``torch.load``: None restores each storage to the device it was
        saved from; a device sends all there; a dict remaps location strings; a
        callable gets each CPU storage and its location and returns the storage
        to use (its storages are read one by one into host memory first).
    weights_only : bool or None
        As for ``torch.load``. True: only tensors, primitive types and allow-listed
        classes are unpickled (torch's weights-only unpickler). False runs arbitrary
        pickle code: only for files you trust. None (default): True, unless torch's
        ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set; ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``
        makes it True whatever is passed.
    mmap : bool or None
        Taken for ``torch.load``'s sake, with the values unchanged: gdskit reads every
        storage into memory of its own (host or GPU) and never maps the file, so the
        storages are never backed by the file's pages. As with ``torch.load``, ``mmap=True``
        needs a path (``InvalidArgumentError`` for a file object); files handed to
        ``torch.load`` (the pre-1.6 format, TorchScript) get the argument as it is.
    progress, return_stats, process_group
        As for :func:`gdskit.safetensors.load_file` (``process_group`` needs a path).
    verify : bool, str or path
        Check each storage record's bytes where they landed against the manifest's digests
        (``gdskit digest`` records a torch.save archive per storage record, ``"data/<key>"``):
        ``True`` (the manifest beside the file), a manifest's path, or ``"sha256:<hex>"`` (the
        whole file, at CPU speed). A path only, a zip archive for per-record digests
        (docs/verify.md).

    Every storage is made at the size its record holds and cannot grow: a tensor that
    reaches past its storage is refused (``FormatError``) as torch.load refuses it,
    before any of its bytes are read into it.
    """
    weights_only = resolve_weights_only(weights_only)
    mode = verify_mode(verify)
    if mode.on and not _is_path(f):
        raise InvalidArgumentError("verify= checks a checkpoint given by its path")
    if process_group is not None:
        if not _is_path(f):
            raise InvalidArgumentError("load(process_group=...) reads a checkpoint by its path, not a file object")
        from gdskit.group.load_torch import OneRank, load as group_load  # noqa: PLC0415 - import time
        return group_load(f, map_location, weights_only, process_group=process_group, progress=progress,
                          return_stats=return_stats, pt=OneRank(load, _file_kind, _Target, _unpickle, _bytes_of),
                          verify=mode)
    if mode.on:
        return _verified_load(f, mode, map_location, weights_only, mmap, progress, return_stats)
    with collector_paused():
        return _load(f, map_location, weights_only, mmap, progress, return_stats)


def _verified_load(f: Any, mode: Any, map_location: MapLocation, weights_only: bool, mmap: bool | None,
                   progress: ProgressArg, return_stats: bool) -> Any:
    """:func:`load` with ``verify``: each storage record checked once read, or the file's sha256."""
    path = os.fspath(f)
    if mode.whole_file:
        check = Sha256Check([path], mode)
        try:
            with collector_paused():
                result = _load(f, map_location, weights_only, mmap, progress, return_stats)
        finally:
            check.wait()
        return result
    (expectation,) = expectations([path], mode).values()  # refused before a byte is read
    with collector_paused():
        return _load(f, map_location, weights_only, mmap, progress, return_stats, expectation)


def resolve_weights_only(weights_only: bool | None) -> bool:
    """``weights_only`` as torch.load decides it: None means True, and torch's environment
    variables force it (``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` always, ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
    only where the caller left it None)."""
    yes = ("1", "y", "yes", "true")
    force = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in yes
    force_not = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in yes
    if force and force_not:
        raise ConfigError("only one of TORCH_FORCE_WEIGHTS_ONLY_LOAD and TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD may be set")
    if force:
        return True
    if weights_only is None:
        return not force_not
    return bool(weights_only)


def _is_path(f: Any) -> bool:
    return isinstance(f, (str, os.PathLike))


@dataclasses.dataclass(frozen=True)
class _Source:
    """What a load reads: ``path`` (for the engine; an open file's descriptor as a path), or a
    stream read through its own methods; ``where`` names it in errors."""

    given: Any                 # what the caller passed (handed on to torch.load)
    where: str
    path: str | None = None
    stream: BinaryIO | None = None
    start: int = 0             # of the checkpoint in the stream

    @classmethod
    def of(cls, f: Any) -> _Source:
        if _is_path(f):
            path = os.fspath(f)
            return cls(f, path, path=path)
        if not all(callable(getattr(f, m, None)) for m in ("read", "seek", "tell")):
            raise InvalidArgumentError(f"load reads a path or a seekable binary file object, not a {type(f).__name__}")
        try:
            start = f.tell()
        except (OSError, ValueError) as exc:  # io.UnsupportedOperation is both; a closed file says ValueError
            raise InvalidArgumentError(f"the file object cannot be read at positions: {exc}") from None
        name = getattr(f, "name", None)
        where = name if isinstance(name, str) else f"<{type(f).__name__}>"
        fd = _regular_fd(f)
        if fd is not None and start == 0:  # read through the engine, by the open file itself
            return cls(f, where, path=f"/proc/self/fd/{fd}")
        return cls(f, where, stream=f, start=start)

    def rewind(self) -> None:
        if self.stream is not None:
            self.stream.seek(self.start)


def _regular_fd(f: Any) -> int | None:
    """The descriptor of file object ``f`` where it is a regular file this process can reopen
    by it (and has nothing buffered for writing); else None."""
    try:
        fd = f.fileno()
        if not isinstance(fd, int) or not stat.S_ISREG(os.fstat(fd).st_mode) or not os.path.exists("/proc/self/fd"):
            return None
        if callable(getattr(f, "flush", None)) and getattr(f, "writable", lambda: False)():
            f.flush()
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation: no descriptor
        return None
    return fd


def _file_kind(path: str) -> tuple[str, int]:
    """``"zip"`` (torch.save since 1.6), ``"legacy"`` (older pickle stream) or ``"other"``, and
    the file's size (opened as the engine opens files: a FIFO is refused, never waited on)."""
    if is_object_url(path):
        with open_file(path) as obj:
            head = bytearray(4)
            return _kind_of(bytes(head[:obj.read(head)])), obj.size
    fd, st = open_file_fd(path, os.O_RDONLY)
    try:
        head = os.pread(fd, 4, 0)
    finally:
        os.close(fd)
    return _kind_of(head), st.st_size


def _stream_kind(source: _Source) -> tuple[str, int]:
    """:func:`_file_kind` of a stream: its kind and the bytes from its start to its end."""
    stream = source.stream
    assert stream is not None
    head = stream.read(4)
    size = stream.seek(0, os.SEEK_END) - source.start
    source.rewind()
    return _kind_of(head if isinstance(head, bytes) else b""), size


def _kind_of(head: bytes) -> str:
    if head == b"PK\x03\x04":
        return "zip"
    if head[:2] == b"\x80\x02":
        return "legacy"
    return "other"


def _load(f: Any, map_location: MapLocation, weights_only: bool, mmap: bool | None, progress: ProgressArg,
          return_stats: bool, expectation: Expectation | None = None) -> Any:
    torch = _torch()
    source = _Source.of(f)
    try:
        kind, archive_size = _file_kind(source.path) if source.path is not None else _stream_kind(source)
    except OSError as exc:
        raise from_os_error(exc, source.where) from None
    if kind == "other":
        raise FormatError(f"{source.where}: not a torch.save file (neither a zip archive nor a pickle stream)")
    if kind == "legacy" and expectation is not None:
        raise InvalidArgumentError(f"{source.where}: per-record digests need a torch.save zip archive; "
                                   "check this file with verify='sha256:<hex>'")
    if kind == "legacy":
        return _fallback(torch, source, map_location, weights_only, mmap, return_stats)
    # An object's archive is read by torch's reader through a stream of ranged GETs; its storages
    # through the engine by URL, as a file's by path.
    directory = open_object_stream(source.path) if is_object_url(source.path) else None
    try:
        archive = StorageRecords.open(torch, source.path if source.path is not None and directory is None
                                      else directory or source.stream, archive_size, source.where)
    except BaseException:
        if directory is not None:
            directory.close()
        raise
    try:
        if archive.not_ours() is not None:
            if expectation is not None:
                raise InvalidArgumentError(f"{source.where}: an archive torch.load reads itself cannot be checked "
                                           "record by record; check it with verify='sha256:<hex>'")
            return _fallback(torch, source, map_location, weights_only, mmap, return_stats)
        if mmap and not _is_path(f):
            raise InvalidArgumentError("mmap=True needs a path, as for torch.load")
        return _ZipLoad(torch, source, archive, _Target(torch, map_location), progress, expectation).run(
            weights_only, return_stats)
    finally:
        archive.close()  # whatever an error's traceback keeps alive, the file is closed now
        if directory is not None:
            directory.close()


class _ZipLoad:
    """One load of a torch.save zip archive: its storages, the reads into them, the unpickle.

    Every storage is a view of an allocation of exactly its record's size that cannot be
    resized (a slice of the allocation, as torch.load's own CPU storages are views of
    their records): torch's ``Tensor.set_`` then refuses, before it makes the tensor, any
    view that reaches past the storage, by torch's own arithmetic (which is torch.load's
    rule, since its storages cannot grow either). A storage that could grow would be
    reallocated instead, and a read still under way would write into the freed memory.
    The load holds every read's destination until the read has ended, whatever fails.

    A checkpoint with a path is read through the engine; one in a stream (``path`` None)
    is read storage by storage through the stream, as its records are read.
    """

    def __init__(self, torch: Any, source: _Source, archive: StorageRecords, target: _Target,
                 progress: ProgressArg, expectation: Expectation | None = None) -> None:
        self.torch, self.archive, self.target, self.progress = torch, archive, target, progress
        self.expectation = expectation
        self.read_records: dict[str, tuple[StorageRecord, Any]] = {}  # with verify: each record's storage
        self.checks = LoadChecks(expectation is not None)
        self.hashed: list[concurrent.futures.Future[dict[str, str]]] = []  # digests taken as the reads landed
        self.path, self.where = source.path, source.where
        # torch.load shares only storages with memory (not empty or meta ones)
        self.persistent_load = archive.persistent_loader(self._typed_storage, lambda _rec, typed: typed._data_ptr() != 0)
        self.pending: list[tuple[Any, StorageRecord]] = []   # storages read after the unpickle
        self.ahead: _ReadAhead | None = None
        self._file: Any = None                       # for storages read one by one

    def run(self, weights_only: bool, return_stats: bool) -> Any:
        torch = self.torch
        before = stats() if return_stats else None
        with self.checks:  # no hashing thread outlives the load
            try:
                if self.target.single_device and self.path is not None:
                    self.ahead = _ReadAhead.start(torch, self.path, self.archive, self.target, self.progress,
                                                  self._hashing(), self.hashed)
                data = self.archive.record("data.pkl")
                result = _unpickle(torch, data, self.persistent_load, weights_only, self.target.map_location,
                                   self.where)
                if self.ahead is not None:
                    self.ahead.complete()
                elif self.path is not None:
                    _read_storages(torch, self.path, self.pending, self.progress, self._hashing(), self.hashed)
            except BaseException:
                if self.ahead is not None:
                    self.ahead.abandon()  # no read may outlive the call or its destination
                raise
            finally:
                if self._file is not None:
                    self._file.close()
            if self.expectation is not None:
                self._verify()
        _validate_sparse(torch, self.where)
        if return_stats:
            return result, stats_delta(before, stats())
        return result

    def _hashing(self) -> LoadChecks | None:
        """Where the reads hand each run of storages once it has landed (a verified load)."""
        return self.checks if self.expectation is not None else None

    def _verify(self) -> None:
        """Check every storage record read against the manifest (its bytes as stored): the records
        hashed as their reads landed, and the others (small, inflated, on a GPU) now."""
        from gdskit.verify import check_tensors  # noqa: PLC0415 - import time

        assert self.expectation is not None
        torch = self.torch
        early = merged(self.hashed)
        named = [(name, _bytes_of(torch, storage, rec.nbytes)) for name, (rec, storage) in self.read_records.items()
                 if rec.nbytes and name not in early]
        ranges = {name: (rec.offset, rec.offset + rec.nbytes) for name, (rec, _s) in self.read_records.items()}
        if named:
            check_loaded(self.expectation, named, ranges)
        check_tensors(self.expectation, {name: early[name] for name in self.read_records if name in early}, ranges)

    def _typed_storage(self, rec: StorageRecord) -> Any:
        storage = self._storage(rec)
        if self.expectation is not None:
            self.read_records[rec.name] = (rec, storage)
        return self.torch.storage.TypedStorage(wrap_storage=storage, dtype=rec.dtype, _internal=True)

    def _storage(self, rec: StorageRecord) -> Any:
        """The storage of record ``rec`` on its device: read now, queued, or being read ahead."""
        torch = self.torch
        if self.ahead is not None:
            found = self.ahead.storages.get(rec.name) if rec.nbytes and rec.raw else None
            if found is not None:
                return found
            storage = new_storage(torch, rec.nbytes, self.ahead.device)
            self._fill_now(storage, rec)
            return storage
        storage = new_storage(torch, rec.nbytes, self.target.device(rec.location))
        if not self.target.eager:
            if rec.raw and self.path is not None:
                self.pending.append((storage, rec))
            else:
                self._fill_now(storage, rec)
            return storage
        self._fill_now(storage, rec)
        try:
            mapped = self.target.map_location(storage, rec.location)
            if mapped is None:
                mapped = torch.serialization.default_restore_location(storage, rec.location)
        except RuntimeError as exc:
            raise DeviceUnavailableError(f"{self.where}: storage {rec.name} saved on {rec.location!r}: {exc}") from None
        mapped = mapped._untyped_storage if isinstance(mapped, torch.storage.TypedStorage) else mapped
        return fixed_size(torch, mapped)

    def _fill_now(self, storage: Any, rec: StorageRecord) -> None:
        """Read ``rec``'s bytes into ``storage`` before going on: records that must be inflated,
        every storage of a stream, and every storage handed to a ``map_location`` callable."""
        torch = self.torch
        if storage.device.type == "meta":
            return
        if not rec.raw or self.path is None:
            data = self.archive.read(rec)  # even an empty record: torch.load refuses one it cannot read
            if rec.nbytes:
                _bytes_of(torch, storage, rec.nbytes).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            return
        if not rec.nbytes:
            return
        dest = _bytes_of(torch, storage, rec.nbytes)
        from gdskit.formats.torch_io import wait_for_all  # noqa: PLC0415 - import time
        if self._file is None:
            self._file = open_file(self.path, "r")
        fut = self._file.pread(dest, size=rec.nbytes, file_offset=rec.offset)
        wait_for_all([fut])
        if fut.result() != rec.nbytes:
            raise TruncatedFileError(f"{self.where}: short read of storage {rec.name}")


def new_storage(torch: Any, nbytes: int, device: Any) -> Any:
    """An untyped storage of ``nbytes`` bytes on ``device`` that cannot be resized (but on the
    meta device, as with torch.load: a meta storage holds no memory)."""
    storage = torch.UntypedStorage(nbytes, device=device)
    if device.type == "meta":
        return storage
    return torch._C.StorageBase.__getitem__(storage, slice(0, nbytes))  # the slice, without the meta check


def fixed_size(torch: Any, storage: Any) -> Any:
    """``storage``, or a view of all of it that cannot be resized (it keeps ``storage``'s
    memory alive). Meta storages hold no memory and stay as they are, as with torch.load."""
    if not storage.resizable() or storage.device.type == "meta":
        return storage
    return storage[0:storage.nbytes()]


class _Abandoned(Exception):
    """Stops the read-ahead job from inside its progress callback; never reaches the caller."""


class _AbandonableProgress(Progress):
    """Progress whose next report stops the job that reports it, once ``abandoned`` is set
    (the engine stops a job whose ``on_bytes`` raises, after the pieces under way)."""

    abandoned = False

    def advance(self, nbytes: int) -> None:
        if self.abandoned:
            raise _Abandoned
        super().advance(nbytes)


class _ReadAhead:
    """The large storages of the archive, read on one device while the pickle is unpickled.

    When ``map_location`` names one device, each storage's place is known before the
    pickle says which storages there are, so their reads need not wait for it (the unpickle
    is a good part of a hot load). The small storages are read after the unpickle: making
    their read requests runs Python, which would contend with the unpickler (docs/engine.md,
    "Measurements behind the defaults"). torch.save writes only records the pickle refers
    to; any other is read for nothing.

    The reads land in storages of exactly their records' sizes that cannot be resized, so
    nothing the pickle does can free memory a read is writing into; :meth:`abandon` and
    :meth:`complete` return only once every read has ended.
    """

    def __init__(self, path: str, device: Any, storages: dict[str, Any], dests: dict[str, Any],
                 small: read_plan.ReadPlan, prog: _AbandonableProgress,
                 read_large: Callable[[], None]) -> None:
        self.storages = storages  # record name ("data/0") -> storage
        self.device = device
        self._path, self._dests, self._small = path, dests, small
        self._prog = prog
        self._pool = executor(1, "gdskit-load")
        self._job = self._pool.submit(read_large)

    @classmethod
    def start(cls, torch: Any, path: str, records: StorageRecords, target: _Target, progress: ProgressArg,
              checks: LoadChecks | None = None,
              hashed: list[concurrent.futures.Future[dict[str, str]]] | None = None) -> _ReadAhead | None:
        """``checks`` (a verified load): the large reads run in the runs it cuts, each hashed on
        its threads once landed (its digests appended to ``hashed``, by record name)."""
        spans = records.spans()
        if not spans:
            return None  # nothing to read, or a record the lazy path will report by name
        dev = target.device("cpu")  # the saved location does not matter: map_location names the device
        if dev.type not in ("cpu", "cuda"):
            return None
        from gdskit.formats.device_memory import reserve_device_memory  # noqa: PLC0415 - import time
        from gdskit.formats.torch_io import execute  # noqa: PLC0415 - test seam
        reserve_device_memory(dev, [n for _k, _o, n in spans])
        storages = {f"data/{k}": new_storage(torch, n, dev) for k, _o, n in spans}
        dests = {k: _bytes_of(torch, storages[f"data/{k}"], n) for k, _o, n in spans}
        plan = read_plan.plan([read_plan.Extent(k, o, n) for k, o, n in spans], small=SMALL_STORAGE_BYTES,
                              max_group=MAX_GROUP_BYTES, max_gap=MAX_GAP_BYTES)
        large = dataclasses.replace(plan, groups=())
        prog = _AbandonableProgress(plan.payload_bytes, progress, "loading")

        def read_large() -> None:
            if large.direct or large.empty:
                with open_file(path, "r") as f:
                    for i, run in enumerate(_verified_runs(checks, large.direct, dev)):
                        part = dataclasses.replace(large, direct=tuple(run), empty=large.empty if i == 0 else ())
                        execute(f, part, dev, dests=dests, progress=prog)
                        _hash_landed(checks, hashed, [(f"data/{e.key}", dests[e.key]) for e in run], dev)

        return cls(path, dev, storages, dests, dataclasses.replace(plan, direct=(), empty=()), prog, read_large)

    def _end(self) -> None:
        """Wait for the job to end and its thread to go, through any interruption; close the bar."""
        from gdskit.formats.torch_io import wait_for_all  # noqa: PLC0415 - import time
        wait_for_all([self._job])  # from here on no read is under way
        self._pool.shutdown(wait=True)
        self._prog.close()

    def abandon(self) -> None:
        """Stop the reads and wait for those under way (raising nothing: the unpickling error
        comes first). A refused checkpoint is not read to its end."""
        self._prog.abandoned = True
        self._end()

    def complete(self) -> None:
        """Raise what the large reads raised, if anything; then read the small storages."""
        from gdskit.formats.torch_io import execute, wait_for_all  # noqa: PLC0415 - test seam
        try:
            wait_for_all([self._job])
            self._job.result()
            if self._small.groups:
                with open_file(self._path, "r") as f:
                    execute(f, self._small, self.device, dests=self._dests, progress=self._prog)
        except BaseException:
            self._prog.abandoned = True
            raise
        finally:
            self._end()


def _bytes_of(torch: Any, storage: Any, nbytes: int) -> Any:
    """A 1-D uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


def _unpickle(torch: Any, data: bytes, persistent_load: Callable[[Any], Any], weights_only: bool,
              map_location: MapLocation, where: str) -> Any:
    tls = getattr(torch.serialization, "_serialization_tls", None)
    if tls is not None:
        tls.map_location = map_location  # used by tensors rebuilt outside a storage (numpy, subclasses)
    try:
        if weights_only:
            try:  # at C speed when the pickle is a plain state dict (gdskit.formats.weights_pickle)
                return weights_pickle.load(data, persistent_load)
            except weights_pickle.NotPlain:
                pass
            from torch import _weights_only_unpickler  # noqa: PLC0415 - optional dependency (torch)
            up = _weights_only_unpickler.Unpickler(io.BytesIO(data), encoding="utf-8")
        else:
            up = _FullUnpickler(torch, io.BytesIO(data), encoding="utf-8")
        up.persistent_load = persistent_load
        try:
            return up.load()
        except pickle.UnpicklingError as exc:
            if not weights_only:
                raise FormatError(f"{where}: the checkpoint's pickle is damaged: {exc}") from None
            raise UnsafeCheckpointError(
                f"{where}: weights_only load refused the checkpoint: {exc}. Load it with weights_only=False "
                "only if you trust its source, or allow its classes with "
                "torch.serialization.add_safe_globals.") from None
        except (GdskitError, MemoryError):
            raise
        except Exception as exc:  # values that do not fit what they build (a view past its storage...)
            raise FormatError(f"{where}: the checkpoint's pickle is damaged: {type(exc).__name__}: {exc}") from exc
    finally:
        if tls is not None:
            tls.map_location = None


class _FullUnpickler(pickle.Unpickler):
    """The unpickler torch.load uses with ``weights_only=False`` (legacy storage names, moved modules)."""

    def __init__(self, torch: Any, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._torch = torch

    def find_class(self, module: str, name: str) -> Any:
        if type(name) is str and "Storage" in name:
            try:
                return self._torch.serialization.StorageType(name)
            except KeyError:
                pass
        if module == "torch.tensor":
            module = "torch._tensor"
        return super().find_class(module, name)


def _verified_runs(checks: LoadChecks | None, extents: Sequence[read_plan.Extent], device: Any) -> list[list[Any]]:
    """``extents`` as the runs read one after another: cut where a verified load hashes each run
    while the next is read (:class:`~gdskit.formats.verified.LoadChecks`), else one run."""
    if checks is None or not checks.overlaps(device):
        return [list(extents)]
    return checks.runs(sorted(extents, key=lambda e: e.file_offset), lambda e: e.nbytes, device) or [[]]


def _hash_landed(checks: LoadChecks | None, hashed: list[concurrent.futures.Future[dict[str, str]]] | None,
                 named: list[tuple[str, Any]], device: Any) -> None:
    """Hand a landed run's storages (by record name) to the hashing threads, where they overlap the reads."""
    if checks is not None and hashed is not None and checks.overlaps(device):
        hashed.append(checks.hash(named, device))


def _read_storages(torch: Any, path: str, pending: list[tuple[Any, StorageRecord]], progress: ProgressArg,
                   checks: LoadChecks | None = None,
                   hashed: list[concurrent.futures.Future[dict[str, str]]] | None = None) -> None:
    """Read the storages the unpickle made, grouped by device (``checks``, ``hashed``: as for
    :meth:`_ReadAhead.start`)."""
    from gdskit.formats.torch_io import execute  # noqa: PLC0415 - test seam
    by_device: dict[Any, list[tuple[int, Any, StorageRecord]]] = {}
    for i, (storage, rec) in enumerate(pending):
        if rec.nbytes and storage.device.type != "meta":
            by_device.setdefault(storage.device, []).append((i, storage, rec))
    if not by_device:
        return
    total = sum(rec.nbytes for items in by_device.values() for _i, _s, rec in items)
    with Progress(total, progress, "loading") as prog, open_file(path, "r") as f:
        for dev, items in by_device.items():
            extents = [read_plan.Extent(i, rec.offset, rec.nbytes) for i, _s, rec in items]
            dests = {i: _bytes_of(torch, storage, rec.nbytes) for i, storage, rec in items}
            names = {i: rec.name for i, _s, rec in items}
            for run in _verified_runs(checks, extents, dev):
                plan = read_plan.plan(run, small=SMALL_STORAGE_BYTES, max_group=MAX_GROUP_BYTES,
                                      max_gap=MAX_GAP_BYTES)
                execute(f, plan, dev, dests=dests, progress=prog)
                _hash_landed(checks, hashed, [(names[e.key], dests[e.key]) for e in run], dev)


def _validate_sparse(torch: Any, where: str) -> None:
    """torch.load's check of the sparse tensors the pickle built, once their bytes are in."""
    validate = getattr(torch._utils, "_validate_loaded_sparse_tensors", None)
    if validate is None:
        return
    try:
        validate()
    except (RuntimeError, ValueError, IndexError) as exc:
        raise FormatError(f"{where}: a sparse tensor of the checkpoint is invalid: {exc}") from None


def _fallback(torch: Any, source: _Source, map_location: MapLocation, weights_only: bool, mmap: bool | None,
              return_stats: bool) -> Any:
    """Files gdskit does not read itself (pre-1.6 format, TorchScript, big-endian): torch.load,
    given what the caller gave (a stream from where the checkpoint starts)."""
    where = source.where
    source.rewind()
    given = open_object_stream(source.path) if is_object_url(source.path) else source.given
    try:
        out = torch.load(given, map_location=map_location, weights_only=weights_only, mmap=mmap)
    except pickle.UnpicklingError as exc:
        if weights_only:
            raise UnsafeCheckpointError(f"{where}: {exc}") from None
        raise FormatError(f"{where}: {exc}") from None
    except OSError as exc:
        raise from_os_error(exc, where) from None
    except (GdskitError, MemoryError):
        raise
    except Exception as exc:  # whatever torch.load's reading of a damaged file raises
        raise FormatError(f"{where}: torch.load cannot read it: {type(exc).__name__}: {exc}") from exc
    finally:
        if given is not source.given:
            given.close()
    return (out, None) if return_stats else out


# -- into existing tensors (gdskit.formats.into_exec) ----------------------------

__all__ += ["load_into"]


def load_into(target: Any, path: str | os.PathLike[str], *, strict: bool = True, cast: bool = False,
              weights_only: bool | None = None, progress: ProgressArg = None, return_stats: bool = False,
              verify: Any = False) -> Any:
    """Fill the tensors ``target`` already has from a torch.save state dict, in place.

    As :func:`gdskit.safetensors.load_into` (same arguments, result and errors); the file
    is a torch.save zip archive holding a mapping of names to tensors (its entries that are
    not tensors count as unexpected). ``weights_only`` as for :func:`load`. The archive is
    read and checked as :func:`load` reads it, and its pickle onto the meta device first, so
    every check runs before any target is written (records stored deflated are inflated then).

    ``verify`` (True, a manifest's path or ``"sha256:<hex>"``) checks the bytes as :func:`load`
    does; a tensor filled from a record has the record's digest only where it covers all of the
    record (a view of part of one cannot be checked: ``NothingToVerifyError`` before anything is
    read; load such a file with :func:`load`).
    """
    _torch()
    weights_only = resolve_weights_only(weights_only)
    from gdskit.formats.into_exec import load_torch_into  # noqa: PLC0415 - import time
    return load_torch_into(target, path, file_kind=_file_kind, unpickle=_unpickle,
                           shape=read_plan.ReadShape(SMALL_STORAGE_BYTES, MAX_GROUP_BYTES, MAX_GAP_BYTES),
                           strict=strict, cast=cast, progress=progress, return_stats=return_stats,
                           weights_only=weights_only, verify=verify)


def __dir__() -> list[str]:
    return sorted(__all__)  # the API and its errors; the module's own imports are not part of it
