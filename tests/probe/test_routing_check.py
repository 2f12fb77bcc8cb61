"""`gdskit check`'s route table on captured trees: two root complexes with the drive under one
and a GPU under each (NVLink and not), one GPU, routing off; the JSON and the table."""

from __future__ import annotations

import json

import pytest
import typer
from cli_app import one_command_app
from typer.testing import CliRunner

import gdskit
from check_helpers import fixture_root
from gdskit.cli import check as check_cli
from gdskit.probe import run_check
from gdskit.probe.routes import peer_links
from gdskit.machine.storage import FixtureFacts
from gdskit.machine.root import SystemRoot

ROUTING_KEYS = {"policy", "gpu_count", "applies", "why", "peers", "mounts"}
MOUNT_ROUTE_KEYS = {"mountpoint", "storage", "storage_unknown", "direct", "nearest_gpus", "nearest_distance",
                    "applies", "poor_pairing", "gpus"}
GPU_ROUTE_KEYS = {"gpu", "pci_bus_id", "distance", "routed", "via", "why", "peer"}


def routes_of(name: str, mountpoint: str, **kw) -> dict:
    d = json.loads(json.dumps(run_check(root=fixture_root(name), **kw).to_dict()))
    found = [m for m in d["routing"]["mounts"] if m["mountpoint"] == mountpoint]
    assert len(found) == 1
    return d["routing"] | {"mount": found[0]}


def test_the_far_gpu_reads_through_the_one_beside_the_drive_over_nvlink():
    r = routes_of("two-gpus-nvlink", "/data")
    assert set(r) - {"mount"} == ROUTING_KEYS and set(r["mount"]) == MOUNT_ROUTE_KEYS
    assert (r["policy"], r["gpu_count"], r["applies"], r["why"]) == ("auto", 2, True, None)
    assert r["peers"] == [{"gpus": [0, 1], "access": True, "nvlink": True}]
    m = r["mount"]
    assert [s["name"] for s in m["storage"]] == ["nvme0"] and m["storage"][0]["pci_bus_id"] == "0000:84:00.0"
    assert m["direct"] and m["nearest_gpus"] == [1] and m["nearest_distance"] == "same-switch"
    assert m["applies"] and m["poor_pairing"]
    by_gpu = {g["gpu"]: g for g in m["gpus"]}
    assert all(set(g) == GPU_ROUTE_KEYS for g in m["gpus"])
    assert by_gpu[0] | {"peer": None} == {"gpu": 0, "pci_bus_id": "0000:03:00.0", "distance": "cross-socket",
                                         "routed": True, "via": 1, "why": "nearer_gpu", "peer": None}
    assert by_gpu[0]["peer"] == {"access": True, "nvlink": True}
    assert (by_gpu[1]["routed"], by_gpu[1]["why"], by_gpu[1]["distance"]) == (False, "target_nearest", "same-switch")


def test_without_peer_access_nothing_is_routed_and_the_finding_says_how_to_pair():
    report = run_check(root=fixture_root("two-gpus-no-p2p"))
    m = next(m for m in report.routes.mounts if m.mountpoint == "/data")
    assert not m.applies and m.poor_pairing
    assert [r.why.value for r in m.routes] == ["no_peer_access", "target_nearest"]
    found = [f for f in report.findings if f.id == "routing.poor_pairing"]
    assert len(found) == 1 and found[0].severity == "warning" and found[0].subject == "mount /data"
    assert "slot" in found[0].fix and "NVLink" in found[0].fix
    nvlink = run_check(root=fixture_root("two-gpus-nvlink"))
    (info,) = [f for f in nvlink.findings if f.id == "routing.poor_pairing"]
    assert info.severity == "info"


def test_a_mount_without_a_direct_path_is_not_routed():
    r = routes_of("two-gpus-nvlink", "/")  # the SATA boot disk: compat at best
    assert not r["mount"]["direct"] and not r["mount"]["applies"]
    assert {g["why"] for g in r["mount"]["gpus"]} == {"no_direct_path"}


