"""``gdskit bench --processes``: each worker a process of its own, with the same results and clean-up."""

from __future__ import annotations

import json
import os
import resource
import signal

import psutil
import pytest

import gdskit
from gdskit.bench import procs, runner
from gdskit.bench.params import MiB, make_params
from gdskit.errors import GdskitFileNotFoundError, GdskitIOError, WorkerProcessError


_EARLIER: set[int] = set()


@pytest.fixture(autouse=True)
def _earlier_children():
    """Children the test process had before the test (a session's S3 server, say) are not the
    test's: only those it started count."""
    _EARLIER.clear()
    _EARLIER.update(p.pid for p in psutil.Process().children(recursive=True))
    yield


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in _EARLIER]


def test_reads_happen_in_the_worker_processes_and_their_cpu_is_counted(tmp_path):
    # Hot: the workers spend their time on the CPU, not waiting for a disk, whatever the machine.
    p = make_params(size="16M", io_size="4K", workers=2, paths="host", op="randread", cache="hot",
                    repeat=2, duration=0.4, processes=True)
    before = gdskit.stats()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    rep = runner.run_benchmark(p, workdir=str(tmp_path))
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    own = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    assert rep.params["processes"] is True
    for r in rep.runs:
        assert r.ops > 100 and r.bytes == r.ops * 4096
        assert r.taken == {"host": r.bytes} and not r.fell_back
        assert r.latency_p50_us is not None and r.latency_p99_us >= r.latency_p50_us
    # This process read nothing itself (its ledger did not move): the workers did, elsewhere...
    assert (gdskit.stats() - before).paths.get("host") is None
    # ...and the CPU they spent is in the report, beyond what this process spent waiting for them.
    assert sum(r.cpu.process_cpu_s for r in rep.runs) > own
    assert os.listdir(tmp_path) == [] and _children() == []


def test_sequential_read_makes_one_pass_per_run(tmp_path):
    p = make_params(size="8M", io_size="1M", workers=2, paths="host", cache="cold", repeat=1, processes=True)
    (r,) = runner.run_benchmark(p, workdir=str(tmp_path)).runs
    assert r.bytes == 8 * MiB and r.ops == 8 and r.taken == {"host": 8 * MiB}


@pytest.mark.parametrize("op,cache", [("randwrite", "cold"), ("read", "hot")])
def test_verify_in_processes(tmp_path, op, cache):
    target = tmp_path / "v.bin"
    p = make_params(file=str(target), size="4M", io_size="64K", workers=3, paths="host", op=op, verify=True,
                    cache=cache, repeat=1, total="1M" if op == "randwrite" else None, processes=True)
    rep = runner.run_benchmark(p)
    (r,) = rep.runs
    assert r.verify is not None and r.verify.ok and r.verify.checked_bytes > 0
    assert rep.verify_ok is True


def test_a_worker_error_comes_back_as_the_same_exception_type(tmp_path):
    p = make_params(size="4M", io_size="1M", workers=1, paths="host", repeat=1, processes=True)
    missing = str(tmp_path / "gone.bin")
    targets = runner.Targets(files=[missing], slices=[(missing, 0, 4 * MiB)])
    with procs.WorkerProcesses(1) as pool:
        with pytest.raises(GdskitFileNotFoundError) as exc_info:
            runner.run_once(p, targets, "host", MiB, 0, pool)
        assert missing in str(exc_info.value)
        # A short read in the timed window (the file is shorter than the slice) is an I/O error.
        short = tmp_path / "short.bin"
        short.write_bytes(b"x" * MiB)
        targets = runner.Targets(files=[str(short)], slices=[(str(short), 0, 4 * MiB)])
        with pytest.raises(GdskitIOError, match="short read"):
            runner.run_once(p, targets, "host", MiB, 0, pool)
        # The pool still serves after its workers' errors.
        ok = runner.Targets(files=[str(short)], slices=[(str(short), 0, MiB)])
        assert runner.run_once(p, ok, "host", MiB, 0, pool).bytes == MiB
    assert _children() == []


def test_a_worker_process_that_dies_is_reported_not_hung(tmp_path):
    p = make_params(size="4M", io_size="1M", workers=2, paths="host", repeat=1, processes=True)
    data = tmp_path / "d.bin"
    data.write_bytes(b"\0" * 4 * MiB)
    targets = runner.Targets(files=[str(data)], slices=[(str(data), 0, 2 * MiB), (str(data), 2 * MiB, 2 * MiB)])
    with procs.WorkerProcesses(2) as pool:
        os.kill(pool.pids[1], signal.SIGKILL)
        with pytest.raises(WorkerProcessError, match="signal 9"):
            runner.run_once(p, targets, "host", MiB, 0, pool)
    assert _children() == []


