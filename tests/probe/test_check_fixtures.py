"""`gdskit check` against captured machine trees: one test per fixture, verdicts and reasons."""

from __future__ import annotations

import filecmp
import importlib.util
import json
import os

import pytest

from check_helpers import FIXTURES, copy_fixture, fixture_root
from gdskit.probe import SystemRoot, run_check
from gdskit.probe.report import CheckReport
from gdskit.vocabulary import Path, Reason


def check(name: str, paths=None, **kw) -> CheckReport:
    return run_check(paths, root=fixture_root(name), **kw)


def mount(report: CheckReport, mountpoint: str):
    found = [m for m in report.mounts if m.mountpoint == mountpoint]
    assert len(found) == 1, [m.mountpoint for m in report.mounts]
    return found[0]


def finding_ids(report: CheckReport) -> set[str]:
    return {f.id for f in report.findings}


def test_fixture_trees_match_their_generator(tmp_path):
    spec = importlib.util.spec_from_file_location("make_fixtures", os.path.join(FIXTURES, "make_fixtures.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.build(str(tmp_path))

    def entries(d: str) -> list[str]:
        # git keeps no empty directories: a fresh checkout lacks them, and nothing reads them.
        def empty_dir(p: str) -> bool:
            return os.path.isdir(p) and not os.path.islink(p) and all(
                empty_dir(os.path.join(p, n)) for n in os.listdir(p))
        return sorted(n for n in os.listdir(d) if not empty_dir(os.path.join(d, n)))

    def compare(a: str, b: str) -> None:
        names_a, names_b = entries(a), entries(b)
        assert names_a == names_b, (a, set(names_a) ^ set(names_b))
        for n in names_a:
            pa, pb = os.path.join(a, n), os.path.join(b, n)
            if os.path.islink(pa) or os.path.islink(pb):
                assert os.readlink(pa) == os.readlink(pb), pa
            elif os.path.isdir(pa):
                compare(pa, pb)
            else:
                assert filecmp.cmp(pa, pb, shallow=False), pa

    for name in mod.FIXTURES:
        compare(os.path.join(tmp_path, name), fixture_root(name))


def test_nvme_ext4_with_nvidia_fs_is_direct():
    r = check("nvme-ext4-nvfs")
    data = mount(r, "/data")
    assert data.verdict == "direct" and data.route == Path.CUFILE_NVFS.value
    assert data.reasons == [Reason.DIRECT.value]
    assert [n.dev_type for n in data.device.leaves()] == ["nvme"]
    assert data.device.kind == "partition" and data.device.children[0].name == "nvme0n1"
    assert data.udev_entry is True
    root = mount(r, "/")
    assert root.verdict == "compat" and root.reasons == [Reason.FS_UNSUPPORTED.value]
    assert root.device.leaves()[0].dev_type == "scsi"
    assert r.gds.nvidia_fs.loaded and r.gds.nvidia_fs.version == "2.24.4"
    assert r.gpu.kernel_module == "proprietary" and not r.gds.p2pdma.available
    assert r.gds.config.posix_gds_min_kb == {"lustre": 0, "nfs": 4}
    assert r.gds.config.logging_dir == "/var/log/cufile"
    assert r.gds.virtualization is None and r.gds.iommu.state == "off"
    (link,) = r.topology.links
    assert link.relation == "same-switch" and link.common_bridge == "0000:01:00.0"
    assert not link.acs_blocking and not link.acs_unknown
    assert r.gpu.gpus[0].pci_bus_id == "0000:03:00.0" and r.gpu.gpus[0].numa_node == 0


def test_p2pdma_kernel_without_nvidia_fs_is_direct_through_p2pdma():
    r = check("p2pdma-no-nvfs")
    assert r.gds.p2pdma.available and not r.gds.nvidia_fs.loaded
    data = mount(r, "/data")
    assert data.verdict == "direct" and data.route == Path.CUFILE_P2PDMA.value
    assert "gds.nvidia_fs_missing" in finding_ids(r)
    assert next(f for f in r.findings if f.id == "gds.nvidia_fs_missing").severity == "info"


def test_raid0_over_nvme_with_p2pdma_only_needs_nvidia_fs():
    r = check("raid0-p2pdma")
    raid = mount(r, "/raid")
    assert raid.verdict == "compat" and raid.route is None
    assert raid.reasons == [Reason.RAID_OR_MULTIPATH.value]
    assert raid.raid_or_multipath
    assert raid.device.kind == "md" and raid.device.detail == "raid0"
    assert sorted(n.name for n in raid.device.leaves()) == ["nvme0n1", "nvme1n1"]
    f = next(f for f in r.findings if f.id == "mount.raid_p2pdma")
    assert f.reason == Reason.RAID_OR_MULTIPATH.value and f.severity == "error" and f.fix


def test_acs_on_switch_ports_blocks_p2pdma_and_names_the_bridge():
    r = check("acs-switch")
    data = mount(r, "/data")
    assert data.verdict == "compat" and Reason.P2PDMA_UNAVAILABLE.value in data.reasons
    (link,) = r.topology.links
    assert link.relation == "same-switch"
    assert [b.bdf for b in link.acs_blocking] == ["0000:02:00.0", "0000:02:01.0"]
    assert set(link.acs_blocking[1].acs.enabled) == {"SV", "RR", "CR", "UF"}
    assert link.acs_blocking[1].port_type == "switch downstream port"
    subjects = {f.subject for f in r.findings if f.id == "topology.acs"}
    assert subjects == {"bridge 0000:02:00.0", "bridge 0000:02:01.0"}


def test_gpu_and_nvme_under_different_root_complexes():
    r = check("cross-root-complex")
    (link,) = r.topology.links
    assert link.relation == "across-root-complexes" and link.cross_numa
    assert [b.bdf for b in link.bridges] == ["0000:00:01.0", "0000:80:01.0"]
    assert "topology.cross_root_complex" in finding_ids(r)
    assert mount(r, "/data").verdict == "direct"   # nvidia-fs still serves it, at a cost the finding names


def test_small_bar1_is_a_warning_not_a_blocker():
    r = check("small-bar1")
    assert r.gpu.gpus[0].bar1_small
    f = next(f for f in r.findings if f.id == "gpu.bar1_small")
    assert f.severity == "warning" and f.subject == "GPU 0"
    assert mount(r, "/data").verdict == "direct"


def test_nfs_without_rdma_is_compat_and_with_rdma_is_direct():
    r = check("nfs-no-rdma")
    tcp = mount(r, "/mnt/nfs")
    assert tcp.network and tcp.rdma is False
    assert tcp.verdict == "compat" and tcp.reasons == [Reason.FS_UNSUPPORTED.value]
    assert "mount.no_rdma" in finding_ids(r)
    rdma = mount(r, "/mnt/nfs rdma")                 # mountinfo escapes the space as \040
    assert rdma.rdma is True and rdma.verdict == "direct" and rdma.route == Path.CUFILE_NVFS.value
    (peer,) = [p for p in r.topology.peers if p.kind == "rdma"]
    assert peer.name == "mlx5_0" and peer.netdevs == ("ibp5s0",) and peer.pci_bus_id == "0000:05:00.0"


def test_overlay_and_tmpfs_have_no_direct_path():
    r = check("overlay-tmpfs")
    assert {m.mountpoint for m in r.mounts} == {"/", "/scratch", "/data"}   # /dev/shm and /run are plumbing
    over, tmp = mount(r, "/"), mount(r, "/scratch")
    for m in (over, tmp):
        assert m.verdict == "compat" and m.reasons == [Reason.FS_UNSUPPORTED.value] and m.device is None
    assert tmp.fallback == Path.BOUNCE_CACHED.value
    assert mount(r, "/data").verdict == "direct"
    assert {"mount.overlay", "mount.memory_fs"} <= finding_ids(r)


def test_firecracker_vm_like_the_gpu_machine():
    r = check("vm-firecracker")
    (root,) = r.mounts
    assert root.mountpoint == "/" and root.verdict == "unsupported" and root.route is None
    assert set(root.reasons) == {Reason.UDEV_MISSING.value, Reason.FS_UNSUPPORTED.value,
                                 Reason.NVIDIA_FS_MISSING.value, Reason.P2PDMA_UNAVAILABLE.value}
    assert root.reasons[0] == Reason.UDEV_MISSING.value         # the blocker comes first
    (vda,) = root.device.leaves()
    assert (vda.name, vda.dev_type, vda.major, vda.minor) == ("vda", "virtio", 254, 0)
    assert r.gds.virtualization == "firecracker" and r.gds.kernel_version == (6, 18)
    assert not r.gds.udev.database and not r.gds.nvidia_fs.loaded
    assert r.gds.p2pdma.kernel_symbol is False and r.gds.p2pdma.kernel_version_ok
    assert r.gds.cufile.found and r.gds.cufile.version == "1.15"
    assert r.gds.config.found and r.gds.config.error is None
    (gpu,) = r.gpu.gpus
    assert gpu.name == "NVIDIA H200" and gpu.bar1_total == 256 << 30 and not gpu.bar1_small
    assert (gpu.pcie_gen, gpu.pcie_width) == (5, 16)
    assert {"gds.udev_missing", "gds.nvidia_fs_missing", "gds.p2pdma_unavailable", "mount.device_virtio"} \
        <= finding_ids(r)
    assert not r.summary()["direct_possible_anywhere"]


def test_no_gpu_at_all_says_so_and_offers_the_host_path():
    r = check("no-gpu")
    assert r.gpu.gpus == [] and not r.gpu.nvml_available
    assert not r.gds.cufile.found
    for m in r.mounts:
        assert m.verdict == "unsupported" and m.fallback == Path.HOST.value
        assert m.reasons[:2] == [Reason.NO_GPU.value, Reason.CUFILE_MISSING.value]
    f = next(f for f in r.findings if f.id == "gpu.none")
    assert f.severity == "error" and f.reason == Reason.NO_GPU.value and "host" in f.consequence
    assert r.topology.links == []


# --------------------------------------------------------------------------- injected facts
def test_injected_nvml_source_replaces_the_fixture_gpu():
    root = SystemRoot(fixture_root("nvme-ext4-nvfs"), nvml=lambda: {"available": False, "error": "gone"})
    r = run_check(root=root)
    assert r.gpu.gpus == [] and r.gpu.nvml_error == "gone"
    assert all(Reason.NO_GPU.value in m.reasons for m in r.mounts)


def test_force_compat_mode_from_the_environment():
    root = SystemRoot(fixture_root("nvme-ext4-nvfs"), env={"CUFILE_FORCE_COMPAT_MODE": "true"})
    data = mount(run_check(root=root), "/data")
    assert data.verdict == "compat" and data.reasons == [Reason.FORCED_BY_SETTING.value]


def test_compat_disallowed_makes_non_direct_unsupported():
    root = SystemRoot(fixture_root("acs-switch"), env={"CUFILE_ALLOW_COMPAT_MODE": "0"})
    r = run_check(root=root)
    assert mount(r, "/data").verdict == "unsupported"
    assert "config.compat_disabled" in finding_ids(r)


def test_cufile_env_path_json_is_honoured(tmp_path):
    tree = copy_fixture("nvme-ext4-nvfs", str(tmp_path))
    with open(os.path.join(tree, "opt-cufile.json"), "w") as fh:
        fh.write('{"properties": {"force_compat_mode": true} // forced\n}')
    r = run_check(root=SystemRoot(tree, env={"CUFILE_ENV_PATH_JSON": "/opt-cufile.json"}))
    assert r.gds.config.path == "/opt-cufile.json" and r.gds.config.force_compat_mode
    assert mount(r, "/data").verdict == "compat"


def test_broken_cufile_json_is_an_error_finding(tmp_path):
    tree = copy_fixture("nvme-ext4-nvfs", str(tmp_path))
    with open(os.path.join(tree, "etc", "cufile.json"), "w") as fh:
        fh.write('{"properties": {')
    r = run_check(root=tree)
    assert r.gds.config.error is not None
    assert next(f for f in r.findings if f.id == "config.invalid").severity == "error"


def test_missing_udev_entry_for_the_device_blocks_registration(tmp_path):
    tree = copy_fixture("nvme-ext4-nvfs", str(tmp_path))
    os.unlink(os.path.join(tree, "run", "udev", "data", "b259:1"))
    r = run_check(root=tree)
    data = mount(r, "/data")
    assert data.udev_entry is False and data.verdict == "unsupported"
    assert data.reasons == [Reason.UDEV_MISSING.value]
    assert "mount.udev_entry" in finding_ids(r)


def test_injected_odirect_failure_turns_direct_into_compat(tmp_path):
    tree = copy_fixture("nvme-ext4-nvfs", str(tmp_path))
    with open(os.path.join(tree, ".gdskit-fixture", "odirect.json"), "w") as fh:
        json.dump({"/data": "unsupported"}, fh)
    data = mount(run_check(root=tree), "/data")
    assert data.odirect.status == "unsupported"
    assert data.verdict == "compat" and data.reasons == [Reason.FS_UNSUPPORTED.value]
    assert data.fallback == Path.BOUNCE_CACHED.value


def test_odirect_is_not_probed_in_captured_trees():
    assert all(m.odirect.status == "not-probed" for m in check("nvme-ext4-nvfs").mounts)


def test_paths_select_their_mounts():
    r = check("nvme-ext4-nvfs", ["/data/models/a.safetensors", "/data/x", "/etc/hosts"])
    assert [(m.mountpoint, m.requested) for m in r.mounts] == [
        ("/data", ["/data/models/a.safetensors", "/data/x"]), ("/", ["/etc/hosts"])]


def test_require_direct_fails_only_for_non_direct_mounts():
    assert check("nvme-ext4-nvfs", ["/data"], require="direct").exit_code == 0
    r = check("nvme-ext4-nvfs", require="direct")
    assert r.exit_code == 1 and [m.mountpoint for m in r.failing_mounts] == ["/"]
    assert check("nvme-ext4-nvfs", require="compat").exit_code == 0
    assert check("vm-firecracker", require="compat").exit_code == 1


def test_a_requirement_is_not_met_by_no_mounts(tmp_path):
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "mountinfo").write_text("")
    r = run_check(root=str(tmp_path), require="direct", odirect=False)
    assert r.mounts == [] and r.require_met is False and r.exit_code == 1


def test_bad_arguments_raise_typed_errors(tmp_path):
    from gdskit.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError):
        run_check(root=str(tmp_path / "no-such-dir"), require="direct")
    with pytest.raises(InvalidArgumentError):
        check("nvme-ext4-nvfs", require="fast")
    with pytest.raises(InvalidArgumentError):
        check("nvme-ext4-nvfs", ["relative/path"])


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, n))))
def test_every_report_is_json_and_uses_the_vocabulary(name):
    r = check(name)
    d = json.loads(json.dumps(r.to_dict()))
    words = {x.value for x in Reason}
    for m in d["mounts"]:
        assert m["verdict"] in ("direct", "compat", "unsupported")
        assert set(m["reasons"]) <= words and m["reasons"]
        assert (m["route"] is not None) == (m["verdict"] == "direct")
    for f in d["findings"]:
        assert f["severity"] in ("ok", "info", "warning", "error")
        assert f["reason"] is None or f["reason"] in words
        if f["severity"] in ("warning", "error"):
            assert f["consequence"] and f["fix"]


