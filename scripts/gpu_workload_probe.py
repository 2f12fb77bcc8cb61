"""A small GPU workload for `gdskit run` on a GPU machine: one file written and read back
through the cuFile path and through the bounce path, bytes checked."""

import os
import sys

import numpy as np

import gdskit
from gdskit.engine import cuda

path = sys.argv[1] if len(sys.argv) > 1 else "gdskit-run-probe.bin"
size = 64 << 20
data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
try:
    with open(path, "wb") as fh:
        fh.write(data.tobytes())
    for mode in ("cufile", "bounce"):
        buf = cuda.DeviceArray(size)
        with gdskit.settings.set(mode=mode), gdskit.open(path) as f:
            assert f.read(buf) == size
        assert np.array_equal(buf.to_numpy(), data), mode
        buf.free()
finally:
    os.unlink(path)
print(gdskit.stats().summary(), file=sys.stderr)
