"""`gdskit stats` and publication trust no file: hostile snapshot documents (hypothesis), files that are
too large, FIFOs, links and other users' files, directories others can write or created first by
someone else, and links planted where the publisher writes."""

from __future__ import annotations

import io
import json
import os
import resource
import stat
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st
from rich.console import Console
from test_telemetry_prometheus import parse_prometheus
from cli_app import one_command_app
from typer.testing import CliRunner

from gdskit.errors import FormatError, GdskitError, GdskitPermissionError, NotPublishingError
from gdskit.engine.ledger import Ledger
from gdskit.telemetry import list_snapshots, location, prometheus, publish, read, read_snapshot, render, schema
from gdskit.telemetry.schema import MAX_SNAPSHOT_BYTES
from gdskit.telemetry.snapshot import MAX_ARGV_CHARS, Snapshot, command_line, ledger_dict, restrict
from gdskit.telemetry.workload import make_report
from gdskit.vocabulary import Path, Reason, is_direct_path

ROOT = os.geteuid() == 0
PATHS = [p.value for p in Path]
REASONS = [r.value for r in Reason]
POWERS = [str(1 << k) for k in range(64)]
COUNTERS = ("read_bytes", "n_total_reads", "n_nvfs_reads", "n_posix_reads", "n_reads_err", "write_bytes")

APP = textwrap.dedent('''
    import typer
    from gdskit.cli import stats as stats_cli

    app = typer.Typer(pretty_exceptions_enable=False)

    @app.callback()
    def _main() -> None:
        """gdskit"""

    stats_cli.register(app)
    app()
''')


@pytest.fixture(scope="module")
def app():
    from gdskit.cli import stats as stats_cli

    return one_command_app(stats_cli.register)


def cli(app, *args):
    return CliRunner().invoke(app, ["stats", *args], env={"COLUMNS": "200"})


def _me() -> tuple[int, int]:
    return os.getpid(), location.start_ticks(os.getpid())


# -- documents -------------------------------------------------------------------------------------

def _totals(entries: list[dict]) -> dict:
    total = sum(e["bytes"] for e in entries)
    direct = sum(e["bytes"] for e in entries if is_direct_path(e["path"]))
    return {"total_bytes": total, "direct_bytes": direct, "posix_bytes": total - direct,
            "requests": sum(e.get("requests", 0) for e in entries)}


def good_doc(pid: int | None = None, ticks: int | None = None, **changes) -> dict:
    pid, ticks = (pid, ticks) if pid is not None else _me()
    entries = [{"path": "host", "reason": "no_gpu", "op": "read", "bytes": 7, "ops": 1, "busy_s": 0.1, "requests": 1,
                "size_hist": {"8": 1}}]
    doc = {"schema": "gdskit.stats/1", "pid": pid, "start_ticks": ticks, "uid": os.geteuid(), "argv": ["python"],
           "level": 3, "interval_s": 0.5, "session": None, "final": False, "seq": 1, "started_at": 1.0,
           "updated_at": 2.0, "ledger": {**_totals(entries), "paths": {}, "reasons": {}, "entries": entries},
           "gpus": {"0": {"host": {"bytes_read": 7, "requests": 1, "busy_s": 0.1, "mean_latency_s": 0.1}}},
           "cufile": {"per_gpu": {"0": {"n_posix_reads": 1}}, "totals": {"n_posix_reads": 1}}}
    doc.update(changes)
    return doc


entry_st = st.fixed_dictionaries(
    {"path": st.sampled_from(PATHS), "reason": st.sampled_from(REASONS), "op": st.sampled_from(["read", "write"]),
     "bytes": st.integers(0, 2**40), "ops": st.integers(0, 2**20),
     "busy_s": st.floats(0, 1e6, allow_nan=False, allow_infinity=False), "requests": st.integers(0, 2**20)},
    optional={"size_hist": st.dictionaries(st.sampled_from(POWERS), st.integers(0, 2**20), max_size=4)})
path_stats_st = st.fixed_dictionaries(
    {}, optional={k: st.integers(0, 2**40) for k in ("bytes_read", "bytes_written", "ops_read", "ops_written",
                                                     "requests")}
    | {"busy_s": st.floats(0, 1e6), "mean_latency_s": st.none() | st.floats(0, 10)})
