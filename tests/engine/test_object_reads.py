"""Reads and writes of s3:// objects through gdskit.open, against moto's S3 server in a subprocess
(tests/support/object_server.py): the bytes equal the object's (the test reads them with its own boto3
client), missing objects and credentials raise gdskit's classes, the ledger names the path and
the endpoint, writes appear whole or not at all."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

import gdskit
from gdskit.errors import (BufferTooSmallError, ClosedFileError, GdskitFileNotFoundError, InvalidArgumentError,
                           NoCredentialsError, ReadOnlyBufferError, UnsupportedOperationError)

from object_server import S3, moto_endpoint, s3  # noqa: F401 - fixtures

MiB = 1 << 20


@pytest.fixture
def small_parts():
    with gdskit.settings.set(s3_part_size="5MiB", s3_concurrency=4):
        yield


def _object(s3: S3, key: str, n: int, seed: int = 0) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    s3.put(key, data.tobytes())
    return data


def test_whole_object_in_many_parts_equals_its_bytes(s3, small_parts):
    data = _object(s3, "dir/obj.bin", 12 * MiB + 4097)
    out = np.zeros(data.size, np.uint8)
    with gdskit.open(s3.url("dir/obj.bin")) as f:
        assert f.size == data.size
        assert f.read(out) == data.size
    assert np.array_equal(out, data)


@given(offset=st.integers(0, 7 * MiB), size=st.integers(0, 6 * MiB), buf_offset=st.integers(0, 64))
@hsettings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_range_reads_what_the_object_holds(s3, small_parts, offset, size, buf_offset):
    key = "hyp.bin"
    if not hasattr(test_any_range_reads_what_the_object_holds, "data") or \
            test_any_range_reads_what_the_object_holds.bucket != s3.bucket:
        test_any_range_reads_what_the_object_holds.data = _object(s3, key, 6 * MiB + 333, seed=1)
        test_any_range_reads_what_the_object_holds.bucket = s3.bucket
    data = test_any_range_reads_what_the_object_holds.data
    out = np.full(buf_offset + size, 7, np.uint8)
    with gdskit.open(s3.url(key)) as f:
        n = f.read(out, size, offset, buf_offset)
    expect = data[offset:offset + size]
    assert n == expect.size  # short only at the end of the object, 0 past it
    assert np.array_equal(out[buf_offset:buf_offset + n], expect)
    assert (out[:buf_offset] == 7).all() and (out[buf_offset + n:] == 7).all()  # nothing else written


def test_read_many_read_batch_and_pread(s3, small_parts):
    data = _object(s3, "m.bin", 11 * MiB)
    a, b = np.zeros(6 * MiB, np.uint8), bytearray(100)
    with gdskit.open(s3.url("m.bin")) as f:
        assert f.read_many([(a, 6 * MiB, 3 * MiB), (b, 50, 11 * MiB - 20, 10)]) == [6 * MiB, 20]
        assert np.array_equal(a, data[3 * MiB:9 * MiB])
        assert bytes(b[10:30]) == data[-20:].tobytes()
        batch = np.zeros(40, np.uint8)
        offsets = [0, 5 * MiB - 3, 11 * MiB - 10, 11 * MiB + 5]
        assert f.read_batch(batch, offsets, 10) == [10, 10, 10, 0]
        assert np.array_equal(batch[:30], np.concatenate([data[o:o + 10] for o in offsets[:3]]))
        fut = f.pread(a, 1000, 7)
        assert fut.result() == 1000 and np.array_equal(a[:1000], data[7:1007])
        lat: list[int] = []
        assert f.read_batch(batch, [1, 2], 4, latencies_ns=lat) == [4, 4] and len(lat) == 2


def test_bad_arguments_are_refused_as_for_files(s3):
    _object(s3, "x.bin", 100)
    with gdskit.open(s3.url("x.bin")) as f:
        with pytest.raises(BufferTooSmallError):
            f.read(np.zeros(10, np.uint8), 11)
        with pytest.raises(InvalidArgumentError):
            f.read(np.zeros(10, np.uint8), 5, -1)
        with pytest.raises(ReadOnlyBufferError):
            f.read(b"0123456789", 5)
        with pytest.raises(UnsupportedOperationError):
            f.write(np.zeros(4, np.uint8))
    with pytest.raises(ClosedFileError):
        f.read(np.zeros(4, np.uint8))
    for mode in ("r+", "a"):
        with pytest.raises(InvalidArgumentError):
            gdskit.open(s3.url("x.bin"), mode)
    with pytest.raises(InvalidArgumentError):
        gdskit.open("s3://Not_A_Bucket/key")


def test_missing_object_and_bucket_are_file_not_found(s3):
    with pytest.raises(GdskitFileNotFoundError) as info:
        gdskit.open(s3.url("no/such/key"))
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        gdskit.open("s3://no-such-bucket-here/key")


def test_no_credentials_is_one_clear_error(s3, monkeypatch):
    import gdskit.engine as engine

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    engine.forget_object_clients()
    _object(s3, "c.bin", 10)
    with pytest.raises(NoCredentialsError) as info:
        gdskit.open(s3.url("c.bin"))
    assert isinstance(info.value, PermissionError)
    assert "\n" not in str(info.value)


def test_credentials_from_a_profile_file(s3, monkeypatch, tmp_path):
    import gdskit.engine as engine

    creds = tmp_path / "credentials"
    creds.write_text("[other]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_PROFILE", "other")
    engine.forget_object_clients()
    data = _object(s3, "p.bin", 1000)
    out = np.zeros(1000, np.uint8)
    with gdskit.open(s3.url("p.bin")) as f:
        f.read(out)
    assert np.array_equal(out, data)


def test_ledger_names_path_endpoint_and_gets(s3, small_parts):
    _object(s3, "l.bin", 12 * MiB)
    before = gdskit.stats()
    with gdskit.open(s3.url("l.bin")) as f:
        f.read(np.zeros(12 * MiB, np.uint8))
    delta = gdskit.stats() - before
    assert set(delta.paths) == {"object"}
    assert delta.bytes_read == 12 * MiB
    (row,) = [o for o in delta.objects if o.op == "read"]
    assert row.endpoint == s3.endpoint
    assert (row.ops, row.retries, row.bytes) == (3, 0, 12 * MiB)  # 5 + 5 + 2 MiB: three GETs
    (again,) = gdskit.Stats.from_dict(delta.to_dict()).objects
    assert (again.endpoint, again.op, again.ops, again.retries, again.bytes) == \
        (row.endpoint, row.op, row.ops, row.retries, row.bytes)


def test_write_appears_whole_in_parts(s3, small_parts):
    data = np.random.default_rng(3).integers(0, 256, 13 * MiB + 5, dtype=np.uint8)
    with gdskit.open(s3.url("w/out.bin"), "w") as f:
        f.write(data, 7 * MiB)
        f.write(data, data.size - 7 * MiB, 7 * MiB, 7 * MiB)
        assert s3.keys() == []  # nothing visible before close
    assert s3.get("w/out.bin") == data.tobytes()
    assert s3.pending_uploads() == []


def test_small_and_empty_writes(s3):
    with gdskit.open(s3.url("small"), "w") as f:
        f.write(bytearray(b"hello"))
    with gdskit.open(s3.url("empty"), "w"):
        pass
    assert s3.get("small") == b"hello" and s3.get("empty") == b""


def test_write_out_of_order_is_refused(s3):
    with gdskit.open(s3.url("o"), "w") as f:
        f.write(b"abc")
        with pytest.raises(InvalidArgumentError):
            f.write(b"x", 1, 10)


def test_failed_writer_leaves_no_object_and_no_upload(s3, small_parts):
    data = os.urandom(12 * MiB)
    with pytest.raises(RuntimeError):
        with gdskit.open(s3.url("half"), "w") as f:
            f.write(data)  # two parts uploaded already
            raise RuntimeError("the producer failed")
    assert "half" not in s3.keys()
    assert s3.pending_uploads() == []


def test_writer_never_closed_publishes_nothing(s3, small_parts):
    f = gdskit.open(s3.url("dropped"), "w")
    f.write(os.urandom(11 * MiB))
    f.abort()
    assert s3.keys() == [] and s3.pending_uploads() == []


@pytest.mark.parametrize("variable, value", [("GDSKIT_S3_PART_SIZE", "1MiB"), ("GDSKIT_S3_CONCURRENCY", "0"),
                                             ("GDSKIT_S3_MAX_RETRIES", "-1"), ("GDSKIT_S3_BACKOFF", "nan")])
def test_invalid_s3_variables_are_named(variable, value):
    import subprocess
    import sys

    code = ("import gdskit\nfrom gdskit.errors import EnvironmentVariableError\n"
            "try:\n    gdskit.settings.check_environment()\nexcept EnvironmentVariableError as e:\n"
            "    print(e.variable)\n")
    from repo_paths import child_pythonpath

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, variable: value, "PYTHONPATH": child_pythonpath()})
    assert out.stdout.strip() == variable


def test_a_raw_read_of_an_object_with_verify_is_refused_before_reading(s3):
    """gdskit.open gives File or ObjectFile with the same read arguments: verify= is taken, and an
    object (no manifest lists it) has nothing to check against."""
    from gdskit.errors import NothingToVerifyError

    s3.put("v.bin", b"x" * 1000)
    with gdskit.open(s3.url("v.bin")) as f:
        before = gdskit.stats()
        with pytest.raises(NothingToVerifyError):
            f.read(bytearray(1000), verify=True)
        assert (gdskit.stats() - before).bytes_read == 0
        assert f.read(bytearray(1000), verify=False) == 1000


def test_the_store_check_refuses_a_path_that_is_not_a_url():
    from gdskit.errors import InvalidArgumentError
    from gdskit.probe.objects import check_object_store

    with pytest.raises(InvalidArgumentError):
        check_object_store("/local/file")


def test_the_object_executor_a_reader_holds_survives_a_change_of_concurrency():
    """A reader that took the object executor before another thread changed s3_concurrency can
    still submit to it: the setting bounds each job, not the executor."""
    from gdskit.engine import pool

    with gdskit.settings.set(s3_concurrency=3):
        held = pool.object_executor()
    with gdskit.settings.set(s3_concurrency=4):
        pool.object_executor()
    assert held.submit(lambda: 42).result() == 42


def test_a_small_write_holds_no_part_sized_buffer(s3):
    import tracemalloc

    with gdskit.settings.set(s3_part_size="256MiB"):
        with gdskit.open(s3.url("warm"), "w") as f:  # the client is made before the measurement
            f.write(b"w")
        tracemalloc.start()
        try:
            with gdskit.open(s3.url("tiny"), "w") as f:
                f.write(b"hello")
                _current, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 16 * MiB  # not the 256 MiB of a part
    assert s3.get("tiny") == b"hello" and s3.get("warm") == b"w"


def test_writes_of_every_size_make_the_object_their_bytes(s3, small_parts):
    data = np.random.default_rng(8).integers(0, 256, 16 * MiB + 11, dtype=np.uint8)
    cuts = [0, 1, 3, 5 * MiB - 1, 5 * MiB + 2, 10 * MiB, 15 * MiB + 7, data.size]
    with gdskit.open(s3.url("pieces"), "w") as f:
        for a, b in zip(cuts, cuts[1:]):
            assert f.write(data[a:b]) == b - a
        assert f.size == data.size
    assert s3.get("pieces") == data.tobytes()
    assert s3.pending_uploads() == []


def test_atomic_is_for_writers_as_for_files(s3):
    s3.put("a.bin", b"abc")
    with pytest.raises(InvalidArgumentError):
        gdskit.open(s3.url("a.bin"), "r", atomic=True)
    with gdskit.open(s3.url("a.bin")) as f:
        assert f.atomic is False
    with gdskit.open(s3.url("b.bin"), "w", atomic=True) as f:
        assert f.atomic is True
        f.write(b"whole")
        assert "b.bin" not in s3.keys()  # published at close, as an atomic file is
    assert s3.get("b.bin") == b"whole"


def test_a_get_body_is_read_a_mebibyte_at_a_time(s3, monkeypatch):
    """botocore's body copies what it is asked for through a bytes object of that size (urllib3's
    ``readinto`` reads, then copies): asked for a whole piece (8 MiB), each of ``s3_concurrency``
    GETs would hold that much again in host memory while it reads."""
    from botocore.response import StreamingBody

    asked: list[int] = []
    real = StreamingBody.readinto

    def recording(self, b):
        asked.append(len(b))
        return real(self, b)

    monkeypatch.setattr(StreamingBody, "readinto", recording)
    data = np.random.default_rng(8).integers(0, 256, 20 << 20, dtype=np.uint8).tobytes()
    s3.put("big.bin", data)
    out = bytearray(len(data))
    with gdskit.open(s3.url("big.bin")) as f:
        assert f.read(out) == len(data)
    assert bytes(out) == data
    assert asked and max(asked) <= 1 << 20
