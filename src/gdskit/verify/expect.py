"""What a file's bytes are checked against: the digests a ``verify=`` mode (:mod:`gdskit.verify.mode`)
points to (the file's own header, a manifest beside it or in a directory above it, a manifest
named, or a sha256 given)."""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from gdskit.errors import InvalidArgumentError, NothingToVerifyError, StaleManifestError, from_os_error
from gdskit.verify.manifest import (DIRECTORY_MANIFEST, MANIFEST_SUFFIX, FileDigests, Manifest, ManifestError,
                                    read_manifest)
from gdskit.verify.mode import HEADER_KEY, VerifyKind, VerifyMode

#: How many directories above a file are searched for a directory manifest that lists it.
_PARENT_LEVELS = 4
_HEX64 = re.compile(r"[0-9a-f]{64}")


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
