"""The digest manifest: a small JSON file beside a checkpoint or dataset that records the BLAKE3
digests of its files, of each fixed piece (chunk) of each file, and of each tensor's bytes.

``<file>.gdskit-digest.json`` beside one file; ``gdskit-digest.json`` inside a directory for
the files under it. Read as hostile input: bounded size, one exact schema, every number and
name checked; anything else is a :class:`ManifestError` (a ``FormatError``).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gdskit.durable import open_file_fd, write_text_whole
from gdskit.errors import FormatError, GdskitIOError, InvalidArgumentError
from gdskit.verify.digest import ALGORITHM

#: What a manifest beside one file is called: the file's name and this.
MANIFEST_SUFFIX = ".gdskit-digest.json"
#: What a manifest inside a directory is called.
DIRECTORY_MANIFEST = "gdskit-digest.json"
#: The ``format`` field every manifest carries.
FORMAT = "gdskit-digest"
#: The version written and the only one read.
VERSION = 1
#: The largest manifest read (tens of thousands of tensors take a few MiB).
MAX_MANIFEST_BYTES = 64 << 20
#: Chunk sizes a manifest may record: powers of two from 1 KiB (BLAKE3's chunk) to 1 GiB.
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 1 << 10, 1 << 30
_MAX_INT = 2**63 - 1
_MAX_NAME_BYTES = 4096
_HEX = re.compile(r"[0-9a-f]{64}")


class ManifestError(FormatError):
    """A digest manifest is not one gdskit wrote: not JSON, too large, or off its schema."""


@dataclass(frozen=True)
class TensorDigest:
    """One tensor's bytes as stored: file offsets ``[offset, offset + nbytes)`` and their digest."""

    offset: int
    nbytes: int
    digest: str


@dataclass(frozen=True)
class FileDigests:
    """One file: its size and modification time when digested, the digest of all its bytes,
    of each ``chunk_bytes`` piece in order, and of each tensor it holds (none for raw files)."""

    size: int
    mtime_ns: int
    digest: str
    chunks: tuple[str, ...]
    tensors: Mapping[str, TensorDigest] = field(default_factory=dict)


@dataclass(frozen=True)
class Manifest:
    """Digests of files, by path relative to the manifest's directory (``/``-separated)."""

    chunk_bytes: int
    files: Mapping[str, FileDigests]
    algorithm: str = ALGORITHM
    version: int = VERSION

    def to_json(self) -> str:
        files = {}
        for name, f in sorted(self.files.items()):
            files[name] = {"size": f.size, "mtime_ns": f.mtime_ns, "digest": f.digest, "chunks": list(f.chunks),
                           "tensors": {n: {"offset": t.offset, "nbytes": t.nbytes, "digest": t.digest}
                                       for n, t in f.tensors.items()}}
        doc = {"format": FORMAT, "version": self.version, "algorithm": self.algorithm,
               "chunk_bytes": self.chunk_bytes, "files": files}
        return json.dumps(doc, indent=1, ensure_ascii=True) + "\n"


