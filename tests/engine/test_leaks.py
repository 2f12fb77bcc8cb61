"""No leaked file descriptors or busy lanes, on success and on error."""

from __future__ import annotations

import os

import numpy as np
import pytest

import gdskit
from gdskit import errors
from leak_helpers import fd_count




def test_no_fd_leak_on_success_and_error(tmp_path):
    p = tmp_path / "d.bin"
    p.write_bytes(os.urandom(2 << 20))
    buf = np.empty(2 << 20, np.uint8)
    with gdskit.open(str(p)) as f:  # warm up the worker threads and lanes
        f.read(buf)
    before = fd_count()
    for policy in ("auto", "always", "never"):
        with gdskit.settings.set(odirect=policy):
            for _ in range(20):
                with gdskit.open(str(p)) as f:
                    f.read(buf)
                    f.pread(buf, 4096, 12345).result()
                with pytest.raises(errors.BufferTooSmallError):
                    with gdskit.open(str(p)) as f:
                        f.read(buf, size=len(buf) + 1)
                with pytest.raises(errors.GdskitFileNotFoundError):
                    gdskit.open(str(tmp_path / "missing"))
                with pytest.raises(RuntimeError):
                    with gdskit.open(str(tmp_path / "a.bin"), "w", atomic=True) as f:
                        f.write(buf)
                        raise RuntimeError
    assert fd_count() == before
    assert gdskit.resources().lanes_busy == 0


def test_unclosed_file_is_closed_by_gc(tmp_path):
    p = tmp_path / "g.bin"
    p.write_bytes(b"x" * 100)
    before = fd_count()
    f = gdskit.open(str(p))
    f.read(bytearray(100))
    del f
    import gc

    gc.collect()
    assert fd_count() == before


def test_close_waits_for_background_requests(tmp_path):
    p = tmp_path / "bg.bin"
    data = os.urandom(8 << 20)
    p.write_bytes(data)
    bufs = [np.empty(1 << 20, np.uint8) for _ in range(8)]
    f = gdskit.open(str(p))
    futs = [f.pread(b, file_offset=i << 20) for i, b in enumerate(bufs)]
    f.close()
    assert all(fut.done() for fut in futs)
    assert b"".join(b.tobytes() for b in bufs) == data


def test_resources_and_release(tmp_path):
    p = tmp_path / "r.bin"
    p.write_bytes(os.urandom(1 << 20))
    with gdskit.open(str(p)) as f:
        f.read(np.empty(1 << 20, np.uint8))
    usage = gdskit.resources()
    assert usage.lanes_busy == 0 and usage.pinned_bytes <= gdskit.settings.pinned_budget
    gdskit.release_resources()
    assert gdskit.resources().lanes == 0
