"""Writes never leave a half-written destination; I/O errors surface as errors."""

from __future__ import annotations

import errno
import os
import subprocess

import numpy as np
import pytest

import gdskit
from gdskit import errors
from gdskit.engine.backends import base
from device_nodes import private_device


def _leftovers(directory) -> list[str]:
    return [n for n in os.listdir(directory) if ".gdskit-" in n]


def test_atomic_write_publishes_on_close(tmp_path):
    target = tmp_path / "model.bin"
    target.write_bytes(b"old contents")
    data = os.urandom(3 * 2**20 + 17)
    with gdskit.open(str(target), "w", atomic=True) as f:
        f.write(data)
        assert target.read_bytes() == b"old contents", "target must not change before close"
    assert target.read_bytes() == data
    assert _leftovers(tmp_path) == []


def test_atomic_write_exception_leaves_target(tmp_path):
    target = tmp_path / "model.bin"
    target.write_bytes(b"old contents")
    with pytest.raises(RuntimeError):
        with gdskit.open(str(target), "w", atomic=True) as f:
            f.write(os.urandom(100_000))
            raise RuntimeError("interrupted")
    assert target.read_bytes() == b"old contents"
    assert _leftovers(tmp_path) == []


def test_atomic_abort(tmp_path):
    target = tmp_path / "new.bin"
    f = gdskit.open(str(target), "w", atomic=True)
    f.write(b"partial")
    f.abort()
    assert not target.exists()
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("code, cls", [(errno.ENOSPC, errors.NoSpaceError), (errno.EIO, errors.GdskitIOError)])
def test_injected_write_fault_keeps_target(tmp_path, monkeypatch, code, cls):
    target = tmp_path / "ckpt.bin"
    target.write_bytes(b"previous checkpoint")
    calls = {"n": 0}
    real = os.pwrite

    def failing(fd, data, offset):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(code, os.strerror(code))
        return real(fd, data, offset)

    monkeypatch.setattr(base.os, "pwrite", failing)
    with gdskit.settings.set(chunk_size="64KiB", threads=2, odirect="never"):
        with pytest.raises(cls) as ei:
            with gdskit.open(str(target), "w", atomic=True) as f:
                f.write(np.zeros(1 << 20, np.uint8))
    assert ei.value.errno == code
    assert target.read_bytes() == b"previous checkpoint"
    assert _leftovers(tmp_path) == []


def test_short_write_of_zero_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(base.os, "pwrite", lambda fd, data, off: 0)
    with gdskit.settings.set(odirect="never"), gdskit.open(str(tmp_path / "z.bin"), "w") as f:
        with pytest.raises(errors.GdskitIOError):
            f.write(b"abc")


