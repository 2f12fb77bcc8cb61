"""Real small runs of the host path through the engine, verification, and clean-up on Ctrl-C."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

import gdskit
from gdskit.bench import runner, worker
from gdskit.bench.memory import pattern
from gdskit.bench.params import MiB, PathUnavailableError, make_params
from gdskit.errors import GdskitIOError, InvalidArgumentError


def _cli() -> typer.Typer:
    from gdskit.cli.bench import register
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

    @app.callback()
    def _root() -> None:
        """gdskit"""

    register(app)
    return app


def _invoke(*args: str):
    return CliRunner().invoke(_cli(), ["bench", *args])


def test_sequential_read_counts_bytes_ops_and_ledger(tmp_path):
    p = make_params(size="8M", io_size="1M", workers=2, paths="host", cache="cold", repeat=2)
    rep = runner.run_benchmark(p, workdir=str(tmp_path))
    assert [r.repetition for r in rep.runs] == [0, 1]
    for r in rep.runs:
        assert r.bytes == 8 * MiB and r.ops == 8 and r.io_size == MiB
        assert r.taken == {"host": 8 * MiB}        # warm-up I/O is outside the window
        assert r.path_taken == "host" and not r.fell_back
        assert r.latency_p50_us is not None and r.latency_p99_us >= r.latency_p50_us
        assert r.cpu.process_cpu_s >= 0
    assert os.listdir(tmp_path) == []           # the temporary file is gone


def test_random_read_with_total_bytes(tmp_path):
    p = make_params(size="4M", io_size="4K", workers=2, paths="host", op="randread", total="64K",
                    cache="hot", repeat=1)
    (r,) = runner.run_benchmark(p, workdir=str(tmp_path)).runs
    assert r.ops == 16 and r.bytes == 64 * 1024 and r.taken == {"host": 64 * 1024}


def test_write_with_verify_leaves_the_pattern(tmp_path):
    target = tmp_path / "w.bin"
    p = make_params(file=str(target), size="4M", io_size="64K", workers=2, paths="host",
                    op="randwrite", verify=True, cache="cold", repeat=1, total="1M")
    rep = runner.run_benchmark(p)
    (r,) = rep.runs
    assert r.bytes == MiB and r.verify is not None and r.verify.ok and r.verify.checked_bytes == 4 * MiB
    data = np.fromfile(target, dtype=np.uint8)
    assert np.array_equal(data, pattern(0, 4 * MiB, 0))   # checked with a plain read, too
    assert rep.verify_ok is True


def test_verify_catches_one_corrupted_byte(tmp_path, monkeypatch):
    target = tmp_path / "r.bin"
    bad_at = 3 * MiB + 12345
    real_prepare = runner.prepare_targets

    def prepare_then_corrupt(params, workdir=None):
        t = real_prepare(params, workdir)
        with open(target, "r+b") as fh:
            fh.seek(bad_at)
            b = fh.read(1)
            fh.seek(bad_at)
            fh.write(bytes([b[0] ^ 0xFF]))
        return t

    monkeypatch.setattr(runner, "prepare_targets", prepare_then_corrupt)
    p = make_params(file=str(target), size="4M", io_size="1M", workers=1, paths="host", verify=True,
                    repeat=1)
    rep = runner.run_benchmark(p)
    v = rep.runs[0].verify
    assert v is not None and not v.ok and v.mismatched_bytes == 1 and v.first_bad_offset == bad_at
    assert rep.verify_ok is False and any("verify FAILED" in w for w in rep.warnings)
    res = _invoke("-f", str(target), "-s", "4M", "-i", "1M", "-w", "1", "-x", "host", "-V", "--repeat", "1",
                  "--force")                       # -V writes its pattern over the file left by the first run
    assert res.exit_code == 1                      # the CLI says so with its exit status


def test_ctrl_c_between_runs_removes_the_temporary_file(tmp_path, monkeypatch):
    seen = []

    def interrupted(params, targets, name, io, rep, processes=None):
        seen.extend(targets.files)
        assert all(os.path.exists(f) for f in targets.files)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_once", interrupted)
    p = make_params(size="4M", io_size="1M", workers=2, paths="host", repeat=1)
    with pytest.raises(KeyboardInterrupt):
        runner.run_benchmark(p, workdir=str(tmp_path))
    assert seen and os.listdir(tmp_path) == []


def test_ctrl_c_inside_a_worker_removes_files_and_cli_exits_130(tmp_path, monkeypatch):
    calls = {"n": 0}
    real_read_batch = gdskit.File.read_batch

    def read_batch(self, *a, **k):  # the timed window's reads (the warm-up uses File.read)
        calls["n"] += 1
        if calls["n"] > 1:          # in the middle of the timed window
            raise KeyboardInterrupt
        return real_read_batch(self, *a, **k)

    monkeypatch.setattr(gdskit.File, "read_batch", read_batch)
    monkeypatch.chdir(tmp_path)
    res = _invoke("-s", "8M", "-i", "1M", "-w", "2", "-x", "host", "--repeat", "1")
    assert res.exit_code == 130
    assert os.listdir(tmp_path) == []


def test_file_made_for_f_is_kept_on_success_and_removed_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "data.bin"
    p = make_params(file=str(target), size="4M", io_size="1M", workers=1, paths="host", repeat=1)
    runner.run_benchmark(p)
    assert target.stat().st_size == 4 * MiB
    target.unlink()
    monkeypatch.setattr(runner, "run_once", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        runner.run_benchmark(p)
    assert not target.exists()


def test_directory_mode_one_file_per_worker(tmp_path):
    p = make_params(directory=str(tmp_path / "d"), size="2M", io_size="512K", workers=3, paths="host",
                    repeat=1, cache="hot")
    (r,) = runner.run_benchmark(p).runs
    assert r.bytes == 3 * 2 * MiB and r.ops == 12
    assert sorted(os.listdir(tmp_path / "d")) == [f"gdskit-bench.{i}" for i in range(3)]


def test_unwritable_target(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_bytes(b"x")
    p = make_params(file=str(blocker / "sub" / "t.bin"), size="4M", io_size="1M", workers=1, paths="host")
    with pytest.raises(GdskitIOError):
        runner.run_benchmark(p)
    res = _invoke("-f", str(blocker / "sub" / "t.bin"), "-s", "4M", "-x", "host")
    assert res.exit_code == 2


@pytest.mark.skipif(gdskit.engine.cuda.device_count() > 0, reason="checks the no-GPU answer")
def test_sweep_on_an_unavailable_path_is_refused(tmp_path):
    p = make_params(size="64M", sweep=True, paths="cufile,bounce")
    with pytest.raises(PathUnavailableError) as info:
        runner.run_benchmark(p, workdir=str(tmp_path))
    assert info.value.path == "cufile" and str(info.value.reason) == "no_gpu"
    assert isinstance(info.value, InvalidArgumentError)
    assert os.listdir(tmp_path) == []
    res = _invoke("--sweep", "-x", "cufile", "-s", "64M")
    assert res.exit_code == 2


@pytest.mark.parametrize("args", [["-s", "1M", "-i", "4M"], ["-x", "nvme"], ["-w", "0"],
                                  ["-I", "append"], ["-i", "5000"], ["--repeat", "0"]])
def test_cli_bad_arguments_exit_2(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = _invoke(*args)
    assert res.exit_code == 2
    assert os.listdir(tmp_path) == []


def test_cli_json_csv_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    res = _invoke("-s", "4M", "-i", "256K:1M", "-w", "2", "-x", "host", "--repeat", "2", "--json",
                  "--csv", "runs.csv", "--plot", "sweep.png", "--total", "1M")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["schema_version"] == 1 and d["params"]["sweep"] is True
    assert [s["io_size"] for s in d["summaries"]] == [256 * 1024, 512 * 1024, MiB]
    assert all(r["bytes"] == MiB for r in d["runs"]) and len(d["runs"]) == 6
    assert (tmp_path / "runs.csv").read_text().count("\n") == 7
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(os.listdir(tmp_path)) == ["runs.csv", "sweep.png"]


def test_cli_default_run_is_quick_and_tidy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner, "DEFAULT_SIZE_HOST", 16 * MiB)  # the real default is 256 MiB
    res = _invoke("--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["params"]["cache"] == "hot" and d["params"]["repeat"] == 3
    assert "host" in d["paths"] and os.listdir(tmp_path) == []
    assert len(d["runs"]) == 3 * len(d["paths"])


def test_a_worker_failing_before_the_start_is_reported_not_hung(tmp_path, monkeypatch):
    from gdskit.bench import runner as r
    from gdskit.bench.memory import HostBuffer
    monkeypatch.setattr(worker, "allocate", lambda on_device, n, d, huge_pages=False: HostBuffer(n))

    def boom(device):
        raise gdskit.errors.CudaError("no device", code="cudaErrorNoDevice")

    monkeypatch.setattr(r.cuda, "set_device", boom)
    monkeypatch.setattr(r, "ENGINE_MODE", {**r.ENGINE_MODE, "bounce": "host"})
    monkeypatch.setattr(r, "choose_paths", lambda params: (["bounce"], {}))
    monkeypatch.setitem(r.EXPECTED_PATHS, "bounce", ("host",))
    p = make_params(size="4M", io_size="1M", workers=2, repeat=1)
    with pytest.raises(gdskit.errors.CudaError):
        r.run_benchmark(p, workdir=str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_offset_batches_cover_a_slice_in_order_or_draw_the_same_random_offsets():
    seq = make_params(size="4M", io_size="64K", workers=1, paths="host", op="read")
    gen = worker._offset_batches(seq, 64 * 1024, 1 << 20, 1 << 20, 0, 0, 5)
    offs = [o for _ in range(4) for o in next(gen)][:16]
    assert offs == [(1 << 20) + i * 65536 for i in range(16)]
    assert next(gen)[:1] == [(1 << 20) + 4 * 65536]  # wraps around the 16 slots

    rnd = make_params(size="4M", io_size="4K", workers=2, paths="host", op="randread")
    a = next(worker._offset_batches(rnd, 4096, 2 << 20, 2 << 20, 1, 0, 64))
    b = next(worker._offset_batches(rnd, 4096, 2 << 20, 2 << 20, 1, 0, 64))
    assert a == b, "every path must do the very same I/O"
    assert all((2 << 20) <= o < (4 << 20) and o % 4096 == 0 for o in a) and len(set(a)) > 32


def _anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping holding ``address``, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0


def test_huge_page_host_buffer_is_aligned_exact_and_backed_where_the_kernel_allows():
    from gdskit.bench.memory import HUGE_PAGE, HostBuffer, transparent_huge_pages
    b = HostBuffer(MiB + 4096, huge_pages=True)
    try:
        assert b.array.ctypes.data % HUGE_PAGE == 0 and b.array.size == MiB + 4096
        assert not b.array.any()                   # touched (zeroed) before any timed run
        if transparent_huge_pages() in ("always", "madvise"):
            assert _anon_huge_bytes(b.array.ctypes.data) >= HUGE_PAGE
    finally:
        b.free()
    plain = HostBuffer(MiB)
    try:
        if transparent_huge_pages() != "always":  # where the kernel gives huge pages unasked, it may here too
            assert _anon_huge_bytes(plain.array.ctypes.data) == 0    # the default: ordinary pages, as fio's
    finally:
        plain.free()


def test_huge_pages_option_reads_the_same_bytes_and_is_reported(tmp_path):
    rep = runner.run_benchmark(make_params(size="8M", io_size="1M", workers=2, paths="host", cache="cold",
                                           repeat=1, verify=True, huge_pages=True), workdir=str(tmp_path))
    assert rep.params["huge_pages"] is True
    assert [r.bytes for r in rep.runs] == [8 * MiB] and rep.verify_ok is True
    assert rep.runs[0].verify.checked_bytes == 8 * MiB
    out = _invoke("-s", "4M", "-w", "1", "-x", "host", "--repeat", "1", "--huge-pages", "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["params"]["huge_pages"] is True


def test_huge_pages_without_transparent_huge_pages_is_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "transparent_huge_pages", lambda: "never")
    rep = runner.run_benchmark(make_params(size="4M", io_size="1M", workers=1, paths="host", cache="cold",
                                           repeat=1, huge_pages=True), workdir=str(tmp_path))
    assert any("--huge-pages" in w for w in rep.warnings)
