"""The resident loader (``gdskit serve``) and its client, end to end on real processes: a server
that serves host memory (the same requests, checks and answers as for a GPU's; the GPU's own
sharing is tested in test_resident_gpu.py), real files, a shared mapping compared with a plain read."""

from __future__ import annotations

import mmap
import os
import pathlib
import shutil
import socket
import stat
import subprocess
import sys

import pytest
import typer
from hypothesis import given, settings as hyp_settings, strategies as st

from gdskit.engine import framing
from gdskit.engine import resident
from gdskit.engine.resident import client, wire
from gdskit.errors import InvalidArgumentError, ResidentLoaderError, TruncatedFileError
from gdskit.settings import settings
from resident_server import ServerProcess, runtime_dir  # noqa: F401 - the fixture


@pytest.fixture
def server(runtime_dir):
    s = ServerProcess(runtime_dir, "--host").wait_listening()
    yield s
    s.stop()


@pytest.fixture
def data_file(runtime_dir):
    data = os.urandom(3_000_017)
    path = os.path.join(runtime_dir, "data.bin")
    with open(path, "wb") as fh:
        fh.write(data)
    return path, data


def _shared(path, file_size, memfd, reads, **kw):
    """One file's reads ``(place, bytes, file offset)`` into the shared mapping, as one request."""
    return client.read_to_shared([(path, file_size)], memfd, [(p, n, 0, o) for p, n, o in reads], **kw)


