"""`gdskit bench` with device buffers (GPU machine only)."""

from __future__ import annotations

import os

import pytest

from gdskit.bench import runner
from gdskit.bench.params import MiB, PathUnavailableError, make_params

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("op", ["read", "randwrite"])
def test_bounce_path_verifies_every_byte(tmp_path, op):
    p = make_params(size="16M", io_size="1M", workers=2, paths="bounce,host", op=op, verify=True,
                    cache="cold", repeat=1)
    rep = runner.run_benchmark(p, workdir=str(tmp_path))
    assert [r.path for r in rep.runs] == ["bounce", "host"]
    bounce = rep.runs[0]
    assert bounce.verify is not None and bounce.verify.ok and bounce.verify.checked_bytes >= 16 * MiB
    assert set(bounce.taken) <= {"bounce-direct", "bounce-cached"} and not bounce.fell_back
    assert sum(bounce.taken.values()) == bounce.bytes == 16 * MiB
    assert os.listdir(tmp_path) == []


def test_cufile_run_reports_the_path_it_took(tmp_path):
    p = make_params(size="16M", io_size="1M", workers=2, paths="cufile", verify=True, repeat=1)
    try:
        rep = runner.run_benchmark(p, workdir=str(tmp_path))
    except PathUnavailableError as exc:   # e.g. no udev database: cuFile cannot register the file
        assert exc.path == "cufile"
        assert os.listdir(tmp_path) == []
        return
    (r,) = rep.runs
    assert r.verify is not None and r.verify.ok
    assert sum(r.taken.values()) == r.bytes
    direct = {"cufile-nvfs", "cufile-p2pdma"}
    if not set(r.taken) <= direct:
        assert r.fell_back and r.fallback_reason and rep.warnings


def test_small_sweep_gives_a_knee_or_says_why(tmp_path):
    p = make_params(size="32M", io_size="64K:1M", workers=2, paths="cufile,bounce", repeat=2,
                    total="4M", cache="hot")
    try:
        rep = runner.run_benchmark(p, workdir=str(tmp_path))
    except PathUnavailableError:
        pytest.skip("cuFile cannot register files on this machine")
    assert rep.knee is not None and len(rep.knee.verdicts) == 5
    assert rep.knee.threshold > 0


@pytest.mark.parametrize("op", ["read", "randwrite"])
def test_worker_processes_on_the_gpu(tmp_path, op):
    """--processes: each worker process makes its own CUDA context, pinned ring and cuFile handle."""
    p = make_params(size="16M", io_size="1M", workers=2, paths="cufile,bounce", op=op, verify=True,
                    cache="cold", repeat=1, processes=True)
    try:
        rep = runner.run_benchmark(p, workdir=str(tmp_path))
    except PathUnavailableError:
        p = make_params(size="16M", io_size="1M", workers=2, paths="bounce", op=op, verify=True,
                        cache="cold", repeat=1, processes=True)
        rep = runner.run_benchmark(p, workdir=str(tmp_path))
    for r in rep.runs:
        assert r.verify is not None and r.verify.ok and r.verify.checked_bytes >= 16 * MiB
        assert sum(r.taken.values()) == r.bytes
    bounce = next(r for r in rep.runs if r.path == "bounce")
    assert set(bounce.taken) <= {"bounce-direct", "bounce-cached"} and not bounce.fell_back
    cufile = [r for r in rep.runs if r.path == "cufile"]
    if cufile and op == "read" and cufile[0].cufile_counters is not None:
        # the workers' own cuFile counters came back and add up to every read they made
        c = cufile[0].cufile_counters
        assert c["n_nvfs_reads"] + c["n_p2p_reads"] + c["n_posix_reads"] >= cufile[0].ops
    assert os.listdir(tmp_path) == []


def test_a_read_benchmark_reports_the_engines_rate_beside_the_rows(tmp_path):
    p = make_params(size="256M", io_size="1M", workers=4, paths="bounce,host", cache="hot", repeat=2)
    rep = runner.run_benchmark(p, workdir=str(tmp_path))
    e = rep.engine
    assert e is not None and e.bytes == 256 * MiB and len(e.gib_per_s) == 2
    assert sum(e.taken.values()) == 2 * 256 * MiB and e.path_taken is not None
    bounce = [r.gib_per_s for r in rep.runs if r.path == "bounce"]
    assert e.note and bounce
    assert rep.to_dict()["engine"]["gib_per_s_median"] == e.gib_per_s_median
    assert os.listdir(tmp_path) == []
