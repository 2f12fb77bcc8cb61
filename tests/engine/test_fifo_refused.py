"""A FIFO where a file is expected is refused at once, never waited on.

Opening a FIFO for reading blocks until some process opens it for writing, so a dataset or
checkpoint directory that others can write could hang a job by swapping a listed file for a
FIFO between the listing and the read. Every place gdskit opens a file opens it without
blocking and refuses what is not a file (``NotAFileError``, an ``OSError``). Each case runs
in a fresh interpreter under a time limit: a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from repo_paths import SRC as SRC_PATH

SRC = str(SRC_PATH)

CASES = {
    "gdskit.open": "import gdskit\ngdskit.open(FIFO)",
    "gdskit.open for writing": "import gdskit\ngdskit.open(FIFO, 'w')",
    "gdskit.open, a reader waiting": textwrap.dedent("""\
        import gdskit, os, threading
        threading.Thread(target=lambda: os.open(FIFO, os.O_RDONLY), daemon=True).start()
        import time; time.sleep(0.2)
        gdskit.open(FIFO, 'r+')"""),
    "many-file job": textwrap.dedent("""\
        import gdskit.engine.many_files as mf
        mf.read_files([mf.FileReads(FIFO, [(bytearray(16), 16, 0)])])"""),
    "npy header": "from gdskit.formats import npy_format\nnpy_format.read_header(FIFO)",
    "dataset's readability check": textwrap.dedent("""\
        from gdskit.data.datasets import _check_readable
        from gdskit.data.sources import Source
        _check_readable([Source(FIFO, FIFO, 0)])"""),
    "safetensors header": "from gdskit.formats import safetensors_format as sf\nsf.read_header_file(FIFO)",
    "safetensors shard index": textwrap.dedent("""\
        from gdskit.formats import safetensors_format as sf
        sf.resolve_checkpoint(FIFO)"""),
    "DCP metadata": textwrap.dedent("""\
        import os, gdskit.dcp
        gdskit.dcp.StorageReader(os.path.dirname(FIFO)).read_metadata()"""),
}
#: The FIFO's name, where a case needs one.
NAMES = {"safetensors shard index": "model.safetensors.index.json", "DCP metadata": ".metadata"}

PROLOGUE = textwrap.dedent("""\
    import sys
    sys.path.insert(0, {src!r})
    FIFO = {fifo!r}
    try:
    {body}
    except BaseException as exc:
        from gdskit.errors import NotAFileError
        print(type(exc).__name__, isinstance(exc, NotAFileError), isinstance(exc, OSError), exc)
    else:
        print("no error")
    """)


@pytest.mark.parametrize("case", list(CASES))
def test_a_fifo_is_refused_without_waiting(tmp_path, case):
    fifo = str(tmp_path / NAMES.get(case, "data.npy"))
    os.mkfifo(fifo)
    code = PROLOGUE.format(src=SRC, fifo=fifo, body=textwrap.indent(CASES[case], "    "))
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: still waiting on the FIFO after 20 s")
    assert out.returncode == 0, out.stderr
    name, is_ours, is_os, *message = out.stdout.split()
    assert (name, is_ours, is_os) == ("NotAFileError", "True", "True"), out.stdout
    assert fifo in " ".join(message) and "FIFO" in " ".join(message)


def test_the_torch_loader_refuses_a_fifo(tmp_path):
    pytest.importorskip("torch")
    fifo = str(tmp_path / "model.pt")
    os.mkfifo(fifo)
    code = PROLOGUE.format(src=SRC, fifo=fifo, body="    import gdskit.torch\n    gdskit.torch.load(FIFO)")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("gdskit.torch.load: still waiting on the FIFO after 20 s")
    assert out.stdout.split()[:3] == ["NotAFileError", "True", "True"], out.stdout + out.stderr


def test_a_fifo_as_the_profile_store_is_a_config_error(tmp_path):
    store = tmp_path / "gdskit" / "profiles.json"
    store.parent.mkdir()
    os.mkfifo(store)
    code = textwrap.dedent(f"""\
        import os, sys
        sys.path.insert(0, {SRC!r})
        os.environ["XDG_CONFIG_HOME"] = {str(tmp_path)!r}
        from gdskit.engine import profiles
        from gdskit.errors import ConfigError
        try:
            profiles.load()
        except ConfigError as exc:
            print("ConfigError", exc)
        """)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("the profile store: still waiting on the FIFO after 20 s")
    assert out.stdout.startswith("ConfigError") and "FIFO" in out.stdout, out.stdout + out.stderr


def test_the_system_probe_reads_a_fifo_as_absent(tmp_path):
    """``gdskit check`` and ``gdskit accept`` read paths from the environment too
    (``CUFILE_ENV_PATH_JSON``): a FIFO there reads as no file, at once."""
    fifo = str(tmp_path / "cufile.json")
    os.mkfifo(fifo)
    code = textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {SRC!r})
        from gdskit.machine.root import SystemRoot
        root = SystemRoot()
        print(root.read_text({fifo!r}), root.read_bytes({fifo!r}), list(root.iter_lines({fifo!r})))
        """)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("the system probe: still waiting on the FIFO after 20 s")
    assert out.stdout.split() == ["None", "None", "[]"], out.stdout + out.stderr


def test_block_and_character_devices_still_open():
    import gdskit

    with gdskit.open("/dev/zero") as f:  # positional reads work on it: not refused
        buf = bytearray(8)
        assert f.read(buf, 8, 0) == 8 and bytes(buf) == bytes(8)


@pytest.mark.parametrize("flags", [os.O_RDONLY, os.O_RDWR, os.O_WRONLY | os.O_APPEND])
def test_a_file_is_left_blocking_with_its_own_flags(tmp_path, flags):
    """O_NONBLOCK is only for the open: io_uring hands EAGAIN back for a non-blocking file."""
    import fcntl

    from gdskit.durable import open_file_fd

    path = tmp_path / "f.bin"
    path.write_bytes(b"abc")
    fd, st = open_file_fd(str(path), flags)
    try:
        got = fcntl.fcntl(fd, fcntl.F_GETFL)
        assert not got & os.O_NONBLOCK and got & os.O_ACCMODE == flags & os.O_ACCMODE
        assert bool(got & os.O_APPEND) == bool(flags & os.O_APPEND) and st.st_size == 3
    finally:
        os.close(fd)