def test_ctrl_c_ends_the_worker_processes_and_removes_the_file(tmp_path, monkeypatch):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(procs.cpu_mod, "sample", interrupted)  # after the workers are ready, before the start
    p = make_params(size="4M", io_size="1M", workers=2, paths="host", repeat=1, processes=True)
    with pytest.raises(KeyboardInterrupt):
        runner.run_benchmark(p, workdir=str(tmp_path))
    assert os.listdir(tmp_path) == [] and _children() == []


def test_cli_processes_flag(tmp_path, monkeypatch):
    from test_bench_runner import _invoke

    monkeypatch.chdir(tmp_path)
    args = ["-s", "4M", "-i", "1M", "-w", "2", "-x", "host", "--repeat", "1", "--processes"]
    res = _invoke(*args, "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["params"]["processes"] is True and d["runs"][0]["bytes"] == 4 * MiB
    res = _invoke(*args)
    assert res.exit_code == 0 and "2 worker processes" in res.stdout


def test_an_interrupted_run_ends_its_workers_at_once(tmp_path, monkeypatch):
    """Ctrl-C in the middle of a long time-bound run: the workers are not waited for."""
    import time

    monkeypatch.setattr(procs, "_EXIT_GRACE_S", 60.0)  # what waiting for them would cost

    data = tmp_path / "d.bin"
    data.write_bytes(b"\0" * 4 * MiB)
    p = make_params(file=str(data), size="4M", io_size="4K", workers=2, paths="host", op="randread", cache="hot",
                    repeat=1, duration=60.0, processes=True)
    targets = runner.Targets(files=[str(data)], slices=[(str(data), 0, 2 * MiB), (str(data), 2 * MiB, 2 * MiB)])
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with procs.WorkerProcesses(2) as pool:
            real_recv = pool._recv
            calls = {"n": 0}

            def recv(child):
                calls["n"] += 1
                if calls["n"] > 2:  # both are ready and running: the user presses Ctrl-C
                    raise KeyboardInterrupt
                return real_recv(child)

            pool._recv = recv
            runner.run_once(p, targets, "host", 4096, 0, pool)
    assert time.monotonic() - t0 < 30 and _children() == []


def test_small_io_from_threads_points_at_processes(tmp_path):
    threads = make_params(size="4M", io_size="4K", workers=2, paths="host", op="randread", total="64K", cache="hot",
                          repeat=1)
    rep = runner.run_benchmark(threads, workdir=str(tmp_path))
    assert any("--processes" in w for w in rep.warnings)
    for p in (make_params(size="4M", io_size="4K", workers=2, paths="host", op="randread", total="64K", cache="hot",
                          repeat=1, processes=True),
              make_params(size="4M", io_size="1M", workers=2, paths="host", repeat=1, cache="hot"),
              make_params(size="4M", io_size="4K", workers=1, paths="host", op="randread", total="64K", repeat=1,
                          cache="hot")):
        assert not any("--processes" in w for w in runner.run_benchmark(p, workdir=str(tmp_path)).warnings)


def test_a_worker_process_that_cannot_start_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(procs.sys, "executable", str(tmp_path / "no-such-python"))
    p = make_params(size="4M", io_size="1M", workers=2, paths="host", repeat=1, processes=True)
    with pytest.raises(WorkerProcessError, match="cannot start"):
        runner.run_benchmark(p, workdir=str(tmp_path))
    assert os.listdir(tmp_path) == [] and _children() == []


def test_workers_started_from_a_gdskit_thread_still_take_sigterm(tmp_path):
    """A child inherits the signal mask of the thread that started it (gdskit's threads block the
    process's signals): a worker unblocks them first thing, so the parent's SIGTERM ends it."""
    from gdskit.threads import start_thread
    from signal_helpers import blocked_signals

    made = []
    start_thread(lambda: made.append(procs.WorkerProcesses(1)), "gdskit-test").join()
    (pool,) = made
    try:
        p = make_params(size="1M", io_size="1M", workers=1, paths="host", repeat=1, processes=True)
        data = tmp_path / "d.bin"
        data.write_bytes(os.urandom(MiB))
        targets = runner.Targets(files=[str(data)], slices=[(str(data), 0, MiB)])
        assert runner.run_once(p, targets, "host", MiB, 0, pool).bytes == MiB  # the worker is past its start
        (pid,) = pool.pids
        assert signal.SIGTERM not in blocked_signals(pid)
    finally:
        pool.close(now=True)
    assert _children() == []
