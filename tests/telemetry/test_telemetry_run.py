"""`gdskit run` and run_workload: summing every gdskit process of a workload, verdicts on the host
path, --require direct, exit statuses, killed and timed-out workloads, Ctrl-C forwarding."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import textwrap

import psutil
import pytest

from gdskit.errors import (
    GdskitFileNotFoundError,
    InvalidArgumentError,
    WorkloadTimeoutError,
)
from gdskit.engine.ledger import LedgerEntry, Stats
from gdskit.telemetry import Snapshot, WorkloadReport, run_workload, verdict
from gdskit.telemetry.workload import make_report

HOST_REASONS = ("no_gpu", "host_memory")  # which one depends on whether this machine has a GPU

READER = textwrap.dedent("""
    import sys
    import numpy as np
    import gdskit

    buf = np.empty(int(sys.argv[2]), dtype=np.uint8)
    with gdskit.open(sys.argv[1]) as f:
        f.read(buf)
""")

# A parent that reads 1 MiB, starts a fresh interpreter (which inherits GDSKIT_STATS) reading 2 MiB,
# and a multiprocessing fork child reading 4 KiB: nothing may be counted twice.
FAMILY = textwrap.dedent("""
    import multiprocessing as mp, subprocess, sys
    import numpy as np
    import gdskit

    def forked(path):
        buf = np.empty(4096, dtype=np.uint8)
        with gdskit.open(path) as f:
            f.read(buf)

    if __name__ == "__main__":
        path, reader = sys.argv[1], sys.argv[2]
        buf = np.empty(1 << 20, dtype=np.uint8)
        with gdskit.open(path) as f:
            f.read(buf)
        subprocess.run([sys.executable, reader, path, str(2 << 20)], check=True)
        p = mp.get_context("fork").Process(target=forked, args=(path,))
        p.start()
        p.join()
        sys.exit(p.exitcode)
""")

APP = textwrap.dedent("""
    import typer
    from gdskit.cli import run as run_cli

    app = typer.Typer()

    @app.callback()
    def _main() -> None:
        '''gdskit'''

    run_cli.register(app)
    app()
