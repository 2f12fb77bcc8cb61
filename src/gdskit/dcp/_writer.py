"""``StorageWriter``: each rank writes its items into one file in the stock DCP layout, through the engine."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import os
import pickle
import uuid
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem, storage as dcp_storage
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.futures import Future

from gdskit.dcp import _archive
from gdskit.dcp._common import (DATA_SUFFIX, METADATA_NAME, CheckpointExistsError, UnsupportedItemError,
                                item_name, member, metadata_name)
from gdskit.dcp._layout import ItemShape, Placement, place
from gdskit.durable import OwnedTemp, create_locked_temp, fsync_dir, is_temp_name, remove_if_present
from gdskit.errors import GdskitError, GdskitIOError, InvalidArgumentError, from_os_error
from gdskit.engine import delete_object, is_object_url, object_exists, open_file
from gdskit.formats.digest_scan import RunningDigests, Span
from gdskit.formats.verified import tensor_digests
from gdskit.formats.torch_io import flat_bytes, has_plain_bytes
from gdskit.verify import (DEFAULT_CHUNK_BYTES, DIRECTORY_MANIFEST, MANIFEST_SUFFIX, FileDigests, Manifest,
                           ManifestError, read_manifest, write_manifest)

#: Tensor payloads of at least this many bytes start 4 KiB-aligned and are written
#: straight from their own memory; smaller items are packed and written in batches.
LARGE_ITEM_BYTES = 1 << 20
#: Largest host batch of packed small items; at most two batches are in flight at once, so
#: packed items never take more than twice this in host memory.
MAX_BATCH_BYTES = 16 << 20
_BATCHES_IN_FLIGHT = 2
ALIGNMENT = 4096


@dataclasses.dataclass(frozen=True)
class _RankFiles:
    """A rank's part of the global save plan: the prefix of its file names (``__{rank}_``)."""

    prefix: str


@dataclasses.dataclass(frozen=True)
class _Digested:
    """A write result's storage data with ``digests=True``: the stock ``info`` that goes into
    ``.metadata``, and on one result per file, that file's digests (carried to ``finish``)."""

    info: _StorageInfo
    file: FileDigests | None = None


@dataclasses.dataclass
class _Entry:
    item: WriteItem
    shape: ItemShape
    template: _archive.Template | None = None
    raw: bytes | None = None
    where: Placement | None = None


def _check_written(f: Any, fut: concurrent.futures.Future[int], n: int) -> None:
    got = fut.result()
    if got != n:
        raise GdskitError(f"short write to {f.path}: {got} of {n} bytes")


def _tensor_bytes(tensor: Any, item: WriteItem) -> torch.Tensor:
    """The item's tensor as a flat uint8 tensor over contiguous memory (a copy only if it is not contiguous)."""
    if not isinstance(tensor, torch.Tensor):
        raise UnsupportedItemError(f"{item.index.fqn}: the planner resolved {type(tensor).__name__}, not a tensor")
    t, want = tensor, item.tensor_data
    if not has_plain_bytes(t):
        raise UnsupportedItemError(f"{item.index.fqn}: a {t.layout} tensor on {t.device} has no plain bytes to save")
    if want is not None and (tuple(t.shape) != tuple(want.chunk.sizes) or t.dtype != want.properties.dtype):
        raise UnsupportedItemError(f"{item.index.fqn}: resolved {t.dtype}{tuple(t.shape)}, the plan says "
                                   f"{want.properties.dtype}{tuple(want.chunk.sizes)}")
    return flat_bytes(t)