@pytest.mark.parametrize("name", ["nvme-ext4-nvfs", "cross-root-complex", "vm-firecracker"])
def test_one_gpu_is_a_no_op_and_the_check_says_why(name):
    report = run_check(root=fixture_root(name))
    d = report.to_dict()["routing"]
    assert d["gpu_count"] == 1 and d["why"] == "one_gpu" and not d["applies"]
    assert all(g["why"] == "one_gpu" and not g["routed"] for m in d["mounts"] for g in m["gpus"])
    assert not [f for f in report.findings if f.id.startswith("routing.")]


def test_no_gpu_and_unknown_storage():
    d = run_check(root=fixture_root("no-gpu")).to_dict()["routing"]
    assert d["gpu_count"] == 0 and d["why"] == "one_gpu"
    nfs = routes_of("nfs-no-rdma", "/mnt/nfs")["mount"]
    assert nfs["storage"] == [] and "RDMA" in nfs["storage_unknown"]
    rdma = routes_of("nfs-no-rdma", "/mnt/nfs rdma")["mount"]
    assert [s["name"] for s in rdma["storage"]] == ["mlx5_0"] and rdma["nearest_distance"] == "same-switch"
    tmpfs = routes_of("overlay-tmpfs", "/scratch")["mount"]
    assert tmpfs["storage"] == [] and tmpfs["storage_unknown"]


def test_routing_off_and_force_as_the_check_reports_them():
    with gdskit.settings.set(routing="off"):
        off = routes_of("two-gpus-nvlink", "/data")
    assert off["why"] == "off" and not off["applies"]
    assert {g["why"] for g in off["mount"]["gpus"]} == {"off"}
    with gdskit.settings.set(routing="force"):
        forced = routes_of("two-gpus-nvlink", "/data")
    assert [(g["via"], g["why"]) for g in forced["mount"]["gpus"]] == [(1, "forced"), (0, "forced")]


def test_peer_facts_of_a_captured_tree_and_a_tree_without_them():
    root = SystemRoot(fixture_root("two-gpus-no-p2p"))
    links = peer_links(root, ["0000:03:00.0", "0000:83:00.0"])
    assert [(sorted(k), v.access, v.nvlink) for k, v in links.items()] == [
        (["0000:03:00.0", "0000:83:00.0"], False, False)]
    assert peer_links(SystemRoot(fixture_root("nvme-ext4-nvfs")), ["0000:03:00.0", "0000:04:00.0"]) == {}


def test_the_engine_fact_source_over_a_captured_tree():
    facts = FixtureFacts(fixture_root("two-gpus-nvlink"), 259, 1)(0, ("0000:03:00.0", "0000:83:00.0", "0000:99:00.0"))
    assert facts.known and facts.devices == ("0000:84:00.0",)
    assert {k: v.value for k, v in facts.distances.items()} == {
        "0000:03:00.0": "cross-socket", "0000:83:00.0": "same-switch", "0000:99:00.0": "unknown"}
    assert not FixtureFacts(fixture_root("two-gpus-nvlink"), 7, 99)(0, ("0000:03:00.0",)).known


# --------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def app() -> typer.Typer:
    return one_command_app(check_cli.register)


def run(app, *args):
    return CliRunner().invoke(app, ["check", *args], env={"COLUMNS": "240"})


def test_the_table_shows_routes_and_the_json_carries_them(app):
    res = run(app, "--root", fixture_root("two-gpus-nvlink"))
    assert res.exit_code == 0, res.output
    assert "Routes (routing=auto)" in res.output
    assert "through GPU 1 over NVLink (nearer the storage)" in res.output
    assert "GPU peer links: 0-1: NVLink" in res.output
    as_json = json.loads(run(app, "--root", fixture_root("two-gpus-nvlink"), "--json").stdout)
    assert as_json["routing"]["applies"] is True


def test_the_table_says_routing_is_a_no_op_on_one_gpu(app):
    res = run(app, "--root", fixture_root("nvme-ext4-nvfs"))
    assert res.exit_code == 0, res.output
    assert "Routing: 1 GPU: nothing to route through" in res.output
    assert "Routes (routing=" not in res.output
