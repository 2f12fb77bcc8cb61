"""`gdskit bench` (and so `make run`) on a machine without a GPU says what its one `host` row
is and what a GPU machine would add, in one line of its own output."""

from __future__ import annotations

import json

import pytest
from cli_app import one_command_app
from typer.testing import CliRunner

from gdskit.engine import cuda
from gdskit.cli import bench as bench_cli

SMALL_DEFAULT_RUN = ("bench", "-s", "8M", "-w", "1", "--repeat", "1")   # no -f: the `make run` case


def _lines_naming_every_path(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if all(p in ln for p in ("host", "cufile", "bounce"))]


def _run(tmp_path, monkeypatch, *extra: str):
    monkeypatch.chdir(tmp_path)
    app = one_command_app(bench_cli.register)
    return CliRunner().invoke(app, [*SMALL_DEFAULT_RUN, *extra], env={"COLUMNS": "400"})


@pytest.mark.skipif(cuda.device_count() > 0, reason="a GPU is here: the note is for machines without one")
def test_without_a_gpu_one_line_says_what_the_host_row_is_and_what_a_gpu_adds(tmp_path, monkeypatch):
    res = _run(tmp_path, monkeypatch)
    assert res.exit_code == 0, res.output
    assert len(_lines_naming_every_path(res.stdout)) == 1
    res = _run(tmp_path, monkeypatch, "--json")   # machines read the JSON: no note in it
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["unavailable"] == {"cufile": "no_gpu", "bounce": "no_gpu"}


@pytest.mark.gpu
@pytest.mark.skipif(cuda.device_count() == 0, reason="needs a CUDA GPU")
def test_with_a_gpu_no_such_line(tmp_path, monkeypatch):
    res = _run(tmp_path, monkeypatch, "--no-engine")
    assert res.exit_code == 0, res.output
    assert _lines_naming_every_path(res.stdout) == []
