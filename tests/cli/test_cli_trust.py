"""The command line can be trusted: it never changes a file it did not create, never shows a
traceback for a bad argument or variable, and says what it did (the files it wrote, its version).
Also what ships with it: the README's example, the Makefile's two set-ups, the licence and type hints."""

from __future__ import annotations

import email.parser
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import gdskit
from gdskit.accept.context import AcceptContext, AcceptOptions
from gdskit.accept.result import FAIL, NA, PASS, AcceptReport, ItemResult
from gdskit.bench import runner
from gdskit.bench.memory import pattern
from gdskit.bench.params import make_params
from gdskit.cli.main import app, main
from gdskit.errors import ConfigError, EnvironmentVariableError, InvalidArgumentError
from gdskit.settings import ENV_VARS, Settings
from repo_paths import REPO, SRC

MiB = 1 << 20


def cli(*args: str, **kw):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"}, **kw)


def refused(res) -> bool:
    """Exit status 2 through the CLI's own exit, not an exception escaping it."""
    return res.exit_code == 2 and (res.exception is None or isinstance(res.exception, SystemExit))


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSKIT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def gdskit_cmd(*args: str, env: dict[str, str] | None = None, cwd: str | None = None, **kw):
    return subprocess.run([sys.executable, "-m", "gdskit", *args], env=env or child_env(), cwd=cwd,
                          capture_output=True, text=True, timeout=120, **kw)


class Untouched:
    """A user's file, with what must stay as it is: its bytes and its modification time."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        path.write_bytes(np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8).tobytes())
        os.utime(path, ns=(1_500_000_000_000_000_000, 1_500_000_000_000_000_000))  # long ago: a change shows
        self.data = path.read_bytes()

    def check(self) -> None:
        assert self.path.read_bytes() == self.data
        assert self.path.stat().st_mtime_ns == 1_500_000_000_000_000_000


BENCH = ("bench", "-x", "host", "-i", "1M", "-w", "1", "--repeat", "1")


# --------------------------------------------------------------------------- bench and the user's files
def test_bench_reads_an_existing_file_as_it_is_and_refuses_one_too_small(tmp_path):
    user = Untouched(tmp_path / "mine.bin", 2 * MiB + 4096)
    res = cli(*BENCH, "-f", str(user.path), "-s", "4M")
    assert refused(res), res.output
    user.check()
    with pytest.raises(runner.TargetTooSmallError) as info:
        runner.run_benchmark(make_params(file=str(user.path), size="4M", paths="host", workers=1, repeat=1))
    assert isinstance(info.value, InvalidArgumentError) and info.value.size == 2 * MiB + 4096
    assert info.value.needed == 4 * MiB
    user.check()
    for size in (["-s", "2M"], []):  # fits; no -s: the file's own size
        res = cli(*BENCH, "-f", str(user.path), *size, "--json")
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["runs"][0]["bytes"] == 2 * MiB
        user.check()
    assert os.listdir(tmp_path) == ["mine.bin"]


@pytest.mark.parametrize("args", [["-V"], ["-I", "write"], ["-I", "randwrite"], ["-I", "1"], ["-V", "-s", "8M"]])
def test_bench_refuses_to_write_over_an_existing_file_without_force(tmp_path, args):
    user = Untouched(tmp_path / "mine.bin", 4 * MiB)
    res = cli(*BENCH, "-f", str(user.path), "-s", "4M", *args)
    assert refused(res), res.output
    user.check()
    d = tmp_path / "d"
    d.mkdir()
    other = Untouched(d / "gdskit-bench.1", 4 * MiB)  # -D: worker 1's file is someone's
    res = cli(*BENCH, "-D", str(d), "-w", "2", "-s", "4M", *args)
    assert refused(res), res.output
    other.check()
    assert os.listdir(d) == ["gdskit-bench.1"]   # nothing made for worker 0 either: all checked first


def test_bench_library_names_the_refusal(tmp_path):
    user = Untouched(tmp_path / "mine.bin", 4 * MiB)
    with pytest.raises(runner.TargetExistsError) as info:
        runner.run_benchmark(make_params(file=str(user.path), size="4M", paths="host", workers=1, repeat=1,
                                         verify=True))
    assert isinstance(info.value, FileExistsError) and info.value.filename == str(user.path)
    user.check()


def test_bench_force_lets_it_write_over_the_file(tmp_path):
    target = tmp_path / "scratch.bin"
    Untouched(target, 4 * MiB)
    res = cli(*BENCH, "-f", str(target), "-s", "4M", "-V", "--force")
    assert res.exit_code == 0, res.output
    assert np.array_equal(np.fromfile(target, dtype=np.uint8), pattern(0, 4 * MiB, 0))


def test_bench_makes_only_the_last_directory_of_D(tmp_path):
    deep = tmp_path / "a" / "b" / "c"
    res = cli(*BENCH, "-D", str(deep), "-s", "1M")
    assert refused(res) and not (tmp_path / "a").exists()
    with pytest.raises(InvalidArgumentError):
        make_params(directory=str(deep), size="1M", io_size="1M", workers=1)
    last = tmp_path / "new"
    res = cli(*BENCH, "-D", str(last), "-s", "1M", "-w", "2")
    assert res.exit_code == 0, res.output
    assert sorted(os.listdir(last)) == ["gdskit-bench.0", "gdskit-bench.1"]


def test_bench_removes_the_directory_it_made_when_it_fails(tmp_path, monkeypatch):
    made = tmp_path / "new"
    monkeypatch.setattr(runner, "run_once", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        runner.run_benchmark(make_params(directory=str(made), size="1M", io_size="1M", workers=2, paths="host",
                                         repeat=1))
    assert os.listdir(tmp_path) == []


_NO_SPACE = """
import json, sys
from gdskit.bench import runner
from gdskit.bench.params import make_params
from gdskit.errors import NoSpaceError
kw = dict(size="100000T", io_size="1M", workers=1, paths="host", repeat=1)
if sys.argv[1] != "-": kw["file"] = sys.argv[1]
try:
    runner.run_benchmark(make_params(**kw), workdir=sys.argv[2])
