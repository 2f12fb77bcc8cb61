"""The report's stable JSON schema, CSV, table and plot."""

from __future__ import annotations

import csv
import io
import json
import sys

import pytest

from gdskit.bench.cpu import CpuCost
from gdskit.bench.knee import find_knee
from gdskit.bench.report import (CSV_COLUMNS, SCHEMA_VERSION, BenchReport, RunResult, VerifyResult,
                                 csv_text, plot, render_table, summarize)
from gdskit.errors import MissingDependencyError

COST = CpuCost(user_pct=10.0, system_pct=20.0, iowait_pct=5.0, busy_pct=30.0, process_cpu_s=0.5,
               process_user_s=0.2, process_system_s=0.3, wall_s=1.0)


def _run(path, size, rep, gib, taken=None, fell_back=False, reason=None, verify=None):
    taken = taken or {"host": 2**30}
    return RunResult(path=path, io_size=size, repetition=rep, op="read", bytes=2**30, ops=2**30 // size,
                     wall_s=1.0 / gib, gib_per_s=gib, latency_avg_us=100.0, latency_p50_us=90.0,
                     latency_p99_us=300.0, cpu=COST, taken=taken, reasons={"host_memory": 2**30},
                     path_taken=max(taken, key=taken.get), fell_back=fell_back,
                     fallback_reason=reason, verify=verify)


def _report():
    runs = []
    for size in (4096, 8192):
        for rep in range(3):
            runs.append(_run("cufile", size, rep, 1.0 + rep, taken={"cufile-compat": 2**30},
                             fell_back=True, reason="cufile_compat_observed"))
            runs.append(_run("bounce", size, rep, 2.0 + rep, taken={"bounce-direct": 2**30}))
    direct = {s: [r.gib_per_s for r in runs if r.path == "cufile" and r.io_size == s] for s in (4096, 8192)}
    cpu = {s: [r.gib_per_s for r in runs if r.path == "bounce" and r.io_size == s] for s in (4096, 8192)}
    return BenchReport(params={"op": "read", "workers": 4, "cache": "cold", "repeat": 3, "size": 2**30},
                       machine={"filesystem": "ext4", "mount_source": "/dev/vda", "gpu": {},
                                "cufile_version": None},
                       paths=["cufile", "bounce"], unavailable={"host": "test"}, runs=runs,
                       knee=find_knee(direct, cpu, fstype="ext4"), warnings=["cufile fell back"],
                       created="2026-11-29T00:00:00Z")


# The stable schema: within one schema_version keys are only ever added, never changed or removed.
TOP_KEYS = {"schema_version", "kind", "created", "params", "machine", "paths", "unavailable",
            "summaries", "runs", "knee", "profile_saved", "engine", "verify_ok", "warnings"}
RUN_KEYS = {"path", "io_size", "repetition", "op", "bytes", "ops", "wall_s", "gib_per_s", "latency_us",
            "cpu", "ledger", "path_taken", "fell_back", "fallback_reason", "verify", "cufile_counters"}
SUMMARY_KEYS = {"path", "io_size", "repetitions", "gib_per_s_median", "gib_per_s_min", "gib_per_s_max",
                "latency_avg_us", "latency_p50_us", "latency_p99_us", "user_pct", "system_pct",
                "iowait_pct", "cpu_s_per_gib", "paths_taken", "fell_back", "fallback_reason"}


def test_json_schema_is_stable():
    d = json.loads(json.dumps(_report().to_dict()))
    assert SCHEMA_VERSION == 1 and d["schema_version"] == 1
    assert set(d) == TOP_KEYS
    assert all(set(r) == RUN_KEYS for r in d["runs"])
    assert all(set(s) == SUMMARY_KEYS for s in d["summaries"])
    assert set(d["runs"][0]["latency_us"]) == {"avg", "p50", "p99"}
    assert set(d["runs"][0]["cpu"]) == {"user_pct", "system_pct", "iowait_pct", "busy_pct",
                                        "process_cpu_s", "process_user_s", "process_system_s",
                                        "cpu_s_per_gib"}
    assert set(d["runs"][0]["ledger"]) == {"paths", "reasons"}


def test_summaries_are_median_min_max():
    sums = summarize(_report().runs)
    assert [(s.path, s.io_size) for s in sums] == [("cufile", 4096), ("bounce", 4096),
                                                  ("cufile", 8192), ("bounce", 8192)]
    s = sums[1]
    assert (s.gib_per_s_median, s.gib_per_s_min, s.gib_per_s_max) == (3.0, 2.0, 4.0)
    assert s.paths_taken == ("bounce-direct",) and not s.fell_back
    assert sums[0].fell_back and sums[0].fallback_reason == "cufile_compat_observed"
    assert s.cpu_s_per_gib == pytest.approx(0.5)


def test_csv_has_one_row_per_run():
    rep = _report()
    rows = list(csv.reader(io.StringIO(csv_text(rep.runs))))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert len(rows) == 1 + len(rep.runs)
    first = dict(zip(rows[0], rows[1]))
    assert first["path"] == "cufile" and first["fell_back"] == "1" and int(first["bytes"]) == 2**30
    assert first["path_taken"] == "cufile-compat"


def test_verify_ok_aggregates():
    rep = _report()
    assert rep.verify_ok is None
    rep.runs.append(_run("host", 4096, 0, 1.0, verify=VerifyResult(4096, 1, 17)))
    assert rep.verify_ok is False


def test_table_shows_fallback_loudly():
    from rich.console import Console
    console = Console(record=True, width=200)
    render_table(_report(), console)
    text = console.export_text()
    assert "FELL BACK" in text and "cufile_compat_observed" in text and "WARNING" in text


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "sweep.png"
    plot(_report(), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependencyError):
        plot(_report(), str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


def test_small_io_from_several_processes_into_gpu_memory_says_the_gpu_takes_turns():
    """Worker processes each have a CUDA context, and the GPU serves the contexts in turns: at
    4 KiB the bounce path's latency grows with the processes. Said where it applies, only."""
    from gdskit.bench import runner
    from gdskit.bench.params import make_params

    def noted(paths, **kw):
        params = make_params(size="4M", paths=",".join(paths), repeat=1, cache="hot", **kw)
        runs = [_run(p, params.io_sizes[0], 0, 1.0, taken={p if p != "bounce" else "bounce-cached": 2**30})
                for p in paths]
        return [w for w in runner._warnings(runs, params) if "CUDA context" in w]

    found = noted(["bounce", "host"], io_size="4K", workers=4, processes=True)
    assert len(found) == 1 and "4 worker processes" in found[0] and "bounce latency" in found[0]
    assert noted(["host"], io_size="4K", workers=4, processes=True) == []       # no copy into GPU memory
    assert noted(["bounce"], io_size="4K", workers=4) == []                     # threads: one context
    assert noted(["bounce"], io_size="4K", workers=1, processes=True) == []     # one process
    assert noted(["bounce"], io_size="1M", workers=4, processes=True) == []     # large I/O
