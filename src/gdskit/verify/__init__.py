"""Verified loading: BLAKE3 digests of checkpoints and datasets, the manifest that records them,
and the comparison that refuses bytes that differ (docs/verify.md).

This package stands beside the engine: it imports only the ground floor, and the engine may use
it (``File.read(..., verify=...)``). Hashing where the bytes landed (a GPU kernel for device
memory) is the engine's: ``gdskit.engine.digest_buffers``.
"""

from __future__ import annotations

from gdskit.verify.check import check_sha256, check_tensors, mismatch, sha256_of_file
from gdskit.verify.digest import (ALGORITHM, DEFAULT_CHUNK_BYTES, DIGEST_BYTES, blake3_hex, chunk_ranges, hasher,
                                  tagged)
from gdskit.verify.expect import (HEADER_KEY, OFF, Expectation, VerifyKind, VerifyMode, find_expectation,
                                  header_digests, relative_name, verify_mode)
from gdskit.verify.manifest import (DIRECTORY_MANIFEST, MANIFEST_SUFFIX, FileDigests, Manifest, ManifestError,
                                    TensorDigest, manifest_path_for, parse_manifest, read_manifest, write_manifest)

__all__ = ["ALGORITHM", "DEFAULT_CHUNK_BYTES", "DIGEST_BYTES", "DIRECTORY_MANIFEST", "HEADER_KEY", "MANIFEST_SUFFIX",
           "OFF", "Expectation", "FileDigests", "Manifest", "ManifestError", "TensorDigest", "VerifyKind", "VerifyMode",
           "blake3_hex", "check_sha256", "check_tensors", "chunk_ranges", "find_expectation", "hasher", "header_digests",
           "manifest_path_for", "mismatch", "parse_manifest", "read_manifest", "relative_name", "sha256_of_file", "tagged",
           "verify_mode", "write_manifest"]
