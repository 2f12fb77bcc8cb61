"""`gdskit accept` on the command line: this machine (no GPU in CI), captured trees, exit codes, the files."""

from __future__ import annotations

import json
import os

import pytest
import typer
from cli_app import one_command_app
from typer.testing import CliRunner

from check_helpers import fixture_root
from gdskit.engine import cuda
from gdskit.cli import accept as accept_cli

HAS_GPU = cuda.device_count() > 0

TOP_KEYS = {"schema", "schema_version", "gdskit_version", "created", "machine", "options", "items", "summary",
            "notes"}
ITEM_KEYS = {"id", "key", "title", "status", "summary", "evidence", "data", "fix", "artifacts", "duration_s"}
SUMMARY_KEYS = {"pass", "fail", "n/a", "failed_items", "verdict", "exit_code"}


def validate(doc: dict) -> None:
    """The documented schema (docs/accept.md), checked key by key."""
    assert set(doc) == TOP_KEYS
    assert doc["schema"] == "gdskit.accept" and doc["schema_version"] == 1
    assert [i["id"] for i in doc["items"]] == [1, 2, 3, 4, 5, 6, 7]
    for it in doc["items"]:
        assert set(it) == ITEM_KEYS
        assert it["status"] in ("pass", "fail", "n/a")
        assert isinstance(it["evidence"], list) and all(isinstance(x, str) for x in it["evidence"])
        assert isinstance(it["data"], dict)
        assert (it["fix"] is None) or isinstance(it["fix"], str)
        if it["status"] == "fail":
            assert it["fix"], f"item {it['id']} failed without a fix"
        for a in it["artifacts"]:
            assert set(a) == {"kind", "path", "title"} and a["kind"] in ("plot", "json", "csv")
    s = doc["summary"]
    assert set(s) == SUMMARY_KEYS
    assert s["pass"] + s["fail"] + s["n/a"] == 7
    assert s["exit_code"] == (1 if s["fail"] else 0)
    assert s["failed_items"] == [i["id"] for i in doc["items"] if i["status"] == "fail"]
    json.dumps(doc)  # plain JSON all the way down


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    return one_command_app(accept_cli.register)


