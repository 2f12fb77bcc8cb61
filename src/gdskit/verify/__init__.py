"""Verified loading: BLAKE3 digests of checkpoints and datasets, the manifest that records them,
and the comparison that refuses bytes that differ (docs/verify.md).

This package stands beside the engine: it imports only the ground floor, and the engine may use
it (``File.read(..., verify=...)``). Hashing where the bytes landed (a GPU kernel for device
memory) is the engine's: ``gdskit.engine.digest_buffers``.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from gdskit.verify.digest import (ALGORITHM, DEFAULT_CHUNK_BYTES, DIGEST_BYTES, SPREAD_BYTES, blake3_hex, chunk_ranges,
                                  hasher, tagged)
from gdskit.verify.mode import HEADER_KEY, OFF, VerifyKind, VerifyMode, verify_mode

if TYPE_CHECKING:
    from gdskit.verify.check import check_sha256, check_tensors, mismatch, sha256_of_file
    from gdskit.verify.expect import Expectation, find_expectation, header_digests, relative_name
    from gdskit.verify.manifest import (DIRECTORY_MANIFEST, MANIFEST_SUFFIX, FileDigests, Manifest, ManifestError,
                                        TensorDigest, manifest_path_for, parse_manifest, read_manifest,
                                        write_manifest)

# Every loader reads ``verify=`` at import (the mode); the manifests, the lookup of what a file
# is checked against and the checks load with their first use, by a load that verifies.
_LAZY = {**dict.fromkeys(("check_sha256", "check_tensors", "mismatch", "sha256_of_file"), "check"),
         **dict.fromkeys(("Expectation", "find_expectation", "header_digests", "relative_name"), "expect"),
         **dict.fromkeys(("DIRECTORY_MANIFEST", "MANIFEST_SUFFIX", "FileDigests", "Manifest", "ManifestError",
                          "TensorDigest", "manifest_path_for", "parse_manifest", "read_manifest", "write_manifest"),
                         "manifest")}

__all__ = ["ALGORITHM", "DEFAULT_CHUNK_BYTES", "DIGEST_BYTES", "DIRECTORY_MANIFEST", "HEADER_KEY", "MANIFEST_SUFFIX",
           "OFF", "SPREAD_BYTES", "Expectation", "FileDigests", "Manifest", "ManifestError", "TensorDigest",
           "VerifyKind", "VerifyMode", "blake3_hex", "check_sha256", "check_tensors", "chunk_ranges",
           "find_expectation", "hasher", "header_digests", "manifest_path_for", "mismatch", "parse_manifest",
           "read_manifest", "relative_name", "sha256_of_file", "tagged", "verify_mode", "write_manifest"]


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where == "check":
        from gdskit.verify import check as module  # noqa: PLC0415 - import time
    elif where == "expect":
        from gdskit.verify import expect as module  # noqa: PLC0415 - import time
    elif where == "manifest":
        from gdskit.verify import manifest as module  # noqa: PLC0415 - import time
    else:
        raise AttributeError(f"module 'gdskit.verify' has no attribute {name!r}")
    value = getattr(module, name)
    setattr(sys.modules[__name__], name, value)  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
