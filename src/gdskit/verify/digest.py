"""BLAKE3 on the CPU: the reference every digest gdskit records or checks is compared with.

BLAKE3 is a tree hash (1 KiB chunks, parent nodes over pairs, a left-balanced tree), so one
input spreads over many threads here and over many GPU threads in the engine's kernel
(``gdskit.engine.gpu_hash``), and both give the digest ``b3sum`` prints.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gdskit.errors import MissingDependencyError

#: The digest algorithm gdskit records, and the prefix of a digest's text (``"blake3:<hex>"``).
ALGORITHM = "blake3"
#: Bytes of a BLAKE3 digest.
DIGEST_BYTES = 32
#: A raw file's bytes are also digested per piece of this many bytes (the manifest records the
#: size it used), so that a ranged read can be checked against the pieces it covers.
DEFAULT_CHUNK_BYTES = 64 << 20
#: Below this, one input is hashed by one thread: spreading it costs more than it saves.
SPREAD_BYTES = 1 << 20


def _blake3() -> Any:
    try:
        import blake3  # noqa: PLC0415 - import time
    except ImportError:
        raise MissingDependencyError("digests need the blake3 package: pip install blake3") from None
    return blake3


def blake3_hex(data: Any) -> str:
    """The BLAKE3 digest (hex) of ``data``, any object exposing a contiguous buffer."""
    b3 = _blake3()
    view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data
    threads = b3.blake3.AUTO if len(view) >= SPREAD_BYTES else 1
    return b3.blake3(view, max_threads=threads).hexdigest()


def hasher(spread: bool = False) -> Any:
    """A running BLAKE3 digest (``update(data)``, ``hexdigest()``) of the ``blake3`` package;
    ``spread``: large updates are hashed across threads."""
    b3 = _blake3()
    return b3.blake3(max_threads=b3.blake3.AUTO) if spread else b3.blake3()


def chunk_ranges(size: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """The ``(start, end)`` file offsets of the pieces a file of ``size`` bytes is digested in."""
    for start in range(0, size, chunk_bytes):
        yield start, min(start + chunk_bytes, size)


def tagged(hex_digest: str, algorithm: str = ALGORITHM) -> str:
    """A digest as errors and ``gdskit digest`` show it: ``"blake3:<hex>"``."""
    return f"{algorithm}:{hex_digest}"
