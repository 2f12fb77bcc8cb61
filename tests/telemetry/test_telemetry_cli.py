"""`gdskit stats` on the command line: tables, --json schema, --prometheus, --watch, errors and exit codes."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import typer
from test_telemetry_prometheus import parse_prometheus
from cli_app import one_command_app
from typer.testing import CliRunner

from gdskit.cli import stats as stats_cli

CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import gdskit
    from gdskit.telemetry import publish_now

    buf = np.empty(1 << 20, dtype=np.uint8)
    with gdskit.open(sys.argv[1]) as f:
        f.read(buf)
        f.read(buf[:4096])
    publish_now()
    print("ready", flush=True)
    sys.stdin.readline()
""")

SNAPSHOT_KEYS = {"schema", "pid", "start_ticks", "uid", "argv", "level", "interval_s", "session", "final", "seq",
                 "started_at", "updated_at", "ledger"}
LEDGER_KEYS = {"total_bytes", "direct_bytes", "posix_bytes", "requests", "paths", "reasons", "entries"}
PATH_KEYS = {"bytes_read", "bytes_written", "ops_read", "ops_written", "busy_s", "requests", "mean_latency_s"}
ENTRY_KEYS = {"path", "reason", "op", "bytes", "ops", "busy_s", "requests"}


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    return one_command_app(stats_cli.register)


