"""``gdskit check s3://bucket/prefix``: whether an object store answers, whether the credentials
work, and what one ranged GET of 64 MiB achieves, as a dataclass the CLI renders. A prefix is
listed up to :data:`LIST_LIMIT` keys, never whole (it may hold millions)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gdskit.engine import is_object_url, list_objects_bounded, object_endpoint_name, open_file
from gdskit.errors import GdskitError, GdskitFileNotFoundError, InvalidArgumentError, NoCredentialsError, ObjectStoreError

#: Bytes the check's GET reads (less where the largest object is smaller).
PROBE_BYTES = 64 << 20

#: Keys the check lists under a prefix at most (one page of S3's listing).
LIST_LIMIT = 1000


@dataclass(frozen=True)
class ObjectStoreCheck:
    """What the check found for one URL. ``credentials``: ``ok``, ``missing`` (none found),
    ``refused`` (the store said no) or ``unknown`` (the store did not answer)."""

    url: str
    endpoint: str
    reachable: bool
    credentials: str
    objects: int | None = None          # objects listed under the prefix (1 for an object URL)
    more_objects: bool = False          # the prefix holds more objects than the check listed
    probe_object: str | None = None     # the object the GET read
    probe_bytes: int = 0
    probe_seconds: float | None = None
    error: str | None = None

    @property
    def rate_bytes_s(self) -> float | None:
        if not self.probe_bytes or not self.probe_seconds:
            return None
        return self.probe_bytes / self.probe_seconds

    @property
    def ok(self) -> bool:
        return self.reachable and self.credentials == "ok" and self.error is None

    def to_dict(self) -> dict[str, Any]:
        rate = self.rate_bytes_s
        return {"url": self.url, "endpoint": self.endpoint, "reachable": self.reachable,
                "credentials": self.credentials, "objects": self.objects,
                "more_objects": self.more_objects, "probe_object": self.probe_object,
                "probe_bytes": self.probe_bytes,
                "probe_seconds": None if self.probe_seconds is None else round(self.probe_seconds, 6),
                "rate_bytes_s": None if rate is None else round(rate), "ok": self.ok, "error": self.error}


def check_object_store(url: str, list_limit: int = LIST_LIMIT) -> ObjectStoreCheck:
    """List ``url`` (a prefix ending in ``/``: its first ``list_limit`` keys; or one object) and
    GET up to 64 MiB of the largest object listed into host memory; never raises for what the
    store answers (it is the finding)."""
    if not is_object_url(url):
        raise InvalidArgumentError(f"not an object URL: {url!r}")
    try:
        endpoint = object_endpoint_name()
    except GdskitError as exc:  # the extra is missing
        return ObjectStoreCheck(url, "unknown", False, "unknown", error=str(exc))
    more = False
    try:
        if url.endswith("/"):
            found, more = list_objects_bounded(url, list_limit)
        else:
            with open_file(url) as obj:
                found = [(url, obj.size)]
    except NoCredentialsError as exc:
        return ObjectStoreCheck(url, endpoint, False, "missing", error=str(exc))
    except PermissionError as exc:
        return ObjectStoreCheck(url, endpoint, True, "refused", error=str(exc))
    except GdskitFileNotFoundError as exc:
        return ObjectStoreCheck(url, endpoint, True, "ok", 0, error=str(exc))
    except ObjectStoreError as exc:
        return ObjectStoreCheck(url, endpoint, False, "unknown", error=str(exc))
    if not found:
        return ObjectStoreCheck(url, endpoint, True, "ok", 0, error="no object under this prefix to read")
    target, size = max(found, key=lambda item: item[1])
    n = min(PROBE_BYTES, size)
    buf = bytearray(n)
    try:
        with open_file(target) as obj:
            t0 = time.perf_counter()
            got = obj.read(buf, n, 0)
            elapsed = time.perf_counter() - t0
    except GdskitError as exc:
        return ObjectStoreCheck(url, endpoint, True, "ok", len(found), more, target, error=str(exc))
    return ObjectStoreCheck(url, endpoint, True, "ok", len(found), more, target, got, elapsed)
