"""Publication and reading across two real processes: figures, file modes, removal at exit,
stale snapshots of dead processes, reused pids, another user's process, forked children."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time

import pytest

import gdskit
from gdskit.errors import (
    FormatError,
    GdskitError,
    GdskitPermissionError,
    NotPublishingError,
    ProcessNotFoundError,
)
from gdskit.telemetry import (
    clean_stale,
    list_snapshots,
    location,
    publish,
    read,
    read_snapshot,
)

# A child that does host-path reads and writes, prints its own ledger, and waits for a line on stdin.
CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import gdskit
    from gdskit.telemetry import publish_now

    path = sys.argv[1]
    buf = np.empty(3 << 20, dtype=np.uint8)
    with gdskit.open(path) as f:
        f.read(buf)
        f.read(buf[:5000], file_offset=4096)
    with gdskit.open(path + ".out", "w") as f:
        f.write(buf[:1 << 20])
    if "--no-flush" not in sys.argv:
        publish_now()
    print(json.dumps(gdskit.stats().to_dict()), flush=True)
    sys.stdin.readline()
""")


@pytest.fixture
def data_file(tmp_path):
    p = tmp_path / "data.bin"
    p.write_bytes(os.urandom(3 << 20))
    return p


def _spawn(tmp_path, data_file, stats_dir, level="1", *extra):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "GDSKIT_STATS": level, "GDSKIT_STATS_DIR": str(stats_dir), "GDSKIT_STATS_INTERVAL": "0.05"}
    proc = subprocess.Popen([sys.executable, str(script), str(data_file), *extra], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    own = json.loads(proc.stdout.readline())
    return proc, own


def _finish(proc):
    proc.stdin.write("\n")
    proc.stdin.close()
    proc.wait(30)
    proc.stdout.close()


def test_another_process_reads_the_figures_the_child_recorded(tmp_path, data_file, stats_dir):
    proc, own = _spawn(tmp_path, data_file, stats_dir)
    try:
        snap = read_snapshot(proc.pid)
        assert snap.pid == proc.pid and snap.level == 1 and snap.session is None
        got = snap.stats
        assert got.total_bytes == own["total_bytes"] == (3 << 20) + 5000 + (1 << 20)
        host = got.paths["host"]
        assert (host.bytes_read, host.bytes_written) == (own["paths"]["host"]["bytes_read"], 1 << 20)
        assert (host.ops_read, host.ops_written) == (own["paths"]["host"]["ops_read"], own["paths"]["host"]["ops_written"])
        assert host.requests == 3 and host.mean_latency_s > 0
        assert set(got.reasons) == set(own["reasons"])
        assert "gpus" not in snap.doc and all("size_hist" not in e for e in snap.doc["ledger"]["entries"])
        assert [s.pid for s in list_snapshots()] == [proc.pid]
    finally:
        _finish(proc)


def test_periodic_publication_without_an_explicit_flush(tmp_path, data_file, stats_dir):
    proc, own = _spawn(tmp_path, data_file, stats_dir, "2", "--no-flush")
    try:
        deadline = time.monotonic() + 20
        while True:  # the publisher thread writes within a tick (GDSKIT_STATS_INTERVAL=0.05)
            snap = read_snapshot(proc.pid)
            if snap.stats.total_bytes == own["total_bytes"] or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert snap.stats.total_bytes == own["total_bytes"]
        hist = {e["op"]: e["size_hist"] for e in snap.doc["ledger"]["entries"]}
        assert hist["write"] == {str(1 << 20): 1}
        assert hist["read"] == {str(1 << 22): 1, str(1 << 13): 1}
    finally:
        _finish(proc)


def test_files_are_private_and_removed_at_exit(tmp_path, data_file, stats_dir):
    proc, _ = _spawn(tmp_path, data_file, stats_dir)
    try:
        file = stats_dir / f"{proc.pid}.json"
        assert stat.S_IMODE(os.stat(stats_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(file).st_mode) == 0o600
        assert os.stat(file).st_uid == os.geteuid()
    finally:
        _finish(proc)
    assert os.listdir(stats_dir) == []
    with pytest.raises(ProcessNotFoundError) as info:
        read_snapshot(proc.pid)
    assert isinstance(info.value, ProcessLookupError) and isinstance(info.value, GdskitError)


def test_not_publishing_says_how_to_turn_it_on(stats_dir):
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    try:
        with pytest.raises(NotPublishingError, match="GDSKIT_STATS=1") as info:
            read_snapshot(proc.pid)
        assert isinstance(info.value, FileNotFoundError)
    finally:
        proc.stdin.close()
        proc.wait()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _fake_snapshot(directory, pid, ticks):
    directory.mkdir(mode=0o700, exist_ok=True)
    doc = {"schema": "gdskit.stats/1", "pid": pid, "start_ticks": ticks, "level": 1, "updated_at": time.time(),
           "ledger": {"entries": [{"path": "host", "reason": "no_gpu", "op": "read", "bytes": 7, "ops": 1,
                                   "busy_s": 0.1, "requests": 1}]}}
    path = directory / f"{pid}.json"
    publish.write_private(str(path), json.dumps(doc).encode())
    return path


def test_stale_snapshot_of_a_dead_process_is_cleaned_up(stats_dir):
    pid = _dead_pid()
    path = _fake_snapshot(stats_dir, pid, 12345)
    tmp = stats_dir / f".{pid}.json.{pid}.tmp"
    tmp.write_text("half")
    run_dir = stats_dir / read.run_dir_name(pid, 1, "abc")
    run_dir.mkdir()
    (run_dir / "1-1.json").write_text("{}")
    live = _fake_snapshot(stats_dir, os.getpid(), location.start_ticks(os.getpid()))
    assert [s.pid for s in list_snapshots()] == [os.getpid()]  # listing cleans first
    assert not path.exists() and not tmp.exists() and not run_dir.exists()
    assert live.exists()
    assert clean_stale(str(stats_dir)) == []


def test_cleanup_leaves_files_that_are_not_gdskit_snapshots(stats_dir):
    # GDSKIT_STATS_DIR may name a directory that holds other things called <number>.json.
    stats_dir.mkdir(parents=True, exist_ok=True)
    other = stats_dir / f"{_dead_pid()}.json"
    other.write_text('{"epoch": 3, "loss": 0.25}')
    assert clean_stale(str(stats_dir)) == []
    assert other.exists()


def test_a_reused_pid_does_not_inherit_the_old_snapshot(stats_dir):
    # A snapshot naming a live pid but another start time: written by an earlier process with that pid.
    sleeper = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    try:
        ticks = location.start_ticks(sleeper.pid)
        path = _fake_snapshot(stats_dir, sleeper.pid, ticks - 1)
        with pytest.raises(NotPublishingError):
            read_snapshot(sleeper.pid)
        assert not path.exists()
        path = _fake_snapshot(stats_dir, sleeper.pid, ticks - 1)
        assert clean_stale(str(stats_dir)) == [str(path)]
        path = _fake_snapshot(stats_dir, sleeper.pid, ticks)  # the right start time: it is this process's
        assert read_snapshot(sleeper.pid).stats.total_bytes == 7
    finally:
        sleeper.stdin.close()
        sleeper.wait()


def test_another_users_process_is_a_permission_error(stats_dir, monkeypatch):
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    try:
        # Seen from user 65534: the process (ours) belongs to someone else.
        monkeypatch.setattr(os, "geteuid", lambda: 65534)
        with pytest.raises(GdskitPermissionError, match="readable only by the user") as info:
            read_snapshot(proc.pid)
        assert isinstance(info.value, PermissionError)
    finally:
        proc.stdin.close()
        proc.wait()


def test_a_snapshot_owned_by_another_user_is_refused_even_for_root(stats_dir):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file away")
    path = _fake_snapshot(stats_dir, os.getpid(), location.start_ticks(os.getpid()))
    os.chown(path, 65534, 65534)
    with pytest.raises(GdskitPermissionError, match="refused"):
        read_snapshot(os.getpid())
    assert list_snapshots() == []


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"), reason="needs root and a system python")
def test_the_file_mode_keeps_other_users_out(tmp_path, data_file):
    # Really as another user: a directory they may enter, our 0600 snapshot inside it.
    base = tmp_path / "open"
    base.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(base, 0o755)
    proc, _ = _spawn(tmp_path, data_file, base)
    try:
        file = base / f"{proc.pid}.json"
        probe = subprocess.run(["/usr/bin/python3", "-c", f"open({str(file)!r}).read()"], user=65534, group=65534,
                               capture_output=True, text=True, cwd="/", check=False)
        assert probe.returncode != 0 and "PermissionError" in probe.stderr
    finally:
        _finish(proc)


def test_a_named_directory_others_can_write_into_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    monkeypatch.setenv("GDSKIT_STATS_DIR", str(d))
    with pytest.raises(GdskitPermissionError):
        publish.publication_dir()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o777  # never taken over
    os.chmod(d, 0o755)  # readable by others but not writable: accepted, mode left alone
    assert publish.publication_dir().path == str(d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o755


def test_malformed_snapshots_are_format_errors(stats_dir):
    stats_dir.mkdir(mode=0o700)
    path = stats_dir / f"{os.getpid()}.json"
    publish.write_private(str(path), b"{not json")
    with pytest.raises(FormatError):
        read_snapshot(os.getpid())
    publish.write_private(str(path), json.dumps({"schema": "gdskit.stats/2", "pid": 1, "level": 1, "ledger": {}}).encode())
    with pytest.raises(FormatError, match="schema"):
        read_snapshot(os.getpid())


def test_in_process_switch_on_and_off(stats_dir, tmp_path):
    """settings.set(stats_level=...) starts publication; back to 0 withdraws the snapshot."""
    def gone(file):
        deadline = time.monotonic() + 20
        while file.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return not file.exists()

    file = stats_dir / f"{os.getpid()}.json"
    with gdskit.settings.set(stats_interval=0.05):
        with gdskit.settings.set(stats_level=1):
            assert file.exists()
            assert read_snapshot(os.getpid()).pid == os.getpid()
            with gdskit.settings.set(stats_level=0):
                assert gone(file)
            assert file.exists()  # switched back on as the inner `with` ends
        assert gone(file)


FORKER = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import gdskit
    from gdskit.telemetry import publish_now, read_snapshot

    buf = np.empty(1 << 20, dtype=np.uint8)
    with gdskit.open(sys.argv[1]) as f:
        f.read(buf)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        with gdskit.open(sys.argv[1]) as f:
            f.read(buf[:4096])
        publish_now()
        os.read(r, 1)  # until the parent has looked
        sys.exit(0)
    while True:  # the child's snapshot shows only the child's own I/O
        try:
            child = read_snapshot(pid)
            if child.stats.total_bytes:
                break
        except Exception:
            pass
        time.sleep(0.01)
    publish_now()
    print(json.dumps({"child": child.stats.total_bytes, "parent": read_snapshot(os.getpid()).stats.total_bytes}))
    os.write(w, b"y")
    os.waitpid(pid, 0)
""")


def test_a_forked_child_publishes_only_its_own_io(tmp_path, data_file, stats_dir):
    script = tmp_path / "forker.py"
    script.write_text(FORKER)
    env = {**os.environ, "GDSKIT_STATS": "1", "GDSKIT_STATS_DIR": str(stats_dir)}
    out = subprocess.run([sys.executable, str(script), str(data_file)], env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"child": 4096, "parent": 1 << 20}
    assert os.listdir(stats_dir) == []  # both withdrew their snapshots at exit
    shutil.rmtree(stats_dir)


RESETTER = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import gdskit
    from gdskit.telemetry import publish_now, read_snapshot

    buf = np.empty(1 << 20, dtype=np.uint8)
    with gdskit.open(sys.argv[1]) as f:
        f.read(buf)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)  # so that the parent's end, however it comes, ends the child too
        gdskit.stats_reset()  # the child's ledger now holds less than what it inherited
        with gdskit.open(sys.argv[1]) as f:
            f.read(buf[:4096])
        publish_now()
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    while True:
        try:
            child = read_snapshot(pid)
            if child.stats.total_bytes:
                break
        except gdskit.errors.NotPublishingError:
            pass
        time.sleep(0.01)
    print(json.dumps(child.doc["ledger"]["entries"]))
    os.write(w, b"y")
    os.waitpid(pid, 0)
""")


def test_a_forked_child_that_resets_its_ledger_publishes_what_it_did(tmp_path, data_file, stats_dir):
    script = tmp_path / "resetter.py"
    script.write_text(RESETTER)
    env = {**os.environ, "GDSKIT_STATS": "2", "GDSKIT_STATS_DIR": str(stats_dir)}
    out = subprocess.run([sys.executable, str(script), str(data_file)], env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    (entry,) = json.loads(out.stdout)
    assert (entry["bytes"], entry["ops"], entry["requests"], entry["size_hist"]) == (4096, 1, 1, {"4096": 1})
