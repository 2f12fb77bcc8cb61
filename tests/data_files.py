"""Files of known random bytes for the read tests."""

from __future__ import annotations

import numpy as np


def random_file(tmp_path_factory, name: str, size: int, seed: int) -> tuple[str, bytes]:
    """A new file of ``size`` random bytes (the same bytes for the same seed): (path, bytes)."""
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path_factory.mktemp(name) / "data.bin"
    path.write_bytes(data)
    return str(path), data