def _mapping(nbytes):
    fd = os.memfd_create("dst", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    return fd, mmap.mmap(fd, nbytes)


def test_bytes_land_where_asked_as_a_plain_read_gives_them(server, data_file):
    path, data = data_file
    fd, view = _mapping(8 << 20)
    reads = [(0, 1, 0), (7, 4093, 1), (8192, 2_000_000, 999_999), (3 << 20, len(data) - 5, 5)]
    got = []
    from gdskit.engine import stats, stats_delta

    before = stats()
    assert _shared(path, len(data), fd, reads, on_bytes=got.append) is None
    delta = stats_delta(before, stats())
    for place, n, offset in reads:
        assert view[place:place + n] == data[offset:offset + n]
    assert sum(got) == sum(n for _p, n, _o in reads)
    # The loader's ledger rows are this process's now: every byte, on the host path.
    assert sum(e.bytes for e in delta.entries) == sum(n for _p, n, _o in reads)
    os.close(fd)
    server.stop()
    assert [e for e in server.events if e["event"] == "served"][0]["bytes"] == sum(n for _p, n, _o in reads)


def test_one_request_reads_many_files_each_into_its_places(server, runtime_dir):
    from data_files import random_files

    files = random_files(pathlib.Path(runtime_dir), [1_000_003, 5, 2_500_000, 77_777], seed=9, prefix="many")
    fd, view = _mapping(8 << 20)
    # (place, bytes, file, file offset): files out of order, two reads of one file, a whole file.
    reads = [(5 << 20, 2_000_000, 2, 500_000), (0, 1_000_003, 0, 0), (2 << 20, 5, 1, 0),
             (3 << 20, 77_000, 3, 777), (4 << 20, 400_000, 2, 0)]
    got = []
    assert client.read_to_shared([(p, len(d)) for p, d in files], fd, reads, on_bytes=got.append) is None
    for place, n, k, offset in reads:
        assert view[place:place + n] == files[k][1][offset:offset + n], (place, k)
    assert sum(got) == sum(r[1] for r in reads)
    with pytest.raises(TruncatedFileError, match="many0002"):  # the file whose size changed is named
        client.read_to_shared([(p, len(d) + (k == 2)) for k, (p, d) in enumerate(files)], fd, reads)
    os.close(fd)
    server.stop()
    served = [e for e in server.events if e["event"] == "served"]
    assert [(e["files"], e["bytes"]) for e in served] == [(4, sum(r[1] for r in reads))]


def test_more_files_than_a_request_carries_go_as_several_requests(server, runtime_dir, monkeypatch):
    from data_files import random_files

    files = random_files(pathlib.Path(runtime_dir), [1000 + k for k in range(5)], seed=2, prefix="cut")
    monkeypatch.setattr(client, "MAX_FILES", 2)
    fd, view = _mapping(1 << 20)
    reads = [(k * 4096, len(d), k, 0) for k, (_p, d) in enumerate(files) if k != 3]  # the second request: one file
    assert client.read_to_shared([(p, len(d)) for p, d in files], fd, reads) is None
    for place, n, k, _o in reads:
        assert view[place:place + n] == files[k][1]
    with pytest.raises(InvalidArgumentError, match="names a file outside"):
        client.read_to_shared([(p, len(d)) for p, d in files], fd, [(0, 10, 5, 0)])
    os.close(fd)
    server.stop()
    assert [e["files"] for e in server.events if e["event"] == "served"] == [2, 2, 1]


def test_the_loaders_plain_lines_name_a_request_of_many_files(runtime_dir, data_file):
    import signal

    path, data = data_file
    proc = subprocess.Popen([sys.executable, "-m", "gdskit", "serve", "--host"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "XDG_RUNTIME_DIR": runtime_dir})
    try:
        assert proc.stdout.readline().startswith("gdskit serve: host memory")
        fd, view = _mapping(1 << 20)
        assert client.read_to_shared([(path, len(data))] * 3, fd, [(0, 10, 0, 0), (10, 10, 2, 5)]) is None
        assert view[:20] == data[:10] + data[5:15]
        os.close(fd)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert f"served {os.path.abspath(path)} and 2 more files: 0.00 GB in" in out


def test_the_loaders_error_names_the_file_it_said_is_at_fault():
    from gdskit.errors import GdskitFileNotFoundError
    from gdskit.engine.resident.server import _file_at_fault

    req = wire.Request([("/a", 1), ("/b", 2)], None, ["memfd"], [])
    assert _file_at_fault(req, [7, 9], "/proc/self/fd/9") == 1 and _file_at_fault(req, [7, 9], "/a") == 0
    assert _file_at_fault(req, [7, 9], "/elsewhere") is None and _file_at_fault(None, [], "/a") is None
    trunc = {"type": "TruncatedFileError", "message": "shrank", "errno": None}
    assert str(client._remote_error({**trunc, "file": 1}, ["/a", "/b"])) == "/b: shrank"
    assert str(client._remote_error({**trunc, "file": 5}, ["/a", "/b"])) == "/a, /b: shrank"
    assert str(client._remote_error({**trunc, "file": True}, ["/a"])) == "/a: shrank"
    gone = client._remote_error({"type": "OSError", "message": "gone", "errno": 2, "file": 1}, ["/a", "/b"])
    assert isinstance(gone, GdskitFileNotFoundError) and gone.filename == "/b"


@pytest.mark.parametrize("reads, why", [
    ([(0, 10, 3_000_010)], "outside the file"),
    ([(0, 0, 0)], "outside the file"),
    ([((4 << 20) - 5, 10, 0)], "past the end of segment"),
])
def test_a_read_outside_the_file_or_the_memory_is_refused_and_nothing_is_written(server, data_file, reads, why):
    path, data = data_file
    fd, view = _mapping(4 << 20)
    reason = _shared(path, len(data), fd, reads)
    assert reason is not None and why in reason
    assert view[:] == bytes(4 << 20)
    with settings.set(resident="require"), pytest.raises(ResidentLoaderError, match=why):
        _shared(path, len(data), fd, reads)
    os.close(fd)


def test_a_file_not_the_size_its_header_said_is_truncated_here(server, data_file):
    path, data = data_file
    fd, _view = _mapping(1 << 20)
    with pytest.raises(TruncatedFileError):
        _shared(path, len(data) + 1, fd, [(0, 10, 0)])
    os.close(fd)


def test_a_missing_file_raises_as_a_read_here_would(server, runtime_dir):
    from gdskit.errors import GdskitFileNotFoundError

    fd, _view = _mapping(1 << 20)
    with pytest.raises(GdskitFileNotFoundError):
        _shared(os.path.join(runtime_dir, "nope"), 10, fd, [(0, 10, 0)])
    os.close(fd)


def test_no_loader_off_and_require(runtime_dir, data_file):
    path, data = data_file
    fd, _view = _mapping(1 << 20)
    assert "no resident loader" in _shared(path, len(data), fd, [(0, 10, 0)])
    with settings.set(resident="off"):
        assert _shared(path, len(data), fd, [(0, 10, 0)]).startswith("off")
    with settings.set(resident="require"), pytest.raises(ResidentLoaderError, match="no resident loader"):
        _shared(path, len(data), fd, [(0, 10, 0)])
    os.close(fd)


def test_an_object_in_a_store_is_never_sent_to_the_loader(server, data_file):
    _path, data = data_file
    fd, view = _mapping(1 << 20)
    url = "s3://bucket/data.bin"
    assert "object in a store" in _shared(url, len(data), fd, [(0, 10, 0)])
    with settings.set(resident="require"), pytest.raises(ResidentLoaderError, match="object in a store"):
        _shared(url, len(data), fd, [(0, 10, 0)])
    assert view[:10] == bytes(10)
    view.close()
    os.close(fd)
    server.stop()
    assert server.kinds() == ["listening", "stopped"]  # it heard nothing


def test_a_directory_others_can_enter_is_refused_on_both_sides(runtime_dir, data_file):
    path, data = data_file
    os.makedirs(os.path.join(runtime_dir, "gdskit"), mode=0o755)
    os.chmod(os.path.join(runtime_dir, "gdskit"), 0o755)
    fd, _view = _mapping(1 << 20)
    assert "other users" in _shared(path, len(data), fd, [(0, 10, 0)])
    s = ServerProcess(runtime_dir, "--host")
    assert s.proc.wait(timeout=60) == 2
    assert "other users" in s.proc.stderr.read()
    assert stat.S_IMODE(os.stat(os.path.join(runtime_dir, "gdskit")).st_mode) == 0o755  # not changed
    os.close(fd)


def test_a_second_loader_is_refused_and_a_dead_ones_socket_is_replaced(runtime_dir, data_file):
    path, data = data_file
    first = ServerProcess(runtime_dir, "--host").wait_listening()
    second = ServerProcess(runtime_dir, "--host")
    assert second.proc.wait(timeout=60) == 2
    assert "already listens" in second.proc.stderr.read()
    first.proc.kill()  # no clean-up: its socket stays behind
    first.proc.wait()
    assert os.path.exists(first.socket)
    fd, view = _mapping(1 << 20)
    assert "no resident loader is listening" in _shared(path, len(data), fd, [(0, 10, 0)])
    third = ServerProcess(runtime_dir, "--host").wait_listening()
    assert _shared(path, len(data), fd, [(0, 10, 0)]) is None
    assert view[:10] == data[:10]
    assert stat.S_IMODE(os.stat(third.socket).st_mode) == 0o600
    assert third.stop() == 0
    assert not os.path.exists(third.socket)  # SIGTERM: stopped, socket removed
    assert third.kinds()[-1] == "stopped"
    os.close(fd)


def test_a_file_in_the_way_of_the_socket_is_never_replaced(runtime_dir):
    os.makedirs(os.path.join(runtime_dir, "gdskit"), mode=0o700)
    blocker = resident.socket_path(resident.HOST)
    with open(blocker, "w") as fh:
        fh.write("mine")
    s = ServerProcess(runtime_dir, "--host")
    assert s.proc.wait(timeout=60) == 2
    assert open(blocker).read() == "mine"


def _raw(sock_path: str, payload: bytes, fds=()) -> tuple[bytes, bytes]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(sock_path)
        if fds:
            framing.send_with_fds(s, b"Q", payload, list(fds))
        else:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        try:
            kind, body = framing.recv_message(s)
        except (EOFError, ConnectionResetError):  # closed on it, unanswered
            return b"", b""
        return kind, bytes(body)


def test_hostile_requests_are_refused_and_the_loader_goes_on(server, data_file):
    path, data = data_file
    fd, view = _mapping(1 << 20)
    file_fd = os.open(path, os.O_RDONLY)
    good = wire.pack_request([(path, len(data))], None, ["memfd"], [(0, 0, 0, 0, 10)])
    cases = [
        b"\xff\xff\xff\xff" + b"Q",                                      # a length past the limit
        b"\x05\x00\x00\x00Qabc",                                          # cut short
        b"garbage that is not a frame at all",
    ]
    for payload in cases:
        kind, _ = _raw(server.socket, payload)
        assert kind in (b"", b"E")
    bad_requests = [
        good[:-3],                                                                         # not whole reads
        b"\x10\x00\x00\x00" + b"{not json at all}",
        wire.pack_request([(path, len(data))], None, ["memfd"], [(0, 1, 0, 0, 10)]),        # no such segment
        wire.pack_request([(path, len(data))], None, ["memfd"], [(1, 0, 0, 0, 10)]),        # no such file
        wire.pack_request([(path, len(data))], None, ["memfd"], [(-1, 0, 0, 0, 10)]),       # nor this one
        wire.pack_request([(path, len(data))], None, ["memfd"], [(0, 0, -1, 0, 10)]),       # before the memory
        wire.pack_request([(path, len(data))], "0" * 8 + "-0000-0000-0000-" + "0" * 12, ["memfd"],
                          [(0, 0, 0, 0, 10)]),
        wire.pack_request([(path, len(data) - 1)], None, ["memfd"], [(0, 0, 0, 0, 10)]),    # not the file's size
        wire.pack_request([(path, len(data))] * 2, None, ["memfd"], [(0, 0, 0, 0, 10)]),    # two files, one sent
        wire.pack_request([], None, ["memfd"], [(0, 0, 0, 0, 10)]),                          # no file
        wire.pack_request([(path, len(data))] * (wire.MAX_FILES + 1), None, ["memfd"], [(0, 0, 0, 0, 10)]),
        good.replace(b'"version":2', b'"version":1'),                                      # the old wire
    ]
    for payload in bad_requests:
        kind, body = _raw(server.socket, payload, [file_fd, fd])
        assert kind == b"E" and b'"refused":true' in body
    kind, body = _raw(server.socket, good, [file_fd])  # no shared mapping sent
    assert kind == b"E" and b'"refused":true' in body
    dev_null = os.open("/dev/null", os.O_RDONLY)
    kind, body = _raw(server.socket, good, [dev_null, fd])  # not a regular file
    assert kind == b"E" and b"not a regular file" in body
    assert view[:] == bytes(1 << 20)
    assert _shared(path, len(data), fd, [(0, 10, 0)]) is None  # still serving
    assert view[:10] == data[:10]
    for f in (file_fd, fd, dev_null):
        os.close(f)


@hyp_settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_any_bytes_unpack_to_a_request_or_a_value_error(payload):
    try:
        req = wire.unpack_request(payload)
    except ValueError:
        return
    assert all(len(r) == 5 for r in req.reads) and 0 < len(req.files) <= wire.MAX_FILES


_files = st.lists(st.tuples(st.text(max_size=30), st.integers(0, 1 << 62)), min_size=1, max_size=wire.MAX_FILES)
_reads = st.lists(st.tuples(*[st.integers(-(1 << 63), (1 << 63) - 1)] * 5), max_size=40)


@hyp_settings(max_examples=200, deadline=None)
@given(_files, st.one_of(st.none(), st.just("00000000-0000-0000-0000-00000000abcd")),
       st.lists(st.text(max_size=10), max_size=5), _reads)
def test_a_request_comes_back_as_it_was_packed(files, device, segments, reads):
    req = wire.unpack_request(wire.pack_request(files, device, segments, reads))
    assert (req.files, req.device, req.segments, req.reads) == (files, device, segments, reads)


def test_extra_descriptors_are_closed_on_receipt():
    a, b = socket.socketpair()
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(3)]
    framing.send_with_fds(a, b"Q", b"x", fds)
    kind, payload, got = framing.recv_with_fds(b, max_fds=1)
    assert (kind, bytes(payload), len(got)) == (b"Q", b"x", 1)
    assert os.get_inheritable(got[0]) is False
    os.close(got[0])
    for f in fds:
        os.close(f)
    a.close()
    b.close()