counters_st = st.dictionaries(st.sampled_from(COUNTERS), st.integers(0, 2**62), max_size=3)
json_leaf = st.none() | st.booleans() | st.integers(-2**62, 2**62) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
unknown_st = st.recursive(json_leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
                          max_leaves=8)


@st.composite
def valid_docs(draw) -> dict:
    entries = draw(st.lists(entry_st, max_size=5, unique_by=lambda e: (e["path"], e["reason"], e["op"])))
    doc = {"schema": draw(st.sampled_from(["gdskit.stats/1", "gdskit.stats/1.3"])),
           "pid": draw(st.integers(1, 2**22)), "level": draw(st.integers(1, 3)),
           "ledger": {**_totals(entries), "entries": entries,
                      "paths": draw(st.dictionaries(st.sampled_from(PATHS), path_stats_st, max_size=2)),
                      "reasons": draw(st.dictionaries(st.sampled_from(REASONS), path_stats_st, max_size=2))}}
    optional = {"start_ticks": st.none() | st.integers(0, 2**40), "uid": st.integers(0, 2**31),
                "argv": st.lists(st.text(st.characters(blacklist_categories=("Cs",)), max_size=10), max_size=3),
                "interval_s": st.floats(0.05, 3600), "session": st.none() | st.text("0123456789abcdef", min_size=1, max_size=16),
                "final": st.booleans(), "seq": st.integers(0, 2**40), "started_at": st.floats(0, 2e9),
                "updated_at": st.floats(0, 2e9),
                "gpus": st.dictionaries(st.integers(0, 7).map(str), st.dictionaries(st.sampled_from(PATHS), path_stats_st,
                                                                                    max_size=2), max_size=2),
                "cufile": st.none() | st.fixed_dictionaries({}, optional={
                    "per_gpu": st.dictionaries(st.integers(0, 7).map(str), counters_st, max_size=2),
                    "totals": counters_st}),
                "future_key": unknown_st}  # later minor versions add keys
    for key, strategy in optional.items():
        if draw(st.booleans()):
            doc[key] = draw(strategy)
    return doc


HOSTILE_TEXT = st.text(st.sampled_from(["a", "[", "/", "]", "\udc80", "\ud800", "\x1b", "\n", "²", "é", "\x00"]),
                       max_size=6)
hostile_values = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from([2**63, 2**64, -1, 10**30])
                  | st.floats() | HOSTILE_TEXT | st.lists(st.integers(), max_size=2)
                  | st.dictionaries(HOSTILE_TEXT, st.integers(), max_size=2)
                  | st.integers(15, 40).map(lambda n: json.loads("[" * n + "]" * n)))


