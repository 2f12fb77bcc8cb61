"""The storage records of a torch.save zip archive, on every torch version gdskit supports.

``PyTorchFileReader.get_record_size`` exists only in torch releases newer than
2.11; older ones expose offsets but not sizes. There the zip central directory
gives the same number (torch stores records uncompressed; names in the directory
carry the archive's prefix folder, which the reader's names leave out).
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from typing import Any, BinaryIO

from gdskit.errors import FormatError
from gdskit.formats.safetensors_format import TruncatedFileError


class RecordSizes:
    """``sizes(name)`` -> bytes of record ``name`` (e.g. ``"data/0"``) of one archive.

    ``source`` is what the reader was opened on: a path or a seekable binary stream.
    """

    def __init__(self, reader: Any, source: str | BinaryIO) -> None:
        self._reader = reader
        self._source = source
        self._sizes: dict[str, int] | None = None

    def __call__(self, name: str) -> int:
        if hasattr(self._reader, "get_record_size"):
            return int(self._reader.get_record_size(name))
        if self._sizes is None:
            with zipfile.ZipFile(self._source) as zf:
                self._sizes = {info.filename.split("/", 1)[-1]: info.file_size for info in zf.infolist()}
        if name not in self._sizes:
            raise RuntimeError(f"record {name} not found")
        return self._sizes[name]


@dataclass(frozen=True)
class StorageRecord:
    """One storage a pickle refers to, and where its bytes lie in the archive."""

    key: str
    dtype: Any       # torch.dtype
    location: str    # the device it was saved from, e.g. "cuda:0"
    offset: int      # of its bytes, from the start of the archive
    nbytes: int


class StorageRecords:
    """Resolves the pickle's persistent ids (``("storage", type, key, location, numel)``)
    to checked records: the id well formed, the record present, its size what the pickle
    says, its bytes within ``limit`` bytes of the archive."""

    def __init__(self, torch: Any, reader: Any, source: str | BinaryIO, limit: int, where: str) -> None:
        self._torch = torch
        self._reader = reader
        self._sizes = RecordSizes(reader, source)
        self._limit = limit
        self._where = where
        self._located: dict[str, tuple[int, int]] = {}  # record name -> (offset, size)

    def _locate(self, name: str) -> tuple[int, int]:
        """(offset, size) of record ``name``, asked of the archive once (8 us a record);
        RuntimeError where it is missing."""
        found = self._located.get(name)
        if found is None:
            found = self._located[name] = (self._reader.get_record_offset(name), self._sizes(name))
        return found

    def spans(self) -> list[tuple[str, int, int]] | None:
        """``(key, offset, nbytes)`` of every storage record in the archive, or None when
        one of them cannot be placed (missing size, or bytes past the end of the archive)."""
        out = []
        try:
            for name in self._reader.get_all_records():
                if name.startswith("data/"):
                    offset, size = self._locate(name)
                    if offset + size > self._limit:
                        return None
                    out.append((name[len("data/"):], offset, size))
        except RuntimeError:
            return None
        return out

    def resolve(self, saved_id: Any) -> StorageRecord:
        torch, where = self._torch, self._where
        if not isinstance(saved_id, tuple) or len(saved_id) != 5:
            raise FormatError(f"{where}: unexpected persistent id in the pickle")
        typename, storage_type, key, location, numel = saved_id
        decode = torch.serialization._maybe_decode_ascii
        if decode(typename) != "storage":
            raise FormatError(f"{where}: unexpected persistent id type {typename!r}")
        key, location = decode(key), decode(location)
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        if not isinstance(numel, int) or numel < 0:
            raise FormatError(f"{where}: storage {key!r} has invalid size {numel!r}")
        nbytes = numel * torch._utils._element_size(dtype)
        name = f"data/{key}"
        try:
            offset, size = self._locate(name)
        except RuntimeError:
            raise FormatError(f"{where}: storage record {name} is missing") from None
        if size != nbytes:
            raise FormatError(f"{where}: record {name} holds {size} bytes, the pickle says {nbytes}")
        if offset + nbytes > self._limit:
            raise TruncatedFileError(f"{where}: record {name} ends past the end of the archive")
        return StorageRecord(key, dtype, location, offset, nbytes)
