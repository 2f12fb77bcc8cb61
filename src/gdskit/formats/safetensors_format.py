"""The safetensors file format in pure Python: parse, validate, lay out, plan reads.

No torch here: this module turns header bytes into immutable records and back.
The torch-facing loader (:mod:`gdskit.safetensors`) executes the plans.

A safetensors file is ``u64 little-endian header length N``, ``N`` bytes of UTF-8
JSON, then the data section. The JSON maps tensor names to ``{"dtype", "shape",
"data_offsets": [begin, end]}`` (offsets relative to the data section) plus an
optional ``"__metadata__"`` of string to string. The tensors must cover the data
section exactly: no holes, no overlap, nothing after the last tensor. Readers
(``safetensors.safe_open`` included) accept trailing spaces in the header, which
is how :func:`layout` aligns the data section to 4 KiB.

The parser accepts and refuses what the reference (the Rust ``safetensors`` crate, whose
JSON parser is serde_json) does, where Python's ``json`` would differ: no ``NaN`` or
``Infinity``, no number beyond the float range, no lone UTF-16 surrogate in a string, at
most 127 nested arrays and objects, ``-0`` is a float (so not a dimension or an offset),
dimensions and offsets are 64-bit unsigned, and the element count, multiplied out from the
first dimension on, must not overflow 64 bits before it reaches a zero. One deliberate
difference: a tensor name or metadata key that appears twice is refused
(:class:`DuplicateNameError`), where the reference silently keeps the last one; two readers
of such a file may disagree about what it holds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import operator
import os
import re
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from gdskit.durable import cache_folder, open_file_fd, read_private, read_whole_file, trim_private, write_private
from gdskit.engine import is_object_url, list_objects, open_file
from gdskit.errors import FormatError, GdskitError, TruncatedFileError, from_os_error, with_path
from gdskit.formats.read_plan import Extent

#: Bits per element of every dtype the safetensors format defines.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8,
    "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}

#: The reference implementation refuses headers above 100 MB; so do we.
MAX_HEADER_BYTES = 100_000_000
#: Dimensions, offsets and byte counts are 64-bit unsigned in the reference.
U64_MAX = 2**64 - 1
#: serde_json's nesting limit: 128 nested arrays and objects are refused.
MAX_JSON_DEPTH = 127
METADATA_KEY = "__metadata__"
DEFAULT_ALIGNMENT = 4096


class HeaderError(FormatError):
    """The header is not valid safetensors: bad length, not JSON, wrong structure, duplicate names."""


class UnknownDtypeError(HeaderError):
    """A tensor's dtype is not one the safetensors format defines."""


class DuplicateNameError(HeaderError):
    """A tensor name (or a ``__metadata__`` key) appears twice in the header.

    Stricter than the reference, which keeps the last: a file that two readers may read
    differently is refused.
    """


class UnencodableNameError(HeaderError, UnicodeError):
    """A tensor name or metadata string to be written is not valid Unicode (a lone
    surrogate): it has no UTF-8 form. Raised before anything is written."""


class HeaderTypeError(HeaderError, TypeError):
    """A tensor name, or the metadata, to be written is of a type a header cannot hold (names
    and metadata keys and values are ``str``, metadata a mapping); a ``TypeError`` as the
    reference raises. Raised before anything is written."""


class LayoutError(FormatError):
    """Tensor offsets are out of range, overlap, leave holes, or disagree with shape and dtype."""


class MissingTensorError(GdskitError, KeyError):
    """A tensor asked for by name is not in the checkpoint."""


def select_names(available: Mapping[str, Any], keys: Iterable[str] | None) -> list[str]:
    """The tensors a load returns: all of ``available`` in its order, or ``keys`` (each once, in
    the order asked); a key not in ``available`` is a :class:`MissingTensorError`."""
    if keys is None:
        return list(available)
    names = list(dict.fromkeys(keys))
    missing = [k for k in names if k not in available]
    if missing:
        raise MissingTensorError(f"not in the checkpoint: {', '.join(map(repr, missing[:5]))}"
                                 + (" ..." if len(missing) > 5 else ""))
    return names


