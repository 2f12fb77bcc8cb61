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
    from gdskit import cuda

    r = run_check()
    assert len(r.gpu.gpus) == cuda.device_count()
    for g in r.gpu.gpus:
        assert g.bar1_total and g.pci_bus_id.count(":") == 2