except runner.NotEnoughSpaceError as exc:
    print(json.dumps({"no_space": isinstance(exc, NoSpaceError), "needed": exc.needed, "free": exc.free}))
"""


def _file_size_limit() -> None:
    # Should a run write its file without looking first, it stops at 64 MiB instead of filling the disk.
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * MiB, 64 * MiB))


@pytest.mark.parametrize("target", ["-", "new.bin"])
def test_bench_checks_free_space_before_it_writes(tmp_path, target):
    work = tmp_path / "work"
    work.mkdir()
    arg = target if target == "-" else str(work / target)
    proc = subprocess.run([sys.executable, "-c", _NO_SPACE, arg, str(work)], env=child_env(), capture_output=True,
                          text=True, timeout=120, preexec_fn=_file_size_limit)
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["no_space"] and d["needed"] == 100000 << 40
    assert 0 <= d["free"] <= shutil.disk_usage(work).total  # what was free then (others write meanwhile)
    assert os.listdir(work) == []
    cmd = ["-f", arg] if target != "-" else []
    proc = subprocess.run([sys.executable, "-m", "gdskit", *BENCH, "-s", "100000T", *cmd], env=child_env(),
                          cwd=work, capture_output=True, text=True, timeout=120, preexec_fn=_file_size_limit)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert os.listdir(work) == []


def test_bench_plot_reports_the_file_it_wrote(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "plots"
    out.mkdir()
    (out / "gdskit-bench.png").write_bytes(b"someone's")
    for where, written in ((str(out), out / "gdskit-bench-2.png"), ("noext", tmp_path / "noext.png")):
        res = cli(*BENCH, "-s", "2M", "--total", "1M", "--plot", where)
        assert res.exit_code == 0, res.output
        assert written.read_bytes()[:4] == b"\x89PNG"
        assert f"plot written to {written.relative_to(tmp_path) if where == 'noext' else written}" in res.output
    assert (out / "gdskit-bench.png").read_bytes() == b"someone's"
    assert sorted(os.listdir(tmp_path)) == ["noext.png", "plots"]


# --------------------------------------------------------------------------- GDSKIT_* variables
@pytest.mark.parametrize("var, value", [("GDSKIT_MODE", "bogus"), ("GDSKIT_THREADS", "0"),
                                        ("GDSKIT_CHUNK_SIZE", "1K"), ("GDSKIT_STATS", "9")])
@pytest.mark.parametrize("args", [["--help"], ["check", "--json"]])
def test_invalid_variable_is_one_line_and_exit_2(var, value, args):
    proc = gdskit_cmd(*args, env=child_env(**{var: value}))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and var in lines[0]


def test_library_raises_the_typed_error_at_first_use():
    code = ("import gdskit, numpy as np, json\n"
            "try:\n"
            "    gdskit.open('/dev/null').read(np.empty(4096, np.uint8))\n"
            "except gdskit.errors.ConfigError as exc:\n"
            "    print(json.dumps([type(exc).__name__, exc.variable, exc.value, bool(exc.accepts),\n"
            "                      isinstance(exc, ValueError)]))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(GDSKIT_ODIRECT="sometimes"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["EnvironmentVariableError", "GDSKIT_ODIRECT", "sometimes", True, True]


@pytest.mark.parametrize("var", sorted(ENV_VARS))
def test_every_variable_says_what_it_takes(var):
    with pytest.raises(EnvironmentVariableError) as info:
        Settings()._apply_env({var: "not-a-value"})
    assert isinstance(info.value, ConfigError)
    assert info.value.variable == var and info.value.value == "not-a-value" and info.value.accepts
    import pickle

    again = pickle.loads(pickle.dumps(info.value))
    assert (again.variable, again.value, again.accepts) == (var, "not-a-value", info.value.accepts)


# --------------------------------------------------------------------------- version, completion, run
def test_version_and_completion_options():
    res = cli("--version")
    assert res.exit_code == 0 and res.stdout.split() == ["gdskit", gdskit.__version__]
    res = cli("--help")
    assert res.exit_code == 0 and "--install-completion" in res.stdout and "--show-completion" in res.stdout
    assert "--version" in res.stdout


def test_run_exit_status_for_a_command_it_cannot_execute(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    assert cli("run", "--", str(script)).exit_code == 126       # there, not executable
    assert cli("run", "--", str(tmp_path)).exit_code == 126     # a directory
    assert cli("run", "--", str(tmp_path / "missing")).exit_code == 127
    script.chmod(0o755)
    assert cli("run", "--", str(script)).exit_code == 0


# --------------------------------------------------------------------------- help texts
def test_help_shows_the_extras_names():
    res = cli("bench", "--help")
    assert res.exit_code == 0 and "gdskit[plot]" in res.stdout
    res = cli("stats", "--help")
    assert res.exit_code == 0 and "gdskit[prometheus]" in " ".join(res.stdout.split())


# --------------------------------------------------------------------------- accept
def _report(statuses: list[str]) -> AcceptReport:
    items = [ItemResult(id=i + 1, key=f"k{i}", title=f"item {i + 1}", status=s, summary="") for i, s in
             enumerate(statuses)]
    return AcceptReport(created="now", machine={}, options={}, items=items)


def _verdict_colour(html_text: str) -> str:
    return re.search(r'class="verdict" style="background:(#[0-9a-fA-F]{6})"', html_text).group(1)


def test_html_headline_is_green_only_when_accepted(tmp_path):
    from gdskit.accept.report import to_html

    accepted = _verdict_colour(to_html(_report([PASS] * 7), str(tmp_path)))
    incomplete = _verdict_colour(to_html(_report([PASS] * 3 + [NA] * 4), str(tmp_path)))
    failed = _verdict_colour(to_html(_report([PASS] * 3 + [FAIL] + [NA] * 3), str(tmp_path)))
    nothing = _verdict_colour(to_html(_report([NA] * 7), str(tmp_path)))
    assert _report([PASS] * 3 + [NA] * 4).verdict == "incomplete"
    assert len({accepted, incomplete, failed}) == 3 and nothing == incomplete


def test_accept_workload_output_stays_out_of_the_terminal(tmp_path, capfd):
    """Item 5's default workload prints a JSON line: it goes to workload.json, not to accept's output."""
    pytest.importorskip("gdskit.telemetry")
    from gdskit.accept import items

    (tmp_path / "target").mkdir()
    ctx = AcceptContext(AcceptOptions(targets=[str(tmp_path / "target")], report_dir=str(tmp_path / "report"),
                                      quick=True, size=2 * MiB))
    ctx._gpus = 1  # run the item as on a GPU machine (its memory is host memory here)
    capfd.readouterr()
    r = items.item_workload(ctx)
    seen = capfd.readouterr()
    assert r.data["returncode"] == 0, r.evidence
    assert '"identical"' not in seen.out + seen.err
    archived = json.loads((tmp_path / "report" / "workload.json").read_text())
    printed = json.loads(archived["stdout"].strip().splitlines()[-1])
    assert printed["identical"] is True and printed["bytes"] >= 2 * MiB - 4096


# --------------------------------------------------------------------------- no traceback for bad arguments
BAD_ARGUMENTS = [
    ["--bogus"], ["no-such-command"],
    ["check", "missing/path"], ["check", "--require", "bogus"], ["check", "--root", "missing"],
    ["bench", "-f", "missing/dir/x"], ["bench", "-D", "missing/a/b"], ["bench", "-f", "adir"],
    ["bench", "-f", "x", "-D", "adir"], ["bench", "-f", "/dev/null", "-s", "4M"], ["bench", "-f", "fifo"],
    ["bench", "-f", "fifo", "-s", "4M", "-I", "write"], ["bench", "-f", ""], ["bench", "-D", ""],
    ["bench", "-s", "-1M"], ["bench", "-s", "0"], ["bench", "-s", "abc"], ["bench", "-s", "1.5G"],
    ["bench", "-i", "0"], ["bench", "-i", "-4K"], ["bench", "-i", "5000"], ["bench", "-i", "8K:4K"],
    ["bench", "-i", "4K:"], ["bench", "-i", ":"], ["bench", "-i", "4K:8K:16K"], ["bench", "-i", "-4K:1M"],
    ["bench", "-i", "1.5M"], ["bench", "-w", "-1"], ["bench", "-w", "0"], ["bench", "-w", "abc"],
    ["bench", "-w", "100000"], ["bench", "-d", "-1"], ["bench", "-T", "-1"], ["bench", "-T", "nan"],
    ["bench", "-T", "inf"], ["bench", "--total", "-5"], ["bench", "--total", "1"], ["bench", "--repeat", "-1"],
    ["bench", "--seed", "-1"], ["bench", "--cache", "lukewarm"], ["bench", "-x", ""], ["bench", "-x", ","],
    ["bench", "-x", "nvme"], ["bench", "-I", "9"], ["bench", "--csv", "missing/dir/x.csv"],
    ["bench", "--csv", "adir"], ["bench", "--plot", "missing/x.png"], ["bench", "--plot", "x.bogusext"],
    ["accept", "missing"], ["accept", "--items", "9"], ["accept", "--items", "a,b"], ["accept", "--items", ","],
    ["accept", "--items", "-1"], ["accept", "--size", "-1"], ["accept", "--size", "abc"], ["accept", "--size", "0"],
    ["accept", "--timeout", "-1"], ["accept", "--timeout", "nan"], ["accept", "-d", "-1"],
    ["accept", "--report", "/proc/x"], ["accept", "--root", "missing"], ["accept", "--workload", "'unbalanced"],
    ["accept", "--workload", ""],
    ["stats", "-p", "-1"], ["stats", "-p", "999999999"], ["stats", "-l", "9"], ["stats", "--watch", "0"],
    ["stats", "--serve", "0"], ["stats", "--serve", "70000"], ["stats", "--json", "--prometheus"],
    ["stats", "--serve", "1", "--serve-addr", "no such address"],
    ["run"], ["run", "-l", "0", "--", "true"], ["run", "--timeout", "0", "--", "true"],
    ["run", "--timeout", "nan", "--", "true"], ["run", "--report", "missing/x.json", "--", "true"],
    ["run", "--require", "bogus", "--", "true"],
]


@pytest.mark.parametrize("args", BAD_ARGUMENTS, ids=" ".join)
def test_bad_arguments_end_with_a_status_not_a_traceback(args, tmp_path, monkeypatch, capsys):
    if "--plot" in args:
        pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    os.mkfifo(tmp_path / "fifo")   # opening it to read would wait for a writer
    monkeypatch.setattr(sys, "argv", ["gdskit", *args])
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as info:
        main()  # an exception other than SystemExit fails the test with its traceback
    seen = capsys.readouterr()
    code = info.value.code
    assert code in (1, 2) and (args != ["run"] or code == 2), (code, seen.err)
    assert "Traceback" not in seen.out + seen.err
    assert sorted(os.listdir(tmp_path)) == ["adir", "fifo"]   # and nothing left behind


# --------------------------------------------------------------------------- what ships
def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_readme_first_python_example_runs_as_written(tmp_path):
    blocks = _python_blocks((REPO / "README.md").read_text())
    assert blocks, "the README has a python example"
    (tmp_path / "example.py").write_text(blocks[0])
    proc = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if len(blocks) > 1 and _has_torch():  # the torch example, after the first
        (tmp_path / "example2.py").write_text(blocks[1])
        proc = subprocess.run([sys.executable, "example2.py"], cwd=tmp_path, env=child_env(), capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _make_dry_run(tmp_path: Path, target: str, *stamps: str) -> list[str]:
    venv = tmp_path / "venv"
    venv.mkdir(exist_ok=True)
    for s in stamps:
        (venv / s).touch()
        os.utime(venv / s, (2**31 - 1, 2**31 - 1))   # newer than pyproject.toml
    proc = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(REPO), f"VENV={venv}", target],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_run_installs_the_core_only_and_make_test_the_rest(tmp_path):
    run = _make_dry_run(tmp_path, "run")
    installs = [ln.split("pip install", 1)[1] for ln in run if "pip install" in ln]
    assert installs and not any(w in what for what in installs for w in ("torch", "[", "plot", "test"))
    assert run[-1].endswith("/bin/gdskit bench")
    test = _make_dry_run(tmp_path, "test")
    torch_at = next(i for i, ln in enumerate(test) if 'torch==2.13.0' in ln)
    extras_at = next(i for i, ln in enumerate(test) if "[torch,plot,test,prometheus,s3]" in ln)
    assert torch_at < extras_at and test[-1].endswith("-m pytest -q -n 2")
    # After `make run`, `make test` still installs what the tests need: a stamp of its own.
    core_stamp = next(ln.split()[-1] for ln in run if ln.startswith("touch"))
    after_run = _make_dry_run(tmp_path, "test", os.path.basename(core_stamp))
    assert any("[torch,plot,test,prometheus,s3]" in ln for ln in after_run)
    assert not any(ln.endswith("pip install -q -e .") for ln in after_run)


def test_licence_changelog_and_type_hints_ship(tmp_path):
    licence = (REPO / "LICENSE").read_text()
    assert licence.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in licence and len(licence) > 10000   # the full text
    changelog = (REPO / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^\]]+)\]", changelog, re.M)
    assert headings[:2] == ["Unreleased", "0.1.0"]
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, tmp_path / name)
    shutil.copytree(SRC, src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(tmp_path / "dist"), str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("gdskit-*.whl")
    assert wheel.name.startswith(f"gdskit-{gdskit.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    assert "gdskit/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_sdist_carries_the_docs_and_the_project_metadata(tmp_path):
    pytest.importorskip("setuptools")
    for name in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "MANIFEST.in"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, tmp_path / name)
    shutil.copytree(SRC, tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    # `python -m build --sdist` without the build package: the backend's own hook, as build calls it
    proc = subprocess.run([sys.executable, "-c", "from setuptools import build_meta as b; print(b.build_sdist('dist'))"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    sdist = tmp_path / "dist" / proc.stdout.strip().splitlines()[-1]
    top = f"gdskit-{gdskit.__version__}"
    with tarfile.open(sdist) as tar:
        names = set(tar.getnames())
        info = tar.extractfile(f"{top}/PKG-INFO").read().decode()
    docs = {f"{top}/docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert docs and docs <= names
    assert {f"{top}/CHANGELOG.md", f"{top}/LICENSE", f"{top}/README.md"} <= names
    meta = email.parser.Parser().parsestr(info)
    assert {u.split(",")[0] for u in meta.get_all("Project-URL") or []} >= {"Homepage", "Documentation", "Issues",
                                                                            "Changelog"}
    classifiers = meta.get_all("Classifier") or []
    assert "Programming Language :: Python :: 3" in classifiers
    assert meta.get("Author") or meta.get("Author-email")
