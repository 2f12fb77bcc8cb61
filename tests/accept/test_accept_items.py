"""The checklist items one by one, without a GPU: the workload item against a stand-in for the
telemetry module, the checkpoint round trip on CPU tensors, the fault cases' judgement and
plumbing, and a crashing item."""

from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest

from gdskit.engine import cuda
from gdskit.accept import faults, items, workload
from gdskit.accept.context import QUICK, AcceptContext, AcceptOptions
from gdskit.accept.run import run_accept

MiB = 1 << 20
HAS_GPU = cuda.device_count() > 0


def _ctx(tmp_path, gpus: int | None = None, **kw) -> AcceptContext:
    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    rep = tmp_path / "report"
    rep.mkdir(exist_ok=True)
    ctx = AcceptContext(AcceptOptions(targets=[str(target)], report_dir=str(rep), quick=True, **kw))
    if gpus is not None:
        ctx._gpus = gpus  # what cuda.device_count() would say
    return ctx


# --------------------------------------------------------------------------- item 5
def _workload_report(direct: int, posix: int, rc: int = 0):
    return SimpleNamespace(
        argv=["python", "-m", "x"], returncode=rc, duration_s=1.5, stats=None,
        cufile_counters={"n_nvfs_reads": 10, "n_posix_reads": 0} if direct else None,
        direct_bytes=direct, posix_bytes=posix, all_direct=direct > 0 and posix == 0,
        verdict="all direct" if direct and not posix else "not direct",
        to_dict=lambda: {"direct_bytes": direct, "posix_bytes": posix, "returncode": rc})


@pytest.fixture
def calls(monkeypatch):
    seen: list = []

    def install(report):
        def fake(argv, **kw):
            seen.append((argv, kw))
            if isinstance(report, BaseException):
                raise report
            return report
        monkeypatch.setattr(items, "run_workload", fake)
        return seen
    return install


def test_workload_passes_when_direct_grows_and_posix_stays_flat(tmp_path, calls):
    seen = calls(_workload_report(direct=3 << 30, posix=0))
    r = items.item_workload(_ctx(tmp_path, gpus=1))
    assert r.status == "pass", r
    argv, kw = seen[0]
    assert argv[1:3] == ["-m", "gdskit.accept.workload"]
    assert argv[argv.index("--size") + 1] == str(QUICK.workload)
    assert kw["level"] == 3
    assert not os.path.exists(argv[argv.index("--dir") + 1])   # its directory is removed
    assert json.loads((tmp_path / "report" / "workload.json").read_text())["direct_bytes"] == 3 << 30
    assert any("n_nvfs_reads=10" in line for line in r.evidence)


@pytest.mark.parametrize("direct, posix, rc, words", [
    (0, 2 << 30, 0, "item 2"),          # the machine of a compat mount: fix points at the mount
    (1 << 30, 4096, 0, "item 2"),       # some bytes went POSIX
    (1 << 30, 0, 3, "exited with status 3"),
])
def test_workload_fails_otherwise_with_a_fix(tmp_path, calls, direct, posix, rc, words):
    calls(_workload_report(direct, posix, rc))
    r = items.item_workload(_ctx(tmp_path, gpus=1))
    assert r.status == "fail" and r.fix
    assert words in r.fix + r.summary


def test_custom_workload_command_is_split_like_a_shell(tmp_path, calls):
    seen = calls(_workload_report(1 << 30, 0))
    items.item_workload(_ctx(tmp_path, gpus=1, workload="python3 train.py --ckpt 'my dir/x'"))
    assert seen[0][0] == ["python3", "train.py", "--ckpt", "my dir/x"]


def test_workload_without_telemetry_module_fails_clearly(tmp_path, calls):
    calls(ImportError("No module named 'gdskit.telemetry'"))
    r = items.item_workload(_ctx(tmp_path, gpus=1))
    assert r.status == "fail" and "gdskit.telemetry" in r.summary


def test_workload_is_not_applicable_without_gpu(tmp_path, calls):
    seen = calls(_workload_report(1, 0))
    r = items.item_workload(_ctx(tmp_path, gpus=0))
    assert r.status == "n/a" and "no GPU" in r.summary and seen == []


