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
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

from gdskit.durable import fsync_dir, remove_if_present, temp_name
from gdskit.errors import FormatError, GdskitError
from gdskit.formats import read_plan, require_torch, weights_pickle
from gdskit.formats._gc import collector_paused
from gdskit.formats._engine import open_file, stats, stats_delta
from gdskit.formats.progress import Progress, ProgressArg
from gdskit.formats.safetensors_format import TruncatedFileError
from gdskit.formats.torch_zip import RecordSizes, StorageRecords

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


class DeviceUnavailableError(GdskitError, RuntimeError):
    """A storage maps to a device this process cannot use (e.g. CUDA without a GPU)."""


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


def save(obj: Any, path: str | os.PathLike[str], *, progress: ProgressArg = False) -> None:
    """Save ``obj`` like ``torch.save``, with 4 KiB-aligned storages written through the engine.

    The result is an ordinary torch.save archive: ``torch.load`` reads it. The write
    is atomic (a temporary file beside ``path``, fsynced, then renamed). Storages
    on the GPU are written straight from device memory. Changes the process-wide
    ``torch.utils.serialization.config.save.storage_alignment`` for the duration
    of the call, so do not run ``torch.save`` in other threads meanwhile.
    """
    torch = _torch()
    import torch.serialization as ser
    from torch.utils.serialization import config

    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, temp_name(os.path.basename(path)))
    captured: dict[str, Any] = {}
    old_alignment = config.save.storage_alignment
    try:
        config.save.storage_alignment = STORAGE_ALIGNMENT
        try:
            with ser.skip_data():
                torch.save(obj, tmp, pickle_module=_recording_pickle_module(torch, captured))
        finally:
            config.save.storage_alignment = old_alignment
        _fill_storages(torch, tmp, captured, progress)
        os.replace(tmp, path)
        fsync_dir(directory)
    except BaseException:
        remove_if_present(tmp)
        raise


def _fill_storages(torch: Any, tmp: str, captured: dict[str, Any], progress: ProgressArg) -> None:
    reader = torch._C.PyTorchFileReader(tmp)
    record_size = RecordSizes(reader, tmp)
    jobs = []
    for key, storage in captured.items():
        name = f"data/{key}"
        nbytes = storage.nbytes()
        if record_size(name) != nbytes:
            raise FormatError(f"record {name} has {record_size(name)} bytes, its storage {nbytes}")
        if nbytes and storage.device.type != "meta":
            jobs.append((reader.get_record_offset(name), nbytes, storage))
    del reader
    for d in {s.device for _o, _n, s in jobs if s.device.type == "cuda"}:
        torch.cuda.synchronize(d)  # the engine reads device memory outside torch's streams
    futures: list[tuple[Any, int]] = []
    with open_file(tmp, "r+") as f, Progress(sum(n for _o, n, _s in jobs), progress, "saving") as prog:
        try:
            for off, nbytes, storage in sorted(jobs, key=lambda j: j[0]):
                src = _bytes_of(torch, storage, nbytes)
                fut = f.pwrite(src, size=nbytes, file_offset=off)
                fut.add_done_callback(lambda _f, n=nbytes: prog.advance(n))
                futures.append((fut, nbytes))
            for fut, nbytes in futures:
                if fut.result() != nbytes:
                    raise GdskitError(f"short write to {tmp}: {fut.result()} of {nbytes} bytes")
        finally:
            concurrent.futures.wait([fut for fut, _n in futures])
        f.fsync()


# -- load -----------------------------------------------------------------------

def _file_kind(path: str) -> str:
    """``"zip"`` (torch.save since 1.6), ``"legacy"`` (older pickle stream) or ``"other"``."""
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head == b"PK\x03\x04":
        return "zip"
    if head[:2] == b"\x80\x02":
        return "legacy"
    return "other"


