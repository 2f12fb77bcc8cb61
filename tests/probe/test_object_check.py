"""``gdskit check s3://bucket/prefix/`` run as a command against moto's S3 server: the endpoint,
the credentials and one GET, as JSON; exit 1 where the store or the credentials fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from object_server import fault_proxy, free_port, moto_endpoint, s3  # noqa: F401 - fixtures
from repo_paths import child_pythonpath


def _check(*args: str, env_changes: dict[str, str | None]) -> tuple[int, dict]:
    env = dict(os.environ)
    env["PYTHONPATH"] = child_pythonpath()
    for k, v in env_changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    proc = subprocess.run([sys.executable, "-m", "gdskit", "check", *args, "--json"], env=env, capture_output=True,
                          text=True, timeout=120)
    return proc.returncode, (json.loads(proc.stdout) if proc.stdout.strip() else {})


def test_check_reads_one_get_of_the_largest_object(s3):
    s3.put("p/small", b"x" * 10)
    s3.put("p/big", os.urandom(3 << 20))
    rc, out = _check(s3.url("p/"), env_changes={})
    assert rc == 0
    (r,) = out["objects"]
    assert (r["reachable"], r["credentials"], r["objects"], r["ok"]) == (True, "ok", 2, True)
    assert r["probe_object"] == s3.url("p/big") and r["probe_bytes"] == 3 << 20
    assert r["endpoint"] == s3.endpoint and r["rate_bytes_s"] > 0


def test_check_without_credentials_says_so(s3):
    rc, out = _check(s3.url("p/"), env_changes={"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None})
    assert rc == 1
    (r,) = out["objects"]
    assert (r["credentials"], r["ok"]) == ("missing", False)


def test_check_of_an_endpoint_that_does_not_answer(s3):
    rc, out = _check(s3.url("p/"), env_changes={"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
                                                 "GDSKIT_S3_MAX_RETRIES": "0"})
    assert rc == 1
    (r,) = out["objects"]
    assert (r["reachable"], r["ok"]) == (False, False)


def test_check_refuses_mixed_arguments(s3, tmp_path):
    rc, _out = _check(s3.url("p/"), str(tmp_path), env_changes={})
    assert rc == 2


def test_check_lists_a_bounded_number_of_keys_and_says_more_exist(s3, fault_proxy):
    from gdskit.probe.objects import check_object_store

    for i in range(12):
        s3.put(f"many/{i:02d}", b"y" * (i + 1))
    r = check_object_store(s3.url("many/"), list_limit=5)
    lists = [p for m, p in fault_proxy.requests if m == "GET" and "list-type" in p]
    assert len(lists) == 1  # one page of five keys, never the whole prefix
    assert (r.objects, r.more_objects, r.ok) == (5, True, True)
    assert r.to_dict()["more_objects"] is True
    assert r.probe_object == s3.url("many/04") and r.probe_bytes == 5  # the largest of the keys listed
    whole = check_object_store(s3.url("many/"), list_limit=12)
    assert (whole.objects, whole.more_objects) == (12, False)