""")


@pytest.fixture
def files(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(2 << 20))
    reader = tmp_path / "reader.py"
    reader.write_text(READER)
    family = tmp_path / "family.py"
    family.write_text(FAMILY)
    app = tmp_path / "app.py"
    app.write_text(APP)
    return {"data": str(data), "reader": str(reader), "family": str(family), "app": str(app)}


def _gdskit_run(files, *args, **kwargs):
    return subprocess.run([sys.executable, files["app"], "run", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"}, timeout=120, check=False, **kwargs)


def test_host_path_workload_everything_went_through_posix(files, stats_dir):
    report = run_workload([sys.executable, files["reader"], files["data"], str(1 << 20)])
    assert isinstance(report, WorkloadReport)
    assert report.returncode == 0 and report.processes == 1 and not report.partial
    assert report.stats.total_bytes == 1 << 20 and report.stats.paths["host"].bytes_read == 1 << 20
    assert report.direct_bytes == 0 and report.posix_bytes == 1 << 20 and report.all_direct is False
    (reason,) = report.stats.reasons
    assert reason in HOST_REASONS and report.verdict == f"everything went through posix: {reason}"
    assert report.cufile_counters is None
    d = json.loads(json.dumps(report.to_dict()))
    assert d["schema"] == "gdskit.run/1" and d["verdict"] == report.verdict and d["stats"]["total_bytes"] == 1 << 20
    assert os.listdir(stats_dir) == []  # the run directory is gone, and so are the live snapshots


def test_every_gdskit_process_of_the_workload_is_summed_once(files, stats_dir):
    report = run_workload([sys.executable, files["family"], files["data"], files["reader"]], level=1)
    assert report.returncode == 0
    assert report.processes == 3 and not report.partial
    assert report.stats.total_bytes == (1 << 20) + (2 << 20) + 4096
    assert report.stats.requests == 3


def test_no_gdskit_io(files, stats_dir):
    report = run_workload([sys.executable, "-c", "import gdskit"])
    assert report.verdict == "no gdskit I/O recorded" and report.processes == 1
    assert not report.all_direct and report.stats.total_bytes == 0
    report = run_workload([sys.executable, "-c", "raise SystemExit(3)"])
    assert report.returncode == 3 and report.processes == 0 and report.verdict == "no gdskit I/O recorded"


def test_a_killed_workload_still_reports_its_last_snapshot(files, stats_dir):
    code = ("import os, signal, numpy as np, gdskit\n"
            "from gdskit.telemetry import publish_now\n"
            f"buf = np.empty(4096, dtype=np.uint8)\n"
            f"with gdskit.open({files['data']!r}) as f: f.read(buf)\n"
            "publish_now()\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    report = run_workload([sys.executable, "-c", code])
    assert report.returncode == -signal.SIGKILL
    assert report.partial and report.processes == 1 and report.stats.total_bytes == 4096
    assert os.listdir(stats_dir) == []  # the killed process's leftover snapshot was collected and removed


def test_timeout_stops_the_workload_and_keeps_the_report(files, stats_dir):
    with pytest.raises(WorkloadTimeoutError) as info:
        run_workload([sys.executable, "-c", "import gdskit, time; time.sleep(60)"], timeout=0.5)
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value.report, WorkloadReport) and info.value.report.returncode == -signal.SIGTERM


def test_timeout_also_stops_what_the_workload_started(tmp_path, stats_dir):
    from gdskit.telemetry.location import start_ticks

    pid_file = tmp_path / "child.pid"
    script = f"sleep 60 & echo $! > {pid_file}; wait"
    with pytest.raises(WorkloadTimeoutError):
        run_workload(["bash", "-c", script], timeout=3)  # time enough for bash to write the pid
    child = int(pid_file.read_text())

    def gone() -> bool:  # dead; a zombie counts (where nothing reaps orphans, e.g. pytest as PID 1)
        if start_ticks(child) is None:
            return True
        try:
            return psutil.Process(child).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    deadline = time.monotonic() + 5
    while not gone() and time.monotonic() < deadline:  # reaped by init shortly
        time.sleep(0.05)
    assert gone(), "the workload's own child survived the timeout"


@pytest.mark.parametrize("where", ["no-dir/r.json", "a-dir"])
def test_an_unwritable_report_file_exits_2_before_the_workload_runs(files, stats_dir, tmp_path, where):
    (tmp_path / "a-dir").mkdir()
    ran = tmp_path / "ran"
    r = _gdskit_run(files, "--report", str(tmp_path / where), "--", sys.executable, "-c",
                    f"open({str(ran)!r}, 'w').close()")
    assert r.returncode == 2 and "gdskit run: error" in r.stderr and "Traceback" not in r.stderr
    assert not ran.exists(), "the workload ran although its report could never be written"


def test_a_report_into_a_device_is_written_into_it_never_replacing_it(files, stats_dir, tmp_path):
    """A device node of the test's own like /dev/full (never a system device: a test that failed
    would replace it): the report is written into it, whose ENOSPC is exit 2, and it stays a device."""
    import stat

    from device_nodes import private_device

    (tmp_path / "dev").mkdir()
    full = private_device(tmp_path / "dev" / "full", 1, 7)
    r = _gdskit_run(files, "--report", str(full), "--", sys.executable, "-c", "pass")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "gdskit run: error" in r.stderr, r.stderr
    assert stat.S_ISCHR(os.stat(full).st_mode) and os.listdir(tmp_path / "dev") == ["full"]


def test_the_report_file_is_replaced_whole(files, stats_dir, tmp_path):
    (tmp_path / "reports").mkdir()
    out = tmp_path / "reports" / "r.json"
    out.write_text("the previous report")
    r = _gdskit_run(files, "--report", str(out), "--", sys.executable, "-c", "pass")
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["schema"] == "gdskit.run/1"
    assert os.listdir(tmp_path / "reports") == ["r.json"]  # no temporary left beside it


def test_workload_output_can_go_elsewhere(stats_dir):
    code = ("import sys; from gdskit.telemetry import run_workload; "
            "run_workload([sys.executable, '-c', 'print(\"from-workload\")'], stdout=2); print('runner-out')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "GDSKIT_STATS_DIR": str(stats_dir)})
    assert r.returncode == 0, r.stderr
    assert r.stdout == "runner-out\n" and "from-workload" in r.stderr


def test_bad_arguments(stats_dir):
    with pytest.raises(GdskitFileNotFoundError):
        run_workload(["/nonexistent/command"])
    with pytest.raises(InvalidArgumentError):
        run_workload([])
    with pytest.raises(InvalidArgumentError):
        run_workload(["true"], level=0)


def _stats(*rows) -> Stats:
    return Stats.from_entries([LedgerEntry(p, r, op, n, 1, 0.001, 1) for p, r, op, n in rows])


def _report(stats: Stats) -> WorkloadReport:
    doc = {"schema": "gdskit.stats/1", "pid": 1, "level": 1, "ledger": {"entries": [
        {**e.to_dict(), "busy_s": e.busy_s} for e in stats.entries]}}
    return make_report(["x"], 0, 1.0, [Snapshot(doc)])


def test_verdict_words():
    direct = _stats(("cufile-nvfs", "direct", "read", 100), ("cufile-p2pdma", "direct", "write", 5))
    assert verdict(direct) == "direct grew, posix flat"
    r = _report(direct)
    assert r.all_direct and r.direct_bytes == 105 and r.posix_bytes == 0
    mixed = _stats(("cufile-nvfs", "direct", "read", 75), ("bounce-direct", "unaligned", "read", 20),
                   ("bounce-cached", "below_threshold", "read", 5))
    assert verdict(mixed) == "direct grew, posix grew too: 25.0% of the bytes were not direct: unaligned, below_threshold"
    assert not _report(mixed).all_direct
    posix = _stats(("cufile-compat", "nvidia_fs_missing", "read", 10), ("bounce-direct", "udev_missing", "read", 30))
    assert verdict(posix) == "everything went through posix: udev_missing, nvidia_fs_missing"
    assert verdict(Stats()) == "no gdskit I/O recorded"


def test_cli_prints_the_split_and_the_verdict(files, stats_dir):
    r = _gdskit_run(files, "--", sys.executable, files["reader"], files["data"], "8192")
    assert r.returncode == 0, r.stderr
    assert "Path split" in r.stderr and "host" in r.stderr
    assert re.search(r"verdict: everything went through posix: (no_gpu|host_memory)", r.stderr)
    assert r.stdout == ""  # the workload owns stdout


def test_cli_require_direct_fails_on_the_host_path(files, stats_dir):
    r = _gdskit_run(files, "--require", "direct", "--", sys.executable, files["reader"], files["data"], "8192")
    assert r.returncode == 1 and "requirement 'direct' NOT met" in r.stderr
    r = _gdskit_run(files, "--require", "direct", "--", sys.executable, "-c", "import gdskit")
    assert r.returncode == 1  # no bytes at all is not "all direct" either


def test_cli_json_and_report_file(files, stats_dir, tmp_path):
    out = tmp_path / "report.json"
    r = _gdskit_run(files, "--json", "--report", str(out), "-l", "2", "--",
                    sys.executable, files["reader"], files["data"], "8192")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert json.loads(out.read_text()) == d
    assert set(d) == {"schema", "argv", "returncode", "duration_s", "direct_bytes", "posix_bytes", "all_direct",
                      "verdict", "processes", "partial", "stats", "cufile_counters"}
    assert d["stats"]["total_bytes"] == 8192 and d["posix_bytes"] == 8192


def test_cli_exit_statuses(files, stats_dir):
    assert _gdskit_run(files, "--", sys.executable, "-c", "raise SystemExit(3)").returncode == 3
    r = _gdskit_run(files, "--", "/nonexistent/command")
    assert r.returncode == 127 and "command not found" in r.stderr
    r = _gdskit_run(files, "--timeout", "0.3", "--", sys.executable, "-c", "import time; time.sleep(60)")
    assert r.returncode == 124 and "timeout" in r.stderr


def test_cli_forwards_ctrl_c_to_the_workload(files, stats_dir):
    code = ("import sys, time, numpy as np, gdskit\n"
            f"buf = np.empty(4096, dtype=np.uint8)\n"
            f"with gdskit.open({files['data']!r}) as f: f.read(buf)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    runner = subprocess.Popen([sys.executable, files["app"], "run", "--", sys.executable, "-c", code],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                              env={**os.environ, "COLUMNS": "200"})
    try:
        assert runner.stdout.readline().strip() == "ready"
        runner.send_signal(signal.SIGINT)  # not from a terminal: the runner passes it on
        _, err = runner.communicate(timeout=60)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
    assert runner.returncode == 128 + signal.SIGINT, err
    assert "ended by signal 2" in err and "everything went through posix" in err


VERIFIED_READER = textwrap.dedent("""
    import sys
    import gdskit.safetensors as gs

    gs.load_file(sys.argv[1], verify=True)
