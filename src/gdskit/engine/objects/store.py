"""The object store client: one bucket's requests through botocore, with gdskit's own retries,
errors and ledger records.

botocore is the client (docs/object-storage.md has the measurement it was chosen by): a ranged
GET's streaming body reads straight into memory gdskit owns (``readinto``), piece by piece, so a
part's bytes land in the caller's host memory or a pinned lane without a buffer of their own.
Its retries are off: gdskit retries here, so that every retry is counted in the ledger and
bounded by the settings. Credentials come from botocore's standard chain (environment, config
and credentials files, SSO, container and instance roles); the endpoint from
``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL`` or the profile's ``endpoint_url``.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from gdskit.engine.ledger import ledger
from gdskit.engine.objects.url import ObjectURL
from gdskit.errors import (GdskitFileNotFoundError, GdskitPermissionError, InvalidArgumentError,
                           MissingDependencyError, NoCredentialsError, ObjectChangedError, ObjectStoreError)
from gdskit.settings import Settings

T = TypeVar("T")

INSTALL_HINT = "object storage (s3://) needs gdskit's s3 extra: pip install 'gdskit[s3]' (botocore)"

#: HTTP answers worth another try: throttling (503 SlowDown, 429), a server's own error.
_RETRIED_STATUS = frozenset({429, 500, 502, 503, 504})
_RETRIED_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                            "ServiceUnavailable", "RequestLimitExceeded"})


def _botocore() -> Any:
    try:
        import botocore.config  # noqa: PLC0415 - optional dependency (botocore)
        import botocore.exceptions  # noqa: PLC0415 - optional dependency (botocore)
        import botocore.session  # noqa: PLC0415 - optional dependency (botocore)
    except ImportError as exc:
        raise MissingDependencyError(INSTALL_HINT) from exc
    return botocore


@dataclass(frozen=True)
class Endpoint:
    """Where requests go: ``url`` (None: AWS's own S3) in ``region``."""

    url: str | None
    region: str

    @property
    def name(self) -> str:
        """What the ledger and ``gdskit check`` call this endpoint."""
        return self.url or f"aws:{self.region}"


def endpoint_now() -> Endpoint:
    """The endpoint the environment and the AWS config name now (read at each open: a program
    may change them)."""
    session = _botocore().session.get_session()
    url = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    if url is None:
        try:
            url = session.get_scoped_config().get("endpoint_url") or None
        except Exception:  # noqa: BLE001 - a profile that does not exist: the credentials step says so
            url = None
    try:
        region = session.get_config_variable("region") or "us-east-1"
    except Exception:  # noqa: BLE001 - the same
        region = "us-east-1"
    return Endpoint(str(url).rstrip("/") if url else None, str(region))


@dataclass(frozen=True)
class ObjectMeta:
    """What a HEAD says: the object's size and the ETag every later GET must match."""

    size: int
    etag: str | None


@dataclass(frozen=True)
class PendingUpload:
    """A multipart upload under way: its key, id, and when the store says it started (None
    where it did not say)."""

    key: str
    upload_id: str
    initiated: Any = None  # a timezone-aware datetime


class Bucket:
    """One bucket at one endpoint: HEAD, ranged GETs into memory the caller owns, listings,
    multipart uploads."""

    def __init__(self, bucket: str, endpoint: Endpoint, connections: int) -> None:
        botocore = _botocore()
        self.bucket = bucket
        self.endpoint = endpoint
        self._errors = botocore.exceptions
        session = botocore.session.get_session()
        try:
            creds = session.get_credentials()
        except Exception as exc:  # noqa: BLE001 - botocore's own: a broken profile, an expired SSO token
            raise NoCredentialsError(13, f"no usable credentials for {endpoint.name}: {exc}", endpoint.name) from exc
        if creds is None:
            raise NoCredentialsError(13, f"no credentials for {endpoint.name}: set AWS_ACCESS_KEY_ID and "
                                         "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run where a role applies",
                                     endpoint.name)
        config = botocore.config.Config(
            max_pool_connections=connections, retries={"total_max_attempts": 1},  # gdskit retries (counted)
            connect_timeout=10, read_timeout=60, tcp_keepalive=True,
            s3={"addressing_style": "path"} if endpoint.url else None)
        self.client = session.create_client("s3", endpoint_url=endpoint.url, region_name=endpoint.region,
                                            config=config)

    # -- reads ------------------------------------------------------------
    def head(self, url: ObjectURL, cfg: Settings) -> ObjectMeta:
        out = self._call(url, cfg, "read", lambda: self.client.head_object(Bucket=self.bucket, Key=url.key))
        return ObjectMeta(int(out["ContentLength"]), out.get("ETag"))

    def read_range(self, url: ObjectURL, start: int, size: int, etag: str | None, cfg: Settings, piece: int,
                   land: Callable[[int, int], memoryview], landed: Callable[[int, int], None]) -> None:
        """Object bytes ``[start, start + size)`` read under ``etag``, ``piece`` bytes at a time:
        ``land(pos, n)`` gives the memory for range bytes ``[pos, pos + k)`` (``k``, its length,
        from 1 to ``n``), ``landed(pos, k)`` is told once they are there. A connection cut mid-body is retried from where it stopped
        (the bytes already landed stay: the ETag guarantees they are the same object's).
        :class:`ObjectChangedError` where the object changed or is shorter than ``start + size``."""
        done = [0]

        def once() -> None:
            first = start + done[0]
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": url.key,
                                      "Range": f"bytes={first}-{start + size - 1}"}
            if etag is not None:
                kwargs["IfMatch"] = etag
            out = self.client.get_object(**kwargs)
            got_tag = out.get("ETag")
            if etag is not None and got_tag is not None and got_tag != etag:
                raise ObjectChangedError(5, f"object changed while read (ETag {etag} -> {got_tag})", str(url))
            if int(out.get("ContentLength", -1)) != size - done[0]:
                raise ObjectChangedError(5, f"object gave {out.get('ContentLength')} bytes at {first}, not "
                                            f"{size - done[0]}: it is shorter than when it was opened", str(url))
            body = out["Body"]
            try:
                while done[0] < size:
                    view = land(done[0], min(piece, size - done[0]))
                    assert 0 < view.nbytes <= size - done[0], "land() gives 1 to n bytes"
                    _fill(body, view)
                    landed(done[0], view.nbytes)
                    done[0] += view.nbytes
            finally:
                body.close()

        t0 = time.perf_counter()
        self._call(url, cfg, "read", once)
        ledger.record_object(self.endpoint.name, "read", size, 1, 0, time.perf_counter() - t0)

    def list(self, prefix: str, cfg: Settings) -> list[tuple[str, int]]:
        """``(key, size)`` of every object under ``prefix``, sorted by key."""
        return sorted(self.list_bounded(prefix, cfg, None)[0])

    def list_bounded(self, prefix: str, cfg: Settings, limit: int | None) -> tuple[list[tuple[str, int]], bool]:
        """``(key, size)`` of the first ``limit`` objects under ``prefix`` (all where None), in
        the store's order, a page at a time; and whether more exist past them."""

        def once() -> tuple[list[tuple[str, int]], bool]:
            out: list[tuple[str, int]] = []
            token = None
            while True:
                want = 1000 if limit is None else min(1000, limit - len(out))
                kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": want}
                if token is not None:
                    kwargs["ContinuationToken"] = token
                page = self.client.list_objects_v2(**kwargs)
                got = [(o["Key"], int(o["Size"])) for o in page.get("Contents", ())]
                out.extend(got)
                more = bool(page.get("IsTruncated"))
                token = page.get("NextContinuationToken")
                if limit is not None and len(out) >= limit:
                    return out[:limit], more or len(out) > limit
                if not more or not token or not got:  # a page that brings nothing ends it (hostile servers)
                    return out, False

        return self._call(ObjectURL(self.bucket, prefix), cfg, "read", once)

    # -- writes -----------------------------------------------------------
    def start_upload(self, url: ObjectURL, cfg: Settings) -> str:
        out = self._call(url, cfg, "write", lambda: self.client.create_multipart_upload(Bucket=self.bucket,
                                                                                        Key=url.key))
        return str(out["UploadId"])

    def upload_part(self, url: ObjectURL, upload_id: str, number: int, data: memoryview, cfg: Settings) -> str:
        t0 = time.perf_counter()
        out = self._call(url, cfg, "write", lambda: self.client.upload_part(
            Bucket=self.bucket, Key=url.key, UploadId=upload_id, PartNumber=number, Body=bytes(data)))
        ledger.record_object(self.endpoint.name, "write", data.nbytes, 1, 0, time.perf_counter() - t0)
        return str(out["ETag"])

    def complete_upload(self, url: ObjectURL, upload_id: str, etags: list[str], cfg: Settings) -> None:
        """Complete the upload of the parts ``etags`` (as the server answered each). A retry told
        NoSuchUpload may follow a try that completed the upload and lost its answer: then the
        object at the key must be this upload's (its multipart ETag), else
        :class:`ObjectStoreError`."""
        parts = [{"PartNumber": i + 1, "ETag": tag} for i, tag in enumerate(etags)]
        tries = [0]

        def once() -> bool:
            tries[0] += 1
            try:
                self.client.complete_multipart_upload(Bucket=self.bucket, Key=url.key, UploadId=upload_id,
                                                      MultipartUpload={"Parts": parts})
            except self._errors.ClientError as exc:
                if tries[0] > 1 and _status(exc)[1] == "NoSuchUpload":
                    return False  # completed by an earlier try, or aborted by someone else: see below
                raise
            return True

        if not self._call(url, cfg, "write", once):
            self._confirm_completed(url, etags, cfg)

    def _confirm_completed(self, url: ObjectURL, etags: list[str], cfg: Settings) -> None:
        expected = multipart_etag(etags)
        try:
            found = self.head(url, cfg).etag
        except GdskitFileNotFoundError:
            found = None
        if expected is None or found is None or found.strip('"') != expected:
            raise ObjectStoreError(5, f"the multipart upload of {url} at {self.endpoint.name} vanished before its "
                                      f"completion was confirmed, and the object there (ETag {found}) is not "
                                      f"this upload's ({expected})", str(url))

    def abort_upload(self, url: ObjectURL, upload_id: str, cfg: Settings) -> None:
        self._call(url, cfg, "write", lambda: self.client.abort_multipart_upload(
            Bucket=self.bucket, Key=url.key, UploadId=upload_id))

    def list_uploads(self, prefix: str, cfg: Settings, limit: int) -> tuple[list[PendingUpload], bool]:
        """The first ``limit`` multipart uploads under way (started, neither completed nor
        aborted) whose keys start with ``prefix``, a page at a time; and whether more exist."""

        def once() -> tuple[list[PendingUpload], bool]:
            out: list[PendingUpload] = []
            markers: dict[str, str] = {}
            while True:
                page = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix,
                                                          MaxUploads=min(1000, limit - len(out)), **markers)
                got = [PendingUpload(str(u["Key"]), str(u["UploadId"]), u.get("Initiated"))
                       for u in page.get("Uploads", ()) if str(u.get("Key", "")).startswith(prefix)]
                out.extend(got)
                more = bool(page.get("IsTruncated"))
                if len(out) >= limit:
                    return out[:limit], more or len(out) > limit
                key_marker, id_marker = page.get("NextKeyMarker"), page.get("NextUploadIdMarker")
                following = {"KeyMarker": str(key_marker), **({"UploadIdMarker": str(id_marker)} if id_marker else {})}
                if not more or not got or not key_marker or following == markers:
                    return out, False  # a page that brings nothing, or the same markers, ends it (hostile servers)
                markers = following

        return self._call(ObjectURL(self.bucket, prefix), cfg, "read", once)

    def put(self, url: ObjectURL, data: memoryview, cfg: Settings) -> None:
        """A whole small object in one PUT (atomic as every PUT is)."""
        t0 = time.perf_counter()
        self._call(url, cfg, "write", lambda: self.client.put_object(Bucket=self.bucket, Key=url.key,
                                                                     Body=bytes(data)))
        ledger.record_object(self.endpoint.name, "write", data.nbytes, 1, 0, time.perf_counter() - t0)

    def delete(self, url: ObjectURL, cfg: Settings) -> None:
        """Remove the object (nothing to do where there is none: S3 answers the same)."""
        self._call(url, cfg, "write", lambda: self.client.delete_object(Bucket=self.bucket, Key=url.key))

    # -- retries and errors -----------------------------------------------
    def _call(self, url: ObjectURL, cfg: Settings, op: str, request: Callable[[], T]) -> T:
        """``request()`` retried after throttling, server errors and dropped connections, at most
        ``cfg.s3_max_retries`` times, waiting ``s3_backoff * 2**k`` (with jitter, at most 64 times
        ``s3_backoff``) before retry *k*."""
        attempt = 0
        while True:
            try:
                return request()
            except (ObjectChangedError, GdskitPermissionError, GdskitFileNotFoundError):
                raise
            except Exception as exc:  # noqa: BLE001 - sorted below into retried and final
                if not self._retried(exc) or attempt >= cfg.s3_max_retries:
                    raise self._mapped(exc, url, attempt) from exc
            ledger.record_object(self.endpoint.name, op, 0, 1, 1, 0.0)
            time.sleep(min(cfg.s3_backoff * 2 ** attempt, cfg.s3_backoff * 64) * random.uniform(0.5, 1.0))
            attempt += 1

    def _retried(self, exc: BaseException) -> bool:
        """Whether a failed request is worth another try: throttling and server errors (by HTTP
        status and S3 error code), connections refused, reset, timed out or cut mid-body."""
        errors = self._errors
        if isinstance(exc, errors.ClientError):
            status, code = _status(exc)
            return status in _RETRIED_STATUS or code in _RETRIED_CODES
        return isinstance(exc, (errors.HTTPClientError, errors.ResponseStreamingError, errors.IncompleteReadError,
                                ConnectionError, TimeoutError))

    def _mapped(self, exc: BaseException, url: ObjectURL, retries: int = 0) -> BaseException:
        errors = self._errors
        where = f"{url} at {self.endpoint.name}"
        if isinstance(exc, errors.NoCredentialsError):
            return NoCredentialsError(13, f"no credentials for {self.endpoint.name}", str(url))
        if isinstance(exc, errors.ClientError):
            status, code = _status(exc)
            if status == 404 or code in ("NoSuchKey", "NoSuchBucket", "NotFound", "NoSuchUpload"):
                return GdskitFileNotFoundError(2, f"no such object (or bucket) {where} ({code})", str(url))
            if status == 412 or code == "PreconditionFailed":
                return ObjectChangedError(5, f"object changed while read (its ETag no longer matches) {where}",
                                          str(url))
            if status == 416 or code == "InvalidRange":
                return ObjectChangedError(5, f"object is shorter than when it was opened {where}", str(url))
            if status in (401, 403):
                return GdskitPermissionError(13, f"the store refused the credentials for {where} ({code})", str(url))
            if status == 400 and code in ("InvalidBucketName", "KeyTooLongError", "InvalidArgument"):
                return InvalidArgumentError(f"{where}: {code}")
        tried = f" after {retries} retries" if retries else ""
        return ObjectStoreError(5, f"request failed{tried} for {where}: {_first_line(exc)}", str(url))


