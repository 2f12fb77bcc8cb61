"""``gdskit digest`` and ``gdskit digest --check``: manifests written, exit codes, JSON output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import blake3
import numpy as np
import pytest

from repo_paths import child_pythonpath


def gdskit(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    return subprocess.run([sys.executable, "-m", "gdskit", "digest", *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.fixture()
def tree(tmp_path):
    np.save(tmp_path / "x.npy", np.arange(5000, dtype=np.int32))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "raw.bin").write_bytes(os.urandom(300_000))
    return tmp_path


def test_help_and_bad_arguments(tree):
    assert gdskit("--help").returncode == 0
    assert gdskit(str(tree / "x.npy"), "--chunk", "3K").returncode == 2
    assert gdskit(str(tree / "missing")).returncode == 2


def test_a_file_and_a_directory_get_manifests_that_check(tree):
    done = gdskit("--json", "--chunk", "64K", str(tree / "x.npy"), str(tree / "sub"))
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    by_path = {os.path.basename(f["path"]): f for f in doc["files"]}
    raw = (tree / "sub" / "raw.bin").read_bytes()
    assert by_path["raw.bin"]["digest"] == blake3.blake3(raw).hexdigest()
    assert by_path["x.npy"]["kind"] == "npy" and by_path["x.npy"]["tensors"] == 1
    manifest = json.loads((tree / "sub" / "gdskit-digest.json").read_text())
    assert manifest["files"]["raw.bin"]["chunks"] == [blake3.blake3(raw[i:i + 65536]).hexdigest()
                                                      for i in range(0, len(raw), 65536)]
    assert (tree / "x.npy.gdskit-digest.json").is_file()
    checked = gdskit("--check", "--json", str(tree / "x.npy"), str(tree / "sub"))
    assert checked.returncode == 0, checked.stderr
    assert {f["status"] for f in json.loads(checked.stdout)["files"]} == {"ok"}
    assert gdskit("--check", str(tree / "sub" / "raw.bin")).returncode == 0  # through the directory's manifest


def test_check_exits_1_naming_what_differs(tree):
    target = tree / "sub" / "raw.bin"
    assert gdskit("--chunk", "64K", str(tree / "sub")).returncode == 0
    st = os.stat(target)
    data = bytearray(target.read_bytes())
    data[200_000] ^= 1
    target.write_bytes(data)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    done = gdskit("--check", "--json", str(tree / "sub"))
    assert done.returncode == 1
    (f,) = json.loads(done.stdout)["files"]
    assert f["status"] == "mismatch" and set(f["bad"]) == {"chunk 3", "file"}
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # changed since: stale
    done = gdskit("--check", "--json", str(tree / "sub"))
    assert done.returncode == 1 and json.loads(done.stdout)["files"][0]["status"] == "stale"
    target.unlink()
    done = gdskit("--check", "--json", str(tree / "sub"))
    assert done.returncode == 1 and json.loads(done.stdout)["files"][0]["status"] == "missing"


def test_a_malformed_manifest_exits_2(tree):
    (tree / "x.npy.gdskit-digest.json").write_text('{"format": "gdskit-digest"')
    assert gdskit("--check", str(tree / "x.npy")).returncode == 2


def test_a_torch_archive_is_digested_per_storage(tree):
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.arange(1000.0), "v": torch.ones(3, dtype=torch.int64)}, tree / "c.pt")
    done = gdskit("--json", str(tree / "c.pt"))
    assert done.returncode == 0, done.stderr
    (f,) = json.loads(done.stdout)["files"]
    assert f["kind"] == "torch" and f["tensors"] == 2
    manifest = json.loads((tree / "c.pt.gdskit-digest.json").read_text())
    raw = (tree / "c.pt").read_bytes()
    for t in manifest["files"]["c.pt"]["tensors"].values():
        assert t["digest"] == blake3.blake3(raw[t["offset"]:t["offset"] + t["nbytes"]]).hexdigest()


def test_a_file_no_manifest_lists_fails_the_check(tree):
    """A file added (or renamed) after the directory's manifest was made is not vouched for:
    --check names it unlisted and exits 1, never 0 with nothing checked."""
    assert gdskit(str(tree / "sub")).returncode == 0
    (tree / "sub" / "new.bin").write_bytes(b"added later")
    os.rename(tree / "sub" / "raw.bin", tree / "sub" / "renamed.bin")
    for name in ("new.bin", "renamed.bin"):
        checked = gdskit("--check", "--json", str(tree / "sub" / name))
        assert checked.returncode == 1, checked.stdout
        doc = json.loads(checked.stdout)
        assert [f["status"] for f in doc["files"]] == ["unlisted"] and doc["failed"] == 1