def test_injected_read_fault(tmp_path, monkeypatch):
    p = tmp_path / "r.bin"
    p.write_bytes(os.urandom(1 << 20))

    def failing(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(base.os, "preadv", failing)
    with gdskit.settings.set(odirect="never"), gdskit.open(str(p)) as f:
        with pytest.raises(errors.GdskitIOError) as ei:
            f.read(bytearray(1 << 20))
    assert ei.value.errno == errno.EIO
    assert gdskit.resources().lanes_busy == 0


def _small_tmpfs(path) -> bool:
    if os.geteuid() != 0:
        return False
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def test_real_enospc_on_a_full_filesystem(tmp_path):
    mnt = tmp_path / "small"
    if not _small_tmpfs(mnt):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount permission)")
    try:
        target = mnt / "out.bin"
        target.write_bytes(b"keep me")
        with pytest.raises(errors.NoSpaceError):
            with gdskit.open(str(target), "w", atomic=True) as f:
                f.write(np.ones(4 << 20, np.uint8))
        assert target.read_bytes() == b"keep me"
        assert _leftovers(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_atomic_temp_of_a_live_writer_survives_a_sweep(tmp_path):
    # Another writer to the same destination (gdskit.torch.save, or a second atomic File)
    # sweeps away stale temporaries: the temp of a File still being written is not one.
    from gdskit.durable import remove_stale_temps

    target = tmp_path / "out.bin"
    data = np.arange(1 << 16, dtype=np.uint8)
    with gdskit.open(target, "w", atomic=True) as f:
        f.write(data)
        assert remove_stale_temps(tmp_path, "out.bin") == []
        f.write(data, file_offset=data.nbytes)
    assert target.read_bytes() == data.tobytes() * 2
    assert _leftovers(tmp_path) == []


def test_next_atomic_open_removes_what_a_killed_writer_left(tmp_path):
    import sys
    import textwrap

    target = tmp_path / "out.bin"
    code = textwrap.dedent(f"""
        import os, sys, numpy as np, gdskit
        f = gdskit.open({str(target)!r}, "w", atomic=True)
        f.write(np.ones(1 << 20, dtype=np.uint8))
        print("written", flush=True)
        sys.stdin.read()
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "written"
        assert len(_leftovers(tmp_path)) == 1
        live = gdskit.open(target, "w", atomic=True)  # the child still holds its temp: it stays
        live.abort()
        assert len(_leftovers(tmp_path)) == 1
    finally:
        child.kill()
        child.wait()
    with gdskit.open(target, "w", atomic=True) as f:
        f.write(np.zeros(16, dtype=np.uint8))
    assert target.read_bytes() == bytes(16)
    assert _leftovers(tmp_path) == []


def test_write_whole_leaves_the_old_file_on_any_error_and_no_temporary(tmp_path):
    from gdskit.durable import write_whole

    out = tmp_path / "report.json"
    out.write_text("old")

    def half(tmp):
        with open(tmp, "w") as fh:
            fh.write('{"half": ')
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_whole(out, half)
    assert out.read_text() == "old" and os.listdir(tmp_path) == ["report.json"]

    def whole(tmp):
        with open(tmp, "w") as fh:
            fh.write("new")

    write_whole(out, whole)
    assert out.read_text() == "new" and os.listdir(tmp_path) == ["report.json"]


def test_write_whole_writes_into_a_device_and_through_a_link_never_replacing_them(tmp_path):
    """A name that is a character device (``/dev/null``, ``/dev/stdout`` on a terminal) is written
    into, not replaced by a file; a symbolic link keeps pointing where it did, and what it points
    to is replaced whole."""
    import stat

    from gdskit.durable import write_whole

    def fill(text):
        def write(tmp):
            with open(tmp, "w") as fh:
                fh.write(text)
        return write

    null = private_device(tmp_path / "null", 1, 3)  # never a system device: a failure would replace it
    to_device = tmp_path / "sink"
    to_device.symlink_to(null)
    write_whole(to_device, fill("report"))
    write_whole(null, fill("report"))
    assert to_device.is_symlink() and os.readlink(to_device) == str(null)
    assert stat.S_ISCHR(os.stat(null).st_mode)
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_whole(link, fill("new"))
    assert link.is_symlink() and real.read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["link.json", "null", "real.json", "sink"]


def test_an_output_that_is_a_fifo_or_a_block_device_is_refused(tmp_path):
    from gdskit.durable import check_output_file
    from gdskit.errors import InvalidArgumentError

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    targets = [fifo]
    import stat

    block = next((e.path for e in os.scandir("/dev") if stat.S_ISBLK(e.stat(follow_symlinks=False).st_mode)), None)
    if block is not None:
        (tmp_path / "disk").symlink_to(block)
        targets.append(tmp_path / "disk")
    for target in targets:
        with pytest.raises(InvalidArgumentError, match="--out"):
            check_output_file(str(target), "--out")
    assert check_output_file("/dev/null", "--out") == "/dev/null"


def test_atomic_saves_follow_links_and_never_replace_a_device(tmp_path):
    """gdskit.open(..., atomic=True), and the checkpoint savers over it, replace a file whole: a
    symbolic link keeps pointing where it did, and a device is refused, not replaced by a file."""
    import stat

    from gdskit.errors import NotAFileError

    real = tmp_path / "ckpt.bin"
    real.write_bytes(b"old")
    link = tmp_path / "latest.bin"
    link.symlink_to(real)
    with gdskit.open(str(link), "w", atomic=True) as f:
        f.write(bytearray(b"new"), 3, 0)
    assert link.is_symlink() and real.read_bytes() == b"new"
    null = private_device(tmp_path / "null", 1, 3)  # a node of the test's own, never /dev/null
    with pytest.raises(NotAFileError):
        gdskit.open(str(null), "w", atomic=True)
    torch = pytest.importorskip("torch")
    import gdskit.safetensors as gst
    import gdskit.torch as gt

    with pytest.raises(NotAFileError):
        gst.save_file({"a": torch.zeros(2)}, null)
    with pytest.raises(NotAFileError):
        gt.save({"a": torch.zeros(2)}, null)
    assert stat.S_ISCHR(os.stat(null).st_mode)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.bin", "latest.bin", "null"]
