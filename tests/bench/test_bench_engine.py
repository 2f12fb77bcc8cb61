"""``gdskit bench``'s engine row: File.read of the benchmark's file into GPU memory at the
engine's settings, beside the gdsio-style rows, with the sentence that says why they differ."""

from __future__ import annotations

import json
import os

import pytest
import typer
from typer.testing import CliRunner

import gdskit
from gdskit.engine import cuda
from gdskit.bench import runner
from gdskit.bench.params import MiB, make_params
from gdskit.bench.report import BenchReport, EngineResult, render_table

ENGINE_KEYS = {"bytes", "gib_per_s", "gib_per_s_median", "gib_per_s_min", "gib_per_s_max", "mode",
               "chunk_size", "threads", "cpu_s_per_gib", "ledger", "path_taken", "note"}


def _engine() -> EngineResult:
    return EngineResult(bytes=2**30, gib_per_s=(20.0, 30.0, 25.0), mode="auto", chunk_size=8 * MiB, threads=16,
                        cpu_s_per_gib=0.05, taken={"bounce-cached": 3 * 2**30}, path_taken="bounce-cached",
                        note="the engine reading the same file into GPU memory; because of reasons.")


def _report(engine: EngineResult | None) -> BenchReport:
    return BenchReport(params={"op": "read", "workers": 4, "cache": "hot", "repeat": 3, "size": 2**30},
                       machine={"gpu": {}}, paths=["bounce"], unavailable={}, runs=[], engine=engine)


def test_the_engine_result_is_typed_in_json():
    d = json.loads(json.dumps(_report(_engine()).to_dict()))
    e = d["engine"]
    assert set(e) == ENGINE_KEYS
    assert e["gib_per_s_median"] == 25.0 and (e["gib_per_s_min"], e["gib_per_s_max"]) == (20.0, 30.0)
    assert e["chunk_size"] == 8 * MiB and e["threads"] == 16 and e["ledger"] == {"paths": {"bounce-cached": 3 * 2**30}}
    assert json.loads(json.dumps(_report(None).to_dict()))["engine"] is None


def test_the_table_has_the_engine_row_and_says_why():
    from rich.console import Console
    console = Console(record=True, width=220)
    render_table(_report(_engine()), console)
    text = console.export_text()
    row = next(line for line in text.splitlines() if "File.read" in line and "│" in line)
    assert "25.00" in row and "8M" in row and "16" in row and "bounce-cached" in row
    assert "File.read: the engine reading the same file into GPU memory; because of reasons." in text
    console = Console(record=True, width=220)
    render_table(_report(None), console)
    assert "File.read" not in console.export_text()


def test_the_note_names_what_differs():
    p = make_params(size="8M", io_size="1M", workers=4, cache="hot")
    note = runner.engine_note(p, 8 * MiB, 16)
    assert "1M" in note and "8M" in note and "16 workers" in note and "(4)" in note


def test_no_gpu_path_or_no_read_means_no_engine_row(tmp_path):
    p = make_params(size="4M", io_size="1M", workers=2, paths="host", cache="hot", repeat=1)
    assert runner.run_benchmark(p, workdir=str(tmp_path)).engine is None
    assert os.listdir(tmp_path) == []


# -- on the stand-in driver ---------------------------------------------------------------
@pytest.mark.stand_in_gpu
@pytest.mark.skipif(cuda.device_count() > 0, reason="a real GPU is present: test_bench_gpu covers it")
class TestOnTheStandIn:
    def test_a_read_benchmark_measures_file_read_into_gpu_memory(self, tmp_path):
        p = make_params(size="8M", io_size="1M", workers=2, paths="bounce,host", cache="hot", repeat=2)
        with gdskit.settings.set(chunk_size="1MiB", threads=3):
            rep = runner.run_benchmark(p, workdir=str(tmp_path))
        e = rep.engine
        assert e is not None and e.bytes == 8 * MiB and len(e.gib_per_s) == 2
        assert all(g > 0 for g in e.gib_per_s)
        assert e.chunk_size == MiB and e.threads == 3 and e.mode == "auto"
        assert set(e.taken) <= {"bounce-cached", "bounce-direct"} and sum(e.taken.values()) == 2 * 8 * MiB
        assert e.path_taken in ("bounce-cached", "bounce-direct")
        assert os.listdir(tmp_path) == []

    def test_no_engine_and_writes_leave_it_out(self, tmp_path):
        p = make_params(size="4M", io_size="1M", workers=2, paths="bounce", cache="hot", repeat=1, engine=False)
        assert runner.run_benchmark(p, workdir=str(tmp_path)).engine is None
        p = make_params(size="4M", io_size="1M", workers=2, paths="bounce", op="write", repeat=1)
        assert runner.run_benchmark(p, workdir=str(tmp_path)).engine is None

    def test_the_cli_prints_it_in_json_and_the_table(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        res = _invoke("-s", "4M", "-i", "1M", "-w", "2", "-x", "bounce", "--repeat", "1", "--cache", "hot", "--json")
        assert res.exit_code == 0, res.output
        e = json.loads(res.stdout)["engine"]
        assert set(e) == ENGINE_KEYS and e["bytes"] == 4 * MiB
        res = _invoke("-s", "4M", "-i", "1M", "-w", "2", "-x", "bounce", "--repeat", "1", "--cache", "hot")
        assert res.exit_code == 0, res.output
        assert "File.read" in res.stdout and "pinned stage" in res.stdout
        res = _invoke("-s", "4M", "-i", "1M", "-w", "2", "-x", "bounce", "--repeat", "1", "--cache", "hot",
                      "--no-engine", "--json")
        assert res.exit_code == 0 and json.loads(res.stdout)["engine"] is None
        assert os.listdir(tmp_path) == []


def _invoke(*args: str):
    from gdskit.cli.bench import register
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

    @app.callback()
    def _root() -> None:
        """gdskit"""

    register(app)
    return CliRunner().invoke(app, ["bench", *args])