@pytest.fixture
def child(tmp_path, stats_dir):
    """A process publishing at level 3 after 1 MiB + 4 KiB of host reads; ends when the test does."""
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(1 << 20))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "GDSKIT_STATS": "3", "GDSKIT_STATS_DIR": str(stats_dir)}
    proc = subprocess.Popen([sys.executable, str(script), str(data)], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    with contextlib.suppress(BrokenPipeError):  # it may have ended already
        proc.stdin.write("\n")
        proc.stdin.close()
    proc.wait(30)
    proc.stdout.close()


def stats(app, *args):
    return CliRunner().invoke(app, ["stats", *args], env={"COLUMNS": "200"})


def test_json_follows_the_schema_at_each_level(app, child):
    r = stats(app, "-p", str(child.pid), "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert set(d) == SNAPSHOT_KEYS | {"gpus", "cufile"} and d["schema"] == "gdskit.stats/1"
    assert d["pid"] == child.pid and d["level"] == 3 and d["cufile"] is None and d["gpus"] == {}
    assert set(d["ledger"]) == LEDGER_KEYS
    assert d["ledger"]["total_bytes"] == (1 << 20) + 4096 and d["ledger"]["posix_bytes"] == (1 << 20) + 4096
    assert set(d["ledger"]["paths"]["host"]) == PATH_KEYS
    (entry,) = d["ledger"]["entries"]
    assert set(entry) == ENTRY_KEYS | {"size_hist"} and entry["size_hist"] == {"4096": 1, "1048576": 1}

    d1 = json.loads(stats(app, "-p", str(child.pid), "--json", "-l", "1").stdout)
    assert set(d1) == SNAPSHOT_KEYS and d1["level"] == 1
    assert set(d1["ledger"]["entries"][0]) == ENTRY_KEYS


def test_table_shows_paths_reasons_sizes_and_verdict(app, child):
    r = stats(app, "-p", str(child.pid))
    assert r.exit_code == 0, r.output
    for words in ("Paths", "host", "Reasons", "Request sizes", "1.0 MiB", "cuFile: not in use",
                  "verdict: everything went through posix"):
        assert words in r.stdout


def test_list_shows_this_users_publishing_processes(app, child):
    r = stats(app)
    assert r.exit_code == 0 and str(child.pid) in r.stdout
    d = json.loads(stats(app, "--json").stdout)
    assert d["schema"] == "gdskit.stats/1" and [p["pid"] for p in d["processes"]] == [child.pid]


def test_prometheus_output_parses(app, child):
    r = stats(app, "-p", str(child.pid), "--prometheus")
    assert r.exit_code == 0, r.output
    samples = parse_prometheus(r.stdout)
    pid = str(child.pid)
    reason = next(dict(labels)["reason"] for name, labels in samples if name == "gdskit_bytes_total")
    assert reason in ("no_gpu", "host_memory")
    key = frozenset({"pid": pid, "path": "host", "reason": reason, "op": "read"}.items())
    assert samples[("gdskit_bytes_total", key)] == (1 << 20) + 4096
    assert samples[("gdskit_requests_total", key)] == 2
    assert samples[("gdskit_busy_seconds_total", key)] > 0
    hist = frozenset({"pid": pid, "path": "host", "op": "read", "le": "4096"}.items())
    assert samples[("gdskit_request_size_bytes_bucket", hist)] == 1
    inf = frozenset({"pid": pid, "path": "host", "op": "read", "le": "+Inf"}.items())
    assert samples[("gdskit_request_size_bytes_bucket", inf)] == 2
    assert ("gdskit_request_size_bytes_sum", frozenset({"pid": pid, "path": "host", "op": "read"}.items())) in samples


WATCHER = textwrap.dedent('''
    import typer
    from gdskit.cli import stats as stats_cli

    app = typer.Typer()

    @app.callback()
    def _main() -> None:
        """gdskit"""

    stats_cli.register(app)
    app()
''')


def test_watch_follows_the_process_until_it_ends(child, tmp_path):
    script = tmp_path / "watcher.py"
    script.write_text(WATCHER)
    watcher = subprocess.Popen([sys.executable, str(script), "stats", "-p", str(child.pid), "--watch", "0.05",
                                "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(watcher.stdout.readline())  # a frame was shown while the child lived
        assert first["pid"] == child.pid and first["ledger"]["total_bytes"] == (1 << 20) + 4096
        child.stdin.write("\n")
        child.stdin.flush()  # the child ends; --watch notices and exits 0
        rest, err = watcher.communicate(timeout=60)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    assert watcher.returncode == 0, err
    assert all(json.loads(x)["pid"] == child.pid for x in rest.splitlines() if x.strip())
    assert "ended" in err


def test_asking_more_than_published_says_how(app, tmp_path, stats_dir):
    env = {**os.environ, "GDSKIT_STATS": "1", "GDSKIT_STATS_DIR": str(stats_dir)}
    code = "import gdskit, sys; print('ready', flush=True); sys.stdin.readline()"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        r = stats(app, "-p", str(proc.pid), "-l", "3")
        assert r.exit_code == 0 and "GDSKIT_STATS=3" in r.stderr
        assert "verdict: no gdskit I/O recorded" in r.stdout
    finally:
        proc.stdin.close()
        proc.wait()
        proc.stdout.close()


def test_errors_are_clear_and_exit_1(app, stats_dir):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    r = stats(app, "-p", str(dead.pid))
    assert r.exit_code == 1 and f"no process with pid {dead.pid}" in r.stderr
    r = stats(app, "-p", str(os.getpid()))
    assert r.exit_code == 1 and "not publishing" in r.stderr and "GDSKIT_STATS=1" in r.stderr


def test_another_users_process_exits_1_with_a_permission_message(app, child, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 65534)
    r = stats(app, "-p", str(child.pid))
    assert r.exit_code == 1 and "readable only by the user who runs the process" in r.stderr


def test_bad_option_combinations_exit_2(app):
    assert stats(app, "--json", "--prometheus").exit_code == 2
    assert stats(app, "-p", "1", "--watch", "1", "--prometheus").exit_code == 2
    assert stats(app, "-l", "4").exit_code == 2


def test_watch_rates_come_from_published_snapshots_not_from_looks():
    from gdskit.cli.stats import _advance
    from gdskit.engine.ledger import Ledger
    from gdskit.telemetry.snapshot import Snapshot, ledger_dict
    from gdskit.vocabulary import Path, Reason

    def snap(seq, at, nbytes):
        led = Ledger()
        led.record(Path.HOST, Reason.NO_GPU, "read", nbytes, 1, 0.0)
        return Snapshot({"schema": "gdskit.stats/1", "pid": 1, "seq": seq, "updated_at": at, "interval_s": 0.5,
                         "level": 1, "ledger": ledger_dict(led.snapshot(), 1)}, "x")

    a, b = snap(1, 100.0, 0), snap(2, 100.5, 1 << 30)
    shown, rates = _advance(a, b, {}, now=100.6)
    assert shown is b and rates == {"host": 2 * (1 << 30)}
    # Looked again before the next publication: the same rate, not zero.
    assert _advance(b, snap(2, 100.5, 1 << 30), rates, now=100.7) == (b, rates)
    # Nothing published for two intervals: idle.
    assert _advance(b, snap(2, 100.5, 1 << 30), rates, now=102.0) == (b, {})