class _Target:
    """Where each storage goes, following torch.load's ``map_location`` rules."""

    def __init__(self, torch: Any, map_location: MapLocation) -> None:
        self.torch = torch
        self.map_location = map_location
        self.eager = callable(map_location) and not isinstance(map_location, (str, bytes, dict, torch.device))
        self.single_device = isinstance(map_location, (str, bytes, torch.device))  # every storage goes there

    def device(self, location: str) -> Any:
        torch = self.torch
        ml = self.map_location
        if ml is None or self.eager:
            name: Any = location
        elif isinstance(ml, dict):
            name = ml.get(location, location)
        elif isinstance(ml, bytes):
            name = ml.decode()
        else:
            name = ml
        try:
            dev = torch.device(name)
        except (RuntimeError, TypeError) as exc:
            raise DeviceUnavailableError(f"cannot map storage location {location!r} to {name!r}: {exc}") from None
        if self.eager:
            dev = torch.device("cpu")  # the callable receives CPU storages, as with torch.load
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise DeviceUnavailableError(f"storage saved on {location!r} maps to {dev}, "
                                             "but CUDA is not available (pass map_location='cpu')")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        return dev


def load(path: str | os.PathLike[str], map_location: MapLocation = None, weights_only: bool = True, *,
         progress: ProgressArg = None, return_stats: bool = False, process_group: Any = None) -> Any:
    """Load a torch.save file, reading the storage bytes through the engine.

    Parameters
    ----------
    map_location : None, str, torch.device, dict or callable
        As for ``torch.load``: None restores each storage to the device it was
        saved from; a device sends all there; a dict remaps location strings; a
        callable gets each CPU storage and its location and returns the storage
        to use (its storages are read one by one into host memory first).
    weights_only : bool
        True (default): only tensors, primitive types and allow-listed classes are
        unpickled (torch's weights-only unpickler). False runs arbitrary pickle code:
        only for files you trust.
    progress, return_stats, process_group
        As for :func:`gdskit.safetensors.load_file`.
    """
    if process_group is not None:
        from gdskit.group.load_torch import OneRank, load as group_load
        return group_load(path, map_location, weights_only, process_group=process_group, progress=progress,
                          return_stats=return_stats, pt=OneRank(load, _file_kind, _Target, _unpickle, _bytes_of))
    with collector_paused():
        return _load(os.fspath(path), map_location, weights_only, progress, return_stats)