class StorageWriter(dcp_storage.StorageWriter, BlockingAsyncStager):
    """Write a torch.distributed.checkpoint through the gdskit engine.

    >>> import torch.distributed.checkpoint as dcp, gdskit.dcp
    >>> dcp.save(state_dict, storage_writer=gdskit.dcp.StorageWriter("ckpt/step_100"))

    The directory gets the stock layout (``__{rank}_0.distcp`` per rank and a
    ``.metadata`` file), so ``FileSystemReader`` loads it. Tensor payloads of at
    least 1 MiB start 4 KiB-aligned in the file and go straight from each
    rank's device memory to the file.

    An object prefix (``s3://bucket/ckpt/``) gets the same objects: each rank's
    file is one multipart upload, packed without alignment gaps, that appears
    whole or not at all; ``.metadata`` is put last, after every rank's object
    is complete. A failed save aborts its uploads and puts no ``.metadata``.

    Parameters
    ----------
    path : str or PathLike
        The checkpoint's directory, or an object prefix ``s3://bucket/prefix/``
        (``checkpoint_id`` replaces it). Give every checkpoint its own directory:
        a failed save then never harms an older one.
    sync_files : bool
        fsync every file and the directory before the checkpoint is declared
        complete (default). False skips the fsyncs (faster, not crash-safe).
        Objects are durable when their upload completes either way.
    overwrite : bool
        Allow saving into a directory that already holds a complete checkpoint
        (its ``.metadata`` is removed before any new data is written).
    cache_staged_state_dict : bool
        For ``dcp.async_save``: keep the host copy of the state dict between
        saves (faster staging, more host memory), as the stock writer does.
    digests : bool
        Also record each item's BLAKE3 digest (a tensor's bytes as stored, a byte
        item's bytes) in a digest manifest beside the checkpoint, written before
        ``.metadata`` (``gdskit-digest.json`` in the directory; ``__{rank}_0.distcp``'s
        own ``.gdskit-digest.json`` for a save without rank coordination), so that
        ``StorageReader(path, verify=True)`` can check every item it reads
        (docs/verify.md). Each rank hashes its file's bytes as it writes them, from
        the memory they are written from (a device tensor's own digest on its GPU),
        never reading the file back; a save that fails records no digests. Off by
        default.

    ``dcp.async_save`` first copies the state dict to host memory with the
    writer's own staging (the same as the stock ``FileSystemWriter``), then
    writes it from there in the background.
    """

    def __init__(self, path: str | os.PathLike[str], *, sync_files: bool = True, overwrite: bool = True,
                 cache_staged_state_dict: bool = False, digests: bool = False) -> None:
        dcp_storage.StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self.path = os.fspath(path)
        self.sync_files = sync_files
        self.overwrite = overwrite
        if digests and is_object_url(self.path):
            raise InvalidArgumentError(f"{self.path}: digests=True is for a checkpoint directory; an object "
                                       "prefix's checkpoint is saved without digests")
        self.digests = digests
        self.save_id = str(uuid.uuid4())
        self.rank: int | None = None
        self.is_coordinator = False
        self.use_collectives = True

    # -- set-up ---------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_object_url(checkpoint_id) or FileSystem.validate_checkpoint_id(checkpoint_id)

    @property
    def _on_objects(self) -> bool:
        return is_object_url(self.path)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def _own_metadata_name(self) -> str:
        return metadata_name(self.rank if not self.use_collectives and self.rank is not None else None)

    # -- planning -------------------------------------------------------------
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self._on_objects:
            os.makedirs(self.path, exist_ok=True)
        if not self.overwrite and self._exists(metadata_name(None if self.use_collectives else 0)):
            raise CheckpointExistsError(f"{self.path} already holds a complete checkpoint and overwrite=False")
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_RankFiles(f"__{self.rank}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs once (on the coordinator) after every rank planned and before any
        # writes: the directory stops looking complete before new data lands in it.
        self._retire_previous()
        return [dataclasses.replace(p, storage_data=_RankFiles(f"__{i}_")) if p.storage_data is None else p
                for i, p in enumerate(plans)]

    def _exists(self, name: str) -> bool:
        where = member(self.path, name)
        if self._on_objects:
            return object_exists(where)
        return os.path.exists(where)

    def _retire_previous(self) -> None:
        if self._on_objects:  # no temporaries here: an object being uploaded is not in the bucket yet
            delete_object(member(self.path, self._own_metadata_name()))
            return
        changed = False
        meta = os.path.join(self.path, self._own_metadata_name())
        if os.path.exists(meta):
            os.unlink(meta)
            changed = True
        own = None if self.use_collectives else f".__{self.rank}_"
        for manifest in self._own_manifests():  # digests of the data about to be replaced
            if _remove_manifest(manifest):
                changed = True
        for name in os.listdir(self.path):
            # Only a checkpoint's own temporaries: another gdskit writer may be at work in the directory.
            ours = DATA_SUFFIX in name or METADATA_NAME in name
            if is_temp_name(name) and ours and (own is None or name.startswith(own)):
                if remove_if_present(os.path.join(self.path, name)):
                    changed = True
        if changed and self.sync_files:
            fsync_dir(self.path)

    # -- data -----------------------------------------------------------------
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[dcp_storage.WriteResult]]:
        fut: Future[list[dcp_storage.WriteResult]] = Future()
        try:
            fut.set_result(self._write_rank_file(plan, planner))
        except Exception as exc:
            fut.set_exception(exc)
        return fut

    def _write_rank_file(self, plan: SavePlan, planner: SavePlanner) -> list[dcp_storage.WriteResult]:
        prefix = getattr(plan.storage_data, "prefix", None)
        if not isinstance(prefix, str):
            raise GdskitError("the save plan carries no file prefix; was prepare_global_plan skipped?")
        name = f"{prefix}0{DATA_SUFFIX}"
        entries = self._layout(plan.items, planner)
        digests = None
        if self._on_objects:
            self._write_object(name, entries, planner)
        else:
            digests = self._write_file(name, entries, planner)
        results = []
        for e in entries:
            if e.where is None:
                continue  # a file of no items is read by no one: nothing to record
            info: Any = _StorageInfo(name, e.where.offset, e.where.length)
            if digests is not None:
                info, digests = _Digested(info, digests), None  # the file's digests travel once
            results.append(dcp_storage.WriteResult(index=e.item.index, size_in_bytes=e.where.length, storage_data=info))
        return results

    def _write_object(self, name: str, entries: list[_Entry], planner: SavePlanner) -> None:
        """The rank's file as one object: its items in order (an object is written in order), the
        upload completed at close, aborted on any failure (nothing appears)."""
        f = open_file(member(self.path, name), "w")
        try:
            self._write_entries(f, entries, planner)
            f.close()
        except BaseException:
            f.abort()
            raise

    def _write_file(self, name: str, entries: list[_Entry], planner: SavePlanner) -> FileDigests | None:
        """The rank's file, written to a temporary and renamed into place; its digests where asked."""
        owned = self._new_temp(name)
        try:
            running = self._running_digests(entries) if self.digests else None
            f = open_file(owned.fd_path, "w")  # the temporary itself, never whatever is at its name
            try:
                self._write_entries(f, entries, planner, running)
                if self.sync_files:
                    f.fsync()
                f.close()
            except BaseException:
                f.abort()
                raise
            digests = _written_digests(owned, running) if running is not None else None
            self._publish(owned, name)
        except BaseException:
            owned.discard()
            raise
        owned.close()
        return digests

    @staticmethod
    def _running_digests(entries: list[_Entry]) -> RunningDigests:
        """The digests of the file about to be written (whole, chunks, and each item's bytes as
        stored: a tensor's storage record, a byte item whole), fed as its bytes are written."""
        spans = [Span(item_name(e.item.index), e.where.payload_offset, e.shape.payload)
                 for e in entries if e.where is not None]
        return RunningDigests(DEFAULT_CHUNK_BYTES, spans)

    def _layout(self, items: Sequence[WriteItem], planner: SavePlanner) -> list[_Entry]:
        raw: list[_Entry] = []
        small: list[_Entry] = []
        large: list[_Entry] = []
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                b = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                raw.append(_Entry(item, ItemShape(0, len(b), 0, raw=True), raw=b))
                continue
            td = item.tensor_data
            if td is None:
                raise UnsupportedItemError(f"{item.index.fqn}: a tensor item without tensor data")
            shape = tuple(int(s) for s in td.chunk.sizes)  # this rank's chunk, not the global size
            nbytes = torch._utils._element_size(td.properties.dtype)
            for s in shape:
                nbytes *= s
            tpl = _archive.template(td.properties.dtype, shape)
            e = _Entry(item, ItemShape(len(tpl.head), nbytes, len(tpl.tail)), template=tpl)
            (large if nbytes >= LARGE_ITEM_BYTES else small).append(e)
        entries = raw + small + large
        # An object's bytes are read by ranged GETs through pinned lanes: alignment buys nothing,
        # and an object is written in order, so its items are packed without gaps.
        alignment = 1 if self._on_objects else ALIGNMENT
        placements, _size = place([e.shape for e in entries], alignment=alignment, large=LARGE_ITEM_BYTES)
        for e, p in zip(entries, placements):
            e.where = p
        return entries

    def _write_entries(self, f: Any, entries: list[_Entry], planner: SavePlanner,
                       running: RunningDigests | None = None) -> None:
        """Write every item; ``running``: fed each byte of the file in order, from the memory it is
        written from, while the engine writes it (the holes before aligned items as zeros)."""
        futures: list[tuple[concurrent.futures.Future[int], int]] = []
        try:
            packed = [e for e in entries if e.where is not None and not e.where.aligned]
            for i, batch in enumerate(_batches(packed)):
                if i >= _BATCHES_IN_FLIGHT:  # each batch is a host copy: bound how many exist at once
                    _check_written(f, *futures[i - _BATCHES_IN_FLIGHT])
                fut, buf, start = self._write_batch(f, batch, planner)
                futures.append((fut, len(buf)))
                if running is not None:
                    running.feed_zeros(start - running.at)
                    running.feed(buf)
            large = [e for e in entries if e.where is not None and e.where.aligned]
            resolved = [(e, _tensor_bytes(planner.resolve_data(e.item), e.item)) for e in large]
            for dev in {t.device for _e, t in resolved if t.device.type == "cuda"}:
                torch.cuda.synchronize(dev)  # the engine reads device memory outside torch's streams
            on_gpu = _device_digests(resolved) if running is not None else {}
            for e, t in resolved:
                tpl, p = e.template, e.where
                futures.append((f.pwrite(tpl.head, file_offset=p.offset), len(tpl.head)))
                futures.append((f.pwrite(t, size=e.shape.payload, file_offset=p.payload_offset), e.shape.payload))
                futures.append((f.pwrite(tpl.tail, file_offset=p.payload_offset + e.shape.payload), len(tpl.tail)))
                if running is not None:
                    _feed_item(running, e, t, on_gpu.get(item_name(e.item.index)))
            for fut, n in futures:
                _check_written(f, fut, n)
        finally:
            concurrent.futures.wait([fut for fut, _n in futures])

    def _write_batch(self, f: Any, batch: list[_Entry],
                     planner: SavePlanner) -> tuple[concurrent.futures.Future[int], bytearray, int]:
        """Assemble a run of packed items in host memory and write it with one request: the
        write, the bytes (alive until written) and their file offset."""
        start = batch[0].where.offset
        buf = bytearray(batch[-1].where.end - start)
        tensors = {id(e): _tensor_bytes(planner.resolve_data(e.item), e.item) for e in batch if e.raw is None}
        host = _to_host(list(tensors.values()))
        host_of = dict(zip(tensors.keys(), host))
        for e in batch:
            p = e.where
            pos = p.offset - start
            if e.raw is not None:
                buf[pos:pos + len(e.raw)] = e.raw
                continue
            head, tail = e.template.head, e.template.tail
            buf[pos:pos + len(head)] = head
            pos += len(head)
            if e.shape.payload:
                buf[pos:pos + e.shape.payload] = memoryview(host_of[id(e)].numpy())
            pos += e.shape.payload
            buf[pos:pos + len(tail)] = tail
        return f.pwrite(buf, file_offset=start), buf, start

    # -- completion -----------------------------------------------------------
    def finish(self, metadata: Metadata, results: list[list[dcp_storage.WriteResult]]) -> None:
        """Write ``.metadata`` last: temporary name, fsync, rename, directory fsync."""
        if "version" in {fl.name for fl in dataclasses.fields(metadata)}:
            version = getattr(filesystem, "CURRENT_DCP_VERSION", None)
            if version is not None:
                metadata.version = version
        files: dict[str, FileDigests] = {}
        storage = {}
        for wrs in results:
            for wr in wrs:
                info = wr.storage_data
                if isinstance(info, _Digested):
                    if info.file is not None:
                        files[info.info.relative_path] = info.file
                    info = info.info
                storage[wr.index] = info
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        manifest = self._write_manifest(files) if self.digests else None
        name = self._own_metadata_name()
        if self._on_objects:  # one PUT, or an upload completed only now: whole or absent
            with open_file(member(self.path, name), "w") as f:
                f.write(pickle.dumps(metadata))
            return
        owned = self._new_temp(name)
        try:
            with os.fdopen(os.dup(owned.fd), "wb") as fh:
                pickle.dump(metadata, fh)
                fh.flush()
                if self.sync_files:
                    os.fsync(fh.fileno())
            self._publish(owned, name)
        except BaseException:
            owned.discard()
            if manifest is not None:
                _remove_manifest(manifest)  # no checkpoint, no digests of it
            raise
        owned.close()

    # -- digests --------------------------------------------------------------
    def _own_manifests(self) -> list[str]:
        """The manifests this save writes: the directory's, or (without rank coordination) the one
        beside this rank's file."""
        if self.use_collectives:
            return [os.path.join(self.path, DIRECTORY_MANIFEST)]
        return [os.path.join(self.path, f"__{self.rank}_0{DATA_SUFFIX}{MANIFEST_SUFFIX}")]

    def _write_manifest(self, files: dict[str, FileDigests]) -> str:
        """Write the save's digests before ``.metadata``; the manifest's path."""
        (path,) = self._own_manifests()
        if not self.use_collectives:  # this rank's file only
            own = os.path.basename(path)[:-len(MANIFEST_SUFFIX)]
            files = {k: v for k, v in files.items() if k == own}
        write_manifest(Manifest(DEFAULT_CHUNK_BYTES, files), path)
        if self.sync_files:
            fsync_dir(self.path)
        return path

    # -- temporaries ----------------------------------------------------------
    def _new_temp(self, name: str) -> OwnedTemp:
        """A new temporary for ``name`` in the checkpoint's directory: a fresh random name made
        only if nothing is there (a link planted in the directory is never followed)."""
        try:
            return create_locked_temp(self.path, name)
        except OSError as exc:
            raise from_os_error(exc, os.path.join(self.path, name)) from exc

    def _publish(self, owned: OwnedTemp, name: str) -> None:
        """Rename a written temporary over ``name`` (if its name still holds it) and make it durable."""
        final = os.path.join(self.path, name)
        try:
            owned.publish(final)
            if self.sync_files:
                fsync_dir(self.path)
        except GdskitError:
            raise
        except OSError as exc:
            raise from_os_error(exc, final) from exc


