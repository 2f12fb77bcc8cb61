"""What ``verify=`` asks for, read once: the one part of verified loading that every loader
needs at import (the digests, manifests and checks load when a load verifies)."""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass
from typing import Any

from gdskit.errors import InvalidArgumentError

#: The ``__metadata__`` key of a safetensors header where gdskit records each tensor's BLAKE3 digest
#: (a JSON object, name to hex).
HEADER_KEY = "gdskit.blake3"
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


__all__ = ["HEADER_KEY", "OFF", "VerifyKind", "VerifyMode", "verify_mode"]
