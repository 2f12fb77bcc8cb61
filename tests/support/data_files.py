"""Files of known random bytes for the read tests."""

from __future__ import annotations

import numpy as np


def random_file(tmp_path_factory, name: str, size: int, seed: int) -> tuple[str, bytes]:
    """A new file of ``size`` random bytes (the same bytes for the same seed): (path, bytes)."""
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path_factory.mktemp(name) / "data.bin"
    path.write_bytes(data)
    return str(path), data


def random_files(directory, sizes, seed: int = 0, prefix: str = "f") -> list[tuple[str, bytes]]:
    """One new file of random bytes for each of ``sizes`` in ``directory``: (path, bytes) each."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(sizes):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        path = directory / f"{prefix}{i:04d}.bin"
        path.write_bytes(data)
        out.append((str(path), data))
    return out