def _locations(doc, where=()):
    yield where
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _locations(v, (*where, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _locations(v, (*where, i))


def _set(doc, where, value):
    for step in where[:-1]:
        doc = doc[step]
    doc[where[-1]] = value


def _delete(doc, where):
    for step in where[:-1]:
        doc = doc[step]
    del doc[where[-1]]


@st.composite
def hostile_bytes(draw) -> bytes:
    """A valid document with one field replaced, removed or added, then serialised (NaN and
    Infinity included) and maybe damaged at the byte level."""
    doc = draw(valid_docs())
    spots = list(_locations(doc))[1:]
    action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
    if spots and action == "replace":
        _set(doc, draw(st.sampled_from(spots)), draw(hostile_values))
    elif spots and action == "delete":
        _delete(doc, draw(st.sampled_from(spots)))
    else:
        doc[draw(HOSTILE_TEXT)] = draw(hostile_values)
    raw = json.dumps(doc, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    damage = draw(st.sampled_from(["none", "none", "truncate", "byte", "utf16"]))
    if damage == "truncate":
        raw = raw[:draw(st.integers(0, len(raw)))]
    elif damage == "byte":
        i = draw(st.integers(0, len(raw)))
        raw = raw[:i] + bytes([draw(st.integers(0x80, 0xFF))]) + raw[i:]
    elif damage == "utf16":
        raw = raw.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass")
    return raw


def consume(doc: dict) -> None:
    """Everything gdskit does with a snapshot it has read: none of it may raise."""
    snap = Snapshot(doc, "x")
    stats = snap.stats
    assert (snap.pid, snap.level, snap.final) == (doc["pid"], doc["level"], bool(doc.get("final")))
    _ = (snap.session, snap.updated_at, snap.command, snap.cufile_totals, stats.total_bytes)
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    for level in (1, 2, 3):
        cut = restrict(doc, level)
        json.loads(json.dumps(cut, indent=2, allow_nan=False))
        parse_prometheus(prometheus.render([snap], level=level))
        console.print(render.snapshot_view(snap, level, {"host": 1.0}))
    console.print(render.processes_table([snap]))
    console.file.getvalue().encode("utf-8")
    make_report(["x"], 0, 0.0, [snap, snap])


def _write(path, raw: bytes) -> None:
    with open(path, "wb") as f:
        f.write(raw)


@pytest.fixture(scope="module")
def doc_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs") / "stats"
    d.mkdir(mode=0o700)
    return d


@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(raw=hostile_bytes())
def test_a_hostile_document_is_refused_or_survives_every_reader(doc_dir, raw):
    path = doc_dir / "1.json"
    _write(path, raw)
    try:
        doc = read.load_file(str(path), os.geteuid())
    except FormatError:
        return
    consume(doc)


@hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=valid_docs())
def test_every_document_of_the_schema_is_accepted(doc_dir, doc):
    path = doc_dir / "2.json"
    _write(path, json.dumps(doc).encode())
    assert read.load_file(str(path), os.geteuid()) == doc
    consume(doc)


def test_what_the_publisher_writes_is_accepted(stats_dir, tmp_path):
    """Including a command line with bytes that are not UTF-8, and a forked child's figures."""
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(8192))
    code = textwrap.dedent("""
        import os, sys, numpy as np, gdskit
        from gdskit.telemetry import publish_now
        with gdskit.open(sys.argv[1]) as f:
            f.read(np.empty(8192, dtype=np.uint8))
        publish_now()
        print("ready", flush=True)
        sys.stdin.readline()
    """)
    env = {**os.environ, "GDSKIT_STATS": "3", "GDSKIT_STATS_DIR": str(stats_dir)}
    proc = subprocess.Popen([sys.executable, "-c", code, str(data), os.fsdecode(b"caf\xe9\xff"), "[/x]"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        snap = read_snapshot(proc.pid)
        assert snap.stats.total_bytes == 8192
        assert snap.doc["argv"][-1] == "[/x]" and snap.doc["argv"][-2] == "caf\ufffd\ufffd"
        consume(snap.doc)
    finally:
        proc.stdin.close()
        proc.wait(30)
        proc.stdout.close()


def test_the_largest_snapshot_a_process_can_publish_fits_under_the_cap():
    led = Ledger()
    for path in Path:
        for reason in Reason:
            for op in ("read", "write"):
                for k in range(45):  # requests of every size up to 16 TiB
                    led.record(path, reason, op, 1 << k, busy_s=0.123456789)
    doc = good_doc(ledger=ledger_dict(led.snapshot(), 2), argv=["\U0001f600" * (MAX_ARGV_CHARS + 10)] * 3)
    doc["argv"] = command_line(doc["argv"])
    raw = json.dumps(doc, separators=(",", ":")).encode()  # as the publisher writes it
    assert len(raw) < 1 << 20
    assert schema.parse(raw, "x") == doc


# -- every output format: one clean error line, exit 1 -------------------------------------------

def _raw(**changes) -> bytes:
    return json.dumps(good_doc(**changes)).encode()


def _with_entry(**changes) -> bytes:
    doc = good_doc()
    doc["ledger"]["entries"][0].update(changes)
    return json.dumps(doc).encode()


def _nested(depth: int) -> bytes:
    return _raw()[:-1] + b', "later": ' + b"[" * depth + b"]" * depth + b"}"


HOSTILE_FILES = {
    "not utf-8": _raw(argv=["python", "x"]).replace(b'"x"', b'"\xff\xfe"'),
    "utf-16": _raw().decode().encode("utf-16"),
    "nan": _raw().replace(b'"updated_at": 2.0', b'"updated_at": NaN'),
    "infinity": _with_entry(busy_s=1.0).replace(b'"busy_s": 1.0', b'"busy_s": 1e999'),
    "int beyond 2**63": _raw(seq=2**63),
    "int beyond 2**64": _with_entry(bytes=2**64),
    "huge int literal": _raw().replace(b'"seq": 1', b'"seq": ' + b"9" * 5000),
    "negative counter": _with_entry(ops=-1),
    "deep nesting": _nested(100_000),
    "nesting past the limit": _nested(17),
    "level of the wrong type": _raw(level="3"),
    "level out of range": _raw(level=4),
    "pid of the wrong type": _raw(pid=str(os.getpid())),
    "markup as a path": _with_entry(path="[/x]"),
    "lone surrogate": _raw(argv=["python", "\udc80"]),
    "entries not a list": _raw(ledger={"entries": {"0": 1}}),
    "entry not an object": _raw(ledger={"entries": [1]}),
    "size_hist key not a power of two": _with_entry(size_hist={"7": 1}),
    "gpu key not a number": _raw(gpus={"x": {}}),
    "cufile counter of the wrong type": _raw(cufile={"per_gpu": {"0": {"n_posix_reads": "1"}}}),
    "totals that are not the entries' sum": _raw().replace(b'"total_bytes": 7', b'"total_bytes": 8'),
    "duplicate entries": _raw(ledger={"entries": [good_doc()["ledger"]["entries"][0]] * 2}),
    "not an object": b"[1, 2]",
    "larger than the cap": _raw() + b" " * MAX_SNAPSHOT_BYTES,
}


@pytest.mark.parametrize("fmt", [[], ["--json"], ["--prometheus"]], ids=["table", "json", "prometheus"])
@pytest.mark.parametrize("case", sorted(HOSTILE_FILES))
def test_a_hostile_snapshot_is_one_error_line_in_every_format(app, stats_dir, case, fmt):
    stats_dir.mkdir(mode=0o700, exist_ok=True)
    _write(stats_dir / f"{os.getpid()}.json", HOSTILE_FILES[case])
    r = cli(app, "-p", str(os.getpid()), *fmt)
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1
    with pytest.raises(FormatError):
        read_snapshot(os.getpid())


def test_the_cap_is_the_most_a_snapshot_may_be(stats_dir):
    stats_dir.mkdir(mode=0o700)
    raw = _raw()
    path = stats_dir / f"{os.getpid()}.json"
    _write(path, raw + b" " * (MAX_SNAPSHOT_BYTES - len(raw)))
    assert read_snapshot(os.getpid()).stats.total_bytes == 7
    _write(path, raw + b" " * (MAX_SNAPSHOT_BYTES - len(raw) + 1))
    with pytest.raises(FormatError):
        read_snapshot(os.getpid())


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # less than the file: reading it whole fails


def _stats_cli(tmp_path, *args, env=None, memory_limit=False):
    script = tmp_path / "app.py"
    script.write_text(APP)
    return subprocess.run([sys.executable, str(script), "stats", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})}, check=False,
                          preexec_fn=_limit_memory if memory_limit else None)


def test_a_6_gib_sparse_snapshot_is_refused_unread(tmp_path, stats_dir):
    stats_dir.mkdir(mode=0o700)
    path = stats_dir / f"{os.getpid()}.json"
    with open(path, "wb") as f:
        f.truncate(6 << 30)  # sparse: costs no disk; reading it whole would take 6 GiB of memory
    out = _stats_cli(tmp_path, "-p", str(os.getpid()), "--json", memory_limit=True)
    assert out.returncode == 1, out.stderr
    assert out.stdout == "" and len(out.stderr.splitlines()) == 1


def test_a_fifo_is_refused_without_hanging(tmp_path, stats_dir):
    stats_dir.mkdir(mode=0o700)
    os.mkfifo(stats_dir / f"{os.getpid()}.json", 0o600)
    out = _stats_cli(tmp_path, "-p", str(os.getpid()))  # no writer ever opens the FIFO: a blocking open hangs
    assert out.returncode == 1 and len(out.stderr.splitlines()) == 1, out.stderr
    out = _stats_cli(tmp_path, "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["processes"] == [], out.stderr


def test_a_link_in_the_stats_directory_is_refused(app, stats_dir, tmp_path):
    stats_dir.mkdir(mode=0o700)
    real = tmp_path / "real.json"
    real.write_bytes(_raw())
    os.chmod(real, 0o600)
    os.symlink(real, stats_dir / f"{os.getpid()}.json")
    for fmt in ([], ["--json"], ["--prometheus"]):
        r = cli(app, "-p", str(os.getpid()), *fmt)
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit) and len(r.stderr.splitlines()) == 1
    with pytest.raises(GdskitPermissionError):
        read_snapshot(os.getpid())


@pytest.mark.skipif(not ROOT, reason="needs root to give a file away")
def test_another_users_snapshot_is_one_error_line_in_every_format(app, stats_dir):
    stats_dir.mkdir(mode=0o700)
    path = stats_dir / f"{os.getpid()}.json"
    path.write_bytes(_raw())
    os.chown(path, 65534, 65534)
    for fmt in ([], ["--json"], ["--prometheus"]):
        r = cli(app, "-p", str(os.getpid()), *fmt)
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit) and len(r.stderr.splitlines()) == 1


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    yield proc
    proc.stdin.close()
    proc.wait(30)


