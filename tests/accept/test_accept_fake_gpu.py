"""The GPU items' logic on stand-ins for the CUDA runtime and libcufile (CI has neither): the A/B
benchmark and the sweep with their archive and plots, and the two cuFile faults of item 7 run
in this process."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gdskit.engine import direct_path
from gdskit.engine import cuda
from gdskit.accept import fault_child, faults, items
from gdskit.accept.context import QUICK, AcceptContext, AcceptOptions
from gdskit.accept.workload import raw_round_trip

from fake_cufile import FakeCufile
from fake_stack import use_cufile

pytestmark = pytest.mark.skipif(cuda.device_count() > 0, reason="a real GPU is present: the stand-ins would hide it")

MiB = 1 << 20
TINY = dataclasses.replace(QUICK, ab_size=8 * MiB, ab_repeat=1, sweep_size=8 * MiB, sweep_seconds=0.02,
                           sweep_repeat=1, fault=4 * MiB)


def _ctx(tmp_path) -> AcceptContext:
    (tmp_path / "t").mkdir()
    (tmp_path / "r").mkdir()
    ctx = AcceptContext(AcceptOptions(targets=[str(tmp_path / "t")], report_dir=str(tmp_path / "r"), quick=True))
    ctx.sizes = TINY
    return ctx


def test_ab_and_sweep_run_archive_and_plot(tmp_path, compat_cufile):
    pytest.importorskip("matplotlib")
    ctx = _ctx(tmp_path)
    assert ctx.has_gpu
    ab = items.item_ab(ctx)
    assert ab.status == "pass", ab
    text = "\n".join(ab.evidence)
    assert "identical for both paths" in text and "cufile:" in text and "bounce:" in text
    assert "FELL BACK" in text and "CPU-s/GiB" in text and "p50/p99" in text
    assert [a.path for a in ab.artifacts] == ["ab.png", "bench-ab.json", "bench-ab.csv"]
    archived = json.loads((tmp_path / "r" / "bench-ab.json").read_text())
    assert {r["path"] for r in archived["runs"]} == {"cufile", "bounce"}

    sweep = items.item_sweep(ctx)
    assert sweep.status == "pass", sweep
    text = "\n".join(sweep.evidence)
    assert "swept 4K to 1M (9 sizes)" in text and "setting: GDSKIT_" in text
    assert sweep.data["knee"]["verdicts"][0]["io_size"] == 4096
    for a in sweep.artifacts:
        assert (tmp_path / "r" / a.path).stat().st_size > 0
    assert (tmp_path / "r" / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((tmp_path / "t").iterdir()) == []   # bench's temporary file removed


def test_ab_fails_with_the_reason_when_cufile_cannot_register(tmp_path, monkeypatch, fake_cuda):
    lib = use_cufile(monkeypatch, FakeCufile(route="posix", register_fails=True))
    try:
        r = items.item_ab(_ctx(tmp_path))
    finally:
        lib.close()
    assert r.status == "fail" and "cufile path cannot run" in r.summary and r.fix


def test_registration_fault_sends_auto_mode_to_the_bounce_path(tmp_path, monkeypatch, fake_cuda):
    fake = FakeCufile(route="nvfs")          # a machine where cuFile would go direct
    lib = use_cufile(monkeypatch, fake)
    machine = direct_path.direct_route()
    try:
        with fault_child.pretend_direct_route():
            assert direct_path.direct_route().route is not None  # for the router and the cuFile backend alike
            hits = fault_child.refuse_registration(fake)
            out = raw_round_trip(str(tmp_path), 4 * MiB, 0)
    finally:
        lib.close()
    assert direct_path.direct_route() is machine  # this machine's own again
    assert hits["refused"] >= 1
    assert out["identical"] and out["memory"] == "device"
    assert out["direct_bytes"] == 0
    assert set(out["ledger"]["paths"]) <= {"bounce-direct", "bounce-cached"}
    assert set(out["ledger"]["reasons"]) & {"handle_register_failed", "udev_missing"}
    row = faults.judge("register", 0, json.dumps({"case": "register", "memory": "device", "auto": out,
                                                  "registration": hits}), "")
    assert row["status"] == "pass" and "refused" in row["detail"]


def test_forced_compat_pass_goes_through_cufile_compat(tmp_path, compat_cufile):
    out = fault_child.forced_cufile_pass(str(tmp_path), 4 * MiB, 0)
    assert out["identical"] and out["direct_bytes"] == 0
    assert set(out["ledger"]["paths"]) == {"cufile-compat"}
