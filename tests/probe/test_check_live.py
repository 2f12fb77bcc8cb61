"""`gdskit check` against the machine the tests run on (no fixture)."""

from __future__ import annotations

import json

import pytest

from gdskit.probe import run_check
from gdskit.vocabulary import Path, Reason


def test_check_of_this_machine_completes_and_is_consistent():
    r = run_check()
    d = json.loads(json.dumps(r.to_dict()))
    assert d["root"] == "/" and d["mounts"]
    assert any(m["mountpoint"] == "/" for m in d["mounts"])
    for m in d["mounts"]:
        assert m["verdict"] in ("direct", "compat", "unsupported")
        assert m["odirect"]["status"] in ("supported", "unsupported", "not-probed", "error")
    if not r.gpu.gpus:
        # No GPU here: the check must say so, and offer the host path everywhere.
        assert any(f.id == "gpu.none" and f.reason == Reason.NO_GPU.value for f in r.findings)
        assert all(Reason.NO_GPU.value in m.reasons and m.fallback == Path.HOST.value for m in r.mounts)
        assert r.topology.links == []


def test_check_of_given_paths_on_this_machine(tmp_path):
    r = run_check([str(tmp_path)], odirect=True)
    (m,) = r.mounts
    assert m.requested == [str(tmp_path.resolve())]
    assert m.odirect.status in ("supported", "unsupported", "error")
    assert list(tmp_path.iterdir()) == []                     # the O_DIRECT probe cleaned up


@pytest.mark.gpu
def test_check_sees_the_gpus_cuda_sees():
    from gdskit.engine import cuda

    r = run_check()
    assert len(r.gpu.gpus) == cuda.device_count()
    for g in r.gpu.gpus:
        assert g.bar1_total and g.pci_bus_id.count(":") == 2


def test_probe_moves_a_block_through_gdskit_and_reports_the_ledger(tmp_path):
    r = run_check([str(tmp_path)], probe=True)
    (m,) = r.mounts
    p = m.probe
    assert p["status"] == "ok" and p["data_verified"] is True
    assert p["bytes_written"] == p["bytes_read"] == p["bytes"] > 0
    for side in ("write", "read"):
        assert sum(p[side]["paths"].values()) == p["bytes"]
        assert set(p[side]["reasons"]) <= {x.value for x in Reason}
    if not r.gpu.gpus:
        assert set(p["write"]["paths"]) == {Path.HOST.value}
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
def test_probe_on_the_gpu_machine_uses_device_memory(tmp_path):
    r = run_check([str(tmp_path)], probe=True)
    (m,) = r.mounts
    assert m.probe["status"] == "ok" and m.probe["memory"] == "device" and m.probe["data_verified"]
    assert Path.HOST.value not in m.probe["read"]["paths"]
    if m.verdict != "direct":
        assert not set(m.probe["read"]["paths"]) & {Path.CUFILE_NVFS.value, Path.CUFILE_P2PDMA.value}


def test_probe_of_a_directory_it_cannot_write_reports_instead_of_raising(tmp_path):
    from gdskit.probe.live import probe_directory

    res = probe_directory(str(tmp_path / "gone"), 4096, on_gpu=False)
    assert res["status"] == "failed" and "FileNotFoundError" in res["error"]
    ok = probe_directory(str(tmp_path), 4096, on_gpu=False)
    assert ok["status"] == "ok" and ok["data_verified"] and list(tmp_path.iterdir()) == []