def test_listing_survives_odd_names_and_shows_commands_as_text(app, stats_dir, sleeper):
    stats_dir.mkdir(mode=0o700)
    for odd in ("².json", "٣.json", "0042.json", "9" * 30 + ".json", ".².json.².tmp", "run-²-1-x"):
        (stats_dir / odd).write_text("{}")
    doc = good_doc(sleeper.pid, location.start_ticks(sleeper.pid), argv=["python", "[/x]", "\x1b]0;title\x07"],
                   session="s1")
    publish.write_private(str(stats_dir / f"{sleeper.pid}.json"), json.dumps(doc).encode())
    r = cli(app)
    assert r.exit_code == 0, r.exception
    assert str(sleeper.pid) in r.stdout and "[/x]" in r.stdout and "\x1b" not in r.stdout
    d = json.loads(cli(app, "--json").stdout)
    assert [p["pid"] for p in d["processes"]] == [sleeper.pid]
    assert cli(app, "--prometheus").exit_code == 0
    r = cli(app, "-p", str(sleeper.pid))
    assert r.exit_code == 0 and "[/x]" in r.stdout and "\x1b" not in r.stdout


# -- directories -----------------------------------------------------------------------------------

def _untrusted(d, how: str) -> None:
    """Make ``d`` a directory the reader and the publisher must not trust."""
    if how == "mode":
        d.mkdir()
        os.chmod(d, 0o777)
    elif how == "owner":
        d.mkdir(mode=0o700)
        os.chown(d, 65534, 65534)
    else:  # a link to a private directory: someone could point it anywhere
        real = d.parent / f"{d.name}.real"
        real.mkdir(mode=0o700)
        os.symlink(real, d)


