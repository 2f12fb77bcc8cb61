"""``StorageReader``: read a DCP checkpoint (ours or the stock writer's) straight into each rank's tensors."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import os
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint import storage as dcp_storage
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from gdskit.dcp import _archive
from gdskit.dcp._common import IncompleteCheckpointError, UnsupportedItemError, item_name, member, metadata_name
from gdskit.dcp._metadata_pickle import checked_metadata, load_metadata
from gdskit.durable import read_whole_file
from gdskit.errors import FormatError, InvalidArgumentError, NothingToVerifyError, from_os_error
from gdskit.formats import read_plan
from gdskit.formats.verified import check_loaded, expectations
from gdskit.verify import Expectation, verify_mode
from gdskit.engine import is_object_url, open_file
from gdskit.formats.safetensors_format import TruncatedFileError
# Items are torch.save archives: grouped for reading the way gdskit.torch groups storages.
from gdskit.torch import MAX_GAP_BYTES, MAX_GROUP_BYTES
from gdskit.torch import SMALL_STORAGE_BYTES as SMALL_READ_BYTES


@dataclasses.dataclass
class _Job:
    """One tensor read: saved bytes -> destination tensor."""

    req: ReadItem
    dest: torch.Tensor
    view: torch.Tensor          # the saved tensor narrowed to the request, on the meta device
    extent: read_plan.Extent
    direct: bool                # the extent's bytes are exactly the destination's memory
    skip: int = 0               # elements of the read bytes before the view's first (verify: the whole record is read)


def _narrow(t: torch.Tensor, offsets: Any, lengths: Any, where: str) -> torch.Tensor:
    if len(offsets) != t.dim() or len(lengths) != t.dim():
        raise FormatError(f"{where}: the request has {len(offsets)} dimensions, the saved tensor {t.dim()}")
    for dim, (off, n) in enumerate(zip(offsets, lengths)):
        if off < 0 or n < 0 or off + n > t.shape[dim]:
            raise FormatError(f"{where}: request [{off}, {off + n}) is outside dimension {dim} of {tuple(t.shape)}")
        if off != 0 or n != t.shape[dim]:
            t = t.narrow(dim, off, n)
    return t


def _span_elements(t: torch.Tensor) -> int:
    """Elements of storage from ``t``'s first to its last element."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def _engine_device(dev: torch.device) -> torch.device:
    return dev if dev.type in ("cpu", "cuda") else torch.device("cpu")


