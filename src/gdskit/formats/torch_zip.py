"""The records of a torch.save zip archive, placed and checked the way torch.load reads them.

torch.load reads a storage record through miniz: it finds the record in the zip
central directory (names compared without regard to case), refuses a record that
is encrypted, compressed by a method other than deflate, or whose local header
does not start with its signature, inflates a deflated record, and copies a stored
one from just past its local header. gdskit reads stored records itself, straight
from the file into their destination; :class:`StorageRecords` says, for each
record, where those bytes are and whether they may be read that way (``raw``).
Records that may not (deflated ones, or any record of an archive whose central
directory this module cannot read unambiguously) are read through torch's own
reader, so that their bytes are exactly torch.load's.

``PyTorchFileReader.get_record_size`` exists only in torch releases newer than
2.11; older ones expose offsets but not sizes. There the zip central directory
gives the same number (names in the directory carry the archive's prefix folder,
which the reader's names leave out).
"""

from __future__ import annotations

import os
import struct
import sys
import zipfile
import zlib
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, BinaryIO, NamedTuple

from gdskit.durable import open_file_fd
from gdskit.errors import FormatError
from gdskit.formats.safetensors_format import TruncatedFileError

_LOCAL_SIG = b"PK\x03\x04"
_CENTRAL_SIG = b"PK\x01\x02"
_END_SIG = b"PK\x05\x06"
_END64_LOCATOR_SIG = b"PK\x06\x07"
_END64_SIG = b"PK\x06\x06"
_LOCAL_HEADER = 30
_CENTRAL_HEADER = 46
_END_RECORD = 22
_STORED, _DEFLATED = 0, 8
#: General-purpose flags miniz refuses to extract: encrypted, compressed patch, strong encryption.
_UNSUPPORTED_FLAGS = 0x0001 | 0x0020 | 0x0040
_DOS_DIRECTORY = 0x10


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

    def close(self) -> None:
        """Let go of the reader (an error's traceback may keep this object alive)."""
        self._reader = None


class _ArchiveBytes:
    """Positioned reads of the archive torch's reader was opened on (a path or a stream).

    A stream's archive starts at ``start``, where the stream stood when torch's reader was
    opened on it (torch's reader counts its offsets from there): offsets here count from there too.
    """

    def __init__(self, source: str | BinaryIO, start: int = 0) -> None:
        self._fd = -1
        self._stream: BinaryIO | None = None
        self._start = start
        if isinstance(source, (str, os.PathLike)):
            self._fd, st = open_file_fd(os.fspath(source), os.O_RDONLY)
            self.size = st.st_size
        else:
            self._stream = source
            self.size = source.seek(0, os.SEEK_END) - self._start

    def read(self, offset: int, n: int) -> bytes:
        if offset < 0 or n <= 0 or offset >= self.size:
            return b""
        if self._stream is not None:
            self._stream.seek(self._start + offset)
            return self._stream.read(n)
        return os.pread(self._fd, n, offset)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        self._stream = None


class DirectoryEntry(NamedTuple):
    """What the zip central directory says of one record (a tuple: an archive of 20,000
    tensors has as many)."""

    method: int          # 0 stored, 8 deflate
    flags: int           # general-purpose bit flags
    is_directory: bool   # a directory entry (name ends in "/" or the DOS directory attribute)
    compressed_size: int
    size: int            # of the contents
    header_offset: int   # where the record's local header starts


# A central directory entry's fixed part: signature, flags, method, compressed and full size,
# name, extra and comment lengths, external attributes, local header offset.
_CENTRAL_ENTRY = struct.Struct("<4s4xHH8xIIHHH4xII")
_WIDE = 0xFFFFFFFF


