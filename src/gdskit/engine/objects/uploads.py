"""Multipart uploads left under way by writers that died (killed, out of memory, lost their
machine): listed under a prefix, and those older than a threshold aborted (``gdskit uploads``).

An upload under way holds its parts in the bucket, billed, until it is completed or aborted;
gdskit's own writers abort theirs on any failure they live through, but not when the process
dies. Only uploads older than the threshold are aborted, so that a writer still at work (here or
on another machine) keeps its upload: the threshold must exceed the longest write.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from gdskit.engine.objects.store import bucket_for
from gdskit.engine.objects.url import ObjectURL, parse_url
from gdskit.errors import GdskitFileNotFoundError, GdskitError, InvalidArgumentError
from gdskit.settings import settings

#: Uploads one sweep lists at most (the rest are reported as more).
LIST_LIMIT = 10_000


@dataclass(frozen=True)
class UploadFound:
    """One upload under way, and what the sweep did with it. ``action``: ``listed`` (no
    ``--abort``), ``kept`` (younger than the threshold, or of unknown age), ``aborted``, ``gone``
    (completed or aborted by someone else meanwhile) or ``failed`` (``error`` says why)."""

    url: str
    upload_id: str
    initiated: dt.datetime | None
    age_s: float | None
    stale: bool
    action: str
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "upload_id": self.upload_id,
                "initiated": None if self.initiated is None else self.initiated.isoformat(),
                "age_s": None if self.age_s is None else round(self.age_s, 3), "stale": self.stale,
                "action": self.action, "error": self.error}


@dataclass(frozen=True)
class UploadSweep:
    """What :func:`sweep_uploads` found under ``prefix`` (and did, with ``abort``)."""

    prefix: str
    endpoint: str
    older_than_s: float
    abort: bool
    now: dt.datetime
    uploads: tuple[UploadFound, ...]
    more: bool  # more uploads exist than were listed

    @property
    def stale(self) -> int:
        return sum(u.stale for u in self.uploads)

    @property
    def failed(self) -> int:
        return sum(u.action == "failed" for u in self.uploads)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "gdskit.uploads/1", "prefix": self.prefix, "endpoint": self.endpoint,
                "older_than_s": self.older_than_s, "abort": self.abort, "now": self.now.isoformat(),
                "uploads": [u.to_dict() for u in self.uploads], "more": self.more, "stale": self.stale,
                "aborted": sum(u.action == "aborted" for u in self.uploads), "failed": self.failed}


def sweep_uploads(prefix: str, older_than_s: float, abort: bool = False, *, limit: int = LIST_LIMIT,
                  now: dt.datetime | None = None) -> UploadSweep:
    """List the multipart uploads under way whose keys start with ``prefix`` (``s3://bucket/dir/``,
    matched as S3 matches a prefix) and, with ``abort``, abort those started at least
    ``older_than_s`` seconds before ``now`` (default: this machine's clock, in UTC).

    An upload whose start the store does not give is never aborted. Raises for what stops the
    listing (no such bucket, credentials, the store unreachable); an abort that fails is reported
    in its entry, and the others still go ahead.
    """
    if not isinstance(older_than_s, (int, float)) or isinstance(older_than_s, bool) or not older_than_s >= 0:
        raise InvalidArgumentError(f"older_than_s must be a number of seconds, 0 or more; got {older_than_s!r}")
    url = parse_url(prefix)
    now = dt.datetime.now(dt.timezone.utc) if now is None else now
    cfg = settings.snapshot()
    bucket = bucket_for(url)
    pending, more = bucket.list_uploads(url.key, cfg, limit)
    found = []
    for upload in pending:
        age = _age_s(upload.initiated, now)
        stale = age is not None and age >= older_than_s
        found.append(_act(bucket, ObjectURL(url.bucket, upload.key, url.scheme), upload.upload_id,
                          upload.initiated, age, stale, abort, cfg))
    return UploadSweep(str(url), bucket.endpoint.name, float(older_than_s), abort, now, tuple(found), more)


def _age_s(initiated: Any, now: dt.datetime) -> float | None:
    if not isinstance(initiated, dt.datetime):
        return None
    if initiated.tzinfo is None:  # S3 gives UTC
        initiated = initiated.replace(tzinfo=dt.timezone.utc)
    return (now - initiated).total_seconds()


def _act(bucket: Any, where: ObjectURL, upload_id: str, initiated: Any, age: float | None, stale: bool,
         abort: bool, cfg: Any) -> UploadFound:
    when = initiated if isinstance(initiated, dt.datetime) else None
    if not abort:
        return UploadFound(str(where), upload_id, when, age, stale, "listed")
    if not stale:
        return UploadFound(str(where), upload_id, when, age, stale, "kept")
    try:
        bucket.abort_upload(where, upload_id, cfg)
    except GdskitFileNotFoundError:
        return UploadFound(str(where), upload_id, when, age, stale, "gone")
    except GdskitError as exc:
        return UploadFound(str(where), upload_id, when, age, stale, "failed", str(exc))
    return UploadFound(str(where), upload_id, when, age, stale, "aborted")