class TensorEntry(NamedTuple):
    """One tensor of a safetensors file.

    ``start`` and ``end`` are byte offsets relative to the data section, as in the header.
    A named tuple: a header of 20,000 tensors makes 20,000 of them.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Header:
    """A parsed and validated safetensors header.

    ``entries`` are in data order (ascending ``start``); ``data_start`` is the
    file offset of the data section (``8 + header length``).
    """

    entries: tuple[TensorEntry, ...]
    metadata: dict[str, str] | None
    data_start: int

    @property
    def data_size(self) -> int:
        return self.entries[-1].end if self.entries else 0

    @property
    def file_size(self) -> int:
        return self.data_start + self.data_size

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def entry(self, name: str) -> TensorEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)


def element_count(shape: Sequence[int]) -> int:
    """Elements of a tensor of ``shape``; :class:`LayoutError` where the reference's 64-bit
    count overflows. It multiplies from the first dimension on, so a zero does not save a
    count that overflowed before it (``[2**62, 4, 0]``)."""
    n = math.prod(shape)
    if n > U64_MAX or (n == 0 and math.prod(shape[:list(shape).index(0)]) > U64_MAX):
        raise LayoutError(f"shape {list(shape)} overflows a 64-bit element count")
    return n


def nbytes_of(dtype: str, shape: Sequence[int]) -> int:
    """Bytes a tensor of ``dtype`` and ``shape`` takes; :class:`LayoutError` if not whole bytes
    or where the count overflows 64 bits (as the reference counts: in bits)."""
    n = element_count(shape)
    bits = DTYPE_BITS[dtype] * n
    if bits > U64_MAX:
        raise LayoutError(f"shape {list(shape)} of {dtype} overflows a 64-bit bit count")
    if bits % 8:
        raise LayoutError(f"{n} elements of {dtype} are not a whole number of bytes")
    return bits // 8


# -- parsing --------------------------------------------------------------------

def _repeated_keys(pairs: tuple[tuple[str, object], ...]) -> set[str]:
    """The keys that appear more than once among an object's ``(key, value)`` pairs."""
    seen: set[str] = set()
    return {k for k, _ in pairs if k in seen or seen.add(k)}  # type: ignore[func-returns-value]


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _minus_zero_as_float(text: str) -> object:
    return -0.0 if text == "-0" else int(text)  # serde_json reads -0 as a float


# Cheap looks at the text that say whether the slow checks are needed at all.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_MINUS_ZERO = re.compile(r"-0(?![0-9.eE])")
_HAS_SURROGATE = re.compile("[\ud800-\udfff]")