#: Bytes of a device tensor copied to host memory at a time for the file's and chunks' digests.
_DEVICE_PIECE_BYTES = 64 << 20


def _device_digests(resolved: list[tuple[_Entry, torch.Tensor]]) -> dict[str, str]:
    """The digests of the large items in device memory, hashed on their GPUs (one launch pair per
    device), by item name: their bytes need not pass through the CPU's item hashing."""
    on_device = [(item_name(e.item.index), t) for e, t in resolved if t.device.type != "cpu"]
    return tensor_digests(on_device) if on_device else {}


def _feed_item(running: RunningDigests, e: _Entry, t: torch.Tensor, item_digest: str | None) -> None:
    """Feed one aligned item's bytes to ``running``: the hole before it, its head, its payload
    (from the host tensor being written, or host copies of a device tensor's, piece by piece), its tail."""
    tpl, p = e.template, e.where
    running.feed_zeros(p.offset - running.at)
    running.feed(tpl.head)
    if t.device.type == "cpu":
        running.feed(t.numpy())
    else:
        if item_digest is not None:
            running.given(item_name(e.item.index), item_digest)
        for start in range(0, e.shape.payload, _DEVICE_PIECE_BYTES):
            running.feed(t[start:start + _DEVICE_PIECE_BYTES].cpu().numpy())
    running.feed(tpl.tail)


