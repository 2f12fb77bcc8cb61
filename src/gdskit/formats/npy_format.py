"""The ``.npy`` header: parsed here, never evaluated, never unpickled.

A ``.npy`` file is a magic string, a version, a header length, and a header that is the
text of a Python dictionary (``{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }``)
followed by the array's bytes. numpy reads the header with ``ast.literal_eval``; this module
reads it with a small parser of exactly the literals that header needs (quoted strings,
``True``/``False``, tuples of decimal integers), so a hostile file can cost no more than one
pass over at most :data:`MAX_HEADER_CHARS` characters.

What it accepts, numpy accepts with the same dtype, shape and order (the tests hold it to
that, against ``numpy.lib.format``), and its shape is one ``np.load`` makes an array of: an
empty array's dimensions too are held to numpy's bounds. Some headers numpy takes are refused here: Python 2
longs (``3L``), comments, escapes in strings, duplicate keys, booleans or negative numbers as
dimensions, and every dtype that has no plain numeric tensor type (structured, strings,
dates, ``longdouble``; objects above all: those would mean unpickling).
"""

from __future__ import annotations

import functools
import os
import re
import struct
from dataclasses import dataclass

import numpy as np

from gdskit.durable import open_file_fd
from gdskit.engine import is_object_url, open_file
from gdskit.errors import FormatError, GdskitError, from_os_error


class NpyHeaderError(FormatError):
    """A ``.npy`` file's header is not valid: magic, version, length or the header dictionary."""


class UnsupportedDtypeError(GdskitError, TypeError):
    """A dtype with no tensor type here: structured, strings, dates, ``longdouble``, ..."""


class ObjectDtypeError(UnsupportedDtypeError):
    """An ``.npy`` file of Python objects: reading one would mean unpickling (never done)."""

MAGIC = b"\x93NUMPY"
#: numpy's own limit on a header's length in characters (``max_header_size``).
MAX_HEADER_CHARS = 10_000
#: Versions and how each stores the header length and encodes the header.
_VERSIONS = {(1, 0): ("<H", "latin1"), (2, 0): ("<I", "latin1"), (3, 0): ("<I", "utf8")}
#: The most bytes a header can take (8 bytes of magic and version, a 4-byte length, and
#: MAX_HEADER_CHARS characters of up to 4 bytes each in UTF-8).
MAX_PREFIX_BYTES = 12 + 4 * MAX_HEADER_CHARS
#: numpy's limit on dimensions.
MAX_DIMS = 64
_MAX_BYTES = (1 << 63) - 1

#: The plain numeric typestrs (kind and item size) that become tensors.
SUPPORTED = frozenset({"b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"})
_TYPESTR = re.compile(r"([<>|=]?)([a-zA-Z])(\d{1,3})")
_OBJECT = re.compile(r"[<>|=]?O\d{0,3}")


@dataclass(frozen=True)
class NpyHeader:
    """What a ``.npy`` header says: the array's dtype, shape and order, and where its bytes start."""

    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool
    data_offset: int
    version: tuple[int, int]

    @property
    def count(self) -> int:
        """Elements in the array."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the array's data."""
        return self.count * self.dtype.itemsize


def header_length(prefix: bytes) -> int:
    """How many bytes the header takes in all (magic to data), from the file's first 12 bytes
    (fewer for a version 1.0 file: 10)."""
    version = _version(prefix)
    fmt, _encoding = _VERSIONS[version]
    size = struct.calcsize(fmt)
    if len(prefix) < 8 + size:
        raise NpyHeaderError("the file ends inside the .npy header length")
    (n,) = struct.unpack_from(fmt, prefix, 8)
    limit = MAX_HEADER_CHARS * (4 if _encoding == "utf8" else 1)
    if n > limit:
        raise NpyHeaderError(f"the .npy header says it is {n} bytes long: more than the {MAX_HEADER_CHARS} "
                             "characters numpy allows")
    return 8 + size + n


def _version(prefix: bytes) -> tuple[int, int]:
    if len(prefix) < 8 or prefix[:6] != MAGIC:
        raise NpyHeaderError("not a .npy file (its first bytes are not the .npy magic string)")
    version = (prefix[6], prefix[7])
    if version not in _VERSIONS:
        raise NpyHeaderError(f"unknown .npy format version {version[0]}.{version[1]}")
    return version