UNTRUSTED = ["mode", pytest.param("owner", marks=pytest.mark.skipif(not ROOT, reason="needs root to chown")), "link"]


@pytest.mark.parametrize("how", UNTRUSTED)
def test_the_reader_never_trusts_a_directory_others_could_write(stats_dir, how):
    _untrusted(stats_dir, how)
    target = stats_dir / f"{os.getpid()}.json"
    target.write_bytes(_raw())  # a snapshot that would be accepted anywhere else
    os.chmod(target, 0o600)
    with pytest.raises(NotPublishingError):
        read_snapshot(os.getpid())
    refused = []
    assert list_snapshots(refused=refused) == [] and [p for p, _ in refused] == [str(stats_dir)]
    with pytest.raises(GdskitPermissionError):
        read.load_file(str(target), os.geteuid())
    assert target.exists()  # and nothing was cleaned there


@pytest.fixture
def places(tmp_path, monkeypatch):
    """The default locations (no GDSKIT_STATS_DIR) under tmp_path, system ones included."""
    monkeypatch.delenv("GDSKIT_STATS_DIR", raising=False)
    base = {k: tmp_path / k for k in ("xdg", "shm", "run_user", "tmp", "home")}
    for d in base.values():
        d.mkdir()
    os.chmod(base["xdg"], 0o700)
    for var, key in (("XDG_RUNTIME_DIR", "xdg"), ("TMPDIR", "tmp"), ("HOME", "home")):
        monkeypatch.setenv(var, str(base[key]))
    uid = os.geteuid()
    order = [base["xdg"] / "gdskit", base["shm"] / f"gdskit-{uid}", base["tmp"] / f"gdskit-{uid}",
             base["home"] / ".cache" / "gdskit" / f"stats-{uid}"]
    with location.system_dirs(shm=str(base["shm"]), run_user=str(base["run_user"])):
        yield base, order