def _zip64_values(extra: bytes, size: int, compressed: int, offset: int) -> tuple[int, int, int] | None:
    """``(size, compressed size, header offset)`` with the ZIP64 extra field's values where the
    entry's own fields say 0xFFFFFFFF (the values come in that order, each present only where
    its field overflowed), as miniz reads them; None where the field is missing or short."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        if tag == 0x0001:
            body = extra[pos + 4:pos + 4 + length]
            values = [size, compressed, offset]
            at = 0
            for i in range(3):
                if values[i] == _WIDE:
                    if len(body) < at + 8:
                        return None
                    values[i] = struct.unpack_from("<Q", body, at)[0]
                    at += 8
            return values[0], values[1], values[2]
        pos += 4 + length
    return None


def _end_of_central_directory(data: _ArchiveBytes) -> tuple[int, int, int] | None:
    """``(entries, directory offset, directory size)``, found as miniz finds them: the last
    end-of-directory signature with a whole record after it, in the archive's last 64 KiB,
    and the ZIP64 record's figures instead where the locator before it points to one."""
    if data.size < _END_RECORD:
        return None
    start = max(0, data.size - (0xFFFF + _END_RECORD))
    tail = data.read(start, data.size - start)
    pos = tail.rfind(_END_SIG, 0, len(tail) - _END_RECORD + len(_END_SIG))
    if pos < 0:
        return None
    entries, size, offset = struct.unpack_from("<HII", tail, pos + 10)
    at = start + pos
    locator = data.read(at - 20, 20) if at >= 20 else b""
    if len(locator) == 20 and locator[:4] == _END64_LOCATOR_SIG:
        (end64_at,) = struct.unpack_from("<Q", locator, 8)
        end64 = data.read(end64_at, 56)
        if len(end64) == 56 and end64[:4] == _END64_SIG:
            entries, size, offset = struct.unpack_from("<QQQ", end64, 32)
    return entries, offset, size


def read_directory(data: _ArchiveBytes) -> tuple[bytes, dict[bytes, DirectoryEntry | None]] | None:
    """The archive's prefix folder (its first entry's name up to the first ``/``) and its
    central directory entries by lower-cased name (None for a name given more than once);
    None where the directory cannot be read."""
    end = _end_of_central_directory(data)
    if end is None:
        return None
    entries, offset, size = end
    blob = data.read(offset, size)
    if len(blob) != size or entries == 0:
        return None
    out: dict[bytes, DirectoryEntry | None] = {}
    unpack = _CENTRAL_ENTRY.unpack_from
    if size < _CENTRAL_HEADER:
        return None
    prefix = blob[_CENTRAL_HEADER:_CENTRAL_HEADER + unpack(blob)[5]].split(b"/", 1)[0]
    pos = 0
    for _ in range(entries):
        if pos + _CENTRAL_HEADER > size:
            return None
        sig, flags, method, compressed, full, name_len, extra_len, comment_len, external, at = unpack(blob, pos)
        name_end = pos + _CENTRAL_HEADER + name_len
        if sig != _CENTRAL_SIG or name_end > size:
            return None
        name = blob[pos + _CENTRAL_HEADER:name_end]
        if _WIDE in (compressed, full, at):
            wide = _zip64_values(blob[name_end:name_end + extra_len], full, compressed, at)
            if wide is None:
                return None
            full, compressed, at = wide
        key = name.lower()
        is_dir = name.endswith(b"/") or bool(external & _DOS_DIRECTORY)
        out[key] = None if key in out else DirectoryEntry(method, flags, is_dir, compressed, full, at)
        pos = name_end + extra_len + comment_len
    return prefix, out


@dataclass(frozen=True)
class StorageRecord:
    """One storage a pickle refers to, and where its bytes lie in the archive.

    ``raw``: the archive holds the bytes as they are at ``[offset, offset + nbytes)``
    (a stored record); otherwise they must be read with :meth:`StorageRecords.read`.
    """

    key: Any         # as the pickle names it (a str in every file torch writes)
    dtype: Any       # torch.dtype
    location: str    # the device it was saved from, e.g. "cuda:0"
    offset: int      # of its bytes, from the start of the archive
    nbytes: int
    raw: bool = True
    name: str = ""   # the record, e.g. "data/0"


@dataclass(frozen=True)
class _Place:
    offset: int          # of the record's bytes (compressed ones, for a deflated record)
    size: int            # of its contents
    raw: bool            # stored: the contents are the bytes at offset
    compressed: int = -1  # deflated: how many bytes at offset to inflate; -1: ask torch's reader