def test_a_gpu_uuid_names_the_socket_and_nothing_else_does(runtime_dir):
    assert resident.socket_path("01234567-89ab-cdef-0123-456789abcdef").endswith(
        "/gdskit/resident-01234567-89ab-cdef-0123-456789abcdef.sock")
    from gdskit.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError):
        resident.socket_path("../../etc/passwd")


def test_without_a_cuda_driver_a_gpu_load_is_not_worth_asking_unless_required(monkeypatch):
    from gdskit.engine.resident import ipc

    def none(_ordinal):
        raise ipc.IpcUnavailable("no CUDA driver library (libcuda.so.1)")

    monkeypatch.setattr(ipc, "ordinal_uuid", none)
    assert resident.worth_asking(0) is False
    with settings.set(resident="require"):
        assert resident.worth_asking(0) is True
    with settings.set(resident="off"):
        assert resident.worth_asking(0) is False


def test_serve_help_and_a_bad_device(runtime_dir):
    out = subprocess.run([sys.executable, "-m", "gdskit", "serve", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "GDSKIT_RESIDENT" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "gdskit", "serve", "--device", "-1"], capture_output=True, text=True)
    assert bad.returncode == 2


def test_serve_unit_prints_a_unit_for_this_python():
    out = subprocess.run([sys.executable, "-m", "gdskit", "serve", "--unit"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f'ExecStart="{sys.executable}" -m gdskit serve --device %i --json' in out.stdout


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_unit_names_its_python_exactly_whatever_the_path_holds(tmp_path):
    from gdskit.cli.serve import unit_text

    odd = tmp_path / "py $HOME %i"  # spaces, a variable's sign and a specifier, all literal
    odd.symlink_to(sys.executable)
    unit = tmp_path / "gdskit-serve@0.service"
    unit.write_text(unit_text(str(odd)))
    ok = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr  # it checks that the program named can be run
    unit.write_text(unit_text(str(tmp_path / "py $HOME")))  # one that is not there: the check can fail
    missing = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True)
    assert missing.returncode != 0 and "py $HOME" in missing.stderr
    for refused in ("/usr/bin/py\nthon", '/opt/"py"/python3', "/opt/py\\/python3"):  # systemd refuses them
        with pytest.raises(typer.BadParameter):
            unit_text(refused)


def _one_exchange(path: str) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(path)
        try:
            s.sendall(b"x" * 5)
            return s.recv(10)
        except ConnectionResetError:
            return b""


def _as_user(uid: int, fn) -> bytes:
    """``fn()`` in a forked child that has become user ``uid`` (no exec: nothing of this user's
    files need be readable by that one); what it returned."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become the other user, do it, report, leave at once
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(w, fn())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        out = fh.read()
    _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return out


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_a_client_of_another_user_is_refused(server, data_file):
    path, data = data_file
    for d in (os.path.dirname(os.path.dirname(server.socket)), os.path.dirname(server.socket)):
        os.chmod(d, 0o711)  # let the other user reach the socket, for this test
    os.chmod(server.socket, 0o777)
    got = _as_user(65534, lambda: _one_exchange(server.socket))
    assert got == b""  # closed without an answer
    server.stop()
    assert any(e.get("why") == "a client of another user" for e in server.events)


def test_auto_asks_where_a_socket_is_there_until_this_process_has_its_own_staging(runtime_dir, monkeypatch):
    import gdskit.engine.pool as pool
    from gdskit.engine.resident import ipc

    uuid = "01234567-89ab-cdef-0123-456789abcdef"
    monkeypatch.setattr(ipc, "ordinal_uuid", lambda _ordinal: uuid)
    assert resident.worth_asking(0) is False  # no socket
    wire.make_private_dir(resident.socket_dir())
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(resident.socket_path(uuid))
    try:
        assert resident.worth_asking(0) is True
        assert resident.worth_asking(0, [4096] * 1000 + [1 << 20]) is False  # mostly small tensors: read here
        from gdskit.engine import resident_worth_asking

        assert resident_worth_asking(0, [64 << 20, 4096]) is True
        assert resident_worth_asking(0, [4096] * 1000 + [1 << 20]) is False
        assert resident_worth_asking(0, [64 << 20], ["/data/a.safetensors", "s3://b/k"]) is False  # an object
        with settings.set(resident="require"):  # asked, so that the client says why it cannot
            assert resident_worth_asking(0, [64 << 20], ["s3://b/k"]) is True
        monkeypatch.setattr(pool.lanes, "holds", lambda device: device == 0)
        assert resident.worth_asking(0) is False  # warm here: read here
        assert resident.worth_asking(1) is True
        with settings.set(resident="require"):
            assert resident.worth_asking(0) is True
            assert resident.worth_asking(0, [4096]) is True
    finally:
        listener.close()


def test_ledger_rows_that_arrive_before_the_ledger_is_imported_are_not_lost():
    code = """
import sys
from gdskit.engine import ledger_inbox
ledger_inbox.add(ledger_inbox.checked([["bounce-cached", "no_gpu", "read", 4096, 1, 0.5, 1, [[12, 1]]]]))
assert "gdskit.engine.ledger" not in sys.modules
from gdskit.engine import stats
print(sum(e.bytes for e in stats().entries))
ledger_inbox.add(ledger_inbox.checked([["bounce-cached", "no_gpu", "read", 100, 1, 0.1, 1, []]]))
print(sum(e.bytes for e in stats().entries))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["4096", "4196"], out.stderr
    from gdskit.engine import ledger_inbox

    for bad in ("rows", [["too", "short"]], [["host", "no_gpu", "read", "many", 1, 0.1, 1, []]],
                [["nowhere", "no_gpu", "read", 1, 1, 0.1, 1, []]], [["host", "no_gpu", "read", -1, 1, 0.1, 1, []]]):
        with pytest.raises((ValueError, TypeError)):
            ledger_inbox.checked(bad)


def _mapped(segments):
    """A request's destinations as the loader holds them once the client's allocations (here the
    stand-in driver's ``segments``) are mapped."""
    from gdskit.engine.resident.server import _Destinations

    dest = _Destinations.__new__(_Destinations)
    dest.device, dest._opened, dest._map, dest._handles, dest.map_seconds = 0, [], None, [], 0.0
    dest.bases, dest.sizes = [s.ptr for s in segments], [s.nbytes for s in segments]
    return dest


@pytest.mark.stand_in_gpu
def test_on_a_gpu_small_reads_that_touch_go_as_one_and_every_byte_lands(tmp_path_factory):
    """The loader's plan of a request's reads into GPU memory (small reads that touch in the file
    grouped into one scattered read), run by the engine: each read's bytes where it asked."""
    from data_files import random_file
    from devbuf import DeviceBuffer
    from gdskit.engine.file import open as open_file
    from gdskit.engine.resident import SMALL_READ

    path, data = random_file(tmp_path_factory, "resident", 6 << 20, seed=5)
    segments = [DeviceBuffer(4 << 20), DeviceBuffer(4 << 20)]
    for s in segments:
        s.poison()
    dest = _mapped(segments)
    # (segment, offset in it, file offset, bytes): touching small reads across both segments,
    # a gap, one large read, out of file order.
    reads = [(1, 100, 5000, 3000), (0, 0, 0, 5000), (1, 8192, 8000, 4096), (0, 13_000, 20_001, 777),
             (1, 1 << 20, 1 << 20, SMALL_READ + 4096), (0, 5000, 12_096, 7904)]
    items = dest.items(reads)
    assert len(items) == 3  # [0, 20000) touching: one; [20001, 20778) after a gap: another; the large one
    with open_file(path, "r") as f:
        counts = f.pread_many(items).result()
    assert counts == [n for _v, n, _o in items]
    for seg, at, offset, n in reads:
        assert segments[seg].to_bytes()[at:at + n] == data[offset:offset + n], (seg, at, offset)


def test_the_first_eighth_of_a_request_is_read_while_the_rest_is_mapped():
    from gdskit.engine.resident.server import HEAD_SHARE, _head_reads

    assert HEAD_SHARE == 1 / 8
    many = [(0, i, 0, i * 100, 100) for i in range(16)]  # 16 allocations of 100 bytes, in file order
    assert _head_reads(many) == 2
    assert _head_reads([(0, 0, 0, 0, 10), (0, 1, 0, 10, 1000)]) == 2  # the share is reached only with the second
    one = [(k, 0, k * 10, 0, 10) for k in range(5)]  # one allocation over five files: nothing to map meanwhile
    assert _head_reads(one) == 5


@pytest.mark.stand_in_gpu
@pytest.mark.parametrize("nfiles", [1, 3])
@pytest.mark.parametrize("bad_tail", [False, True])
def test_a_request_read_in_two_parts_lands_every_byte_or_is_refused_once_nothing_is_in_flight(
        tmp_path_factory, bad_tail, nfiles):
    """The loader reads a request's first eighth while it maps the rest; a read the rest holds
    that passes its allocation's end is refused then, with the first part's copies ended (the
    client reads everything again itself). A request of several files reads each one's bytes
    from that file."""
    from data_files import random_file
    from devbuf import DeviceBuffer
    from gdskit.engine.resident.server import Refused, ResidentLoader

    per = 8 // nfiles + (8 % nfiles > 0)  # the 8 MiB's pieces a file holds (the last file fewer)
    files = [random_file(tmp_path_factory, f"resident-two-{nfiles}-{k}", min(per, 8 - k * per) << 20, seed=6 + k)
             for k in range(nfiles)]
    segments = [DeviceBuffer(1 << 20) for _ in range(8)]
    for seg in segments:
        seg.poison()
    reads = [(i // per, i, 0, (i % per) << 20, 1 << 20) for i in range(8)]
    if bad_tail:
        reads[7] = (*reads[7][:2], 4096, *reads[7][3:])  # past the end of the last allocation
    req = wire.unpack_request(wire.pack_request([(p, len(d)) for p, d in files], "00000000-0000-0000-0000-000000000000",
                                                ["00" * 64] * 8, reads[::-1]))
    loader = ResidentLoader(0)
    dest = _mapped(segments)
    mine, theirs = socket.socketpair()
    fds = [os.open(p, os.O_RDONLY) for p, _d in files]
    want = [files[k][1][off:off + n] for k, _s, _a, off, n in reads]
    try:
        if bad_tail:
            with pytest.raises(Refused, match="past the end of segment 7"):
                loader._read(mine, req, fds, dest)
            assert segments[0].to_bytes() == want[0]  # the first part ran to its end first
            assert segments[7].to_bytes() != want[7]
        else:
            nbytes, rows = loader._read(mine, req, fds, dest)
            assert nbytes == 8 << 20 and sum(r[3] for r in rows) == 8 << 20
            for i, seg in enumerate(segments):
                assert seg.to_bytes() == want[i], i
    finally:
        for fd in fds:
            os.close(fd)
        mine.close()
        theirs.close()


def test_a_bad_gdskit_resident_is_an_environment_error():
    code = """
from gdskit.engine import resident
from gdskit.errors import EnvironmentVariableError
try:
    resident.worth_asking(0)
except EnvironmentVariableError as exc:
    print("refused", exc.variable)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "GDSKIT_RESIDENT": "sometimes"})
    assert out.stdout.strip() == "refused GDSKIT_RESIDENT", out.stderr


class _Peer:
    """A misbehaving loader on the host socket: takes the request, then does ``behave(conn)``."""

    def __init__(self, behave):
        wire.make_private_dir(resident.socket_dir())
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(resident.socket_path(resident.HOST))
        self.sock.listen(1)
        self.behave = behave
        import threading

        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        conn, _ = self.sock.accept()
        _kind, _payload, fds = framing.recv_with_fds(conn, max_fds=2)
        for fd in fds:
            os.close(fd)
        self.behave(conn)
        conn.close()

    def close(self):
        self.thread.join(10)
        self.sock.close()


@pytest.mark.parametrize("behave, outcome", [
    (lambda c: framing.send_message(c, wire.KIND_PROGRESS, wire.pack_progress(5)), "went away mid-load"),
    (lambda c: framing.send_message(c, b"Z", b""), ResidentLoaderError),
    (lambda c: framing.send_message(c, wire.KIND_DONE, wire.pack_json({"bytes": 3, "rows": []})), ResidentLoaderError),
    (lambda c: framing.send_message(c, wire.KIND_DONE, wire.pack_json({"bytes": 10, "rows": [["x"]]})), ResidentLoaderError),
    (lambda c: framing.send_message(c, wire.KIND_ERROR, wire.pack_json(
        {"type": "TruncatedFileError", "message": "shrank", "refused": False})), TruncatedFileError),
    (lambda c: framing.send_message(c, wire.KIND_ERROR, wire.pack_json(
        {"type": "OSError", "message": "Input/output error", "refused": False, "errno": 5})), OSError),
])
def test_a_loader_that_misbehaves_is_read_past_or_raised_by_name(runtime_dir, data_file, behave, outcome):
    path, data = data_file
    peer = _Peer(behave)
    fd, _view = _mapping(1 << 20)
    got = []
    try:
        if isinstance(outcome, str):
            assert outcome in _shared(path, len(data), fd, [(0, 10, 0)], on_bytes=got.append)
            assert got == [5]  # the caller takes these back before it reads again
        else:
            with pytest.raises(outcome):
                _shared(path, len(data), fd, [(0, 10, 0)])
    finally:
        peer.close()
        os.close(fd)


def test_a_loader_that_stops_answering_is_given_up_on(runtime_dir, data_file, monkeypatch):
    import time as _time

    path, data = data_file
    monkeypatch.setattr(client, "STALL_S", 0.5)
    peer = _Peer(lambda c: _time.sleep(2))
    fd, _view = _mapping(1 << 20)
    try:
        with pytest.raises(ResidentLoaderError, match="stopped answering"):
            _shared(path, len(data), fd, [(0, 10, 0)])
    finally:
        peer.close()
        os.close(fd)


def test_events_from_many_connections_are_whole_json_lines(server):
    for _ in range(40):  # each closed at once: a "refused" event from its own thread
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(server.socket)
            s.shutdown(socket.SHUT_WR)
            assert s.recv(1) == b""  # the loader has turned it down
    assert server.stop() == 0  # every line it printed parsed as JSON
    assert server.kinds().count("refused") == 40 and server.kinds()[-1] == "stopped"


def test_stopping_ends_connections_still_waiting_for_their_request(server):
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle.connect(server.socket)  # and says nothing
    import time as _time

    t0 = _time.monotonic()
    assert server.stop() == 0
    assert _time.monotonic() - t0 < 10  # not the 30 s a request may take to come
    try:
        assert idle.recv(1) == b""  # closed by the loader
    except ConnectionResetError:
        pass  # or, not yet accepted when it stopped, by the kernel
    idle.close()
    assert server.kinds()[-1] == "stopped"
