"""The comparison that decides: digests computed where the bytes landed against the ones expected;
a difference raises :class:`~gdskit.errors.ChecksumMismatchError` (or, where the manifest is
older than the file, :class:`~gdskit.errors.StaleManifestError`)."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterable, Mapping

from gdskit.durable import open_file_fd
from gdskit.errors import ChecksumMismatchError, GdskitIOError, NothingToVerifyError, StaleManifestError
from gdskit.verify.digest import tagged
from gdskit.verify.expect import Expectation


def mismatch(expectation: Expectation, tensor: str | None, byte_range: tuple[int, int] | None, expected: str,
             actual: str, *, filled: Iterable[str] = (), unfilled: Iterable[str] = (),
             algorithm: str = "blake3") -> Exception:
    """The error for one digest that differs (stale where the manifest predates the file)."""
    what = f"tensor {tensor!r}" if tensor is not None else "bytes"
    where = f" (file bytes {byte_range[0]}-{byte_range[1]})" if byte_range is not None else ""
    if expectation.stale_mtime:
        return StaleManifestError(f"{expectation.path}: {what}{where} differ from {expectation.source}, which was "
                                  "made before the file was last modified: digest it again (gdskit digest)",
                                  path=expectation.path, manifest=expectation.source)
    return ChecksumMismatchError(
        f"{expectation.path}: {what}{where} read with digest {tagged(actual, algorithm)}, but "
        f"{expectation.source} records {tagged(expected, algorithm)}",
        path=expectation.path, tensor=tensor, byte_range=byte_range, expected=tagged(expected, algorithm),
        actual=tagged(actual, algorithm), filled=filled, unfilled=unfilled)


def check_tensors(expectation: Expectation, actual: Mapping[str, str],
                  ranges: Mapping[str, tuple[int, int]] | None = None) -> None:
    """Raise for the first tensor (in ``actual``'s order) whose digest is not the expected one.

    A tensor the expectation has no digest for is refused as unverifiable
    (:class:`~gdskit.errors.NothingToVerifyError`): a check asked for is never silently skipped.
    """
    bad = [n for n in actual if n not in expectation.tensors]
    if bad:
        raise NothingToVerifyError(f"{expectation.path}: {expectation.source} records no digest of tensor "
                                   f"{bad[0]!r}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""),
                                   path=expectation.path)
    wrong = [n for n, d in actual.items() if expectation.tensors[n] != d]
    if wrong:
        first = wrong[0]
        good = [n for n in actual if n not in set(wrong)]
        raise mismatch(expectation, first, (ranges or {}).get(first), expectation.tensors[first], actual[first],
                       filled=good, unfilled=wrong)


def sha256_of_file(path: str | os.PathLike[str], stop: threading.Event | None = None, piece: int = 8 << 20) -> str:
    """The sha256 (hex) of every byte of the file at ``path`` (CPU speed: one core per file).
    ``stop``, once set, ends the hashing at the next piece (:class:`InterruptedError`)."""
    path = os.fspath(path)
    fd, _st = open_file_fd(path, os.O_RDONLY)
    h = hashlib.sha256()
    try:
        buf = bytearray(piece)
        view = memoryview(buf)
        while True:
            if stop is not None and stop.is_set():
                raise InterruptedError("the load this check belonged to ended")
            n = os.readv(fd, [buf])
            if not n:
                break
            h.update(view[:n])
    except OSError as exc:
        raise GdskitIOError(exc.errno or 0, exc.strerror or str(exc), path) from exc
    finally:
        os.close(fd)
    return h.hexdigest()


def check_sha256(path: str | os.PathLike[str], expected_hex: str, stop: threading.Event | None = None) -> None:
    """Raise :class:`ChecksumMismatchError` unless the file's sha256 is ``expected_hex``."""
    path = os.fspath(path)
    actual = sha256_of_file(path, stop)
    if actual != expected_hex:
        size = os.stat(path).st_size
        exp = Expectation(path, "verify='sha256:...'", {})
        raise mismatch(exp, None, (0, size), expected_hex, actual, algorithm="sha256")
