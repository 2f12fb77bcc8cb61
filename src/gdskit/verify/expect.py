"""What a file's bytes are checked against: the ``verify=`` argument read once, and the digests
it points to (the file's own header, a manifest beside it or in a directory above it, a manifest
named, or a sha256 given)."""

from __future__ import annotations

import enum
import json
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gdskit.errors import InvalidArgumentError, NothingToVerifyError, StaleManifestError, from_os_error
from gdskit.verify.manifest import (DIRECTORY_MANIFEST, MANIFEST_SUFFIX, FileDigests, Manifest, ManifestError,
                                    read_manifest)

#: The ``__metadata__`` key of a safetensors header where gdskit records each tensor's BLAKE3 digest
#: (a JSON object, name to hex).
HEADER_KEY = "gdskit.blake3"
#: How many directories above a file are searched for a directory manifest that lists it.
_PARENT_LEVELS = 4
_HEX64 = re.compile(r"[0-9a-f]{64}")
_SHA256 = re.compile(r"sha256:([0-9a-f]{64})")


class VerifyKind(enum.Enum):
    """What ``verify=`` asks for."""

    OFF = "off"            # nothing is checked
    AUTO = "auto"          # the file's own digests, or a manifest found beside it or above it
    MANIFEST = "manifest"  # the manifest named
    SHA256 = "sha256"      # the whole file's sha256, given


@dataclass(frozen=True)
class VerifyMode:
    """``verify=`` read: ``kind`` says what is checked; ``manifest`` is the manifest named
    (``MANIFEST``), ``sha256`` the whole file's sha256 in hex (``SHA256``)."""

    kind: VerifyKind
    manifest: str | None = None
    sha256: str | None = None

    @property
    def on(self) -> bool:
        """Whether anything is checked."""
        return self.kind is not VerifyKind.OFF

    @property
    def whole_file(self) -> bool:
        """Whether the check is of the whole file's bytes (a sha256), not per-tensor or per-chunk
        digests: a reader that hands out bytes before the file is read to its end cannot make it."""
        return self.kind is VerifyKind.SHA256

    @property
    def argument(self) -> Any:
        """The ``verify=`` value this mode was read from (False, True, a manifest's path or
        ``"sha256:<hex>"``), to hand on to another reader."""
        if self.kind is VerifyKind.MANIFEST:
            return self.manifest
        if self.kind is VerifyKind.SHA256:
            return f"sha256:{self.sha256}"
        return self.on


OFF = VerifyMode(VerifyKind.OFF)


def verify_mode(verify: Any) -> VerifyMode:
    """Read a ``verify=`` argument: False or None (off), True, ``"sha256:<hex>"``, or a manifest's path.

    Raises
    ------
    InvalidArgumentError
        Anything else.
    """
    if verify is None or verify is False:
        return OFF
    if verify is True:
        return VerifyMode(VerifyKind.AUTO)
    if isinstance(verify, (str, os.PathLike)) and not isinstance(verify, bytes):
        text = os.fspath(verify)
        if isinstance(text, str) and text:
            match = _SHA256.fullmatch(text.lower()) if text.lower().startswith("sha256:") else None
            if text.lower().startswith("sha256:"):
                if match is None:
                    raise InvalidArgumentError("verify='sha256:...' takes 64 hex digits after 'sha256:'")
                return VerifyMode(VerifyKind.SHA256, sha256=match.group(1))
            return VerifyMode(VerifyKind.MANIFEST, manifest=text)
    raise InvalidArgumentError(f"verify takes False, True, 'sha256:<hex>' or a manifest's path, not {verify!r}"[:200])


@dataclass(frozen=True)
class Expectation:
    """The digests one file is checked against.

    ``source`` names where they come from (a manifest's path, or ``"the file's header"``);
    ``tensors`` maps tensor names to hex digests; ``file`` is the manifest's entry (None for a
    header); ``chunk_bytes`` its chunk size; ``stale_mtime``: the file's modification time is
    not the one the manifest recorded (a mismatch then means the file changed, not corruption).
    """

    path: str
    source: str
    tensors: Mapping[str, str]
    file: FileDigests | None = None
    chunk_bytes: int = 0
    stale_mtime: bool = False


def header_digests(metadata: Mapping[str, str] | None, path: str) -> dict[str, str] | None:
    """The tensor digests recorded in a safetensors ``__metadata__`` (None if it records none).

    Raises
    ------
    ManifestError
        The key is there and does not hold a JSON object of names to 64-hex-digit digests.
    """
    if not metadata or HEADER_KEY not in metadata:
        return None
    try:
        doc = json.loads(metadata[HEADER_KEY])
    except (ValueError, RecursionError, TypeError):
        raise ManifestError(f"__metadata__[{HEADER_KEY!r}] is not JSON", path=path) from None
    if not isinstance(doc, dict) or not all(isinstance(v, str) and _HEX64.fullmatch(v) for v in doc.values()):
        raise ManifestError(f"__metadata__[{HEADER_KEY!r}] is not an object of names to BLAKE3 digests", path=path)
    return doc