def run(app, *args):
    return CliRunner().invoke(app, ["accept", *args], env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def live_run(app, tmp_path_factory):
    """One quick run on this machine, shared by the tests that read its report."""
    target = tmp_path_factory.mktemp("target")
    report_dir = tmp_path_factory.mktemp("report") / "rep"
    res = run(app, str(target), "--quick", "--report", str(report_dir), "--json")
    return res, report_dir, target


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU: tests/accept/test_accept_gpu.py")
def test_no_gpu_machine_gpu_items_are_not_applicable(live_run):
    res, report_dir, target = live_run
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    validate(doc)
    status = {i["id"]: i["status"] for i in doc["items"]}
    for gpu_item in (1, 2, 3, 4, 5, 7):
        assert status[gpu_item] == "n/a"
        assert "no GPU" in doc["items"][gpu_item - 1]["summary"]
    assert status[6] in ("pass", "n/a")  # n/a only without torch
    assert doc["summary"]["verdict"] == "incomplete"
    assert any("No GPU" in n for n in doc["notes"])
    assert os.listdir(target) == []       # every temporary file removed


def test_report_files_exist_and_agree(live_run):
    res, report_dir, _ = live_run
    for name in ("report.md", "report.html", "report.json", "check.json"):
        assert (report_dir / name).stat().st_size > 0, name
    on_disk = json.loads((report_dir / "report.json").read_text())
    validate(on_disk)
    assert on_disk == json.loads(res.stdout)
    md = (report_dir / "report.md").read_text()
    html = (report_dir / "report.html").read_text()
    for it in on_disk["items"]:
        assert f"## {it['id']}. {it['title']}" in md
        assert f'id="item-{it["id"]}"' in html
    assert "src=\"http" not in html and "<link" not in html and "<script" not in html  # self-contained


def test_exit_status_is_non_zero_exactly_when_an_item_fails(app, tmp_path):
    bad = run(app, "--root", fixture_root("vm-firecracker"), "--report", str(tmp_path / "a"), "--json")
    assert bad.exit_code == 1, bad.output
    assert json.loads(bad.stdout)["summary"]["failed_items"] == [1, 2]
    good = run(app, "--root", fixture_root("nvme-ext4-nvfs"), "/data", "--report", str(tmp_path / "b"), "--json")
    assert good.exit_code == 0, good.output
    assert [i["status"] for i in json.loads(good.stdout)["items"]][:2] == ["pass", "pass"]


@pytest.mark.parametrize("name, paths, item1, item2, words", [
    ("nvme-ext4-nvfs", ["/data"], "pass", "pass", []),
    ("p2pdma-no-nvfs", ["/data"], "pass", "pass", []),
    ("nvme-ext4-nvfs", [], "pass", "fail", ["/ is compat"]),                   # / is on a SATA disk
    ("vm-firecracker", [], "fail", "fail", ["kernel route", "/ is unsupported"]),
    ("acs-switch", ["/data"], "fail", "fail", ["ACS", "p2pdma_unavailable"]),
    ("small-bar1", ["/data"], "fail", "pass", ["BAR1"]),
    ("nfs-no-rdma", ["/mnt/nfs"], "fail", "fail", ["RDMA"]),
    ("overlay-tmpfs", ["/scratch"], "pass", "fail", ["tmpfs", "fs_unsupported"]),
    ("raid0-p2pdma", ["/raid"], "pass", "fail", ["raid_or_multipath"]),
    ("no-gpu", [], "n/a", "n/a", ["no GPU"]),
])
def test_captured_trees_drive_items_1_and_2(app, tmp_path, name, paths, item1, item2, words):
    res = run(app, "--root", fixture_root(name), *paths, "--report", str(tmp_path / "r"), "--json")
    doc = json.loads(res.stdout)
    validate(doc)
    one, two = doc["items"][0], doc["items"][1]
    assert (one["status"], two["status"]) == (item1, item2), (one, two)
    text = json.dumps([one, two])
    for w in words:
        assert w in text
    for it in doc["items"][2:]:
        assert it["status"] == "n/a" and "captured tree" in it["summary"]
    assert res.exit_code == (1 if "fail" in (item1, item2) else 0)


def test_failures_carry_the_fixes_gdskit_check_gives(app, tmp_path):
    res = run(app, "--root", fixture_root("vm-firecracker"), "--report", str(tmp_path / "r"), "--json")
    one, two = json.loads(res.stdout)["items"][:2]
    assert "modprobe nvidia_fs" in one["fix"]                 # gds.nvidia_fs_missing
    assert "NVMe" in two["fix"] and "/run/udev" in two["fix"]  # mount.device_virtio, gds.udev_missing
    rows = {r["check"]: r["status"] for r in one["data"]["checks"]}
    assert rows["kernel route"] == "fail" and rows["BAR1"] == "pass" and rows["RDMA"] == "n/a"


def test_items_option_selects_and_the_rest_are_listed(app, tmp_path):
    res = run(app, "--root", fixture_root("nvme-ext4-nvfs"), "/data", "--items", "2",
              "--report", str(tmp_path / "r"), "--json")
    doc = json.loads(res.stdout)
    assert [i["status"] for i in doc["items"]] == ["n/a", "pass"] + ["n/a"] * 5
    assert "not selected" in doc["items"][0]["summary"]


def test_human_output_names_the_verdict_and_the_report(app, tmp_path):
    res = run(app, "--root", fixture_root("vm-firecracker"), "--report", str(tmp_path / "r"))
    assert res.exit_code == 1
    assert "NOT ACCEPTED" in res.output and "FAIL" in res.output
    assert "item 1 fix:" in res.output and "report.html" in res.output


@pytest.mark.parametrize("args", [
    ["--items", "9"], ["--items", "x"], ["--size", "lots"], ["/no/such/target/anywhere"], ["--timeout", "0"],
    ["--root", "/no/such/root"],
])
def test_bad_arguments_exit_2(app, tmp_path, args):
    res = run(app, *args, "--report", str(tmp_path / "r"))
    assert res.exit_code == 2, res.output
    assert "error" in res.output


def test_an_unwritable_report_directory_exits_2(app, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    res = run(app, "--root", fixture_root("no-gpu"), "--items", "1", "--report", str(blocker / "r"))
    assert res.exit_code == 2 and "error" in res.output and "Traceback" not in res.output


def test_relative_path_in_a_captured_tree_is_an_argument_error(app, tmp_path):
    res = run(app, "--root", fixture_root("no-gpu"), "relative/path", "--report", str(tmp_path / "r"))
    assert res.exit_code == 2


def test_a_report_directory_with_other_files_is_refused_before_anything_runs(app, tmp_path):
    """`--report .` or a folder of the user's own: gdskit accept writes report.md, check.json and
    more there, so a directory that holds anything but an earlier accept report is refused."""
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "report.md").write_text("my own report")
    res = run(app, "--root", fixture_root("nvme-ext4-nvfs"), "/data", "--report", str(mine), "--json")
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "report" in res.output
    assert os.listdir(mine) == ["report.md"] and (mine / "report.md").read_text() == "my own report"


def test_a_new_empty_or_earlier_report_directory_is_written(app, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for d in (tmp_path / "new", empty, empty):  # the third run writes over the report of the second
        res = run(app, "--root", fixture_root("nvme-ext4-nvfs"), "/data", "--report", str(d), "--json")
        assert res.exit_code == 0, res.output
        validate(json.loads((d / "report.json").read_text()))
        assert not [n for n in os.listdir(d) if n.startswith(".")], "a temporary was left behind"
