"""CPU accounting, machine facts, per-mount profiles: the parts that touch no engine."""

from __future__ import annotations

import json
import os

import pytest

from gdskit.bench import cpu, machine, profile
from gdskit.bench.knee import DIRECT_NEVER, find_knee
from gdskit.errors import ConfigError

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
40 27 259:1 / /mnt/fast rw,relatime shared:5 - xfs /dev/nvme0n1p1 rw
41 27 259:2 / /mnt/fast\\040disk rw,relatime - ext4 /dev/nvme1n1 rw
42 40 0:50 / /mnt/fast/lus rw - lustre 10.0.0.1@o2ib:/fs rw
"""


def test_cpu_cost_from_synthetic_samples():
    a = cpu.CpuSample(wall=0.0, system={"user": 10, "nice": 0, "system": 5, "idle": 80,
                                        "iowait": 5, "irq": 0, "softirq": 0},
                      proc_user=1.0, proc_system=0.5)
    b = cpu.CpuSample(wall=2.0, system={"user": 30, "nice": 0, "system": 25, "idle": 120,
                                        "iowait": 25, "irq": 0, "softirq": 0},
                      proc_user=2.0, proc_system=1.5)
    c = cpu.cpu_cost(a, b)
    assert c.user_pct == pytest.approx(20.0) and c.system_pct == pytest.approx(20.0)
    assert c.iowait_pct == pytest.approx(20.0) and c.busy_pct == pytest.approx(40.0)
    assert c.process_cpu_s == pytest.approx(2.0) and c.wall_s == pytest.approx(2.0)
    assert c.cpu_s_per_gib(2 * 2**30) == pytest.approx(1.0)
    assert c.cpu_s_per_gib(0) is None


def test_cpu_meter_sees_work_in_other_threads():
    import threading

    def spin():
        x = 0
        for i in range(2_000_000):
            x += i

    with cpu.CpuMeter() as m:
        t = threading.Thread(target=spin)
        t.start()
        t.join()
    assert m.cost is not None and m.cost.process_cpu_s > 0
    total = m.cost.user_pct + m.cost.system_pct + m.cost.iowait_pct
    assert 0 <= total <= 100.0001


def test_mountinfo_longest_prefix_and_escapes():
    mounts = machine.parse_mountinfo(MOUNTINFO)
    assert any(m.mount_point == "/mnt/fast disk" for m in mounts)
    m = machine.mount_for("/mnt/fast/lus/data/x", MOUNTINFO)
    assert (m.fstype, m.mount_point, m.dev) == ("lustre", "/mnt/fast/lus", "0:50")
    assert machine.mount_for("/mnt/fast/y", MOUNTINFO).fstype == "xfs"
    assert machine.mount_for("/mnt/fastx", MOUNTINFO).fstype == "ext4"   # not /mnt/fast
    assert machine.mount_for("/mnt/fast disk/f", MOUNTINFO).source == "/dev/nvme1n1"


def test_machine_facts_never_raise(tmp_path):
    f = machine.collect(str(tmp_path), gpu_index=0)
    assert f.filesystem is not None and f.cpu_count >= 1
    json.dumps(f.as_dict())
    assert machine.block_device_facts("999:999", sys_root=str(tmp_path)) == {}


def _knee(knee_at):
    sizes = [4096 * 2**i for i in range(6)]
    cpu_ = {s: [1.0] for s in sizes}
    direct = {s: [2.0 if s >= knee_at else 0.5] for s in sizes}
    return find_knee(direct, cpu_, fstype="xfs")


def test_profile_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    store = profile.store_path()
    assert store == str(tmp_path / "cfg" / "gdskit" / "profiles.json")
    assert profile.threshold_for("/mnt/fast/a", mountinfo_text=MOUNTINFO) is None
    entry = profile.save_profile("/mnt/fast/a", _knee(65536), mountinfo_text=MOUNTINFO)
    assert entry["direct_threshold"] == 65536 and entry["dev"] == "259:1"
    assert profile.threshold_for("/mnt/fast/b/c", mountinfo_text=MOUNTINFO) == 65536
    assert profile.threshold_for("/other", mountinfo_text=MOUNTINFO) is None  # on / : no profile
    data = json.loads(open(store).read())
    assert data["schema_version"] == profile.SCHEMA_VERSION
    assert list(data["profiles"]) == ["/mnt/fast|259:1"]
    # a second mount keeps the first
    profile.save_profile("/", _knee(10**9), mountinfo_text=MOUNTINFO)
    assert profile.threshold_for("/x", mountinfo_text=MOUNTINFO) == DIRECT_NEVER
    assert profile.threshold_for("/mnt/fast/a", mountinfo_text=MOUNTINFO) == 65536
    assert not [n for n in os.listdir(os.path.dirname(store)) if n != "profiles.json"]


def test_a_profile_store_that_is_a_link_stays_one(tmp_path, monkeypatch):
    """A store kept elsewhere and linked into ~/.config (a dotfiles tree): the file it points to
    is replaced whole, and the link stays."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    kept = tmp_path / "dotfiles" / "profiles.json"
    kept.parent.mkdir()
    kept.write_text(json.dumps({"schema_version": profile.SCHEMA_VERSION, "profiles": {}}))
    os.makedirs(tmp_path / "cfg" / "gdskit")
    link = tmp_path / "cfg" / "gdskit" / "profiles.json"
    link.symlink_to(kept)
    profile.save_profile("/mnt/fast/a", _knee(65536), mountinfo_text=MOUNTINFO)
    assert link.is_symlink() and list(json.loads(kept.read_text())["profiles"]) == ["/mnt/fast|259:1"]
    assert os.listdir(kept.parent) == ["profiles.json"]


def test_profile_same_mount_point_other_device(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    profile.save_profile("/mnt/fast/a", _knee(65536), mountinfo_text=MOUNTINFO)
    other = MOUNTINFO.replace("259:1", "259:9")
    assert profile.threshold_for("/mnt/fast/a", mountinfo_text=other) is None


@pytest.mark.parametrize("text", ["{not json", "[" * 100_000 + "]" * 100_000])  # nested past the parser's depth
def test_corrupt_store(tmp_path, monkeypatch, text):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    os.makedirs(tmp_path / "gdskit")
    (tmp_path / "gdskit" / "profiles.json").write_text(text)
    assert profile.threshold_for("/mnt/fast/a", mountinfo_text=MOUNTINFO) is None  # never raises
    with pytest.raises(ConfigError):
        profile.save_profile("/mnt/fast/a", _knee(65536), mountinfo_text=MOUNTINFO)


def test_machine_gpu_facts_come_from_the_check_nvml_query(monkeypatch):
    from gdskit.bench import machine
    from gdskit.machine import gpus

    monkeypatch.setattr(gpus, "query_nvml", lambda: {
        "available": True, "driver_version": "580.1", "gpus": [
            {"index": 0, "name": "H200", "pcie_gen": 5, "pcie_width": 16, "bar1_total": 1 << 38}]})
    assert machine.gpu_facts(0) == {"count": 1, "driver": "580.1", "index": 0, "name": "H200", "pcie_gen": 5,
                                    "pcie_width": 16, "bar1_total_bytes": 1 << 38}
    assert machine.gpu_facts(3) == {"count": 1, "driver": "580.1"}  # no such GPU: no per-GPU facts
    monkeypatch.setattr(gpus, "query_nvml", lambda: {"available": False, "error": "no driver"})
    assert machine.gpu_facts(0) == {}