def test_the_default_locations_and_their_order(places):
    _, order = places
    assert [d.path for d in location.candidate_dirs()] == [str(p) for p in order]
    assert all(d.private for d in location.candidate_dirs())
    assert publish.publication_dir().path == str(order[0])
    assert stat.S_IMODE(os.stat(order[0]).st_mode) == 0o700


PUBLISHER = textwrap.dedent("""
    import json, sys, warnings
    from gdskit.telemetry import location

    with location.system_dirs(shm=sys.argv[1], run_user=sys.argv[2]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import gdskit

            gdskit.settings.set(stats_level=1)
        print(json.dumps([w.category.__name__ for w in caught]), flush=True)
        sys.stdin.readline()
""")


def _publisher(tmp_path, base):
    """A process publishing from the default locations under ``base``; also the warnings it got."""
    script = tmp_path / "publisher.py"
    script.write_text(PUBLISHER)
    env = {k: v for k, v in os.environ.items() if k not in ("GDSKIT_STATS", "GDSKIT_STATS_DIR")}
    proc = subprocess.Popen([sys.executable, str(script), str(base["shm"]), str(base["run_user"])], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    return proc, json.loads(line)


def _end(proc):
    proc.stdin.close()
    proc.wait(30)
    proc.stdout.close()
    proc.stderr.close()


root_only = pytest.mark.skipif(not ROOT, reason="needs root to chown")


@pytest.mark.parametrize("hows", [pytest.param(["mode"], id="mode"), pytest.param(["owner"], id="owner", marks=root_only),
                                  pytest.param(["link"], id="link"),
                                  pytest.param(["mode", "link", "mode"], id="all-but-home"),
                                  pytest.param(["owner", "mode", "owner"], id="all-but-home-owners", marks=root_only)])
def test_publication_passes_over_a_directory_someone_else_made_and_stats_finds_it(app, tmp_path, places, hows):
    base, order = places
    spoiled = len(hows)
    for d, how in zip(order, hows):
        _untrusted(d, how)
    modes = [os.lstat(d).st_mode for d in order[:spoiled]]
    proc, warned = _publisher(tmp_path, base)
    try:
        assert warned == []
        name = f"{proc.pid}.json"
        assert (order[spoiled] / name).exists()
        assert stat.S_IMODE(os.stat(order[spoiled]).st_mode) == 0o700
        assert not any((d / name).exists() for d in order[:spoiled])
        assert [os.lstat(d).st_mode for d in order[:spoiled]] == modes  # the others' directories: untouched
        assert read_snapshot(proc.pid).pid == proc.pid
        for fmt in ([], ["--json"], ["--prometheus"]):
            r = cli(app, "-p", str(proc.pid), *fmt)
            assert r.exit_code == 0, r.stderr
        assert str(proc.pid) in cli(app).stdout
    finally:
        _end(proc)
    assert not (order[spoiled] / name).exists()  # withdrawn at exit


def test_no_usable_location_leaves_publication_off_with_a_warning(tmp_path, places):
    base, order = places
    for d in order[:3]:
        _untrusted(d, "mode")
    order[3].parent.mkdir(parents=True)
    _untrusted(order[3], "mode")
    with pytest.raises(GdskitPermissionError):
        publish.publication_dir()
    proc, warned = _publisher(tmp_path, base)
    try:
        assert warned == ["RuntimeWarning"]
        assert all(os.listdir(d) == [] for d in order)
    finally:
        _end(proc)


READER = textwrap.dedent("""
    import sys
    import numpy as np
    import gdskit

    with gdskit.open(sys.argv[1]) as f:
        f.read(np.empty(4096, dtype=np.uint8))
""")


def test_gdskit_run_collects_from_the_default_locations(tmp_path, places):
    from gdskit.telemetry import run_workload

    _, order = places
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(4096))
    script = tmp_path / "reader.py"
    script.write_text(READER)
    report = run_workload([sys.executable, str(script), str(data)], level=1)
    assert (report.returncode, report.processes, report.stats.total_bytes, report.partial) == (0, 1, 4096, False)
    assert os.listdir(order[0]) == []  # the run directory is gone, and the live snapshot withdrawn