class StorageRecords:
    """Resolves the pickle's persistent ids (``("storage", type, key, location, numel)``)
    to checked records: the id well formed, the record present, its size what the pickle
    says, its bytes within ``limit`` bytes of the archive, and readable as torch.load
    reads them (see the module's docstring).

    Holds torch's reader and a descriptor of the archive: :meth:`close` lets go of both.
    """

    @classmethod
    def open(cls, torch: Any, source: str | BinaryIO, limit: int, where: str) -> StorageRecords:
        """torch's reader opened on ``source`` (a path, or a seekable stream at the archive's
        start), wrapped; FormatError where torch's reader cannot open it."""
        start = 0 if isinstance(source, (str, os.PathLike)) else source.tell()  # the reader moves a stream
        try:
            reader = torch._C.PyTorchFileReader(source)
        except (RuntimeError, ValueError) as exc:
            raise FormatError(f"{where}: not a readable torch.save zip archive: {exc}") from None
        return cls(torch, reader, source, limit, where, start)

    def __init__(self, torch: Any, reader: Any, source: str | BinaryIO, limit: int, where: str,
                 start: int = 0) -> None:
        self._torch = torch
        self._reader = reader
        self._sizes = RecordSizes(reader, source)
        self._source = source
        self._start = start  # of the archive in a stream
        self._limit = limit
        self._where = where
        self._located: dict[str, _Place] = {}
        self._data: _ArchiveBytes | None = None
        self._directory: tuple[bytes, dict[bytes, DirectoryEntry | None]] | None = None
        self._directory_read = False

    def close(self) -> None:
        """Let go of torch's reader and close the archive's descriptor (an error's traceback
        may keep this object alive: nothing it holds may keep the file open)."""
        self._reader = None
        self._sizes.close()
        if self._data is not None:
            self._data.close()

    # -- where a record's bytes are -------------------------------------------------
    def _bytes(self) -> _ArchiveBytes:
        if self._data is None:
            self._data = _ArchiveBytes(self._source, self._start)
        return self._data

    def _entry(self, name: str) -> DirectoryEntry | None:
        """The record's one central directory entry; None where the directory is unreadable or
        names it more than once (miniz's choice among duplicates is not this module's to guess)."""
        if not self._directory_read:
            self._directory_read = True
            try:
                found = read_directory(self._bytes())
            except (OSError, struct.error):
                found = None
            if found is not None:  # names are looked up as torch's reader does: under the prefix, any case
                self._directory = (found[0].lower() + b"/", found[1])
        if self._directory is None:
            return None
        prefix, entries = self._directory
        return entries.get(prefix + name.encode("utf-8", "surrogateescape").lower())

    def _locate(self, name: str) -> _Place:
        """Where record ``name`` is, asked of the archive once; RuntimeError where torch's
        reader cannot find it, FormatError where torch.load would refuse to read it (or would
        hand back memory it never filled)."""
        found = self._located.get(name)
        if found is not None:
            return found
        entry = self._entry(name)
        # The directory's figures where it names the record once (they are what torch's reader
        # would answer, asked for less); torch's reader where it cannot say.
        size = self._sizes(name) if entry is None else entry.size
        if entry is not None:
            # miniz refuses any use of an encrypted record or one of another method, even an empty one.
            if entry.flags & _UNSUPPORTED_FLAGS:
                raise FormatError(f"{self._where}: record {name} is encrypted")
            if entry.method not in (_STORED, _DEFLATED):
                raise FormatError(f"{self._where}: record {name} is compressed with unsupported method "
                                  f"{entry.method}")
            if entry.is_directory or entry.compressed_size == 0:
                if size:  # miniz would read nothing into the record's memory
                    raise FormatError(f"{self._where}: record {name} is a directory entry")
                found = self._located[name] = _Place(0, 0, True)  # nothing is read, not even its header
                return found
        header_at = getattr(self._reader, "get_record_header_offset", None)
        if entry is None and header_at is None:  # an older torch: its offset, no check of the header
            offset = int(self._reader.get_record_offset(name))
        else:
            at = entry.header_offset if entry is not None else int(header_at(name))
            header = self._bytes().read(at, _LOCAL_HEADER)
            if len(header) < _LOCAL_HEADER or header[:4] != _LOCAL_SIG:
                raise FormatError(f"{self._where}: record {name} has a damaged local header")
            name_len, extra_len = struct.unpack_from("<HH", header, 26)
            offset = at + _LOCAL_HEADER + name_len + extra_len
        if entry is None:  # the directory cannot say how it is stored: torch's reader reads it
            found = _Place(offset, size, False)
        elif entry.method == _STORED:
            found = _Place(offset, size, True)
        else:
            found = _Place(offset, size, False, entry.compressed_size)
        self._located[name] = found
        return found

    def spans(self) -> list[tuple[str, int, int]] | None:
        """``(key, offset, nbytes)`` of every storage record of the archive whose bytes are read
        straight from the file (records that must be inflated are left out), or None when one of
        them cannot be placed (missing size, damaged, or bytes past the end of the archive)."""
        out = []
        try:
            for name in self._reader.get_all_records():
                if name.startswith("data/"):
                    place = self._locate(name)
                    if place.offset + place.size > self._limit:
                        return None
                    if place.raw:
                        out.append((name[len("data/"):], place.offset, place.size))
        except (RuntimeError, ValueError):  # ValueError: FormatError, or a name that is not UTF-8
            return None
        return out

    def names(self) -> list[str]:
        """Every record of the archive, as torch's reader names them."""
        try:
            return list(self._reader.get_all_records())
        except (RuntimeError, ValueError) as exc:  # ValueError: a name that is not UTF-8
            raise FormatError(f"{self._where}: cannot list the archive's records: {exc}") from None

    def has(self, name: str) -> bool:
        """Whether the archive has record ``name``, by torch's lookup (case does not matter)."""
        try:
            return bool(self._reader.has_record(name))
        except (RuntimeError, ValueError) as exc:
            raise FormatError(f"{self._where}: cannot look up record {name}: {exc}") from None

    def record(self, name: str) -> bytes:
        """Record ``name`` (``"data.pkl"``, ``"byteorder"``, ...) as torch.load reads it, or
        FormatError where it cannot (where torch's reader would hand back memory it never filled:
        a directory entry, or a deflated record that does not inflate to its size)."""
        try:
            place = self._locate(name)
        except RuntimeError as exc:
            raise FormatError(f"{self._where}: cannot read record {name}: {exc}") from None
        if place.raw:
            if place.offset + place.size > self._limit:
                raise TruncatedFileError(f"{self._where}: record {name} ends past the end of the archive")
            data = self._bytes().read(place.offset, place.size) if place.size else b""
            if len(data) != place.size:
                raise TruncatedFileError(f"{self._where}: short read of record {name}")
            return data
        if place.compressed >= 0:
            return self._inflate(name, place)
        try:
            return self._reader.get_record(name)
        except RuntimeError as exc:
            raise FormatError(f"{self._where}: cannot read record {name}: {exc}") from None

    def _inflate(self, name: str, place: _Place) -> bytes:
        if place.offset + place.compressed > self._limit:
            raise TruncatedFileError(f"{self._where}: record {name} ends past the end of the archive")
        packed = self._bytes().read(place.offset, place.compressed)
        inflater = zlib.decompressobj(-zlib.MAX_WBITS)
        try:
            data = inflater.decompress(packed, place.size + 1)
        except zlib.error as exc:
            raise FormatError(f"{self._where}: record {name} does not inflate: {exc}") from None
        if len(packed) != place.compressed or not inflater.eof or len(data) != place.size:
            raise FormatError(f"{self._where}: record {name} does not inflate to its {place.size} bytes")
        return data

    def read(self, rec: StorageRecord) -> bytes:
        """The bytes of a record that is not ``raw``, as torch.load reads them (inflated)."""
        data = self.record(rec.name)
        if len(data) != rec.nbytes:
            raise FormatError(f"{self._where}: record {rec.name} holds {len(data)} bytes, "
                              f"the pickle says {rec.nbytes}")
        return data

    def identify(self, saved_id: Any) -> tuple[Any, Any]:
        """``(key, dtype)`` of persistent id ``saved_id``, checked as far as torch.load checks
        every id before it looks in its cache of storages already loaded."""
        torch, where = self._torch, self._where
        if not isinstance(saved_id, tuple) or len(saved_id) != 5:
            raise FormatError(f"{where}: unexpected persistent id in the pickle")
        typename, storage_type, key, _location, _numel = saved_id
        try:
            typename = torch.serialization._maybe_decode_ascii(typename)
        except UnicodeDecodeError:
            raise FormatError(f"{where}: a persistent id holds bytes that are not ASCII") from None
        if typename != "storage":
            raise FormatError(f"{where}: unexpected persistent id type {typename!r}")
        if storage_type is torch.UntypedStorage:
            return key, torch.uint8
        dtype = getattr(storage_type, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise FormatError(f"{where}: storage {key!r} has an invalid type {storage_type!r}")
        return key, dtype

    def resolve(self, saved_id: Any, identified: tuple[Any, Any] | None = None) -> StorageRecord:
        """The record of persistent id ``saved_id`` (``identified``: what :meth:`identify` said of
        it), with torch.load's reading of it: the type name and location may be ASCII bytes, the
        key is used as it is (``data/{key}``)."""
        key, dtype = self.identify(saved_id) if identified is None else identified
        location, numel = saved_id[3], saved_id[4]
        where = self._where
        try:
            location = self._torch.serialization._maybe_decode_ascii(location)
        except UnicodeDecodeError:
            raise FormatError(f"{where}: storage {key!r} has a location that is not ASCII") from None
        if not isinstance(location, str):
            raise FormatError(f"{where}: storage {key!r} has an invalid location {location!r}")
        if not isinstance(numel, int) or numel < 0:
            raise FormatError(f"{where}: storage {key!r} has invalid size {numel!r}")
        nbytes = numel * self._torch._utils._element_size(dtype)
        name = f"data/{key}"
        try:
            place = self._locate(name)
        except RuntimeError:
            raise FormatError(f"{where}: storage record {name} is missing") from None
        if place.size != nbytes:
            raise FormatError(f"{where}: record {name} holds {place.size} bytes, the pickle says {nbytes}")
        if place.raw and place.offset + nbytes > self._limit:
            raise TruncatedFileError(f"{where}: record {name} ends past the end of the archive")
        return StorageRecord(key, dtype, location, place.offset, nbytes, place.raw, name)

    def persistent_loader(self, make: Callable[[StorageRecord], Any],
                          shared: Callable[[StorageRecord, Any], bool]) -> Callable[[Any], Any]:
        """A ``persistent_load`` for the pickle, in torch.load's order: each id checked
        (:meth:`identify`), then looked up among the storages already made, then resolved to its
        record and made by ``make(record)``; kept for the ids that name it again where
        ``shared(record, storage)`` says so (torch.load shares storages that have memory)."""
        made: dict[Any, Any] = {}

        def persistent_load(saved_id: Any) -> Any:
            identified = self.identify(saved_id)
            try:
                hit = made.get(identified[0])
            except TypeError:
                raise FormatError(f"{self._where}: a storage key of the pickle is not hashable") from None
            if hit is not None:
                return hit
            rec = self.resolve(saved_id, identified)
            storage = make(rec)
            if shared(rec, storage):
                made[rec.key] = storage
            return storage

        return persistent_load

    def not_ours(self) -> str | None:
        """Check the records torch.load reads before the pickle, as it reads them (FormatError
        where it refuses the archive). None where the archive is a state that gdskit reads itself;
        else why it is torch.load's to read: ``"torchscript"`` (a TorchScript archive, or no
        ``data.pkl``) or ``"byteorder"`` (saved on a machine of the other byte order)."""
        if not self.has("data.pkl") or "constants.pkl" in self.names():
            return "torchscript"
        if self.has(".format_version"):
            self.record(".format_version")
        if self.has("byteorder"):
            order = self.record("byteorder")
            if order not in (b"little", b"big"):
                raise FormatError(f"{self._where}: unknown byte order {order[:16]!r}")
            if order.decode() != sys.byteorder:
                return "byteorder"
        if self.has(".storage_alignment"):
            try:
                int(self.record(".storage_alignment"))
            except ValueError:
                raise FormatError(f"{self._where}: the archive's .storage_alignment record is not a number") from None
        self.serialization_id()
        return None

    def serialization_id(self) -> None:
        """Read the archive's serialization id as torch.load does: it refuses an archive whose id
        is not UTF-8 text. The record is read here first, so that one torch's reader cannot fill
        (a directory entry, which it answers with memory it never wrote) is refused every time."""
        name = ".data/serialization_id"
        try:
            if self.has(name):
                self.record(name).decode("utf-8")
            get = getattr(self._reader, "serialization_id", None)
            if get is not None:
                get()
        except (RuntimeError, UnicodeDecodeError) as exc:
            raise FormatError(f"{self._where}: the archive's serialization id cannot be read: {exc}") from None
