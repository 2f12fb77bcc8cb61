"""``verify=`` in a group load: every rank checks the bytes it holds once the fan-out is done, and
the ranks agree on the outcome, so that a mismatch found on one rank raises
:class:`~gdskit.errors.ChecksumMismatchError` on every rank (docs/verify.md).

Checking after the fan-out, where the bytes came to rest, catches corruption wherever it
happened: on storage, in the reading rank's staging, on the wire, in a receiving rank's
copy-out. A check by the reading rank alone, before it sends, would miss the last three on
the other ranks.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from gdskit.errors import ChecksumMismatchError, GroupError, StaleManifestError
from gdskit.group import exchange, failure

#: Longest message carried from one rank to the others.
_MESSAGE_CHARS = 2000


def _told(error: BaseException | None) -> bytes:
    """What this rank tells the others about its check."""
    if error is None:
        return b""
    doc: dict[str, object] = {"kind": "error", "type": type(error).__name__, "message": str(error)[:_MESSAGE_CHARS]}
    if isinstance(error, ChecksumMismatchError):
        doc.update(kind="mismatch", path=error.path, tensor=error.tensor,
                   byte_range=list(error.byte_range) if error.byte_range is not None else None,
                   expected=error.expected, actual=error.actual)
    elif isinstance(error, StaleManifestError):
        doc.update(kind="stale", path=error.path, manifest=error.manifest)
    return json.dumps(doc).encode()


def _raised_here(doc: dict[str, object], rank: int) -> BaseException:
    """The error another rank's check found, raised on this one (a mismatch stays a mismatch)."""
    message = f"rank {rank} of the process group: {doc['message']}"
    if doc["kind"] == "mismatch":
        span = doc["byte_range"]
        return ChecksumMismatchError(message, path=str(doc["path"]),
                                     tensor=None if doc["tensor"] is None else str(doc["tensor"]),
                                     byte_range=None if span is None else (int(span[0]), int(span[1])),  # type: ignore[index]
                                     expected=str(doc["expected"]), actual=str(doc["actual"]))
    if doc["kind"] == "stale":
        return StaleManifestError(message, path=str(doc["path"]), manifest=str(doc["manifest"]))
    return GroupError(f"rank {rank} of the process group failed checking the loaded bytes ({doc['type']})", (rank,))


def check_on_every_rank(info: exchange.GroupInfo, check: Callable[[], None]) -> None:
    """Run ``check`` (raises on bytes that differ from their digests) on this rank, then learn
    every rank's outcome.

    Raises what ``check`` raised on the rank where it raised; on the others, the first
    :class:`ChecksumMismatchError` (or :class:`StaleManifestError`) any rank found, rebuilt and
    naming that rank, else :class:`GroupError` for any other failure.
    """
    error: BaseException | None = None
    try:
        check()
    except Exception as exc:  # noqa: BLE001 - told to every rank, then raised here
        error = exc
    what = "checking the loaded bytes against their digests"
    everyone = failure.told(error, lambda: exchange.all_gather_blobs(info, _told(error),
                                                                   failure.Deadline(info.timeout_s), what))
    told = [(rank, json.loads(blob.decode())) for rank, blob in enumerate(everyone) if blob]
    told.sort(key=lambda item: item[1]["kind"] == "error")  # a mismatch anywhere outranks other failures
    if told:
        raise _raised_here(told[0][1], told[0][0])