def _loads(raw: bytes) -> object:
    """The header's JSON, refused where serde_json refuses it (see the module docstring). Each
    object comes back as the tuple of its ``(key, value)`` pairs, in order: built in C, with no
    Python call per object (headers hold thousands), and a key given twice is still there to
    be seen (``dict(pairs)`` keeps its last value, as the reference does). An array is a list,
    so ``{}`` and ``[]`` stay apart."""
    try:
        text = raw.decode("utf-8")
        obj = json.loads(text, object_pairs_hook=tuple, parse_constant=_refuse_constant,
                         parse_float=_finite_float,
                         parse_int=_minus_zero_as_float if _MINUS_ZERO.search(text) else None)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise HeaderError(f"safetensors header is not valid UTF-8 JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(text) and _any_surrogate(obj):
        raise HeaderError("safetensors header holds a lone UTF-16 surrogate escape (not valid Unicode)")
    return obj


def _any_surrogate(obj: object) -> bool:
    """Whether any string (key or value, at any depth) holds a lone surrogate; a loop, not
    recursion, for documents nested as deep as ``json`` reads. Objects are tuples of pairs
    (:func:`_loads`), so walking tuples and lists reaches every key and value."""
    todo = [obj]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            if _HAS_SURROGATE.search(item):
                return True
        elif isinstance(item, (tuple, list)):
            todo.extend(item)
    return False


def _check_free_value(name: str, key: str, value: object, depth: int) -> None:
    """A value the format does not define (ignored, as the reference ignores it) must still be
    JSON serde_json reads: nested at most to ``MAX_JSON_DEPTH`` in all, numbers in float range."""
    if isinstance(value, (tuple, list)):  # an object (pairs) or an array
        if depth + 1 > MAX_JSON_DEPTH:
            raise HeaderError(f"entry {name!r}: field {key!r} is nested more than {MAX_JSON_DEPTH} deep")
        for v in (dict(value).values() if isinstance(value, tuple) else value):
            _check_free_value(name, key, v, depth + 1)
    elif type(value) is int and value.bit_length() > 1000:  # serde_json reads it as a float
        try:
            float(value)
        except OverflowError:
            raise HeaderError(f"entry {name!r}: field {key!r} holds a number out of range") from None


def _naturals(v: object) -> bool:
    """A list of 64-bit unsigned integers (bools excluded), checked without a generator per entry."""
    if type(v) is not list:
        return False
    for d in v:
        if type(d) is not int or not 0 <= d <= U64_MAX:
            return False
    return True


def header_length(prefix: bytes, file_size: int) -> int:
    """Validate the 8-byte length prefix against the file size; return the JSON length."""
    if file_size < 8 or len(prefix) < 8:
        raise TruncatedFileError(f"file of {file_size} bytes is too short to be safetensors (needs 8+)")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise HeaderError(f"header length {n} is larger than the {MAX_HEADER_BYTES}-byte limit")
    if n < 2:
        raise HeaderError(f"header length {n} is too small to hold a JSON object")
    if 8 + n > file_size:
        raise TruncatedFileError(f"header length {n} runs past the end of the {file_size}-byte file")
    return n


#: Headers at least this large are remembered once parsed, by their exact bytes and the file's
#: size: a checkpoint of many tensors loaded again in the same process (weights swapped back in,
#: a reload) skips the parse, which for 20,000 tensors costs tens of milliseconds.
MEMO_MIN_BYTES = 64 << 10
#: At most this many headers, of at most this many bytes in all, are remembered (least recently
#: used go first): enough entries for every shard of a checkpoint of a few hundred (a loop over
#: more shards than are kept would find none of them). The parsed entries take about 3.5 times
#: their header's bytes again (20,000 tensors: 2.1 MB of header, 7.4 MB parsed).
MEMO_ENTRIES = 256
MEMO_MAX_BYTES = 16 << 20

_memo: OrderedDict[tuple[int, int, int, int | None], tuple[bytes, Header]] = OrderedDict()
_memo_bytes = 0
_memo_lock = threading.Lock()


def parse_header_json(raw: bytes, data_start: int, file_size: int | None) -> Header:
    """Parse the JSON header bytes and validate every entry and the layout.

    Parameters
    ----------
    raw : bytes
        The ``N`` header bytes (after the 8-byte length).
    data_start : int
        ``8 + N``.
    file_size : int or None
        The file's size; when given, the data section must end exactly there.
    """
    if len(raw) < MEMO_MIN_BYTES:
        return _parse_header_json(raw, data_start, file_size)
    raw = bytes(raw)
    key = (len(raw), zlib.crc32(raw), data_start, file_size)
    with _memo_lock:
        found = _memo.get(key)
        if found is not None and found[0] == raw:  # the same bytes: the same answer
            _memo.move_to_end(key)
            return _fresh(found[1])
    disk_key = _disk_key(raw, data_start, file_size) if file_size is not None else None
    header = _from_disk(disk_key, data_start, file_size) if disk_key is not None else None
    if header is None:
        header = _parse_header_json(raw, data_start, file_size)  # an invalid header raises, and is not kept
        if disk_key is not None:
            _to_disk(disk_key, header)
    _remember(key, raw, header)
    return _fresh(header)


# -- parsed headers kept between processes ------------------------------------
#
# A fresh process's first load of a checkpoint of many tensors parses its header again (20,000
# entries: about 50 ms on the development VM, twice that on slower cores). Headers of at least
# MEMO_MIN_BYTES are therefore also kept, once parsed, in ``$XDG_CACHE_HOME/gdskit/headers``
# (used only where the folder and the file are this user's alone: gdskit.durable). A file is
# named by a SHA-256 of the header's exact bytes, its data start and the file's size, so it
# answers only for the very header it was parsed from, whatever file holds it; it carries a
# SHA-256 of its own content and its own name, so a torn, damaged or misplaced file is a miss,
# parsed and written again.

#: The first line of a kept header: a change of what is kept changes it, and older files miss.
DISK_FORMAT = b"gdskit safetensors header 1\n"
#: Kept headers of at most this many bytes each, and at most this many files (the oldest go).
DISK_MAX_BYTES = 64 << 20
DISK_FILES = 512


def _disk_key(raw: bytes, data_start: int, file_size: int) -> str:
    h = hashlib.sha256(raw)
    h.update(f"|{data_start}|{file_size}".encode())
    return h.hexdigest()


def _disk_path(key: str) -> str:
    return os.path.join(cache_folder("headers"), f"st-{key}")


def _from_disk(key: str, data_start: int, file_size: int) -> Header | None:
    """The header kept under ``key``; None where none is, or it is not whole, or it was kept for
    another header (a file copied to another's name), or its entries do not end at ``file_size``."""
    data = read_private(_disk_path(key), DISK_MAX_BYTES)
    head = len(DISK_FORMAT) + 32
    if data is None or not data.startswith(DISK_FORMAT) or hashlib.sha256(data[head:]).digest() != data[len(DISK_FORMAT):head]:
        return None
    try:
        kept_for, metadata, rows = json.loads(data[head:])
        if kept_for != key or not (metadata is None or type(metadata) is dict):
            return None
        make = tuple.__new__  # named tuples without their Python-level __new__: thousands of them
        header = Header(tuple([make(TensorEntry, (name, dtype, tuple(shape), start, end))
                               for name, dtype, shape, start, end in rows]), metadata, data_start)
        if header.file_size != file_size:
            return None
    except (ValueError, TypeError, RecursionError):  # whole, but not what this version writes
        return None
    return header


def _to_disk(key: str, header: Header) -> None:
    """Keep ``header`` under ``key`` for later processes (no error where it cannot be)."""
    body = json.dumps([key, header.metadata, header.entries], separators=(",", ":")).encode()
    if len(body) + len(DISK_FORMAT) + 32 > DISK_MAX_BYTES:
        return
    path = _disk_path(key)
    write_private(path, DISK_FORMAT + hashlib.sha256(body).digest() + body, durable=False)
    trim_private(os.path.dirname(path), "st-", DISK_FILES)


def _fresh(header: Header) -> Header:
    """A remembered header for one caller: its metadata a dict of the caller's own."""
    return header if header.metadata is None else dataclasses.replace(header, metadata=dict(header.metadata))


def _remember(key: tuple[int, int, int, int | None], raw: bytes, header: Header) -> None:
    global _memo_bytes
    with _memo_lock:
        old = _memo.pop(key, None)
        if old is not None:
            _memo_bytes -= len(old[0])
        if len(raw) <= MEMO_MAX_BYTES:
            _memo[key] = (raw, header)
            _memo_bytes += len(raw)
        while _memo and (len(_memo) > MEMO_ENTRIES or _memo_bytes > MEMO_MAX_BYTES):
            _, (gone, _) = _memo.popitem(last=False)
            _memo_bytes -= len(gone)


def forget_headers() -> None:
    """Drop every remembered header (tests; memory)."""
    global _memo_bytes
    with _memo_lock:
        _memo.clear()
        _memo_bytes = 0


def _parse_header_json(raw: bytes, data_start: int, file_size: int | None) -> Header:
    pairs = _loads(raw)
    if type(pairs) is not tuple:
        raise HeaderError("safetensors header is not a JSON object")
    obj = dict(pairs)
    if len(obj) != len(pairs):
        repeated = _repeated_keys(pairs)
        if METADATA_KEY in repeated:
            raise HeaderError(f"{METADATA_KEY!r} appears twice in the safetensors header")
        raise DuplicateNameError(f"tensor name {min(repeated)!r} appears twice in the safetensors header")

    given = obj.pop(METADATA_KEY, None)
    metadata = None
    if given is not None:
        if type(given) is not tuple or not all(type(v) is str for _k, v in given):
            raise HeaderError("__metadata__ must map strings to strings")
        metadata = dict(given)
        if len(metadata) != len(given):
            raise DuplicateNameError(f"metadata key {min(_repeated_keys(given))!r} appears twice")

    entries = _entries(obj)
    entries.sort(key=_by_position)
    expected = 0
    for name, _dtype, _shape, start, end in entries:
        if start != expected:
            what = "overlaps the previous tensor" if start < expected else "leaves a hole before it"
            raise LayoutError(f"entry {name!r} starts at {start}: {what} (expected {expected})")
        expected = end
    if file_size is not None:
        end_of_data = data_start + expected
        if end_of_data > file_size:
            raise TruncatedFileError(f"tensor data ends at byte {end_of_data}, "
                                     f"but the file has {file_size} bytes")
        if end_of_data < file_size:
            raise LayoutError(f"{file_size - end_of_data} bytes after the last tensor "
                              "are not covered by any tensor")
    return Header(tuple(entries), metadata, data_start)


_by_position = operator.itemgetter(3, 4)  # (start, end) of a TensorEntry
_FIELDS = frozenset({"dtype", "shape", "data_offsets"})


def _fields(name: str, info: object) -> tuple[object, object, object]:
    """An entry's dtype, shape and offsets (None where absent) out of its pairs, in any order:
    a field the format defines given twice is refused; any other field is ignored, but must
    be JSON serde_json reads."""
    if type(info) is not tuple:
        raise HeaderError(f"entry {name!r} is not a JSON object")
    fields = dict(info)
    if len(fields) != len(info):
        twice = _repeated_keys(info) & _FIELDS
        if twice:
            raise HeaderError(f"entry {name!r}: field {min(twice)!r} appears twice")
    for key, value in fields.items():
        if key not in _FIELDS:
            _check_free_value(name, key, value, 2)
    return fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")


def _entries(obj: dict[str, object]) -> list[TensorEntry]:
    """Every entry, checked: the first bad one raises an error that names it."""
    entries: list[TensorEntry] = []
    # Locals, and named tuples made without their Python-level __new__: headers hold thousands.
    append, make, bits_of, prod = entries.append, tuple.__new__, DTYPE_BITS.get, math.prod
    for name, info in obj.items():
        # The form every writer gives (the three fields, in the format's order) is taken apart
        # here without a dict; any other goes through _fields.
        if type(info) is tuple and len(info) == 3:
            (k_dtype, dtype), (k_shape, shape), (k_offsets, offsets) = info
            if k_dtype != "dtype" or k_shape != "shape" or k_offsets != "data_offsets":
                dtype, shape, offsets = _fields(name, info)
        else:
            dtype, shape, offsets = _fields(name, info)
        if type(dtype) is not str:
            raise HeaderError(f"entry {name!r} has no dtype string")
        dtype_bits = bits_of(dtype)
        if dtype_bits is None:
            raise UnknownDtypeError(f"entry {name!r} has unknown dtype {dtype!r}")
        if not _naturals(shape):
            raise HeaderError(f"entry {name!r}: shape must be a list of 64-bit unsigned integers")
        if not _naturals(offsets) or len(offsets) != 2:
            raise HeaderError(f"entry {name!r}: data_offsets must be two 64-bit unsigned integers")
        start, end = offsets
        if end < start:
            raise LayoutError(f"entry {name!r}: data_offsets end {end} is before begin {start}")
        bits = dtype_bits * prod(shape)
        if 0 < bits <= U64_MAX and not bits & 7:
            nbytes = bits >> 3   # the common case, without a call (headers hold thousands)
        else:  # no elements (the count may have overflowed before the zero), too many, or not whole bytes
            try:
                nbytes = nbytes_of(dtype, shape)
            except LayoutError as exc:
                raise LayoutError(f"entry {name!r}: {exc}") from None
        if nbytes != end - start:
            raise LayoutError(f"entry {name!r}: shape {shape} of {dtype} needs "
                              f"{nbytes} bytes, offsets give {end - start}")
        append(make(TensorEntry, (name, dtype, tuple(shape), start, end)))
    return entries


def parse_header(read_at: Callable[[int, int], bytes], file_size: int) -> Header:
    """Read and validate a header with ``read_at(offset, size) -> bytes``."""
    prefix = read_at(0, 8)
    n = header_length(prefix, file_size)
    raw = read_at(8, n)
    if len(raw) != n:
        raise TruncatedFileError("file shrank while its header was read")
    return parse_header_json(raw, 8 + n, file_size)


def parse_bytes(data: bytes) -> Header:
    """Parse the header of a whole safetensors file held in memory (tests, fuzzing)."""
    return parse_header(lambda off, size: data[off:off + size], len(data))


def read_header_file(path: str | os.PathLike[str]) -> Header:
    """Read and validate the header of the safetensors file at ``path`` (plain reads; headers are
    small). Opened as the engine opens files: a FIFO is refused, never waited on. An object URL
    (``s3://``) is read by two ranged GETs through the engine."""
    name = os.fspath(path)
    if is_object_url(name):
        with open_file(name) as obj:
            def read_object_at(off: int, n: int) -> bytes:
                out = bytearray(n)
                return bytes(out[:obj.read(out, n, off)])

            try:
                return parse_header(read_object_at, obj.size)
            except FormatError as exc:
                raise with_path(exc, path) from None
    fd, st = open_file_fd(name, os.O_RDONLY)
    try:
        def read_at(off: int, n: int) -> bytes:
            return os.pread(fd, n, off)

        try:
            return parse_header(read_at, st.st_size)
        except FormatError as exc:
            raise with_path(exc, path) from None
        except OSError as exc:
            raise from_os_error(exc, name) from None
    finally:
        os.close(fd)


# -- writing --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What :func:`layout` needs to know about a tensor to be written."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Layout:
    """A file to be written: the padded header bytes and where each tensor goes."""

    header: bytes           # the 8-byte length and the padded JSON
    entries: tuple[TensorEntry, ...]   # in data order

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def file_size(self) -> int:
        return self.data_start + (self.entries[-1].end if self.entries else 0)

    def file_offset(self, entry: TensorEntry) -> int:
        return self.data_start + entry.start


def layout(specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None = None,
           alignment: int = DEFAULT_ALIGNMENT) -> Layout:
    """Place tensors in a new file so that as many as possible start on ``alignment``.

    The format allows no holes between tensors, so only the data section's start
    can be aligned (by padding the header with spaces). Tensors whose byte size
    is a multiple of ``alignment`` go first, in the given order: each of them
    starts aligned. The rest follow in the given order.
    """
    specs = _checked(specs, metadata)
    sized = [(s, nbytes_of(s.dtype, s.shape)) for s in specs]
    ordered = ([x for x in sized if x[1] % alignment == 0]
               + [x for x in sized if x[1] % alignment != 0])
    return _header_and_entries(ordered, metadata, lambda raw: (-(8 + len(raw))) % alignment)


#: The order of the reference's dtypes (the Rust crate's ``Dtype`` enum, smallest first); its
#: serializer writes tensors of the larger dtypes first, each dtype's tensors by name.
REFERENCE_DTYPE_ORDER = ("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
                         "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
                         "C64", "F64", "I64", "U64")
_REFERENCE_RANK = {d: i for i, d in enumerate(REFERENCE_DTYPE_ORDER)}


def packed_layout(specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None = None) -> Layout:
    """The layout the reference's serializer writes, byte for byte: tensors ordered by dtype
    (largest first) then name, the header padded with spaces to a multiple of 8 bytes."""
    specs = _checked(specs, metadata)
    ordered = sorted(((s, nbytes_of(s.dtype, s.shape)) for s in specs),
                     key=lambda x: (-_REFERENCE_RANK[x[0].dtype], x[0].name))
    return _header_and_entries(ordered, metadata, lambda raw: -len(raw) % 8)


def _checked(specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None) -> list[TensorSpec]:
    """``specs`` as a list, once every name, dtype and metadata string is one a header holds."""
    specs = list(specs)
    seen: set[str] = set()
    for s in specs:
        if not isinstance(s.name, str):
            raise HeaderTypeError(f"tensor names must be strings, got {type(s.name).__name__}")
        if s.name == METADATA_KEY:
            raise HeaderError(f"{METADATA_KEY!r} cannot be a tensor name")
        if s.name in seen:
            raise HeaderError(f"duplicate tensor name {s.name!r}")
        if s.dtype not in DTYPE_BITS:
            raise UnknownDtypeError(f"unknown safetensors dtype {s.dtype!r}")
        seen.add(s.name)
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise HeaderTypeError(f"metadata must be a dict of strings, got {type(metadata).__name__}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise HeaderTypeError("metadata must map strings to strings")
    _utf8_only("tensor name", (s.name for s in specs))
    if metadata:
        _utf8_only("metadata string", (t for kv in metadata.items() for t in kv))
    return specs


def _header_and_entries(ordered: list[tuple[TensorSpec, int]], metadata: Mapping[str, str] | None,
                        padding: Callable[[bytes], int]) -> Layout:
    """The tensors placed back to back in ``ordered`` order, and the header (JSON as serde_json
    writes it, then ``padding(json)`` spaces)."""
    entries = []
    pos = 0
    for s, n in ordered:
        entries.append(TensorEntry(s.name, s.dtype, tuple(s.shape), pos, pos + n))
        pos += n
    doc: dict[str, object] = {}
    if metadata is not None:  # an empty one is written too, as the reference writes it
        doc[METADATA_KEY] = dict(sorted(metadata.items()))
    for e in entries:
        doc[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.start, e.end]}
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * padding(raw)
    return Layout(struct.pack("<Q", len(raw)) + raw, tuple(entries))


def _utf8_only(what: str, texts: Iterable[str]) -> None:
    for text in texts:
        if _HAS_SURROGATE.search(text):
            raise UnencodableNameError(f"{what} {text!r} is not valid Unicode (a lone surrogate): "
                                       "it has no UTF-8 form")


# -- read planning --------------------------------------------------------------

def extents(header: Header, entries: Iterable[TensorEntry]) -> list[Extent]:
    """The file byte ranges of ``entries`` (keyed by tensor name), for :func:`gdskit.formats.read_plan.plan`."""
    base, make = header.data_start, tuple.__new__  # without Extent's Python-level __new__: thousands of them
    return [make(Extent, (name, base + start, end - start)) for name, _dtype, _shape, start, end in entries]


# -- sharded checkpoints --------------------------------------------------------

INDEX_SUFFIX = ".safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class ShardSet:
    """The files of a checkpoint and, for an indexed one, which tensor lives in which file
    (``weight_map``) and the index file (``index``)."""

    files: tuple[str, ...]
    weight_map: dict[str, str] | None
    index: str | None = None


def _check_shard_name(fname: str, index_path: str) -> None:
    """A shard named by an index must be a plain name inside the index's directory: not absolute,
    no ``..``, no NUL (which no file name holds; ``open`` would raise a bare ``ValueError``)."""
    if "\0" in fname:
        raise FormatError(f"shard name {fname!r} holds a NUL byte", path=index_path)
    if not fname or os.path.isabs(fname) or ".." in fname.replace("\\", "/").split("/"):
        raise FormatError(f"shard name {fname!r} leaves the checkpoint directory", path=index_path)


def _read_whole(path: str) -> bytes:
    """A small file's (or object's) bytes."""
    if not is_object_url(path):
        return read_whole_file(path)
    with open_file(path) as obj:
        out = bytearray(obj.size)
        return bytes(out[:obj.read(out)])


def _read_index(index_path: str) -> ShardSet:
    try:
        doc = json.loads(_read_whole(index_path).decode("utf-8"))
    except OSError as exc:
        raise from_os_error(exc, index_path) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"not a valid JSON index: {exc}", path=index_path) from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise FormatError("'weight_map' must map tensor names to file names", path=index_path)
    # An object URL's "directory" is its key's prefix: joined with "/" (os.path would fold "s3://").
    base = index_path.rpartition("/")[0] if is_object_url(index_path) else os.path.dirname(os.path.abspath(index_path))
    files: list[str] = []
    resolved: dict[str, str] = {}
    for name, fname in wm.items():
        _check_shard_name(fname, index_path)
        full = os.path.join(base, fname)
        resolved[name] = full
        if full not in files:
            files.append(full)
    return ShardSet(tuple(files), resolved, index_path)


