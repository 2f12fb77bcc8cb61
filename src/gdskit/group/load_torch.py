"""``gdskit.torch.load(..., process_group=pg)``: each storage byte read once by the group.

Every rank opens the archive with the one-rank loader's reader
(:class:`~gdskit.formats.torch_zip.StorageRecords`, the same checks and refusals) and unpickles
it (the pickle is small), making each storage on its target device as the one-rank loader does;
the bytes of stored records then come through :func:`gdskit.group.load.run_load`, while a
deflated record is inflated by every rank, as the one-rank loader inflates it. Files the one-rank loader hands to ``torch.load``
(pre-1.6 format, TorchScript, another byte order), and a callable ``map_location``, are
loaded by every rank on its own; the ranks still agree on the outcome, so a failure on one
raises on all.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gdskit.errors import ChecksumMismatchError, FormatError, InvalidArgumentError, StaleManifestError, from_os_error
from gdskit.formats import require_torch
from gdskit.engine import is_object_url, open_object_stream, stats, stats_delta
from gdskit.formats.progress import ProgressArg
from gdskit.formats.torch_zip import StorageRecords
from gdskit.formats.verified import check_loaded, expectations
from gdskit.group.load import LoadJob, run_load
from gdskit.group.plan import Segment
from gdskit.verify import OFF, VerifyMode


def _checker(expectation: Any, held: dict[str, tuple[Any, Any]], torch: Any, pt: OneRank) -> Any:
    """The check of every storage record this rank holds (read, received or inflated), as stored."""
    def check() -> None:
        named = [(name, pt.bytes_of(torch, storage, rec.nbytes)) for name, (rec, storage) in held.items()]
        check_loaded(expectation, named, {name: (rec.offset, rec.offset + rec.nbytes)
                                          for name, (rec, _s) in held.items()})
    return check


@dataclass(frozen=True)
class OneRank:
    """What a group load takes from :mod:`gdskit.torch`, which passes it (that module calls this
    one, so this one does not import it): its one-rank ``load``, archive check, map_location
    target, unpickler and storage bytes."""

    load: Callable[..., Any]
    file_kind: Callable[[str], tuple[str, int]]
    target: Callable[[Any, Any], Any]
    unpickle: Callable[..., Any]
    bytes_of: Callable[[Any, Any, int], Any]


def load(path: str | os.PathLike[str], map_location: Any = None, weights_only: bool = True, *,
         process_group: Any, progress: ProgressArg = None, return_stats: bool = False, pt: OneRank,
         verify: VerifyMode = OFF) -> Any:
    """See :func:`gdskit.torch.load`; every rank of ``process_group`` calls it (``pt``: what it
    needs of gdskit.torch). ``verify``: each rank checks the storage records it holds once the
    fan-out is done (:mod:`gdskit.group.checked`)."""
    torch = require_torch("gdskit.torch")

    path = os.fspath(path)

    def local_load() -> LoadJob:
        check = None
        if not verify.on:
            out = pt.load(path, map_location, weights_only, progress=progress)
        else:
            try:
                out = pt.load(path, map_location, weights_only, progress=progress,
                              verify=verify.argument)
            except (ChecksumMismatchError, StaleManifestError) as exc:
                out, found = None, exc

                def check() -> None:  # the mismatch is told to every rank at the group's check
                    raise found
            else:
                def check() -> None:
                    pass
        return LoadJob([path], [None], [], ["torch.load on every rank"], [], {}, set(), out, check=check)

    def prepare() -> LoadJob:
        if verify.whole_file:  # refused here, so that every rank hears of it
            raise InvalidArgumentError("verify='sha256:...' hashes the whole file where a group load shares its "
                                       "bytes out: give a manifest (gdskit digest) or verify=True")
        if verify.on:  # nothing to check against is refused (on every rank) before a byte is read
            expectations([path], verify)
        try:
            kind, archive_size = pt.file_kind(path)
        except OSError as exc:
            raise from_os_error(exc, path) from None
        if kind == "other":
            raise FormatError(f"{path}: not a torch.save file (neither a zip archive nor a pickle stream)")
        target = pt.target(torch, map_location)
        if kind == "legacy" or target.eager:
            return local_load()
        # An object's zip directory and pickle are read through a stream of ranged GETs.
        stream = open_object_stream(path) if is_object_url(path) else None
        try:
            archive = StorageRecords.open(torch, path if stream is None else stream, archive_size, path)
            try:
                if archive.not_ours() is not None:  # TorchScript, or the other byte order: torch.load's
                    return local_load()
                return archive_job(archive, target, archive_size)
            finally:
                archive.close()  # whatever an error's traceback keeps alive, the file is closed now
        finally:
            if stream is not None:
                stream.close()

    def archive_job(archive: StorageRecords, target: Any, archive_size: int) -> LoadJob:
        slots: dict[str, tuple[Any, int, int, Any]] = {}  # key -> (typed storage, offset, nbytes, device)
        inflated: dict[str, str] = {}  # record name -> digest of the bytes of a record read whole (deflated)
        held: dict[str, tuple[Any, Any]] = {}  # record name -> (record, storage) of what this rank holds

        def make_storage(rec: Any) -> Any:
            storage = torch.UntypedStorage(rec.nbytes, device=target.device(rec.location))
            if rec.nbytes and storage.device.type != "meta":
                held[rec.name] = (rec, storage)
            typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=rec.dtype, _internal=True)
            if rec.raw:  # read by the group, after the unpickle
                slots[rec.key] = (typed, rec.offset, rec.nbytes, storage.device)
            else:  # inflated here, by every rank, as the one-rank loader inflates it
                data = archive.read(rec)
                inflated[rec.name] = hashlib.sha256(data).hexdigest()
                if rec.nbytes and storage.device.type != "meta":
                    pt.bytes_of(torch, storage, rec.nbytes).copy_(
                        torch.frombuffer(bytearray(data), dtype=torch.uint8))
            return typed

        persistent_load = archive.persistent_loader(make_storage, lambda _rec, _typed: True)  # every one shared

        pickled = archive.record("data.pkl")
        result = pt.unpickle(torch, pickled, persistent_load, weights_only, map_location, path)
        keys = sorted(slots, key=lambda k: slots[k][1])
        segments = [Segment(k, 0, slots[k][1], slots[k][2]) for k in keys]
        wanted = [slots[k][3].type != "meta" for k in keys]
        dests = {k: pt.bytes_of(torch, slots[k][0]._untyped_storage, slots[k][2])
                 for k, w in zip(keys, wanted) if w}
        # The pickle's digest: the objects around the tensors (a step count) are the checkpoint's too;
        # so are the inflated records' bytes, which no rank sends to another.
        layout = [archive_size, keys, hashlib.sha256(bytes(pickled)).hexdigest(), sorted(inflated.items())]
        check = _checker(expectations([path], verify)[path], held, torch, pt) if verify.on else None
        return LoadJob([path], [archive_size], segments, layout, wanted, dests,
                       {t.device.type for t in dests.values()}, result, check=check)

    before = stats() if return_stats else None
    job = run_load(process_group, prepare, progress)
    validate = getattr(torch._utils, "_validate_loaded_sparse_tensors", None)
    if validate is not None:
        validate()
    if return_stats:
        return job.result, stats_delta(before, stats())
    return job.result