def test_probe_is_skipped_on_captured_trees():
    r = check("vm-firecracker", probe=True)
    assert r.probed and r.notes
    assert all(m.probe["status"] == "skipped" for m in r.mounts)


def _builder():
    spec = importlib.util.spec_from_file_location("make_fixtures", os.path.join(FIXTURES, "make_fixtures.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_device_mapper_loop_and_multipath_layers_are_resolved(tmp_path):
    mf = _builder()
    t = mf.Tree("layers", str(tmp_path))
    mf.bare_metal_base(t, nvfs=True, p2pdma=False)
    t.cufile_json({"allow_compat_mode": True})
    nv0, nv1 = mf._switch_box(t, n_nvme=2)
    t.nvme("nvme0", nv0, {"nvme0n1": ("259:0", {"nvme0n1p1": "259:1", "nvme0n1p2": "259:3"})})
    t.nvme("nvme1", nv1, {"nvme1n1": ("259:2", {})})
    part = f"{nv0}/nvme/nvme0/nvme0n1/nvme0n1p1"
    t.block("/sys/devices/virtual/block/dm-0", "253:0", slaves=[part])
    t.file("/sys/devices/virtual/block/dm-0/dm/uuid", "CRYPT-LUKS2-abc-luks\n")
    t.file("/sys/devices/virtual/block/dm-0/dm/name", "luks\n")
    t.block("/sys/devices/virtual/block/dm-1", "253:1", slaves=[f"{nv1}/nvme/nvme1/nvme1n1"])
    t.file("/sys/devices/virtual/block/dm-1/dm/uuid", "mpath-3600a0b80\n")
    t.block("/sys/devices/virtual/block/loop0", "7:0")
    t.file("/sys/devices/virtual/block/loop0/loop/backing_file", "/data/images/disk.img\n")
    t.mount("259:3", "/data", "xfs", "/dev/nvme0n1p2")
    t.mount("253:0", "/secure", "ext4", "/dev/mapper/luks")
    t.mount("253:1", "/mp", "xfs", "/dev/mapper/mpatha")
    t.mount("7:0", "/img", "ext4", "/dev/loop0")
    t.udev({"259:3": "xfs", "253:0": "ext4", "253:1": "xfs", "7:0": "ext4"})
    t.finish()
    r = run_check(root=t.root)
    assert mount(r, "/data").verdict == "direct"
    secure = mount(r, "/secure")
    assert secure.device.kind == "dm" and secure.device.detail == "crypt"
    assert [n.name for n in secure.device.leaves()] == ["nvme0n1"]
    assert secure.verdict == "compat" and Reason.FS_UNSUPPORTED.value in secure.reasons
    mp = mount(r, "/mp")
    assert mp.raid_or_multipath and mp.device.detail == "multipath"
    img = mount(r, "/img")
    assert img.device.kind == "loop" and img.device.detail == "/data/images/disk.img"
    assert [n.name for n in img.device.leaves()] == ["nvme0n1"]        # the backing file lives on /data
    assert img.verdict == "compat" and "mount.loop" in finding_ids(r)


def test_each_bridge_is_read_once_however_many_links_cross_it(monkeypatch):
    from collections import Counter

    from gdskit.machine import topology

    reads: Counter[str] = Counter()
    real = topology.read_bridge

    def counting(root, bdf):
        reads[bdf] += 1
        return real(root, bdf)

    monkeypatch.setattr(topology, "read_bridge", counting)
    r = check("raid0-p2pdma")
    assert r.topology.links and reads and max(reads.values()) == 1, reads
