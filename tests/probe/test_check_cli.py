"""`gdskit check` on the command line: JSON schema, exit codes, the human table."""

from __future__ import annotations

import io
import json
import os

import pytest
import typer
from cli_app import one_command_app
from rich.console import Console
from typer.testing import CliRunner

from check_helpers import FIXTURES, fixture_root
from gdskit.cli import check as check_cli

TOP_KEYS = {"schema", "schema_version", "gdskit_version", "root", "platform", "gpus", "topology", "mounts", "routing",
            "findings", "summary", "probed", "notes"}
MOUNT_KEYS = {"mountpoint", "requested", "fstype", "source", "options", "device", "device_chain",
              "physical_devices", "raid_or_multipath", "network", "rdma", "odirect", "udev_entry", "verdict",
              "route", "fallback", "reasons", "probe"}
FINDING_KEYS = {"id", "severity", "subject", "title", "consequence", "fix", "reason"}
PLATFORM_KEYS = {"kernel_release", "kernel_version", "virtualization", "cufile", "nvidia_fs", "p2pdma", "iommu",
                 "udev", "cufile_config", "driver", "io_uring"}


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    return one_command_app(check_cli.register)


def run(app, *args):
    return CliRunner().invoke(app, ["check", *args], env={"COLUMNS": "200"})


def test_json_follows_the_documented_schema(app):
    res = run(app, "--root", fixture_root("nvme-ext4-nvfs"), "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert set(d) == TOP_KEYS
    assert d["schema"] == "gdskit.check" and d["schema_version"] == 1
    assert set(d["platform"]) == PLATFORM_KEYS
    assert {m["mountpoint"] for m in d["mounts"]} == {"/", "/data"}
    for m in d["mounts"]:
        assert set(m) == MOUNT_KEYS
    for f in d["findings"]:
        assert set(f) == FINDING_KEYS
    assert set(d["gpus"][0]) == {"index", "name", "pci_bus_id", "numa_node", "memory_total_bytes",
                                 "bar1_total_bytes", "bar1_used_bytes", "bar1_small", "pcie"}
    assert d["summary"]["verdicts"] == {"direct": 1, "compat": 1, "unsupported": 0}


@pytest.mark.parametrize("name, args, code", [
    ("nvme-ext4-nvfs", ["/data", "--require", "direct"], 0),
    ("nvme-ext4-nvfs", ["--require", "direct"], 1),          # / is on a SATA disk
    ("acs-switch", ["/data", "--require", "direct"], 1),
    ("acs-switch", ["/data", "--require", "compat"], 0),
    ("vm-firecracker", ["--require", "compat"], 1),
    ("vm-firecracker", [], 0),                                 # no requirement: the check itself succeeded
    ("no-gpu", ["--require", "direct"], 1),
])
def test_exit_status_under_require(app, name, args, code):
    res = run(app, "--root", fixture_root(name), "--json", *args)
    assert res.exit_code == code, res.output
    assert json.loads(res.stdout)["summary"]["require_met"] is (None if not args or "--require" not in args
                                                                else code == 0)


def test_bad_arguments_exit_2(app):
    assert run(app, "--root", fixture_root("no-gpu"), "relative/path").exit_code == 2
    assert run(app, "--root", fixture_root("no-gpu"), "--require", "fast").exit_code == 2
    assert run(app, "/no/such/path/anywhere").exit_code == 2


@pytest.mark.parametrize("name", ["vm-firecracker", "acs-switch", "no-gpu", "nfs-no-rdma"])
def test_human_table_groups_sections_and_names_fixes(app, name):
    res = run(app, "--root", fixture_root(name))
    assert res.exit_code == 0, res.output
    out = res.stdout
    for section in ("Platform", "Mounts", "Findings"):
        assert section in out
    d = json.loads(run(app, "--root", fixture_root(name), "--json").stdout)
    for m in d["mounts"]:
        assert m["verdict"] in out
    assert ("GPUs" in out) and ("Topology" in out) == bool(d["topology"]["links"])


def test_help_lists_the_options(app):
    res = CliRunner().invoke(app, ["check", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    for opt in ("--json", "--require", "--probe", "--root"):
        assert opt in res.stdout


# --------------------------------------------------------------------------- 80 columns
ALL_FIXTURES = sorted(n for n in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, n)))


def _words(text: str) -> set[str]:
    return set(text.split())


def _rendered_at(width: int, name: str) -> tuple[str, dict]:
    from gdskit.probe import run_check

    report = run_check(root=fixture_root(name))
    buf = io.StringIO()
    check_cli.render(report, Console(file=buf, width=width, color_system=None, legacy_windows=False))
    return buf.getvalue(), report.to_dict()


def _assert_whole(out: str, d: dict, width: int) -> None:
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= width
    seen = _words(out.replace(",", " "))
    for f in d["findings"]:
        if f["severity"] == "ok":
            continue
        for field in ("subject", "title", "consequence", "fix"):
            assert _words(f[field].replace(",", " ")) <= seen, (field, f[field])
        if f["reason"]:
            assert f"[{f['reason']}]" in seen
    for m in d["mounts"]:
        assert _words(m["mountpoint"]) | {m["verdict"], m["fstype"], *m["reasons"]} <= seen, m["mountpoint"]


@pytest.mark.parametrize("name", ALL_FIXTURES)
@pytest.mark.parametrize("width", [80, 200])
def test_the_report_cuts_no_cell_at_80_columns_or_wider(name, width):
    out, d = _rendered_at(width, name)
    _assert_whole(out, d, width)


def test_the_command_at_80_columns_cuts_nothing(app):
    res = CliRunner().invoke(app, ["check", "--root", fixture_root("vm-firecracker")], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    d = json.loads(run(app, "--root", fixture_root("vm-firecracker"), "--json").stdout)
    _assert_whole(res.stdout, d, 80)