_cache: dict[str, tuple[tuple[int, int], Manifest]] = {}
_cache_lock = threading.Lock()


def _cached_manifest(path: str) -> Manifest:
    """The manifest at ``path``, read once while its size and mtime stay (shards share one)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise from_os_error(exc, path) from None
    key = (st.st_size, st.st_mtime_ns)
    with _cache_lock:
        hit = _cache.get(path)
    if hit is not None and hit[0] == key:
        return hit[1]
    manifest = read_manifest(path)
    with _cache_lock:
        if len(_cache) > 64:
            _cache.clear()
        _cache[path] = (key, manifest)
    return manifest


def relative_name(manifest_path: str, file_path: str) -> list[str]:
    """The names a manifest may list ``file_path`` under: relative to the manifest's folder as the
    paths are given, then with links resolved (a Hugging Face snapshot's files are links)."""
    out = []
    for resolve in (os.path.abspath, os.path.realpath):
        rel = os.path.relpath(resolve(file_path), os.path.dirname(resolve(manifest_path))).replace(os.sep, "/")
        if rel not in out:
            out.append(rel)
    return out


def _entry_in(manifest_path: str, file_path: str) -> FileDigests | None:
    manifest = _cached_manifest(manifest_path)
    for rel in relative_name(manifest_path, file_path):
        if rel in manifest.files:
            return manifest.files[rel]
    return None


def _from_entry(path: str, manifest_path: str, entry: FileDigests, chunk_bytes: int) -> Expectation:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise from_os_error(exc, path) from None
    if st.st_size != entry.size:
        raise StaleManifestError(f"{path} has {st.st_size} bytes; {manifest_path} was made when it had "
                                 f"{entry.size}: digest it again (gdskit digest)", path=path, manifest=manifest_path)
    return Expectation(path, manifest_path, {n: t.digest for n, t in entry.tensors.items()}, entry, chunk_bytes,
                       stale_mtime=st.st_mtime_ns != entry.mtime_ns)


def _candidates(path: str) -> list[str]:
    """Manifests that may describe ``path``: beside it, then in its directory and those above."""
    out = [path + MANIFEST_SUFFIX]
    folder = os.path.dirname(os.path.abspath(path))
    for _ in range(_PARENT_LEVELS):
        out.append(os.path.join(folder, DIRECTORY_MANIFEST))
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return out


def find_expectation(path: str | os.PathLike[str], mode: VerifyMode,
                     metadata: Mapping[str, str] | None = None) -> Expectation:
    """What ``path`` is checked against under ``mode`` (``AUTO`` or ``MANIFEST``).

    ``metadata``: the file's safetensors ``__metadata__`` where it has one. A manifest that lists
    the file comes first: it was made apart from the file, so a file replaced by another that
    carries its own digests is caught; the header's digests serve where no manifest lists the
    file (they catch corruption, not substitution).

    Raises
    ------
    NothingToVerifyError
        Nothing records digests of ``path``.
    StaleManifestError
        The manifest found was made for another size of the file.
    ManifestError
        A manifest (or the header's digests) is malformed.
    """
    path = os.fspath(path)
    if mode.whole_file or not mode.on:
        raise InvalidArgumentError(f"{mode.kind.value}: a file's digests are looked up for verify=True or a manifest")
    if mode.kind is VerifyKind.MANIFEST:
        assert mode.manifest is not None
        if "://" in path:
            raise NothingToVerifyError(f"{path}: a manifest lists local files, not objects", path=path)
        entry = _entry_in(mode.manifest, path)
        if entry is None:
            raise NothingToVerifyError(f"{mode.manifest} holds no digests of {path}", path=path)
        return _from_entry(path, mode.manifest, entry, _cached_manifest(mode.manifest).chunk_bytes)
    if "://" not in path:  # an object (s3://) has no manifest: manifests sit beside local files only
        for candidate in _candidates(path):
            if os.path.isfile(candidate):
                entry = _entry_in(candidate, path)
                if entry is not None:
                    return _from_entry(path, candidate, entry, _cached_manifest(candidate).chunk_bytes)
    in_header = header_digests(metadata, path)
    if in_header is not None:
        return Expectation(path, "the file's header", in_header)
    if "://" in path:
        raise NothingToVerifyError(f"{path}: verify=True, but its header records no digests; an object is checked "
                                   "against the digests save_file(..., digests=True) writes in its header", path=path)
    raise NothingToVerifyError(f"{path}: verify=True, but its header records no digests and no manifest "
                               f"({os.path.basename(path)}{MANIFEST_SUFFIX} or {DIRECTORY_MANIFEST} above it) "
                               "lists it; make one with `gdskit digest`", path=path)