def manifest_path_for(path: str | os.PathLike[str]) -> str:
    """Where the manifest of ``path`` goes: inside it for a directory, beside it for a file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return os.path.join(path, DIRECTORY_MANIFEST)
    return path + MANIFEST_SUFFIX


# -- reading ------------------------------------------------------------------------------

def _fail(message: str) -> ManifestError:
    return ManifestError(message)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _fail(f"key {key[:80]!r} appears twice")
        out[key] = value
    return out


def _object(value: Any, keys: tuple[str, ...], where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(f"{where} is a {type(value).__name__}, not an object")
    if set(value) != set(keys):
        odd = sorted(set(value) ^ set(keys))
        raise _fail(f"{where} has keys {sorted(value)[:10]}, expected {list(keys)} (differs in {odd[:5]})")
    return value


def _count(value: Any, where: str) -> int:
    if type(value) is not int or not 0 <= value <= _MAX_INT:
        raise _fail(f"{where} is {str(value)[:40]!r}, not an integer in [0, 2**63)")
    return value


def _hex(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _HEX.fullmatch(value):
        raise _fail(f"{where} is not 64 lowercase hex digits")
    return value


def _name(value: str, where: str, relative_path: bool) -> str:
    if not value or len(value.encode("utf-8", "surrogatepass")) > _MAX_NAME_BYTES or "\x00" in value:
        raise _fail(f"{where}: name {value[:80]!r} is empty, too long or holds NUL")
    if relative_path:
        parts = value.split("/")
        if value.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in value:
            raise _fail(f"{where}: {value[:80]!r} is not a plain relative path")
    return value


def _file(value: Any, name: str, chunk_bytes: int) -> FileDigests:
    where = f"files[{name[:80]!r}]"
    doc = _object(value, ("size", "mtime_ns", "digest", "chunks", "tensors"), where)
    size = _count(doc["size"], where + ".size")
    mtime = _count(doc["mtime_ns"], where + ".mtime_ns")
    digest = _hex(doc["digest"], where + ".digest")
    chunks = doc["chunks"]
    if not isinstance(chunks, list) or len(chunks) != math.ceil(size / chunk_bytes):
        raise _fail(f"{where}.chunks is not a list of ceil(size / chunk_bytes) digests")
    chunk_list = tuple(_hex(c, f"{where}.chunks[{i}]") for i, c in enumerate(chunks))
    tensors_doc = doc["tensors"]
    if not isinstance(tensors_doc, dict):
        raise _fail(f"{where}.tensors is not an object")
    tensors = {}
    for tname, tdoc in tensors_doc.items():
        twhere = f"{where}.tensors[{tname[:80]!r}]"
        _name(tname, twhere, relative_path=False)
        t = _object(tdoc, ("offset", "nbytes", "digest"), twhere)
        offset, nbytes = _count(t["offset"], twhere + ".offset"), _count(t["nbytes"], twhere + ".nbytes")
        if offset + nbytes > size:
            raise _fail(f"{twhere} ends at {offset + nbytes}, past the file's {size} bytes")
        tensors[tname] = TensorDigest(offset, nbytes, _hex(t["digest"], twhere + ".digest"))
    return FileDigests(size, mtime, digest, chunk_list, tensors)


def parse_manifest(data: bytes) -> Manifest:
    """The manifest held in ``data``.

    Raises
    ------
    ManifestError
        ``data`` is larger than :data:`MAX_MANIFEST_BYTES`, not UTF-8 JSON, or off the schema.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise _fail(f"{len(data)} bytes, more than a manifest may hold ({MAX_MANIFEST_BYTES})")
    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates,
                         parse_constant=lambda c: (_ for _ in ()).throw(_fail(f"{c} is not JSON")))
    except ManifestError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _fail(f"not JSON: {str(exc)[:120]}") from None
    doc = _object(doc, ("format", "version", "algorithm", "chunk_bytes", "files"), "the manifest")
    if doc["format"] != FORMAT:
        raise _fail(f"format is {str(doc['format'])[:40]!r}, not {FORMAT!r}")
    if type(doc["version"]) is not int or doc["version"] != VERSION:
        raise _fail(f"version {str(doc['version'])[:20]!r} is not one this gdskit reads ({VERSION})")
    if doc["algorithm"] != ALGORITHM:
        raise _fail(f"algorithm {str(doc['algorithm'])[:40]!r} is not {ALGORITHM!r}")
    chunk_bytes = _count(doc["chunk_bytes"], "chunk_bytes")
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES or chunk_bytes & (chunk_bytes - 1):
        raise _fail(f"chunk_bytes {chunk_bytes} is not a power of two from {MIN_CHUNK_BYTES} to {MAX_CHUNK_BYTES}")
    files_doc = doc["files"]
    if not isinstance(files_doc, dict):
        raise _fail("files is not an object")
    files = {_name(n, "files", relative_path=True): _file(v, n, chunk_bytes) for n, v in files_doc.items()}
    return Manifest(chunk_bytes, files)


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest at ``path`` (a FIFO is refused, never waited on).

    Raises
    ------
    ManifestError
        Naming ``path``, as :func:`parse_manifest`.
    GdskitIOError
        It cannot be read.
    """
    path = os.fspath(path)
    fd, _st = open_file_fd(path, os.O_RDONLY)
    try:
        data = os.read(fd, MAX_MANIFEST_BYTES + 1)
        while data and len(data) <= MAX_MANIFEST_BYTES:
            more = os.read(fd, MAX_MANIFEST_BYTES + 1 - len(data))
            if not more:
                break
            data += more
    except OSError as exc:
        raise GdskitIOError(exc.errno or 0, exc.strerror or str(exc), path) from exc
    finally:
        os.close(fd)
    try:
        return parse_manifest(data)
    except ManifestError as exc:
        exc.path = path
        raise


def write_manifest(manifest: Manifest, path: str | os.PathLike[str]) -> None:
    """Write ``manifest`` at ``path`` whole (a reader sees the old one or the new one). A file
    already there is replaced only if it is a manifest itself.

    Raises
    ------
    InvalidArgumentError
        Something that is not a gdskit manifest is at ``path``.
    """
    path = os.fspath(path)
    if os.path.lexists(path):
        try:
            read_manifest(path)
        except (ManifestError, GdskitIOError):
            raise InvalidArgumentError(f"{path} exists and is not a gdskit digest manifest: not replaced") from None
    write_text_whole(path, manifest.to_json())
