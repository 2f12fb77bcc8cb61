"""Object URLs (``s3://bucket/key``): recognised and parsed in one place."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from gdskit.errors import InvalidArgumentError

#: The URL schemes the object source serves.
SCHEMES = ("s3",)

# S3's rule for bucket names (3-63 of lower-case letters, digits, dots and hyphens, starting and
# ending with a letter or digit); S3-compatible stores take the same names.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_KEY_MAX = 1024  # S3's longest key, in UTF-8 bytes


@dataclass(frozen=True)
class ObjectURL:
    """One object (or, with a key ending in ``/`` or empty, a prefix) of a bucket."""

    bucket: str
    key: str
    scheme: str = "s3"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"

    @property
    def is_prefix(self) -> bool:
        return self.key == "" or self.key.endswith("/")

    def child(self, name: str) -> ObjectURL:
        """The object ``name`` under this URL taken as a prefix (``s3://b/dir`` + ``x`` -> ``s3://b/dir/x``)."""
        base = self.key if self.is_prefix else self.key + "/"
        return parse_url(f"{self.scheme}://{self.bucket}/{base}{name}")


def is_object_url(path: Any) -> bool:
    """Whether ``path`` names an object in a store (``s3://...``) rather than a local file."""
    if isinstance(path, ObjectURL):
        return True
    if not isinstance(path, (str, os.PathLike)):
        return False
    text = os.fspath(path)
    return isinstance(text, str) and text.split("://", 1)[0].lower() in SCHEMES and "://" in text


def parse_url(url: str | ObjectURL) -> ObjectURL:
    """``s3://bucket/key`` as an :class:`ObjectURL`; :class:`~gdskit.errors.InvalidArgumentError`
    for anything else (a missing or malformed bucket, a key past S3's 1024 bytes, a NUL)."""
    if isinstance(url, ObjectURL):
        return url
    text = os.fspath(url)
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise InvalidArgumentError(f"not an object URL (s3://bucket/key): {text!r:.200}")
    bucket, _, key = rest.partition("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise InvalidArgumentError(f"not a bucket name: {bucket!r:.100} in {text!r:.200}")
    if "\x00" in key or len(key.encode("utf-8", "surrogatepass")) > _KEY_MAX:
        raise InvalidArgumentError(f"not an object key (NUL, or longer than {_KEY_MAX} bytes): {text!r:.200}")
    return ObjectURL(bucket, key, scheme.lower())