def _load(path: str, map_location: MapLocation, weights_only: bool, progress: ProgressArg,
          return_stats: bool) -> Any:
    torch = _torch()
    try:
        kind = _file_kind(path)
    except OSError as exc:
        from gdskit.errors import from_os_error
        raise from_os_error(exc, path) from None
    if kind == "other":
        raise FormatError(f"{path}: not a torch.save file (neither a zip archive nor a pickle stream)")
    if kind == "legacy":
        return _fallback(torch, path, map_location, weights_only, return_stats)
    try:
        reader = torch._C.PyTorchFileReader(path)
    except RuntimeError as exc:
        raise FormatError(f"{path}: not a readable torch.save zip archive: {exc}") from None
    records = set(reader.get_all_records())
    if "data.pkl" not in records or "constants.pkl" in records:
        return _fallback(torch, path, map_location, weights_only, return_stats)
    if "byteorder" in records and reader.get_record("byteorder").decode() != sys.byteorder:
        return _fallback(torch, path, map_location, weights_only, return_stats)

    target = _Target(torch, map_location)
    archive_size = os.path.getsize(path)
    records = StorageRecords(torch, reader, path, archive_size, path)
    ahead = _ReadAhead.start(torch, path, records, target, progress) if target.single_device else None
    slots: dict[str, tuple[Any, int, int, Any]] = {}   # key -> (typed storage, offset, nbytes, device)
    before = stats() if return_stats else None
    eager_file: list[Any] = []

    def persistent_load(saved_id: Any) -> Any:
        rec = records.resolve(saved_id)
        if rec.key in slots:
            return slots[rec.key][0]
        nbytes = rec.nbytes
        if ahead is not None:  # every record of the archive has its storage, read during or after the unpickle
            storage = ahead.storages[rec.key]
        else:
            storage = torch.UntypedStorage(nbytes, device=target.device(rec.location))
            if target.eager:
                if nbytes:
                    if not eager_file:
                        eager_file.append(open_file(path, "r"))
                    n = eager_file[0].read(_bytes_of(torch, storage, nbytes), size=nbytes, file_offset=rec.offset)
                    if n != nbytes:
                        raise TruncatedFileError(f"{path}: short read of storage {rec.key}")
                mapped = target.map_location(storage, rec.location)
                if mapped is None:
                    mapped = torch.serialization.default_restore_location(storage, rec.location)
                storage = mapped._untyped_storage if isinstance(mapped, torch.storage.TypedStorage) else mapped
        typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=rec.dtype, _internal=True)
        slots[rec.key] = (typed, rec.offset, nbytes, storage.device)
        return typed

    try:
        result = _unpickle(torch, reader.get_record("data.pkl"), persistent_load, weights_only, map_location)
    except BaseException:
        if ahead is not None:
            ahead.abandon()  # no I/O may outlive the call
        raise
    finally:
        for f in eager_file:
            f.close()
    reader = records = None  # close the archive before the storages are read
    if ahead is not None:
        ahead.complete()
    elif not target.eager:
        _read_storages(torch, path, slots, progress)
    validate = getattr(torch._utils, "_validate_loaded_sparse_tensors", None)
    if validate is not None:
        validate()
    if return_stats:
        return result, stats_delta(before, stats())
    return result


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
    """

    def __init__(self, path: str, device: Any, storages: dict[str, Any], dests: dict[str, Any],
                 small: read_plan.ReadPlan, prog: _AbandonableProgress,
                 read_large: Callable[[], None]) -> None:
        self.storages = storages
        self._path, self._device, self._dests, self._small = path, device, dests, small
        self._prog = prog
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gdskit-load")
        self._job = self._pool.submit(read_large)

    @classmethod
    def start(cls, torch: Any, path: str, records: StorageRecords, target: _Target,
              progress: ProgressArg) -> _ReadAhead | None:
        spans = records.spans()
        if not spans:
            return None  # nothing to read, or a record the lazy path will report by name
        dev = target.device("cpu")  # the saved location does not matter: map_location names the device
        if dev.type not in ("cpu", "cuda"):
            return None
        from gdskit.formats.torch_io import execute, reserve_device_memory
        reserve_device_memory(dev, [n for _k, _o, n in spans])
        storages = {k: torch.UntypedStorage(n, device=dev) for k, _o, n in spans}
        dests = {k: _bytes_of(torch, storages[k], n) for k, _o, n in spans}
        plan = read_plan.plan([read_plan.Extent(k, o, n) for k, o, n in spans], small=SMALL_STORAGE_BYTES,
                              max_group=MAX_GROUP_BYTES, max_gap=MAX_GAP_BYTES)
        large = dataclasses.replace(plan, groups=())
        prog = _AbandonableProgress(plan.payload_bytes, progress, "loading")

        def read_large() -> None:
            if large.direct or large.empty:
                with open_file(path, "r") as f:
                    execute(f, large, dev, dests=dests, progress=prog)

        return cls(path, dev, storages, dests, dataclasses.replace(plan, direct=(), empty=()), prog, read_large)

    def _end(self) -> None:
        """Wait for the job to end and its thread to go; close the bar."""
        self._pool.shutdown(wait=True)
        self._prog.close()

    def abandon(self) -> None:
        """Stop the reads and wait for those under way (raising nothing: the unpickling error
        comes first). A refused checkpoint is not read to its end."""
        self._prog.abandoned = True
        self._end()

    def complete(self) -> None:
        """Raise what the large reads raised, if anything; then read the small storages."""
        from gdskit.formats.torch_io import execute
        try:
            self._job.result()
            if self._small.groups:
                with open_file(self._path, "r") as f:
                    execute(f, self._small, self._device, dests=self._dests, progress=self._prog)
        finally:
            self._end()


def _bytes_of(torch: Any, storage: Any, nbytes: int) -> Any:
    """A 1-D uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