""")


def test_gdskit_run_shows_the_workloads_verified_bytes(files, stats_dir, tmp_path):
    torch = pytest.importorskip("torch")
    import gdskit.safetensors as gs

    tensors = {"a": torch.randn(1000, 100), "b": torch.arange(77)}
    path = tmp_path / "model.safetensors"
    gs.save_file(tensors, path, digests=True)
    reader = tmp_path / "verified_reader.py"
    reader.write_text(VERIFIED_READER)
    nbytes = sum(t.nbytes for t in tensors.values())
    p = _gdskit_run(files, "--json", "--", sys.executable, str(reader), str(path))
    assert p.returncode == 0, p.stderr
    verified = json.loads(p.stdout)["stats"]["verified"]
    assert verified["bytes"] == nbytes and verified["checks"] == 2 and verified["gpu_bytes"] == 0
    p = _gdskit_run(files, "--", sys.executable, str(reader), str(path))
    assert p.returncode == 0, p.stderr
    line = next((ln for ln in p.stderr.splitlines() if ln.startswith("verified:")), None)
    assert line is not None, p.stderr
    from gdskit.telemetry.render import human_bytes
    assert line.startswith(f"verified: {human_bytes(nbytes)} ")  # the bytes, shown as the other figures are
    plain = _gdskit_run(files, "--", sys.executable, files["reader"], files["data"], str(1 << 20))
    assert plain.returncode == 0 and not any(ln.startswith("verified:") for ln in plain.stderr.splitlines())
