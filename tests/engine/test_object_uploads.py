"""Multipart uploads left under way (gdskit.engine.sweep_uploads) against moto's S3 server,
behind the proxy that gives each upload the time it started: listed under their prefix only,
aborted only when older than the threshold, with the clock given (``now=``)."""

from __future__ import annotations

import datetime as dt
import time

import pytest

from gdskit.engine import sweep_uploads
from gdskit.errors import GdskitFileNotFoundError, InvalidArgumentError

from object_server import client_for, fault_proxy, moto_endpoint, s3  # noqa: F401 - fixtures

ClientError = pytest.importorskip("botocore.exceptions").ClientError


def _start(client, bucket: str, key: str) -> str:
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"p" * 1000)
    return upload


def test_only_uploads_under_the_prefix_and_older_than_the_threshold_are_aborted(s3, fault_proxy):
    client = client_for(fault_proxy.endpoint)  # through the proxy: each upload's start is recorded
    old = _start(client, s3.bucket, "run/old.bin")
    outside = _start(client, s3.bucket, "runner/other.bin")  # "run" but not "run/"
    time.sleep(0.05)
    young = _start(client, s3.bucket, "run/young.bin")
    listed = sweep_uploads(s3.url("run/"), 0)
    assert {(u.url, u.upload_id, u.action) for u in listed.uploads} == {
        (s3.url("run/old.bin"), old, "listed"), (s3.url("run/young.bin"), young, "listed")}
    started = {u.upload_id: u.initiated for u in listed.uploads}
    assert started[young] > started[old]
    gap = (started[young] - started[old]).total_seconds()
    now = started[young] + dt.timedelta(seconds=3600)
    swept = sweep_uploads(s3.url("run/"), 3600 + gap / 2, abort=True, now=now)
    assert {u.upload_id: u.action for u in swept.uploads} == {old: "aborted", young: "kept"}
    assert (swept.stale, swept.failed, swept.more) == (1, 0, False)
    assert {u["UploadId"] for u in s3.pending_uploads()} == {young, outside}
    with pytest.raises(ClientError) as info:  # the aborted upload's parts are gone with it
        s3.client.list_parts(Bucket=s3.bucket, Key="run/old.bin", UploadId=old)
    assert info.value.response["Error"]["Code"] == "NoSuchUpload"


def test_the_listing_is_bounded_and_says_more_exist(s3, fault_proxy):
    client = client_for(fault_proxy.endpoint)
    for i in range(3):
        _start(client, s3.bucket, f"many/{i}")
    sweep = sweep_uploads(s3.url("many/"), 0, limit=2)
    assert (len(sweep.uploads), sweep.more) == (2, True)
    assert sweep.to_dict()["more"] is True


def test_bad_arguments_and_a_missing_bucket(s3):
    with pytest.raises(InvalidArgumentError):
        sweep_uploads(s3.url("x/"), -1)
    with pytest.raises(InvalidArgumentError):
        sweep_uploads("/local/dir", 0)
    with pytest.raises(GdskitFileNotFoundError):
        sweep_uploads("s3://no-such-bucket-here/x/", 0)