def _status(exc: Any) -> tuple[int, str]:
    response = getattr(exc, "response", None) or {}
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return status, str(response.get("Error", {}).get("Code", ""))


#: Bytes a response body is asked for at a time. botocore's body (urllib3's) reads what it is asked
#: for into a bytes object and copies it out: asked for a whole piece, every GET in flight would
#: hold a piece's worth of host memory again (16 GETs of 8 MiB: 128 MiB).
BODY_READ_BYTES = 1 << 20


def _fill(body: Any, view: memoryview) -> None:
    """Fill ``view`` from a response body; a body that ends first is a connection cut mid-body."""
    pos, n = 0, view.nbytes
    while pos < n:
        got = body.readinto(view[pos:pos + BODY_READ_BYTES])
        if not got:
            raise ConnectionResetError(f"the body ended {n - pos} bytes short")
        pos += got


def multipart_etag(part_etags: list[str]) -> str | None:
    """The ETag S3 gives an object completed from parts with these ETags (the MD5 of their
    binary MD5s, then ``-<part count>``), unquoted; None where a part's ETag is not an MD5
    (some encryption modes), so the object's cannot be known."""
    digests = []
    for tag in part_etags:
        text = tag.strip('"')
        if len(text) != 32:
            return None
        try:
            digests.append(bytes.fromhex(text))
        except ValueError:
            return None
    return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(part_etags)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


_buckets: dict[tuple[str, Endpoint], Bucket] = {}
_buckets_lock = threading.Lock()

#: Connections a bucket's client keeps (the most any ``s3_concurrency`` can use).
_CONNECTIONS = 256


def bucket_for(url: ObjectURL) -> Bucket:
    """The client of ``url``'s bucket at the endpoint the environment names now (one per bucket
    and endpoint, made on first use)."""
    endpoint = endpoint_now()
    key = (url.bucket, endpoint)
    with _buckets_lock:
        found = _buckets.get(key)
        if found is None:
            found = _buckets[key] = Bucket(url.bucket, endpoint, _CONNECTIONS)
        return found


def forget_clients() -> None:
    """Drop the clients made so far: the next request makes new ones with the credentials the
    chain finds then (after a change of ``AWS_*`` variables or profiles)."""
    with _buckets_lock:
        _buckets.clear()
