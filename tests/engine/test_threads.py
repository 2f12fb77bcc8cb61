"""gdskit's threads leave the process's signals to the main thread, and `gdskit run` forwards a
signal that comes while its workload is being started.

A signal sent to a process goes to any thread that does not block it; Python runs its handler
only in the main thread, and a main thread in a blocking call (``time.sleep``, ``Popen.wait``)
stays in it when the signal lands elsewhere: a Ctrl-C then waited for the sleep to end.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import gdskit
from gdskit import threads
from gdskit.telemetry import run_workload
from gdskit.telemetry import workload as workload_mod
from repo_paths import SRC as REPO_SRC, SUPPORT

SRC = REPO_SRC / "gdskit"
ASYNC = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGCHLD)


def test_threads_started_through_the_helpers_block_the_process_signals():
    seen = {}

    def report(key):
        seen[key] = signal.pthread_sigmask(signal.SIG_BLOCK, [])

    threads.start_thread(lambda: report("thread"), "gdskit-test").join()
    with threads.executor(2, "gdskit-test-pool") as ex:
        ex.submit(report, "pool").result()
    for key in ("thread", "pool"):
        assert set(ASYNC) <= seen[key], key
        # Faults and SIGPIPE belong to the thread that caused them: never blocked.
        assert not {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGPIPE} & seen[key], key
    # The caller's own mask is left as it was.
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


_ENGINE_THREADS = """
import json, sys, threading
sys.path.insert(0, sys.argv[2])
import numpy as np
import gdskit
from signal_helpers import blocked_signals

def blocked(t):
    return sorted(blocked_signals(tid=t.native_id))

path = sys.argv[1]
data = np.fromfile(path, dtype=np.uint8)
buf = np.empty_like(data)
with gdskit.settings.set(threads=4, chunk_size="256K"), gdskit.open(path) as f:
    assert f.read(buf) == data.nbytes                                 # the io workers
    assert f.pread(buf[:4096], 4096, file_offset=0).result() == 4096  # a request thread
assert np.array_equal(buf, data)
print(json.dumps({t.name: blocked(t) for t in threading.enumerate() if t.is_alive()}))
"""


def test_the_engines_threads_block_the_process_signals(tmp_path, stats_dir):
    """In a fresh process publishing its figures: the workers, a request thread, the publisher."""
    path = tmp_path / "data.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8).tobytes())
    out = subprocess.run([sys.executable, "-c", _ENGINE_THREADS, str(path), str(SUPPORT)],
                         capture_output=True, text=True,
                         env={**os.environ, "GDSKIT_STATS": "1"}, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    masks = json.loads(out.stdout)
    main = masks.pop("MainThread")
    assert signal.SIGINT not in main and signal.SIGTERM not in main
    kinds = {name.split("_")[0] for name in masks}
    assert {"gdskit-io", "gdskit-req", "gdskit-stats"} <= kinds, masks
    for name, blocked in masks.items():
        assert set(ASYNC) <= set(blocked), name


def test_no_module_starts_a_thread_another_way():
    """Every thread gdskit starts goes through gdskit.threads, where the mask is set."""
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "threads.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
                if name in ("Thread", "ThreadPoolExecutor", "ProcessPoolExecutor"):
                    offenders.append(f"{path.relative_to(SRC)}:{node.lineno} {name}")
    assert not offenders, offenders


def _popen_then(sig, *, fail=False):
    """A Popen that starts the workload and then receives ``sig`` before the runner goes on
    (or fails to start it, as a missing command would)."""
    real = subprocess.Popen
    started = []

    def popen(*args, **kwargs):
        if fail:
            os.kill(os.getpid(), sig)
            raise FileNotFoundError(2, "No such file or directory", args[0][0])
        proc = real(*args, **kwargs)
        started.append(proc)
        os.kill(os.getpid(), sig)
        time.sleep(0.05)  # the handler runs here, while the runner is still inside Popen
        return proc

    return popen, started


def test_a_ctrl_c_while_the_workload_starts_is_passed_on_to_it(monkeypatch, stats_dir):
    popen, started = _popen_then(signal.SIGINT)
    monkeypatch.setattr(workload_mod.subprocess, "Popen", popen)
    t0 = time.monotonic()
    try:
        report = run_workload([sys.executable, "-c", "import time; time.sleep(30)"])
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C ended the runner and left its workload running")
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert report.returncode == -signal.SIGINT
    assert time.monotonic() - t0 < 20


def test_a_signal_before_a_workload_that_never_started_is_the_runners_own(monkeypatch, stats_dir):
    popen, _ = _popen_then(signal.SIGINT, fail=True)
    monkeypatch.setattr(workload_mod.subprocess, "Popen", popen)
    with pytest.raises(KeyboardInterrupt):
        run_workload(["/nonexistent/command"])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
