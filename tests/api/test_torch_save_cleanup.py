"""What gdskit.torch.save leaves behind when it fails or is killed: nothing, once the next save has run.

- An error (ENOSPC above all) closes and removes the temporary file at once: the space is
  free while the exception is still being handled, and no descriptor of it stays open.
- A writer holds a lock on its temporary; a save removes the temporaries of its destination
  whose lock it can take (writers killed with SIGKILL), never a live writer's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import gdskit.torch as gt  # noqa: E402
from gdskit import durable  # noqa: E402
from gdskit.errors import GdskitIOError, NoSpaceError  # noqa: E402
from repo_paths import child_pythonpath  # noqa: E402

pytestmark = pytest.mark.torch

HERE = Path(__file__).resolve().parent


def open_paths_under(directory: Path) -> list[str]:
    """What this process's descriptors point to below ``directory`` (deleted files included)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory) + "/"):
            out.append(target)
    return out


def free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bfree * st.f_frsize


def temps_in(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if durable.is_temp_name(n))


# -- errors ----------------------------------------------------------------------------

@pytest.fixture
def small_tmpfs(tmp_path):
    """A tmpfs of its own with 256 KiB left free (needs root and the right to mount; skipped
    otherwise). The directory the test writes in is ``data`` inside it."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        (mnt / "filler").write_bytes(bytes(free_bytes(mnt) - (256 << 10)))
        (mnt / "data").mkdir()
        yield mnt / "data"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def many_small() -> dict:
    return {f"layer.{i}.a_rather_long_parameter_name": torch.ones(1) for i in range(6000)}  # a 400 KB pickle


@pytest.mark.parametrize("digests", [False, True])
@pytest.mark.parametrize("what", ["storage bytes", "archive"])
def test_no_space_frees_the_space_at_once(small_tmpfs, what, digests) -> None:
    """Full while the engine writes a storage's bytes, or while torch.save writes the archive;
    with ``digests=True``, no manifest is written either."""
    obj = {"big": torch.ones(1 << 17)} if what == "storage bytes" else many_small()
    before = free_bytes(small_tmpfs)
    try:
        gt.save(obj, small_tmpfs / "ckpt.pt", digests=digests)
    except NoSpaceError as exc:
        kept = exc  # the exception, its traceback and every frame of the save are still alive
        assert isinstance(kept, OSError)
        assert free_bytes(small_tmpfs) == before
        assert open_paths_under(small_tmpfs) == []
        assert os.listdir(small_tmpfs) == []
    else:
        pytest.fail("the save fitted in 256 KiB")


def test_file_size_limit_error_leaves_nothing(tmp_path) -> None:
    """The same without a tmpfs: a process whose file size limit (RLIMIT_FSIZE) stops the write."""
    script = textwrap.dedent(f"""
        import json, os, resource, signal, sys
        sys.path.insert(0, {str(HERE)!r})
        import torch
        import gdskit.torch as gt
        from gdskit.errors import GdskitIOError
        from test_torch_save_cleanup import open_paths_under
        from pathlib import Path
        d = Path({str(tmp_path)!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        report = {{}}
        try:
            gt.save({{"big": torch.ones(1 << 20)}}, d / "ckpt.pt")
        except GdskitIOError as exc:
            report = {{"error": type(exc).__name__, "errno": exc.errno, "open": open_paths_under(d),
                      "left": sorted(os.listdir(d))}}
        print(json.dumps(report))
    """)
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report.get("errno") == 27, report  # EFBIG
    assert report["open"] == [] and report["left"] == []


def test_failed_save_keeps_no_descriptor(tmp_path, monkeypatch) -> None:
    """Any failure, not only ENOSPC: the archive torch opened for the offsets is closed too."""
    import gdskit.engine.file

    def failing_pwrite(self, *a, **kw):
        raise GdskitIOError(5, "injected failure")

    monkeypatch.setattr(gdskit.engine.file.File, "pwrite", failing_pwrite)
    try:
        gt.save({"a": torch.randn(100)}, tmp_path / "x.pt")
    except GdskitIOError as exc:
        kept = exc
        assert open_paths_under(tmp_path) == [] and os.listdir(tmp_path) == []
        del kept
    else:
        pytest.fail("the write did not fail")


# -- leftovers of killed writers ------------------------------------------------------------

_WRITER = textwrap.dedent("""
    import collections, os, signal, sys, torch
    import gdskit.torch as gt
    path, when = sys.argv[1], sys.argv[2]

    class Blocks:
        def __reduce__(self):  # torch.save is half-way through the archive
            print("writing", flush=True)
            sys.stdin.readline()  # the test kills this process, or lets it go on
            return (collections.OrderedDict, ())

    def progress(done, total):  # the first storage is written, 63 are still to come
        os.kill(os.getpid(), signal.SIGKILL)

    if when == "archive":
        gt.save({"big": torch.full((1 << 20,), 2.0), "blocks": Blocks()}, path)
    else:
        gt.save({f"t{i}": torch.full((1 << 18,), float(i)) for i in range(64)}, path, progress=progress)
    print("saved", flush=True)
""")


def start_writer(path: Path, when: str) -> subprocess.Popen:
    """A process saving to ``path``: with ``when="archive"`` it stops, mid-save, until told to go
    on (a line on stdin); with ``"storages"`` it kills itself with SIGKILL once the first storage's
    bytes are written."""
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), when], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    if when == "archive":
        line = proc.stdout.readline()
        if line.strip() != "writing":
            proc.kill()
            proc.wait()
            pytest.fail(f"the writer did not start: {line!r}")
    return proc


@pytest.mark.parametrize("when", ["archive", "storages"])
def test_next_save_removes_what_a_killed_save_left(tmp_path, when) -> None:
    dest = tmp_path / "ckpt.pt"
    gt.save({"old": torch.zeros(3)}, dest)
    writer = start_writer(dest, when)
    if when == "archive":
        writer.send_signal(signal.SIGKILL)
    assert writer.wait(timeout=300) == -signal.SIGKILL
    left = temps_in(tmp_path)
    assert len(left) == 1 and left[0].startswith(".ckpt.pt.")
    assert set(torch.load(dest)) == {"old"}  # the destination was never touched
    gt.save({"new": torch.ones(3)}, dest)
    assert temps_in(tmp_path) == []
    assert torch.equal(torch.load(dest)["new"], torch.ones(3))


def test_live_writers_temp_is_left_alone(tmp_path) -> None:
    dest = tmp_path / "ckpt.pt"
    writer = start_writer(dest, "archive")
    try:
        theirs = temps_in(tmp_path)
        gt.save({"mine": torch.ones(2)}, dest)  # meanwhile, another save of the same file
        assert temps_in(tmp_path) == theirs
        writer.stdin.write("go on\n")
        writer.stdin.flush()
        assert writer.stdout.readline().strip() == "saved"  # its temporary was there to rename
        assert writer.wait() == 0
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert temps_in(tmp_path) == []
    assert torch.equal(torch.load(dest)["big"], torch.full((1 << 20,), 2.0))


# -- the helpers themselves -------------------------------------------------------------------

def test_temps_belong_to_one_destination() -> None:
    token = uuid.uuid4().hex[:12]
    assert durable.is_temp_of(durable.temp_name("a.pt", token), "a.pt")
    assert not durable.is_temp_of(durable.temp_name("a.pt", token), "a")     # ".a.pt.<hex>" is a.pt's
    assert not durable.is_temp_of(durable.temp_name("a.pt", token), "b.pt")
    assert not durable.is_temp_of(".a.pt.not-hex.gdskit-tmp", "a.pt")
    assert not durable.is_temp_of("a.pt", "a.pt")


def test_sweep_takes_only_what_no_one_holds(tmp_path) -> None:
    live = durable.create_locked_temp(tmp_path, "x.pt")
    (tmp_path / durable.temp_name("other.pt")).write_bytes(b"another destination's")
    (tmp_path / durable.temp_name("x.pt")).mkdir()  # not a regular file
    os.symlink(tmp_path / "elsewhere", tmp_path / durable.temp_name("x.pt"))
    stale = tmp_path / durable.temp_name("x.pt")
    stale.write_bytes(b"left by a writer that died")
    try:
        assert durable.remove_stale_temps(tmp_path, "x.pt") == [str(stale)]
        assert os.path.exists(live.path)  # locked by an open file of this very process
    finally:
        live.close()
    assert durable.remove_stale_temps(tmp_path, "x.pt") == [live.path]
    assert len(temps_in(tmp_path)) == 3  # the other destination's, the directory, the link


def test_owned_temp_discard_releases_everything(tmp_path) -> None:
    t = durable.create_locked_temp(tmp_path, "y.pt")
    os.write(t.fd, b"partial")
    t.discard()
    assert os.listdir(tmp_path) == [] and open_paths_under(tmp_path) == []
    t.discard()  # twice is harmless
