"""Parsers behind `gdskit check`: mountinfo, cufile.json with comments, PCI config space, sysfs paths."""

from __future__ import annotations

import json
import os
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gdskit.machine.gds import parse_cufile_json, parse_kernel_version, strip_json_comments
from gdskit.machine.gpus import nvml_bus_id_to_sysfs
from gdskit.machine.mounts import mount_for_path, parse_mountinfo, probe_odirect, unescape_mount_field
from gdskit.machine.topology import ACS_BITS, parse_acs, parse_port_type, place_from_sysfs_path


def kernel_escape(s: str) -> str:
    """What the kernel does to mountinfo fields (show_path / mangle)."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in s)


# --------------------------------------------------------------------------- mountinfo
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1))
def test_mountinfo_unescape_inverts_the_kernel_escape(s):
    assert unescape_mount_field(kernel_escape(s)) == s


@given(st.lists(st.text(alphabet="ab \t\\/é", min_size=1, max_size=12), min_size=1, max_size=4))
def test_mountinfo_round_trip_of_mountpoints(parts):
    mp = "/" + "/".join(parts)
    line = f"36 35 259:1 / {kernel_escape(mp)} rw,relatime shared:1 master:3 - ext4 /dev/nvme0n1p1 rw,data=ordered"
    (m,) = parse_mountinfo(line)
    assert m.mountpoint == mp


def test_mountinfo_fields_with_and_without_optional_fields():
    text = ("27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard\n"
            "40 27 0:52 /sub /mnt/nfs rw,nosuid shared:7 master:2 - nfs4 filer:/export rw,vers=4.2,proto=rdma\n"
            "garbage line\n")
    a, b = parse_mountinfo(text)
    assert (a.major, a.minor, a.fstype, a.source, a.options, a.super_options) == (
        254, 0, "ext4", "/dev/vda", ("rw", "relatime"), ("rw", "discard"))
    assert b.root == "/sub" and b.option("proto") == "rdma" and b.option("vers") == "4.2"
    assert b.option("nosuid") == "" and b.option("missing") is None and not b.read_only


def test_mount_for_path_takes_the_longest_prefix_and_the_last_stacked_mount():
    mounts = parse_mountinfo(
        "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n"
        "2 1 259:1 / /data rw - ext4 /dev/nvme0n1p1 rw\n"
        "3 1 259:2 / /data rw - xfs /dev/nvme1n1 rw\n")
    assert mount_for_path(mounts, "/data/x").minor == 2
    assert mount_for_path(mounts, "/data").minor == 2
    assert mount_for_path(mounts, "/data2/x").major == 8
    assert mount_for_path(mounts, "/").major == 8
    assert mount_for_path([], "/x") is None


# --------------------------------------------------------------------------- cufile.json
def test_cufile_json_comments_are_stripped_but_strings_survive():
    text = """{
      // a line comment with "quotes"
      "logging": {"dir": "http://x//y", /* inline */ "level": "a /* not a comment */ b"},
      "properties": {"allow_compat_mode": false, "use_pci_p2pdma": true,}, /* trailing comma above */
      "escaped": "quote \\" // still string",
    }"""
    d = parse_cufile_json(text)
    assert d["logging"] == {"dir": "http://x//y", "level": "a /* not a comment */ b"}
    assert d["properties"] == {"allow_compat_mode": False, "use_pci_p2pdma": True}
    assert d["escaped"] == 'quote " // still string'


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12)


@given(st.dictionaries(st.text(), json_values, max_size=5))
def test_commented_json_parses_to_the_same_object(d):
    text = json.dumps(d, indent=1)
    # Comments wherever whitespace may stand between tokens: after every newline.
    commented = text.replace("\n", "\n// c \"x\" /* y\n/* block // z */ ")
    assert parse_cufile_json(commented) == d
    assert strip_json_comments(text) == text


def test_cufile_json_must_be_an_object():
    with pytest.raises(ValueError):
        parse_cufile_json("[1, 2]")
    with pytest.raises(ValueError):
        parse_cufile_json('{"a": ')
    for deep in ("[" * 100_000 + "]" * 100_000, '{"properties": ' + "{\"a\": " * 50_000 + "1" + "}" * 50_001):
        with pytest.raises(ValueError, match="nested"):  # not a RecursionError out of gdskit check
            parse_cufile_json(deep)


def test_gdskit_check_reads_a_hostile_cufile_json_as_a_finding(tmp_path):
    import os
    import subprocess
    import sys

    bad = tmp_path / "cufile.json"
    bad.write_text("[" * 100_000 + "]" * 100_000)
    env = {**os.environ, "CUFILE_ENV_PATH_JSON": str(bad), "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "gdskit", "check", "--json"], capture_output=True, text=True,
                         env=env, timeout=120, cwd=tmp_path)
    assert "Traceback" not in out.stderr and "RecursionError" not in out.stderr, out.stderr[-2000:]
    assert "nested" in out.stdout


# --------------------------------------------------------------------------- PCI config space
def make_config(acs_ctrl: int | None, acs_at: int = 0x148, extra_caps: int = 2) -> bytes:
    cfg = bytearray(4096)
    if extra_caps == 0:
        acs_at = 0x100                          # the list always starts at 0x100
    offsets = [0x100 + 0x10 * i for i in range(extra_caps)]
    chain = offsets + ([acs_at] if acs_ctrl is not None else [])
    for i, off in enumerate(chain):
        nxt = chain[i + 1] if i + 1 < len(chain) else 0
        cap_id = 0x000D if (acs_ctrl is not None and off == acs_at) else 0x0001 + i
        struct.pack_into("<I", cfg, off, cap_id | (1 << 16) | (nxt << 20))
    if acs_ctrl is not None:
        struct.pack_into("<HH", cfg, acs_at + 4, 0x7F, acs_ctrl)
    return bytes(cfg)


@given(st.integers(0, 0x7F), st.integers(0, 3), st.sampled_from([0x148, 0x200, 0x2A0, 0xFF8]))
def test_acs_control_bits_are_read_from_the_extended_capability_list(ctrl, extra, at):
    acs = parse_acs(make_config(ctrl, at, extra))
    assert acs is not None and acs.offset == (at if extra else 0x100) and acs.control == ctrl
    assert set(acs.enabled) == {name for name, bit in ACS_BITS.items() if ctrl & bit}
    assert acs.blocks_p2p == bool(ctrl & (ACS_BITS["RR"] | ACS_BITS["CR"] | ACS_BITS["EC"]))


def test_acs_absent_truncated_or_looping_config_gives_none():
    assert parse_acs(make_config(None)) is None
    assert parse_acs(make_config(0x1D)[:64]) is None            # non-root readers see 64 bytes
    assert parse_acs(b"") is None
    looping = bytearray(4096)
    struct.pack_into("<I", looping, 0x100, 0x0001 | (1 << 16) | (0x100 << 20))   # points at itself
    assert parse_acs(bytes(looping)) is None
    backwards = bytearray(4096)
    struct.pack_into("<I", backwards, 0x100, 0x0001 | (0x040 << 20))             # into standard space
    assert parse_acs(bytes(backwards)) is None


@given(st.binary(max_size=600))
def test_acs_parser_never_raises_on_arbitrary_bytes(data):
    parse_acs(data)
    parse_port_type(data)


def test_port_type_from_the_pcie_capability():
    cfg = bytearray(256)
    cfg[0x34] = 0x50
    cfg[0x50], cfg[0x51] = 0x01, 0x60          # power management, next 0x60
    cfg[0x60], cfg[0x61] = 0x10, 0x00          # PCI Express
    struct.pack_into("<H", cfg, 0x62, (0x6 << 4) | 2)
    assert parse_port_type(bytes(cfg)) == "switch downstream port"
    assert parse_port_type(bytes(64)) is None


# --------------------------------------------------------------------------- small parsers
def test_sysfs_paths_and_ids():
    p = place_from_sysfs_path("/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0/nvme/nvme0/nvme0n1")
    assert p.host_bridge == "pci0000:80" and p.chain == ("0000:80:01.0", "0000:81:00.0") and p.bdf == "0000:81:00.0"
    assert place_from_sysfs_path("/sys/devices/platform/virtio-mmio.0/virtio0/block/vda").chain == ()
    assert nvml_bus_id_to_sysfs("00000000:1A:00.0") == "0000:1a:00.0"
    assert nvml_bus_id_to_sysfs("0001:03:00.1") == "0001:03:00.1"
    assert parse_kernel_version("6.18.44-fc-v669") == (6, 18)
    assert parse_kernel_version("weird") is None and parse_kernel_version(None) is None


def test_odirect_probe_leaves_nothing_behind(tmp_path):
    result = probe_odirect(str(tmp_path))
    assert result.status in ("supported", "unsupported")
    assert os.listdir(tmp_path) == []


def test_odirect_probe_where_nothing_can_be_written_is_not_probed(tmp_path):
    assert probe_odirect(str(tmp_path / "does-not-exist")).status == "not-probed"


def test_a_captured_tree_with_facts_nested_too_deep_reads_as_no_facts(tmp_path):
    from gdskit.machine.root import FIXTURE_DIR, SystemRoot

    (tmp_path / FIXTURE_DIR).mkdir()
    for name in ("nvml.json", "env.json"):
        (tmp_path / FIXTURE_DIR / name).write_text("[" * 100_000 + "]" * 100_000)
    root = SystemRoot(str(tmp_path))
    assert root.nvml_facts() is None and root.env == {}
