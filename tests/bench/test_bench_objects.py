"""``gdskit bench s3://bucket/key`` run as a command against moto's S3 server: the JSON report's
shape, every cell of the grid reading the whole object (its bytes and their CRC-32), the GETs
each cell sent, and bad arguments refused with exit status 2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import zlib

import pytest

from object_server import moto_endpoint, s3  # noqa: F401 - fixtures
from repo_paths import child_pythonpath

MiB = 1 << 20
SIZE = 12 * MiB + 12345


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = child_pythonpath()
    return subprocess.run([sys.executable, "-m", "gdskit", "bench", *args], env=env, capture_output=True,
                          text=True, timeout=240)


@pytest.fixture
def blob(s3):
    data = os.urandom(SIZE)
    s3.put("bench/blob.bin", data)
    return s3.url("bench/blob.bin"), data


def test_every_cell_reads_the_whole_object(s3, blob):
    url, data = blob
    proc = _bench(url, "--part-sizes", "5M,8M", "--concurrency", "1,4", "--repeat", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["url"], out["endpoint"], out["object_bytes"], out["repeat"], out["whole"]) == \
        (url, s3.endpoint, SIZE, 2, True)
    assert out["etag"] == s3.client.head_object(Bucket=s3.bucket, Key="bench/blob.bin")["ETag"]
    assert set(out["settings"]) == {"s3_part_size", "s3_concurrency"}
    cells = out["cells"]
    assert sorted((c["part_size"], c["concurrency"]) for c in cells) == \
        [(5 * MiB, 1), (5 * MiB, 4), (8 * MiB, 1), (8 * MiB, 4)]
    for c in cells:
        assert c["bytes"] == SIZE and c["crc32"] == zlib.crc32(data) and c["consistent"]
        assert c["gets"] == math.ceil(SIZE / c["part_size"]) and c["retries"] == 0
        assert c["gb_s_min"] <= c["gb_s"] <= c["gb_s_max"] and c["gb_s"] > 0 and c["seconds"] > 0
    assert out["best"]["gb_s"] == max(c["gb_s"] for c in cells)


def test_an_object_larger_than_the_buffer_is_read_a_buffer_at_a_time(blob):
    url, data = blob
    proc = _bench(url, "--part-sizes", "5M", "--concurrency", "2", "--repeat", "1", "--buffer", "7M", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    (c,) = out["cells"]
    assert out["buffer_bytes"] == 7 * MiB and out["whole"]
    assert c["bytes"] == SIZE and c["crc32"] == zlib.crc32(data)
    windows = [min(7 * MiB, SIZE - off) for off in range(0, SIZE, 7 * MiB)]
    assert c["gets"] == sum(math.ceil(w / (5 * MiB)) for w in windows)


def test_the_default_grid_comes_from_the_settings(blob, monkeypatch):
    url, _data = blob
    monkeypatch.setenv("GDSKIT_S3_PART_SIZE", "24MiB")  # the command's settings, from its environment
    monkeypatch.setenv("GDSKIT_S3_CONCURRENCY", "8")
    proc = _bench(url, "--repeat", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["settings"] == {"s3_part_size": 24 * MiB, "s3_concurrency": 8}
    assert sorted((c["part_size"], c["concurrency"]) for c in out["cells"]) == \
        [(6 * MiB, 2), (6 * MiB, 8), (24 * MiB, 2), (24 * MiB, 8)]


def test_the_table_for_people(blob):
    url, _data = blob
    proc = _bench(url, "--part-sizes", "5M", "--concurrency", "1,2", "--repeat", "1")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 1 + 1 + 2 + 1  # what, header, two cells, the fastest


@pytest.mark.parametrize("args", [("--part-sizes", "1M"), ("--part-sizes", "lots"), ("--concurrency", "0"),
                                  ("--concurrency", "x"), ("--repeat", "0"), ("-f", "some-file"), ("--sweep",)])
def test_bad_arguments_exit_2(blob, args):
    url, _data = blob
    assert _bench(url, *args, "--json").returncode == 2


def test_a_missing_object_or_a_non_url_exits_2(s3):
    assert _bench(s3.url("no/such/object"), "--json").returncode == 2
    assert _bench("not-a-url", "--json").returncode == 2