class StorageReader(dcp_storage.StorageReader):
    """Read a torch.distributed.checkpoint through the gdskit engine.

    >>> dcp.load(state_dict, storage_reader=gdskit.dcp.StorageReader("ckpt/step_100"))

    Reads checkpoints written by :class:`gdskit.dcp.StorageWriter` and by DCP's
    stock ``FileSystemWriter``, with any world size at load (resharding is
    DCP's planning; the reader moves whatever byte ranges the plan asks for).
    Each tensor's bytes go straight from the file into the destination tensor's
    memory when the saved and requested ranges are contiguous; otherwise the
    covering range is read onto the destination's device and copied from there.

    ``path`` may be an object prefix (``s3://bucket/ckpt/``): ``.metadata`` and
    the items' bytes are then read by ranged GETs through the engine.

    ``verify`` (True, or a digest manifest's path) checks every item read against the digests
    :class:`gdskit.dcp.StorageWriter` recorded with ``digests=True`` (a tensor's storage record
    whole, where it landed; a byte item's bytes): a mismatch raises
    :class:`~gdskit.errors.ChecksumMismatchError` naming the item, a checkpoint without digests
    :class:`~gdskit.errors.NothingToVerifyError` before anything is read (docs/verify.md). A
    request for part of a saved tensor (resharding) reads the whole record to check it.
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: Any = False) -> None:
        super().__init__()
        self.verify = verify_mode(verify)
        if self.verify.whole_file:
            raise InvalidArgumentError("a DCP checkpoint is many files: verify takes True or a manifest's path")
        self.path = os.fspath(path)
        if self.verify.on and is_object_url(self.path):
            raise InvalidArgumentError(f"{self.path}: verify is for a checkpoint directory; an object prefix's "
                                       "checkpoint has no digests (its writer records none)")
        self.storage_data: dict[Any, Any] = {}
        self.load_id = str(uuid.uuid4())

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_object_url(checkpoint_id) or FileSystem.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's ``.metadata`` (``__{rank}.metadata`` with ``rank=`` for saves without coordination).

        Raises :class:`IncompleteCheckpointError` if it is missing: the save never
        finished, or the directory holds no checkpoint.
        """
        rank = kwargs.get("rank")
        path = member(self.path, metadata_name(rank))
        try:
            data = _read_object(path) if is_object_url(path) else read_whole_file(path)
        except FileNotFoundError:
            if is_object_url(path):
                what = f"prefix has no {metadata_name(rank)} object"
            else:
                what = "does not exist" if not os.path.isdir(self.path) else f"has no {metadata_name(rank)} file"
            raise IncompleteCheckpointError(
                2, f"no complete checkpoint: the directory {what} (a save that failed or is still "
                   "running leaves this state)", self.path) from None
        except OSError as exc:
            raise from_os_error(exc, path) from None
        # DCP's classes only (a planted call never runs), of the types the planners rely on
        metadata = checked_metadata(load_metadata(data, path), path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise FormatError(f"{self.path}: the metadata has no storage map")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        fut: Future[None] = Future()
        try:
            per_file: dict[str, list[ReadItem]] = {}
            for req in plan.items:
                per_file.setdefault(self._info(req).relative_path, []).append(req)
            expect = self._expectations(per_file) if self.verify.on else {}
            for rel, reqs in per_file.items():
                self._read_file(rel, reqs, planner, expect.get(rel))
            fut.set_result(None)
        except Exception as exc:
            fut.set_exception(exc)
        return fut

    # -- internals ------------------------------------------------------------
    def _expectations(self, per_file: dict[str, list[ReadItem]]) -> dict[str, Expectation]:
        """What each file's items are checked against, found (or refused) before a byte is read."""
        found = expectations([os.path.join(self.path, rel) for rel in per_file], self.verify)
        out = {}
        for rel, reqs in per_file.items():
            path = os.path.join(self.path, rel)
            exp = found[path]
            lacking = [item_name(r.storage_index) for r in reqs if item_name(r.storage_index) not in exp.tensors]
            if lacking:
                raise NothingToVerifyError(f"{path}: {exp.source} records no digest of item {lacking[0]!r}"
                                           + (f" (and {len(lacking) - 1} more)" if len(lacking) > 1 else "")
                                           + "; save with StorageWriter(..., digests=True)", path=path)
            out[rel] = exp
        return out

    def _info(self, req: ReadItem) -> Any:
        try:
            info = self.storage_data[req.storage_index]
        except KeyError:
            raise FormatError(f"{self.path}: the metadata has no storage entry for {req.storage_index}") from None
        if getattr(info, "transform_descriptors", None):
            raise UnsupportedItemError(f"{req.storage_index.fqn} was written with stream transforms "
                                       f"{list(info.transform_descriptors)}; read it with FileSystemReader")
        return info

    def _read_file(self, rel: str, reqs: list[ReadItem], planner: LoadPlanner,
                   expect: Expectation | None = None) -> None:
        path = member(self.path, rel)
        with open_file(path, "r") as f:
            size = f.size
            for req in reqs:
                info = self._info(req)
                if info.offset < 0 or info.length < 0 or info.offset + info.length > size:
                    raise TruncatedFileError(f"{path}: item {req.storage_index.fqn} at [{info.offset}, "
                                             f"{info.offset + info.length}) is past the end ({size} bytes)")
            self._read_bytes(f, [r for r in reqs if r.type == LoadItemType.BYTE_IO], planner, expect)
            tensors = [r for r in reqs if r.type != LoadItemType.BYTE_IO]
            if tensors:
                self._read_tensors(f, path, tensors, planner, expect)

    def _read_bytes(self, f: Any, reqs: list[ReadItem], planner: LoadPlanner, expect: Expectation | None) -> None:
        bufs = [bytearray(self._info(r).length) for r in reqs]
        futs = [f.pread(b, file_offset=self._info(r).offset) for r, b in zip(reqs, bufs)]
        try:
            for r, b, fut in zip(reqs, bufs, futs):
                if fut.result() != len(b):
                    raise TruncatedFileError(f"{f.path}: short read of {r.storage_index.fqn}")
        finally:
            concurrent.futures.wait(futs)
        if expect is not None:  # before the planner sees any of them
            _check(expect, [(item_name(r.storage_index), _host_bytes(b), (self._info(r).offset, self._info(r).offset + len(b)))
                            for r, b in zip(reqs, bufs)])
        for r, b in zip(reqs, bufs):
            planner.load_bytes(r, io.BytesIO(b))

    def _parse_archives(self, f: Any, path: str, reqs: list[ReadItem]
                        ) -> tuple[dict[tuple[int, int], _archive.SavedTensor], dict[tuple[int, int], bytes]]:
        """Parse each distinct item archive once, reading its two ends in parallel. Returns the
        parsed archives and, for those small enough to be read whole, their bytes."""
        spans = sorted({(self._info(r).offset, self._info(r).length) for r in reqs})
        ends: list[tuple[tuple[int, int], bytearray, bytearray | None]] = []
        futs = []
        for off, n in spans:
            if n <= _archive.HEAD_BYTES + _archive.TAIL_BYTES:
                whole = bytearray(n)
                futs.append(f.pread(whole, file_offset=off))
                ends.append(((off, n), whole, None))
            else:
                head, tail = bytearray(_archive.HEAD_BYTES), bytearray(_archive.TAIL_BYTES)
                futs.append(f.pread(head, file_offset=off))
                futs.append(f.pread(tail, file_offset=off + n - len(tail)))
                ends.append(((off, n), head, tail))
        try:
            for fut in futs:
                fut.result()
        finally:
            concurrent.futures.wait(futs)
        out, wholes = {}, {}
        for (off, n), head, tail in ends:
            out[(off, n)] = _archive.parse(_reader_of(f), off, n, bytes(head),
                                           bytes(tail if tail is not None else head), f"{path}@{off}")
            if tail is None:
                wholes[(off, n)] = bytes(head)
        return out, wholes

    def _read_tensors(self, f: Any, path: str, reqs: list[ReadItem], planner: LoadPlanner,
                      expect: Expectation | None = None) -> None:
        saved, wholes = self._parse_archives(f, path, reqs)
        jobs: list[_Job] = []
        for i, req in enumerate(reqs):
            info = self._info(req)
            st = saved[(info.offset, info.length)]
            where = f"{path}: {req.storage_index.fqn}"
            view = _narrow(st.meta, req.storage_offsets, req.lengths, where)
            dest = planner.resolve_tensor(req).detach()
            if tuple(dest.shape) != tuple(view.shape):
                raise FormatError(f"{where}: the request wants shape {tuple(dest.shape)}, "
                                  f"the checkpoint holds {tuple(view.shape)}")
            es = view.element_size()
            direct = (view.is_contiguous() and dest.is_contiguous() and dest.dtype == view.dtype
                      and dest.device.type in ("cpu", "cuda"))
            if expect is not None:  # the digest covers the whole record: read all of it, where it can be hashed
                direct = direct and view.storage_offset() == 0 and view.numel() * es == st.record_nbytes
                extent = read_plan.Extent(i, st.record_offset, st.record_nbytes)
                jobs.append(_Job(req, dest, view, extent, direct, skip=view.storage_offset()))
                continue
            nbytes = (view.numel() if direct else _span_elements(view)) * es
            extent = read_plan.Extent(i, st.record_offset + view.storage_offset() * es, nbytes)
            jobs.append(_Job(req, dest, view, extent, direct))
        from gdskit.formats.torch_io import execute  # noqa: PLC0415 - test seam
        by_device: dict[torch.device, list[_Job]] = {}
        served: dict[torch.device, list[tuple[_Job, bytes]]] = {}
        landed: list[tuple[str, Any, tuple[int, int]]] = []  # verify: each item's record as read
        for j in jobs:
            if j.dest.device.type == "meta":
                continue
            info = self._info(j.req)
            whole = wholes.get((info.offset, info.length))
            if whole is not None:  # read whole for parsing: its bytes are here already
                data = _item_bytes(j, whole, info.offset, path)
                served.setdefault(j.dest.device, []).append((j, data))
                if expect is not None:
                    landed.append((item_name(j.req.storage_index), _host_bytes(data), _span(j)))
            else:
                by_device.setdefault(_engine_device(j.dest.device), []).append(j)
        for dev, items in served.items():
            _fill_from_bytes(dev, items)
        for dev, group in by_device.items():
            dests = {j.extent.key: j.dest.reshape(-1).view(torch.uint8) for j in group if j.direct}
            plan = read_plan.plan([j.extent for j in group], small=SMALL_READ_BYTES, max_group=MAX_GROUP_BYTES,
                                  max_gap=MAX_GAP_BYTES)
            out = execute(f, plan, dev, dests=dests)
            for j in group:
                src = out[j.extent.key]
                if expect is not None:
                    landed.append((item_name(j.req.storage_index), src, _span(j)))
                if not j.direct and j.view.numel():
                    typed = src.view(j.view.dtype)
                    j.dest.copy_(typed.as_strided(j.view.shape, j.view.stride(), typed.storage_offset() + j.skip))
        if expect is not None:  # before the planner is handed any of them
            _check(expect, landed)
        for j in jobs:
            planner.commit_tensor(j.req, j.dest)


def _read_object(url: str) -> bytes:
    """Every byte of the object at ``url``, read through the engine (under one ETag)."""
    with open_file(url, "r") as f:
        buf = bytearray(f.size)
        got = f.read(buf)
    if got != len(buf):
        raise TruncatedFileError(f"{url}: read {got} of its {len(buf)} bytes")
    return bytes(buf)


def _reader_of(f: Any) -> Any:
    """``read(offset, n)`` of the open engine file (or object) ``f``: at most ``n`` bytes at ``offset``."""

    def read(offset: int, n: int) -> bytes:
        buf = bytearray(n)
        got = f.read(buf, n, offset)
        return bytes(buf[:got])

    return read


def _span(j: _Job) -> tuple[int, int]:
    return j.extent.file_offset, j.extent.file_offset + j.extent.nbytes


def _host_bytes(data: bytes | bytearray) -> torch.Tensor:
    """``data`` as a flat uint8 tensor over its own memory (an empty one for no bytes)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _check(expect: Expectation, landed: list[tuple[str, Any, tuple[int, int]]]) -> None:
    """Check each item's bytes as read; an item read twice (two requests of one saved chunk) is
    checked each time."""
    while landed:
        seen: set[str] = set()
        now, later = [], []
        for item in landed:
            (later if item[0] in seen else now).append(item)
            seen.add(item[0])
        check_loaded(expect, [(n, t) for n, t, _r in now], {n: r for n, _t, r in now})
        landed = later


def _item_bytes(j: _Job, whole: bytes, archive_offset: int, path: str) -> bytes:
    """The bytes of ``j``'s tensor, from its item's archive read whole at ``archive_offset``."""
    start = j.extent.file_offset - archive_offset
    if start < 0 or start + j.extent.nbytes > len(whole):
        raise FormatError(f"{path}: {j.req.storage_index.fqn}: the tensor's bytes at [{j.extent.file_offset}, "
                          f"{j.extent.file_offset + j.extent.nbytes}) lie outside its item")
    return whole[start:start + j.extent.nbytes]


_SERVED_BATCH = 64 << 20  # bytes of small items moved to a GPU in one copy
_SERVED_ALIGN = 16        # each item's place in a batch: any dtype may view it


def _fill_from_bytes(device: torch.device, items: list[tuple[_Job, bytes]]) -> None:
    """Fill each job's destination on ``device`` from its bytes: one host-to-device copy per batch
    of items (not one per tensor), then device-side copies into the destinations."""
    start = 0
    while start < len(items):
        batch, places, size = [], [], 0
        for j, data in items[start:]:
            if batch and size + len(data) > _SERVED_BATCH:
                break
            batch.append((j, data))
            places.append(size)
            size += -(-len(data) // _SERVED_ALIGN) * _SERVED_ALIGN
        start += len(batch)
        buf = bytearray(size)
        for (_, data), at in zip(batch, places):
            buf[at:at + len(data)] = data
        blob = torch.frombuffer(buf, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        if device.type != "cpu":
            blob = blob.to(device)
        for (j, data), at in zip(batch, places):
            if not data or not j.view.numel():
                continue
            src = blob[at:at + len(data)]
            if j.direct:
                j.dest.reshape(-1).view(torch.uint8).copy_(src)
            else:  # as_strided counts from the start of the blob's storage
                typed = src.view(j.view.dtype)
                j.dest.copy_(typed.as_strided(j.view.shape, j.view.stride(), typed.storage_offset() + j.skip))