def _written_digests(owned: OwnedTemp, running: RunningDigests) -> FileDigests:
    """The digests of the file just written, once every write has completed: its size must be
    every byte fed, its modification time is the one it keeps when renamed into place."""
    st = os.fstat(owned.fd)
    if st.st_size != running.at:
        raise GdskitError(f"{owned.fd_path}: the written file holds {st.st_size} bytes, not the {running.at} written")
    return running.result(st.st_mtime_ns)


def _remove_manifest(path: str) -> bool:
    """Remove the digest manifest at ``path``: only one gdskit wrote (anything else stays)."""
    if not os.path.isfile(path) or os.path.islink(path):
        return False
    try:
        read_manifest(path)
    except (ManifestError, GdskitIOError):
        return False
    return remove_if_present(path)


def _batches(entries: list[_Entry]) -> list[list[_Entry]]:
    """Split a packed run into consecutive batches of at most MAX_BATCH_BYTES (one oversized item alone)."""
    out: list[list[_Entry]] = []
    cur: list[_Entry] = []
    size = 0
    for e in entries:
        if cur and size + e.where.length > MAX_BATCH_BYTES:
            out.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e.where.length
    if cur:
        out.append(cur)
    return out


def _to_host(flats: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of the flat uint8 tensors: one gather and one device-to-host copy per device."""
    out: list[Any] = [t if t.device.type == "cpu" else None for t in flats]
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(flats):
        if t.device.type != "cpu":
            by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        joined = torch.cat([flats[i] for i in idx]).cpu()
        for i, part in zip(idx, torch.split(joined, [flats[i].numel() for i in idx])):
            out[i] = part
    return out