def parse_header(data: bytes) -> NpyHeader:
    """Parse the header at the start of ``data`` (the file's first bytes: at least the whole header).

    Raises
    ------
    NpyHeaderError
        The header is not a valid ``.npy`` header (or one of the forms refused here).
    ObjectDtypeError
        The array holds Python objects.
    UnsupportedDtypeError
        The dtype has no numeric tensor type.
    """
    data = bytes(data[:MAX_PREFIX_BYTES])
    version = _version(data)
    total = header_length(data)
    if len(data) < total:
        raise NpyHeaderError(f"the file ends inside the .npy header ({len(data)} of {total} bytes)")
    fmt, encoding = _VERSIONS[version]
    start = 8 + struct.calcsize(fmt)
    try:
        text = data[start:total].decode(encoding)
    except UnicodeDecodeError:
        raise NpyHeaderError("the .npy header is not valid UTF-8") from None
    if len(text) > MAX_HEADER_CHARS:
        raise NpyHeaderError(f"the .npy header has {len(text)} characters, more than numpy allows")
    fields = _Parser(text).header()
    missing = {"descr", "fortran_order", "shape"} - fields.keys()
    if missing:
        raise NpyHeaderError(f"the .npy header lacks {', '.join(sorted(missing))}")
    descr, fortran, shape = fields["descr"], fields["fortran_order"], fields["shape"]
    if not isinstance(fortran, bool):
        raise NpyHeaderError(f"fortran_order is not True or False: {fortran!r:.40}")
    if not isinstance(shape, tuple):
        raise NpyHeaderError(f"shape is not a tuple of integers: {shape!r:.40}")
    if len(shape) > MAX_DIMS:
        raise NpyHeaderError(f"shape has {len(shape)} dimensions, more than {MAX_DIMS}")
    if not isinstance(descr, str):
        raise NpyHeaderError(f"descr is not a dtype string: {descr!r:.40}")
    dtype = numeric_dtype(descr)
    _check_extent(shape, dtype.itemsize, fortran)
    return NpyHeader(dtype, shape, fortran, total, version)


def _check_extent(shape: tuple[int, ...], itemsize: int, fortran: bool) -> None:
    """Refuse a shape that ``np.load`` cannot make an array of (nor torch a tensor).

    numpy reshapes the data it read to the shape (reversed for Fortran order), multiplying the
    dimensions in that order, and refuses a product past ``2**63 - 1`` even where a later 0 would
    make it 0; the array it makes must then have its item size times every non-zero dimension
    within that bound (its strides). An empty array can thus have large dimensions, but not any.
    """
    count = 1
    for d in shape[::-1] if fortran else shape:
        count *= d
        if count > _MAX_BYTES:
            raise NpyHeaderError(f"shape {shape} has more elements than any array holds")
    extent = itemsize
    for d in shape:
        extent *= d or 1
        if extent > _MAX_BYTES:
            raise NpyHeaderError(f"shape {shape} describes more bytes than any array holds"
                                 + (" (it is empty, but numpy cannot make it)" if count == 0 else ""))


def numeric_dtype(descr: str) -> np.dtype:
    """The numpy dtype of a plain numeric typestr (``'<f4'``, ``'|u1'``, ``'>i8'``...)."""
    m = _TYPESTR.fullmatch(descr)
    if m is None or (m.group(2) + m.group(3)) not in SUPPORTED:
        if _OBJECT.fullmatch(descr):
            raise ObjectDtypeError("the .npy file holds Python objects: reading it would mean unpickling, "
                                   "which gdskit never does")
        raise UnsupportedDtypeError(f"dtype {descr!r:.40} has no numeric tensor type")
    return np.dtype(descr)  # a validated typestr: numpy only looks it up


_WS = " \t\n\r\f"  # inside the braces (Python joins the lines there)
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_STRING_CHARS = frozenset(chr(c) for c in range(0x20, 0x7F)) - {"\\", "'", '"'}
_MAX_DIGITS = 19  # dimensions are below 2**63


