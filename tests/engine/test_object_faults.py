"""Faults between gdskit and an S3 server, injected by a real proxy in front of moto's server
(tests/support/object_server.py): throttling and dropped connections are retried up to the bound and
counted; an object replaced mid-read is an error, never mixed bytes; a failed upload leaves no
object and no pending upload."""

from __future__ import annotations

import numpy as np
import pytest

import gdskit
from gdskit.errors import ObjectChangedError, ObjectStoreError

from object_server import fault_proxy, moto_endpoint, s3  # noqa: F401 - fixtures

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _quick_retries():
    with gdskit.settings.set(s3_part_size="5MiB", s3_concurrency=2, s3_backoff=0.001, s3_max_retries=3):
        yield


def _object(s3, key: str, n: int, seed: int = 0) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    s3.put(key, data.tobytes())
    return data


def _retries(delta) -> int:
    return sum(o.retries for o in delta.objects)


def test_slow_down_is_retried_and_counted(s3, fault_proxy):
    data = _object(s3, "t.bin", 11 * MiB)
    fault_proxy.slow_down = 3
    out = np.zeros(data.size, np.uint8)
    before = gdskit.stats()
    with gdskit.open(s3.url("t.bin")) as f:
        assert f.read(out) == data.size
    assert np.array_equal(out, data)
    delta = gdskit.stats() - before
    assert fault_proxy.served_faults == 3
    assert _retries(delta) == 3
    assert sum(o.ops for o in delta.objects if o.op == "read") == 3 + 3  # three parts, three retried


def test_throttling_past_the_bound_fails(s3, fault_proxy):
    _object(s3, "t.bin", 1000)
    fault_proxy.slow_down = 100
    with gdskit.open(s3.url("t.bin")) as f, gdskit.settings.set(s3_max_retries=2):
        with pytest.raises(ObjectStoreError) as info:
            f.read(np.zeros(1000, np.uint8))
    assert not isinstance(info.value, ObjectChangedError)
    assert fault_proxy.served_faults == 3  # the first try and two retries


def test_connection_cut_mid_body_is_retried_from_where_it_stopped(s3, fault_proxy):
    data = _object(s3, "c.bin", 12 * MiB + 7)
    fault_proxy.cut_mid_body = 2
    out = np.zeros(data.size, np.uint8)
    before = gdskit.stats()
    with gdskit.open(s3.url("c.bin")) as f:
        assert f.read(out) == data.size
    assert np.array_equal(out, data)
    assert fault_proxy.served_faults == 2
    assert _retries(gdskit.stats() - before) == 2


def test_object_replaced_mid_read_is_an_error_never_mixed_bytes(s3, fault_proxy):
    old = _object(s3, "r.bin", 15 * MiB, seed=1)
    new = np.random.default_rng(2).integers(0, 256, old.size, dtype=np.uint8)

    def replace_before_second_get(number: int) -> None:
        if number == 2:
            s3.put("r.bin", new.tobytes())

    fault_proxy.before_get = replace_before_second_get
    out = np.zeros(old.size, np.uint8)
    with gdskit.settings.set(s3_concurrency=1), gdskit.open(s3.url("r.bin")) as f:
        with pytest.raises(ObjectChangedError) as info:
            f.read(out)
    assert info.value.filename == s3.url("r.bin")
    # What landed is the old object's bytes, or untouched: never the new object's.
    for k in range(0, out.size, MiB):
        piece = out[k:k + MiB]
        assert not (np.array_equal(piece, new[k:k + MiB]) and not np.array_equal(piece, old[k:k + MiB]))


def test_object_shorter_than_opened_is_an_error(s3, fault_proxy):
    _object(s3, "s.bin", 11 * MiB)
    f = gdskit.open(s3.url("s.bin"))
    etag = f.etag
    s3.put("s.bin", b"short")  # replaced by a shorter object: its ETag differs too
    with pytest.raises(ObjectChangedError):
        f.read(np.zeros(11 * MiB, np.uint8))
    f.close()
    assert etag is not None


def test_failed_part_upload_aborts_the_upload(s3, fault_proxy):
    fault_proxy.fail_part_uploads = 100
    data = np.random.default_rng(4).integers(0, 256, 12 * MiB, dtype=np.uint8)
    with pytest.raises(ObjectStoreError):
        with gdskit.open(s3.url("u.bin"), "w") as f:
            f.write(data)
    assert "u.bin" not in s3.keys()
    assert s3.pending_uploads() == []


def test_part_upload_retried_within_the_bound_completes(s3, fault_proxy):
    fault_proxy.fail_part_uploads = 2
    data = np.random.default_rng(5).integers(0, 256, 12 * MiB, dtype=np.uint8)
    with gdskit.open(s3.url("v.bin"), "w") as f:
        f.write(data)
    assert s3.get("v.bin") == data.tobytes()
    assert s3.pending_uploads() == []


def test_a_complete_whose_answer_was_lost_is_accepted_when_the_object_is_whole(s3, fault_proxy):
    # The server completes the upload, its answer never arrives; the retry is told NoSuchUpload.
    fault_proxy.lose_complete_answers = 1
    data = np.random.default_rng(6).integers(0, 256, 12 * MiB + 3, dtype=np.uint8)
    with gdskit.open(s3.url("lost.bin"), "w") as f:
        f.write(data)
    assert fault_proxy.served_faults == 1
    assert s3.get("lost.bin") == data.tobytes()
    assert s3.pending_uploads() == []


def test_a_lost_complete_is_a_failure_when_another_object_took_the_key(s3, fault_proxy):
    fault_proxy.lose_complete_answers = 1
    fault_proxy.after_lost_complete = lambda: s3.put("raced.bin", b"another writer's object")
    data = np.random.default_rng(7).integers(0, 256, 11 * MiB, dtype=np.uint8)
    with pytest.raises(ObjectStoreError):
        with gdskit.open(s3.url("raced.bin"), "w") as f:
            f.write(data)
    assert fault_proxy.served_faults == 1
    assert s3.get("raced.bin") == b"another writer's object"


def test_a_lost_complete_is_a_failure_when_the_key_holds_nothing(s3, fault_proxy):
    fault_proxy.lose_complete_answers = 1
    fault_proxy.after_lost_complete = lambda: s3.client.delete_object(Bucket=s3.bucket, Key="gone.bin")
    with pytest.raises(ObjectStoreError):
        with gdskit.open(s3.url("gone.bin"), "w") as f:
            f.write(np.ones(11 * MiB, np.uint8))
    assert "gone.bin" not in s3.keys()