def _unpickle(torch: Any, data: bytes, persistent_load: Callable[[Any], Any], weights_only: bool,
              map_location: MapLocation) -> Any:
    tls = getattr(torch.serialization, "_serialization_tls", None)
    if tls is not None:
        tls.map_location = map_location  # used by tensors rebuilt outside a storage (numpy, subclasses)
    try:
        if weights_only:
            try:  # at C speed when the pickle is a plain state dict (gdskit.formats.weights_pickle)
                return weights_pickle.load(data, persistent_load)
            except weights_pickle.NotPlain:
                pass
            from torch import _weights_only_unpickler
            up = _weights_only_unpickler.Unpickler(io.BytesIO(data), encoding="utf-8")
            up.persistent_load = persistent_load
            try:
                return up.load()
            except pickle.UnpicklingError as exc:
                raise UnsafeCheckpointError(
                    f"weights_only load refused the checkpoint: {exc}. Load it with weights_only=False "
                    "only if you trust its source, or allow its classes with "
                    "torch.serialization.add_safe_globals.") from None
            except (GdskitError, MemoryError):
                raise
            except Exception as exc:  # allowed objects built from values that do not fit them
                raise FormatError(f"the checkpoint's pickle is damaged: {type(exc).__name__}: {exc}") from None
        up = _FullUnpickler(torch, io.BytesIO(data), encoding="utf-8")
        up.persistent_load = persistent_load
        return up.load()
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


def _read_storages(torch: Any, path: str, slots: Mapping[str, tuple[Any, int, int, Any]],
                   progress: ProgressArg) -> None:
    from gdskit.formats.torch_io import execute
    by_device: dict[Any, list[str]] = {}
    for key, (_t, _o, _n, dev) in slots.items():
        if dev.type != "meta":
            by_device.setdefault(dev, []).append(key)
    total = sum(slots[k][2] for keys in by_device.values() for k in keys)
    with Progress(total, progress, "loading") as prog, open_file(path, "r") as f:
        for dev, keys in by_device.items():
            extents = [read_plan.Extent(k, slots[k][1], slots[k][2]) for k in keys]
            dests = {k: _bytes_of(torch, slots[k][0]._untyped_storage, slots[k][2]) for k in keys}
            plan = read_plan.plan(extents, small=SMALL_STORAGE_BYTES, max_group=MAX_GROUP_BYTES,
                                  max_gap=MAX_GAP_BYTES)
            execute(f, plan, dev, dests=dests, progress=prog)


def _fallback(torch: Any, path: str, map_location: MapLocation, weights_only: bool, return_stats: bool) -> Any:
    """Files gdskit does not read itself (pre-1.6 format, TorchScript, big-endian): torch.load."""
    try:
        out = torch.load(path, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        if weights_only:
            raise UnsafeCheckpointError(str(exc)) from None
        raise FormatError(f"{path}: {exc}") from None
    except (EOFError, RuntimeError) as exc:
        raise FormatError(f"{path}: torch.load cannot read it: {exc}") from None
    return (out, None) if return_stats else out


# -- into existing tensors (gdskit.formats.into_exec) ----------------------------

__all__ += ["load_into"]


def load_into(target: Any, path: str | os.PathLike[str], *, strict: bool = True, cast: bool = False,
              weights_only: bool = True, progress: ProgressArg = None, return_stats: bool = False) -> Any:
    """Fill the tensors ``target`` already has from a torch.save state dict, in place.

    As :func:`gdskit.safetensors.load_into` (same arguments, result and errors); the file
    is a torch.save zip archive holding a mapping of names to tensors (its entries that are
    not tensors count as unexpected). ``weights_only`` as for :func:`load`. The pickle is
    read onto the meta device first, so every check runs before any data is read.
    """
    _torch()
    from gdskit.formats.into_exec import load_torch_into
    return load_torch_into(target, path, file_kind=_file_kind, unpickle=_unpickle,
                           shape=read_plan.ReadShape(SMALL_STORAGE_BYTES, MAX_GROUP_BYTES, MAX_GAP_BYTES),
                           strict=strict, cast=cast, progress=progress, return_stats=return_stats,
                           weights_only=weights_only)