class _Parser:
    """One pass over the header text; no recursion: the only nesting is a tuple inside the dict."""

    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0

    def fail(self, what: str) -> NpyHeaderError:
        return NpyHeaderError(f"the .npy header is not valid: {what} at character {self.i}")

    def ws(self) -> None:
        s, i = self.s, self.i
        while i < len(s) and s[i] in _WS:
            i += 1
        self.i = i

    def blanks(self) -> None:
        while self.peek() in (" ", "\t") and self.peek():
            self.i += 1

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def expect(self, ch: str) -> None:
        if self.peek() != ch:
            raise self.fail(f"expected {ch!r}")
        self.i += 1

    def header(self) -> dict[str, object]:
        # Outside the braces Python's line rules hold (an indented line is an error): spaces and
        # tabs before the dictionary; after it spaces and tabs, then only blank lines.
        self.blanks()
        self.expect("{")
        out: dict[str, object] = {}
        self.ws()
        while self.peek() != "}":
            key = self.string()
            if key in out:
                raise self.fail(f"key {key!r} given twice")
            if key not in ("descr", "fortran_order", "shape"):
                raise self.fail(f"unexpected key {key!r:.40}")
            self.ws()
            self.expect(":")
            self.ws()
            out[key] = self.value(key)
            self.ws()
            if self.peek() == ",":
                self.i += 1
                self.ws()
            elif self.peek() != "}":
                raise self.fail("expected ',' or '}'")
        self.i += 1
        self.blanks()
        while self.peek() == "\n":  # blank lines; the last one ends with its newline
            self.i += 1
            if self.i == len(self.s):
                break
            self.blanks()
            if self.peek() != "\n":
                raise self.fail("an indented line after the dictionary")
        if self.i != len(self.s):
            raise self.fail("text after the dictionary")
        return out

    def string(self) -> str:
        quote = self.peek()
        if quote not in ("'", '"'):
            raise self.fail("expected a quoted string")
        end = self.s.find(quote, self.i + 1)
        if end < 0:
            raise self.fail("unterminated string")
        body = self.s[self.i + 1:end]
        if not _STRING_CHARS.issuperset(body):
            raise self.fail("a string with escapes or characters other than printable ASCII")
        self.i = end + 1
        return body

    def value(self, key: str) -> object:
        ch = self.peek()
        if ch in ("'", '"'):
            return self.string()
        if ch == "(":
            return self.int_tuple()
        if ch == "[" and key == "descr":  # a list of fields: nothing in it is needed to refuse it
            raise UnsupportedDtypeError("a structured dtype (a list of fields) has no tensor type")
        for word, val in (("True", True), ("False", False)):
            if self.s.startswith(word, self.i):
                after = self.i + len(word)
                if after < len(self.s) and self.s[after] in _NAME_CHARS:
                    break
                self.i = after
                return val
        raise self.fail("expected a string, True, False or a tuple")

    def int_tuple(self) -> tuple[int, ...]:
        self.expect("(")
        self.ws()
        items: list[int] = []
        comma = False  # a single element needs one to be a tuple
        while self.peek() != ")":
            items.append(self.integer())
            self.ws()
            if self.peek() == ",":
                self.i += 1
                comma = True
                self.ws()
            elif self.peek() != ")":
                raise self.fail("expected ',' or ')'")
        self.i += 1
        if len(items) == 1 and not comma:
            raise self.fail("a parenthesised number is not a tuple")
        return tuple(items)

    def integer(self) -> int:
        s, start = self.s, self.i
        i = start
        while i < len(s) and s[i].isdigit() and s[i].isascii():
            i += 1
        digits = s[start:i]
        if not digits:
            raise self.fail("expected a non-negative integer")
        if i < len(s) and s[i] in _NAME_CHARS | {".", "'", '"'}:
            raise self.fail("a dimension that is not a plain decimal integer")
        if len(digits) > 1 and digits[0] == "0" and digits.strip("0"):
            raise self.fail("a number with a leading zero")
        if len(digits.lstrip("0")) > _MAX_DIGITS or int(digits) > _MAX_BYTES:
            raise self.fail("a dimension too large for any file")
        self.i = i
        return int(digits)


def read_header(path: str | os.PathLike[str], *, whole_file_ahead: int = 0) -> tuple[NpyHeader, int]:
    """The header of the ``.npy`` file at ``path`` and the file's size, read with a plain
    ``pread`` (a few KiB: no engine job). OS errors become :class:`gdskit.errors.GdskitIOError`\\ s.

    A file of at most ``whole_file_ahead`` bytes is first asked into the page cache whole
    (``posix_fadvise(WILLNEED)``, which returns once the reads are queued): from the disk, a small
    file's array then comes in the same request as its header instead of in a second one.
    """
    name = os.fspath(path)
    if is_object_url(name):
        return _object_header(name)
    fd, st = open_file_fd(name, os.O_RDONLY)
    try:
        size = st.st_size
        if 0 < size <= whole_file_ahead:
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
        head = os.pread(fd, 4096, 0)
        try:
            need = header_length(head)
        except NpyHeaderError as exc:
            raise NpyHeaderError(f"{name}: {exc}") from None
        if need > len(head):
            head += os.pread(fd, need - len(head), len(head))
    except OSError as exc:
        raise from_os_error(exc, name) from exc
    finally:
        os.close(fd)
    return header_of(name, head), size


#: The first bytes of an ``.npy`` object read for its header (one ranged GET; a header longer
#: than this is refused by :func:`header_of` as it would be cut short).
OBJECT_NPY_HEAD = 64 << 10


def _object_header(url: str) -> tuple[NpyHeader, int]:
    """:func:`read_header` of an object (``s3://...``): its first bytes in one ranged GET."""
    with open_file(url) as obj:
        size = obj.size
        head = bytearray(min(OBJECT_NPY_HEAD, size))
        return header_of(url, memoryview(head)[:obj.read(head)]), size


def header_of(name: str, data: bytes | memoryview) -> NpyHeader:
    """The header at the start of ``data``, the first bytes of the ``.npy`` file ``name`` (at least
    its whole header; a whole small file read at once); errors name the file."""
    try:
        need = header_length(bytes(data[:12]))
        if need > len(data):
            return parse_header(bytes(data))  # says how short it is
        return _parse_known(bytes(data[:need]))
    except (NpyHeaderError, UnsupportedDtypeError) as exc:
        raise type(exc)(f"{name}: {exc}") from None


@functools.lru_cache(maxsize=256)
def _parse_known(header: bytes) -> NpyHeader:
    """:func:`parse_header` of a whole header, remembered: the shards of a dataset mostly share
    one header, and parsing costs more than reading a small file (errors are not remembered)."""
    return parse_header(header)
