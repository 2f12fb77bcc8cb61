"""``gdskit uploads s3://bucket/prefix`` against moto's S3 server behind the proxy that gives each
upload the time it started: a writer killed mid-upload (in a subprocess) leaves an upload, the
command lists it, and ``--abort --older-than`` aborts it while younger uploads and other prefixes
are left alone; bad arguments exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from typer.testing import CliRunner

from cli_app import one_command_app
from gdskit.cli.uploads import register
from object_server import client_for, fault_proxy, moto_endpoint, s3  # noqa: F401 - fixtures
from repo_paths import child_pythonpath

_KILLED_WRITER = """
import os, signal, sys
import gdskit
with gdskit.settings.set(s3_part_size="5MiB"):
    f = gdskit.open(sys.argv[1], "w")
    f.write(bytes(5 << 20))  # a full part: the multipart upload has started
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _uploads(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(one_command_app(register), ["uploads", *args, "--json"])
    return result.exit_code, (json.loads(result.stdout) if result.stdout.strip() else {})


def test_a_killed_writers_upload_is_listed_then_aborted_alone(s3, fault_proxy):
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}  # AWS_ENDPOINT_URL: the proxy
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, s3.url("ckpt/rank0.bin")], env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    client = client_for(fault_proxy.endpoint)
    other = client.create_multipart_upload(Bucket=s3.bucket, Key="elsewhere/x.bin")["UploadId"]

    rc, listed = _uploads(s3.url("ckpt/"))
    assert rc == 0
    ((dead,),) = [listed["uploads"]]
    assert (dead["url"], dead["action"]) == (s3.url("ckpt/rank0.bin"), "listed")
    assert {u["UploadId"] for u in s3.pending_uploads()} == {dead["upload_id"], other}  # listing aborts nothing

    time.sleep(3)
    young = client.create_multipart_upload(Bucket=s3.bucket, Key="ckpt/rank1.bin")["UploadId"]
    rc, swept = _uploads(s3.url("ckpt/"), "--older-than", "2s", "--abort")
    assert rc == 0
    assert {u["upload_id"]: u["action"] for u in swept["uploads"]} == {dead["upload_id"]: "aborted", young: "kept"}
    assert (swept["aborted"], swept["failed"]) == (1, 0)
    assert {u["UploadId"] for u in s3.pending_uploads()} == {young, other}
    assert "ckpt/rank0.bin" not in s3.keys()


def test_bad_arguments_exit_2(s3):
    assert _uploads("/not/a/url")[0] == 2
    assert _uploads(s3.url("p/"), "--older-than", "soon")[0] == 2
    assert _uploads("s3://no-such-bucket-here/p/")[0] == 2
    rc, empty = _uploads(s3.url("p/"))
    assert (rc, empty["uploads"], empty["more"]) == (0, [], False)


def test_a_failed_abort_is_reported_and_exits_1(s3, fault_proxy):
    import gdskit

    client = client_for(fault_proxy.endpoint)
    stuck = client.create_multipart_upload(Bucket=s3.bucket, Key="f/a.bin")["UploadId"]
    fault_proxy.fail_aborts = 1
    with gdskit.settings.set(s3_max_retries=0):
        rc, out = _uploads(s3.url("f/"), "--older-than", "0s", "--abort")
    assert rc == 1
    ((entry,),) = [out["uploads"]]
    assert (entry["upload_id"], entry["action"], out["failed"]) == (stuck, "failed", 1)
    assert [u["UploadId"] for u in s3.pending_uploads()] == [stuck]
