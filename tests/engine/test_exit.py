"""The process exits cleanly, every time: the ordered exit (gdskit.shutdown), and fresh processes
that use gdskit and leave without cleaning up, whose exit codes must be exactly what they return."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from repo_paths import SRC, STAND_INS


def _run(code: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_stages_run_in_order_whatever_the_registration_order(tmp_path: Path) -> None:
    out = _run("""
        from gdskit import shutdown as s
        s.at_exit(s.FREE_MEMORY, lambda: print("free"))
        s.at_exit(s.CLOSE_DRIVERS, lambda: print("close"))
        s.at_exit(s.STOP_WORK, lambda: print("stop-1"))
        s.at_exit(s.STOP_WORK, lambda: print("stop-2"))
        def boom():
            raise RuntimeError("one part failing must not keep the rest from closing")
        s.at_exit(s.CLOSE_DRIVERS, boom)
        assert not s.exiting()
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["stop-2", "stop-1", "close", "free"]


def test_objects_closed_at_exit_each_close_once_in_their_stage_failing_or_not(tmp_path: Path) -> None:
    out = _run("""
        import gc
        from gdskit import shutdown as s
        class Thing:
            def __init__(self, name, fails=False):
                self.name, self.fails = name, fails
            def close(self):
                print("closed", self.name)
                if self.fails:
                    raise OSError("one object failing must not keep the others from closing")
        live = s.ClosedAtExit(s.STOP_WORK, lambda t: t.close())
        s.at_exit(s.CLOSE_DRIVERS, lambda: print("drivers"))
        kept = [Thing("a", fails=True), Thing("b")]
        for t in kept:
            live.add(t)
        live.add(kept[0])              # added twice: closed once
        gone = Thing("dropped")
        live.add(gone)
        del gone
        gc.collect()                   # held weakly: an object dropped is not kept alive to be closed
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert sorted(lines[:2]) == ["closed a", "closed b"] and lines[2:] == ["drivers"]


def test_unknown_stage_is_refused() -> None:
    from gdskit import shutdown

    with pytest.raises(ValueError):
        shutdown.at_exit(7, lambda: None)
    with pytest.raises(ValueError):
        shutdown.ClosedAtExit(7, lambda obj: None)


def test_cufile_driver_closes_after_workers_and_before_pinned_memory(tmp_path: Path) -> None:
    # The cuFile library registers its close in the ordered exit, not with atexit directly:
    # an atexit hook registered after it would otherwise run the workers past the driver.
    out = _run("""
        from gdskit import shutdown as s
        from gdskit.engine.backends.cufile import CufileLibrary
        class Mod:
            def driver_open(self): pass
            def driver_close(self): print("driver_close")
            def set_stats_level(self, n): raise RuntimeError("no stats")
        lib = CufileLibrary(loader=Mod)
        assert lib.available()
        s.at_exit(s.STOP_WORK, lambda: print("workers"))
        s.at_exit(s.FREE_MEMORY, lambda: print("pinned"))
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["workers", "driver_close", "pinned"]


def test_library_exit_without_cleanup_keeps_the_exit_code(tmp_path: Path) -> None:
    # Open files, a background read still pending, threads and lanes alive at exit; the
    # process must leave with the status it asked for, every time.
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(3 << 20))
    for code in (0, 3):
        for _ in range(5):
            out = _run(f"""
                import sys, numpy as np, gdskit
                f = gdskit.open({str(data)!r})
                buf = np.empty(3 << 20, dtype=np.uint8)
                assert f.read(buf) == 3 << 20
                fut = f.pread(buf, 1 << 20, 0)   # left running
                sys.exit({code})
            """, tmp_path)
            assert out.returncode == code, out.stderr


@pytest.mark.torch
def test_checkpoint_load_then_exit_without_cleanup(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.randn(256, 256) for i in range(8)}, str(path))
    for _ in range(5):
        out = _run(f"""
            import gdskit.safetensors as st
            d = st.load_file({str(path)!r}, device="cpu")
            assert len(d) == 8
        """, tmp_path)
        assert out.returncode == 0, out.stderr


@pytest.mark.gpu
def test_gpu_processes_exit_with_their_status(tmp_path: Path) -> None:
    """On a GPU machine: the CLI and a library load to the GPU, in fresh processes, exit with
    their own status each time (a signal shows as a negative return code)."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.randn(1024, 1024) for i in range(64)}, str(path))  # 256 MiB
    runs = int(os.environ.get("GDSKIT_EXIT_RUNS", "10"))
    seen: list[tuple[str, int]] = []
    for _ in range(runs):
        out = _run(f"""
            import torch, gdskit.safetensors as st
            d = st.load_file({str(path)!r}, device="cuda:0")
            assert len(d) == 64
        """, tmp_path)
        seen.append(("load", out.returncode))
        if out.returncode != 0:
            pytest.fail(f"load exited with {out.returncode}:\n{out.stderr[-6000:]}", pytrace=False)
    cli = [["check", "--probe", str(tmp_path)],
           ["bench", "-s", "64M", "-D", str(tmp_path)]]
    for args in cli:
        for _ in range(max(2, runs // 3)):
            out = _run(f"import sys; from gdskit.cli.main import main; sys.argv = ['gdskit'] + {args!r}; main()",
                       tmp_path, timeout=300)
            seen.append((args[0], out.returncode))
            if out.returncode not in (0, 1):  # the whole of faulthandler's report, not a repr cut short
                pytest.fail(f"{args} exited with {out.returncode}:\n{out.stderr[-6000:]}", pytrace=False)
    for i in range(2):
        report = tmp_path / f"report{i}"
        out = _run(f"import sys; from gdskit.cli.main import main; "
                   f"sys.argv = ['gdskit', 'accept', '--quick', '--report', {str(report)!r}, {str(tmp_path)!r}]; main()",
                   tmp_path, timeout=600)
        seen.append(("accept", out.returncode))
        if out.returncode not in (0, 1):
            pytest.fail(f"accept exited with {out.returncode}:\n{out.stderr[-6000:]}", pytrace=False)
        assert (report / "report.json").exists()


def test_the_exit_closes_cufile_without_stopping_its_statistics(tmp_path: Path) -> None:
    """At exit the cuFile driver is closed but its statistics are not stopped first:
    ``cuFileStatsStop`` there crashed the interpreter on the GPU machine (a segmentation fault
    inside libcufile, after stream-ordered reads); the driver's close frees them anyway."""
    out = _run(f"""
        import sys
        sys.path.insert(0, {str(STAND_INS)!r})
        from fake_cufile import FakeCufile
        from gdskit.engine.backends.cufile import CufileLibrary
        fake = FakeCufile()
        fake.stats_stop = lambda: print("stats_stop", flush=True)
        real_close = fake.driver_close
        def close():
            print("driver_close", flush=True)
            real_close()
        fake.driver_close = close
        lib = CufileLibrary(loader=lambda: fake)
        assert lib.available() and lib.stats_enabled
        print("exiting", flush=True)
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["exiting", "driver_close"]