def test_workload_item_with_the_real_telemetry_module(tmp_path):
    """The default workload in a child process, observed by gdskit.telemetry. Without a GPU its
    memory is host memory: nothing can go direct, and the item says so."""
    pytest.importorskip("gdskit.telemetry")
    r = items.item_workload(_ctx(tmp_path, gpus=1, size=2 * MiB))
    assert r.data["returncode"] == 0, r.evidence
    assert r.status == ("pass" if r.data["direct_bytes"] and not r.data["posix_bytes"] else "fail")
    if HAS_GPU is False:
        assert r.data["direct_bytes"] == 0 and r.data["posix_bytes"] >= 4 * MiB
        assert r.fix and "item 2" in r.fix
    assert os.listdir(tmp_path / "target") == []


def test_default_workload_module_round_trips(tmp_path, capsys):
    assert workload.main(["--dir", str(tmp_path), "--size", "3M"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["identical"] and out["bytes"] >= 3 * MiB - 4096
    assert out["direct_bytes"] == 0 and out["ledger"]["total_bytes"] >= 2 * 3 * MiB - 8192
    assert workload.main(["--dir", str(tmp_path), "--size", "2M", "--raw"]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert raw["kind"] == "raw" and raw["identical"] and raw["ledger"]["total_bytes"] == 4 * MiB
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- item 6
@pytest.mark.torch
def test_checkpoint_round_trip_on_cpu_tensors(tmp_path):
    from gdskit.accept import checkpoint

    out = checkpoint.round_trip(str(tmp_path), 1 * MiB, "cpu")
    rows = {r["check"]: r for r in out["checks"]}
    assert all(r["status"] == "pass" for r in rows.values()), rows
    assert "plain torch.load reads gdskit's torch.save file" in rows
    assert "safetensors library reads gdskit's safetensors file" in rows
    fallback = [r for name, r in rows.items() if name.startswith("fallback path (mode=host)")]
    assert len(fallback) == 2 and all(set(r["ledger"]["paths"]) == {"host"} for r in fallback)


@pytest.mark.torch
def test_checkpoint_comparison_catches_a_changed_byte(tmp_path):
    import torch

    from gdskit.accept import checkpoint

    want = {"a": torch.arange(10, dtype=torch.float32), "b": torch.zeros(3, dtype=torch.int8)}
    changed = {k: v.clone() for k, v in want.items()}
    changed["a"][7] = float("nan")
    row = checkpoint._attempt(torch, want, "reader", lambda: changed)
    assert row["status"] == "fail" and "1 tensor(s) differ" in row["detail"]
    row = checkpoint._attempt(torch, want, "reader", lambda: (_ for _ in ()).throw(OSError("boom")))
    assert row["status"] == "fail" and "boom" in row["detail"]


# --------------------------------------------------------------------------- item 7
def _child_out(identical=True, direct=0, paths=None, refused=None, forced=None) -> str:
    paths = paths or {"bounce-direct": {"bytes_read": 4 * MiB, "bytes_written": 4 * MiB}}
    total = sum(v["bytes_read"] + v["bytes_written"] for v in paths.values())
    ledger = {"total_bytes": total, "direct_bytes": direct, "paths": paths,
              "reasons": {"handle_register_failed": {}}}
    out = {"case": "x", "memory": "device", "auto": {"bytes": 4 * MiB, "memory": "device", "identical": identical,
                                                      "direct_bytes": direct, "ledger": ledger}}
    if refused is not None:
        out["registration"] = {"refused": refused}
    if forced is not None:
        out["cufile_mode"] = forced
    return "some library chatter\n" + json.dumps(out) + "\n"


@pytest.mark.parametrize("rc, stdout, status, words", [
    (0, _child_out(refused=2), "pass", "refused 2 time(s)"),
    (0, _child_out(refused=0), "pass", "never reached"),
    (-11, "", "fail", "crashed (SIGSEGV)"),
    (1, "", "fail", "exit status 1"),
    (0, "no json here", "fail", "exit status 0"),
    (0, _child_out(identical=False), "fail", "differ"),
    (0, _child_out(direct=4 * MiB, paths={"cufile-nvfs": {"bytes_read": 4 * MiB, "bytes_written": 4 * MiB}}),
     "fail", "still took the direct path"),
    (0, _child_out(paths={"host": {"bytes_read": MiB, "bytes_written": MiB}}), "fail", "unexpected ledger"),
    (0, _child_out(forced={"refused": True, "reason": "udev_missing"}), "pass", "refused the file (udev_missing)"),
    (0, _child_out(forced={"identical": True, "direct_bytes": 0,
                           "ledger": {"paths": {"cufile-compat": {"bytes_read": 1, "bytes_written": 1}}}}),
     "pass", "cufile-compat"),
    (0, _child_out(forced={"identical": False, "direct_bytes": 0, "ledger": {"paths": {}}}), "fail", "data differ"),
])
def test_fault_case_judgement(rc, stdout, status, words):
    row = faults.judge("register", rc, stdout, "Traceback ...\nRuntimeError: last words\n")
    assert row["status"] == status, row
    assert words in row["detail"]
    if status == "fail":
        assert row["fix"]


def test_forced_compat_config_keeps_the_rest_of_cufile_json(tmp_path, monkeypatch):
    src = tmp_path / "site-cufile.json"
    src.write_text('// site config\n{"properties": {"use_pci_p2pdma": true, "force_compat_mode": false},\n'
                   ' "fs": {"lustre": {"posix_gds_min_kb": 4}}, "logging": {"level": "ERROR"}}\n')
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(src))
    out = tmp_path / "child"
    out.mkdir()
    data = json.loads(open(faults.forced_compat_config(str(out))).read())
    assert data["properties"] == {"use_pci_p2pdma": True, "force_compat_mode": True, "allow_compat_mode": True}
    assert data["fs"] == {"lustre": {"posix_gds_min_kb": 4}}
    assert data["logging"] == {"level": "ERROR", "dir": str(out)}


def test_fault_children_run_and_degrade_on_host_memory(tmp_path):
    """The real child processes, on this machine. Without a GPU their memory is host memory: this
    proves the plumbing (environment, child, judgement), not a GPU fallback."""
    ctx = _ctx(tmp_path, gpus=1)
    ctx.sizes = dataclasses.replace(QUICK, fault=2 * MiB)
    r = items.item_faults(ctx)
    by_case = {c["case"]: c for c in r.data["cases"]}
    if not faults.is_tmpfs(faults.TMPFS_DIR):
        assert by_case["tmpfs"]["status"] == "n/a"
        del by_case["tmpfs"]
    for case, row in by_case.items():
        assert row["status"] == "pass", row
        assert row["child"]["auto"]["identical"]
    assert r.status == "pass"
    assert json.loads((tmp_path / "report" / "faults.json").read_text())[0]["case"] == "compat"
    assert os.listdir(tmp_path / "target") == []


def test_fault_item_is_not_applicable_without_gpu(tmp_path):
    r = items.item_faults(_ctx(tmp_path, gpus=0))
    assert r.status in ("n/a", "fail")
    rows = {c["case"]: c for c in r.data["cases"]}
    assert rows["compat"]["status"] == rows["register"]["status"] == "n/a"
    assert r.status == "n/a", rows


# --------------------------------------------------------------------------- the run
def test_an_item_that_raises_is_a_failure_and_the_report_is_still_written(tmp_path, monkeypatch):
    def boom(ctx):
        raise OSError(28, "No space left on device")

    monkeypatch.setitem(items.ITEMS, 6, boom)
    opts = AcceptOptions(targets=[str(tmp_path)], report_dir=str(tmp_path / "rep"), quick=True, items=(6,))
    report = run_accept(opts)
    six = report.items[5]
    assert six.status == "fail" and "No space left" in six.summary and six.fix
    assert report.exit_code == 1
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["summary"]["failed_items"] == [6]


def test_workload_timeout_fails_with_what_was_done(tmp_path, calls):
    exc = TimeoutError("ran past its 5 s timeout")
    exc.report = _workload_report(direct=0, posix=123)
    calls(exc)
    r = items.item_workload(_ctx(tmp_path, gpus=1, timeout=5))
    assert r.status == "fail" and "timeout" in r.summary and "--timeout" in r.fix
    assert any("POSIX bytes 123" in line for line in r.evidence)
