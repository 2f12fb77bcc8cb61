"""One DCP tensor item as a torch.save archive: build its bytes around the payload, and parse it back.

torch.distributed.checkpoint's file format stores every tensor item as a
complete ``torch.save`` archive (the stock reader ``torch.load``s each item's
byte range). gdskit writes exactly such archives, but never runs the tensor's
bytes through torch.save: :func:`template` asks ``torch.save`` (under
``torch.serialization.skip_data``) for the archive of an empty tensor of the
item's dtype and shape, keeps the bytes before and after the storage record, and
the payload is written between them straight from device memory.

:func:`parse` does the reverse for any archive, ours or the stock writer's: it
finds the storage record and the tensor's view (shape, strides, offset) from
the archive's zip directory and pickle, reading only the archive's first and
last few KiB, so that the payload can be read straight into its destination.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch import _weights_only_unpickler

from gdskit.errors import FormatError
from gdskit.formats.torch_zip import RecordSizes, StorageRecords

#: Bytes read from each end of an archive to parse it (miniz looks for the end
#: of the zip directory in the last 4 KiB; the pickle sits near the start).
HEAD_BYTES = 4096
TAIL_BYTES = 8192

_STORAGE_KEY = "0"  # torch.save of one tensor names its storage data/0


@dataclasses.dataclass(frozen=True)
class Template:
    """An item's archive without its payload: ``head + payload + tail`` is the whole archive."""

    head: bytes
    tail: bytes


class _SparseSink:
    """A write-only, seekable stream that keeps what is written and leaves skipped ranges as holes."""

    def __init__(self) -> None:
        self.pos = 0
        self.pieces: list[tuple[int, bytes]] = []

    def write(self, data: Any) -> int:
        b = bytes(data)
        if b:
            self.pieces.append((self.pos, b))
        self.pos += len(b)
        return len(b)

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 0:
            self.pos = offset
        elif whence == 1:
            self.pos += offset
        else:
            self.pos = self.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass

    @property
    def size(self) -> int:
        return max((o + len(b) for o, b in self.pieces), default=0)

    def range(self, start: int, end: int) -> bytes:
        out = bytearray(end - start)
        for o, b in self.pieces:
            lo, hi = max(o, start), min(o + len(b), end)
            if lo < hi:
                out[lo - start:hi - start] = b[lo - o:hi - o]
        return bytes(out)


class _RangeStream:
    """A read-only, seekable stream over ``length`` bytes that ``fetch(start, end)`` serves
    (what torch's archive reader needs from a Python object)."""

    def __init__(self, length: int, fetch: Callable[[int, int], bytes]) -> None:
        self._length = length
        self._fetch = fetch
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else (self._pos + offset if whence == 1 else self._length + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        start = min(self._pos, self._length)
        end = self._length if n is None or n < 0 else min(self._length, start + n)
        out = self._fetch(start, end)
        self._pos = start + len(out)
        return out


@functools.lru_cache(maxsize=4096)
def template(dtype: torch.dtype, shape: tuple[int, ...]) -> Template:
    """The archive torch.save writes for a contiguous CPU tensor of ``dtype`` and ``shape``, minus its bytes."""
    # torch.empty maps memory lazily: a large shape costs no RAM, and skip_data never touches it.
    t = torch.empty(shape, dtype=dtype)
    sink = _SparseSink()
    with torch.serialization.skip_data():
        torch.save(t, sink)
    nbytes = t.untyped_storage().nbytes()
    del t
    source = _RangeStream(sink.size, sink.range)
    reader = torch._C.PyTorchFileReader(source)
    name = f"data/{_STORAGE_KEY}"
    offset = reader.get_record_offset(name)
    size = RecordSizes(reader, source)(name)
    if size != nbytes:
        raise FormatError(f"torch.save wrote {size} bytes for a {nbytes}-byte storage")
    return Template(sink.range(0, offset), sink.range(offset + nbytes, max(sink.size, offset + nbytes)))


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """What an item's archive holds: a tensor view over one storage record.

    ``meta`` is a tensor on the meta device with the saved dtype, shape, strides
    and storage offset; ``record_offset`` is the storage record's position in the
    *file*, ``record_nbytes`` its size.
    """

    meta: torch.Tensor
    record_offset: int
    record_nbytes: int


def _slice_stream(read: Callable[[int, int], bytes], offset: int, length: int, head: bytes, tail: bytes
                  ) -> _RangeStream:
    """``[offset, offset + length)`` of what ``read(offset, n)`` reads as a stream, served from
    prefetched ends when possible."""
    tail_start = length - len(tail)

    def fetch(start: int, end: int) -> bytes:
        if end <= len(head):
            return head[start:end]
        if start >= tail_start:
            return tail[start - tail_start:end - tail_start]
        return read(offset + start, end - start)

    return _RangeStream(length, fetch)


def parse(read: Callable[[int, int], bytes], offset: int, length: int, head: bytes, tail: bytes,
          where: str) -> SavedTensor:
    """Parse the tensor archive at ``[offset, offset + length)`` of what ``read(offset, n)``
    reads (a file's or an object's bytes: at most ``n`` at ``offset``).

    ``head`` and ``tail`` are the archive's first and last bytes, already read
    (any length; what they miss is read on demand). Raises :class:`FormatError`
    if the range is not a torch.save archive of one tensor.
    """
    if not head.startswith(b"PK\x03\x04"):
        raise FormatError(f"{where}: the item is not a torch.save archive")
    try:
        source = _slice_stream(read, offset, length, head, tail)
        reader = torch._C.PyTorchFileReader(source)
        pkl = reader.get_record("data.pkl")
    except RuntimeError as exc:
        raise FormatError(f"{where}: damaged torch.save archive: {exc}") from None
    storages: dict[str, tuple[int, int]] = {}
    records = StorageRecords(torch, reader, source, length, where)

    def persistent_load(saved_id: Any) -> Any:
        rec = records.resolve(saved_id)
        if not rec.raw:  # compressed in the file: its bytes are not at its offset as they are
            raise FormatError(f"{where}: storage record {rec.name} is compressed; the reader reads "
                              "records stored as they are")
        storages[rec.key] = (rec.offset, rec.nbytes)
        storage = torch.UntypedStorage(rec.nbytes, device="meta")
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=rec.dtype, _internal=True)

    obj = _unpickle(pkl, persistent_load, where)
    if type(obj) is not torch.Tensor or obj.device.type != "meta" or len(storages) != 1:
        raise FormatError(f"{where}: the item is not one plain tensor")
    rec_offset, nbytes = next(iter(storages.values()))
    return SavedTensor(obj, offset + rec_offset, nbytes)


def _unpickle(data: bytes, persistent_load: Callable[[Any], Any], where: str) -> Any:
    up = _weights_only_unpickler.Unpickler(io.BytesIO(data), encoding="utf-8")
    up.persistent_load = persistent_load
    try:
        return up.load()
    except FormatError:
        raise
    except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, TypeError) as exc:
        raise FormatError(f"{where}: the item's pickle cannot be read safely: {exc}") from None