# -- writing -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("plant", ["symlink", "hardlink"])
def test_a_link_planted_at_the_temporary_name_is_not_written_through(tmp_path, plant):
    d = tmp_path / "stats"
    d.mkdir(mode=0o700)
    outside = tmp_path / "precious.txt"
    outside.write_bytes(b"keep me")
    tmp = d / f".7.json.{os.getpid()}.tmp"
    (os.symlink if plant == "symlink" else os.link)(outside, tmp)
    publish.write_private(str(d / "7.json"), b"snapshot")
    assert outside.read_bytes() == b"keep me"
    st_ = os.lstat(d / "7.json")
    assert stat.S_ISREG(st_.st_mode) and stat.S_IMODE(st_.st_mode) == 0o600 and st_.st_nlink == 1
    assert (d / "7.json").read_bytes() == b"snapshot"
    assert sorted(os.listdir(d)) == sorted(["7.json", tmp.name])  # the planted name: passed over, untouched


def test_the_temporary_file_is_opened_exclusive_without_following_links_and_close_on_exec(tmp_path, monkeypatch):
    d = tmp_path / "stats"
    d.mkdir(mode=0o700)
    real_open, seen = os.open, []

    def spy(path, flags, mode=0o777, *, dir_fd=None):
        seen.append((os.fspath(path), flags, mode))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", spy)
    publish.write_private(str(d / "7.json"), b"x")
    monkeypatch.undo()
    (flags, mode), = [(f, m) for p, f, m in seen if p.endswith(".tmp")]
    want = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    assert flags & want == want and flags & os.O_ACCMODE != os.O_RDONLY and not flags & os.O_TRUNC and mode == 0o600


def test_the_temporary_file_is_fresh_and_private_whatever_the_umask(tmp_path):
    d = tmp_path / "stats"
    d.mkdir(mode=0o700)
    old = os.umask(0o277)  # would leave a new file unwritable, and a new directory unusable
    try:
        publish.write_private(str(d / "7.json"), b"one")
        publish.write_private(str(d / "7.json"), b"two")
        place = location.StatsDir(str(tmp_path / "new"))
        publish.prepare_dir(place)
        publish.write_private(str(tmp_path / "new" / "7.json"), b"three", private=True)
    finally:
        os.umask(old)
    assert (d / "7.json").read_bytes() == b"two"
    assert stat.S_IMODE(os.stat(d / "7.json").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o700


@pytest.mark.parametrize("how", UNTRUSTED)
def test_the_publisher_does_not_write_into_a_directory_it_does_not_trust(tmp_path, how):
    d = tmp_path / "stats"
    _untrusted(d, how)
    with pytest.raises(GdskitPermissionError):
        publish.write_private(str(d / "7.json"), b"x")
    assert not os.path.exists(d / "7.json")


def test_errors_from_a_stats_directory_are_gdskit_errors(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(GdskitError):
        read.load_file(str(tmp_path / "file" / "1.json"), os.geteuid())
    with pytest.raises(FileNotFoundError):
        read.load_file(str(tmp_path / "absent" / "1.json"), os.geteuid())