def resolve_checkpoint(path_or_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> ShardSet:
    """Turn a file, a list of shards, a directory or an index file into a :class:`ShardSet`.

    A directory with one ``*.safetensors.index.json`` is read through its index;
    otherwise every ``*.safetensors`` file in it is a shard.
    """
    if isinstance(path_or_paths, (list, tuple)):
        return ShardSet(tuple(os.fspath(p) for p in path_or_paths), None)
    path = os.fspath(path_or_paths)  # type: ignore[arg-type]
    if is_object_url(path) and path.endswith("/"):  # a prefix: the objects directly under it, as a directory
        listed = {url.rpartition("/")[2]: url for url, _size in list_objects(path) if "/" not in url[len(path):]}
        indexes = sorted(n for n in listed if n.endswith(INDEX_SUFFIX))
        if len(indexes) == 1:
            return _read_index(listed[indexes[0]])
        if len(indexes) > 1:
            raise FormatError(f"several index files ({', '.join(indexes)}); pass one of them", path=path)
        shards = [listed[n] for n in sorted(listed) if n.endswith(".safetensors")]
        if not shards:
            raise FormatError("no .safetensors objects under this prefix", path=path)
        return ShardSet(tuple(shards), None)
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        indexes = [n for n in names if n.endswith(INDEX_SUFFIX)]
        if len(indexes) == 1:
            return _read_index(os.path.join(path, indexes[0]))
        if len(indexes) > 1:
            raise FormatError(f"several index files ({', '.join(indexes)}); pass one of them", path=path)
        shards = [os.path.join(path, n) for n in names if n.endswith(".safetensors")]
        if not shards:
            raise FormatError("no .safetensors files in this directory", path=path)
        return ShardSet(tuple(shards), None)
    if path.endswith(".json"):
        return _read_index(path)
    return ShardSet((path,), None)
