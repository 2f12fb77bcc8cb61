"""Host-memory reads of one request that lie near each other in an object share one ranged GET
(``settings.s3_coalesce_gap``): any reads, overlapping or not, of any sizes, give the object's
bytes; a request sends no more GETs than its runs; a GET cut mid-body resumes where it stopped."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

import gdskit

from object_server import fault_proxy, moto_endpoint, s3  # noqa: F401 - fixtures

PART = 5 << 20
SIZE = 11 << 20


@pytest.fixture
def blob(s3: Any) -> tuple[str, bytes]:
    data = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    s3.put("blob.bin", data)
    return s3.url("blob.bin"), data


def _runs(reads: list[tuple[int, int]], gap: int) -> int:
    """Runs of the reads' parts (each read split at PART bytes, clipped at the object's end):
    by offset, a part joins the run before it where it starts at most ``gap`` past its end and
    the run stays within PART bytes."""
    parts = sorted((off + k, min(off + k + PART, off + n, SIZE))
                   for off, n in reads for k in range(0, max(0, min(n, SIZE - off)), PART))
    runs, start, end = 0, None, None
    for lo, hi in parts:
        if end is not None and lo - end <= gap and max(end, hi) - start <= PART:
            end = max(end, hi)
            continue
        runs, start, end = runs + 1, lo, hi
    return runs


def _gets(before: Any) -> int:
    return sum(o.ops for o in (gdskit.stats() - before).objects if o.op == "read")


_read = st.tuples(st.integers(0, SIZE + 100), st.integers(0, 3 * PART // 2))
_near = st.tuples(st.integers(0, 4096), st.integers(1, 2048))  # small reads in one corner: they touch and overlap


@hsettings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reads=st.lists(st.one_of(_read, _near), min_size=1, max_size=12),
       gap=st.sampled_from([0, 1, 1000, 1 << 20]))
def test_any_reads_give_the_objects_bytes_in_no_more_gets_than_runs(blob, reads, gap):
    url, data = blob
    bufs = [bytearray(n) for _off, n in reads]
    with gdskit.settings.set(s3_part_size=PART, s3_coalesce_gap=gap), gdskit.open(url) as f:
        before = gdskit.stats()
        counts = f.read_many([(b, n, off) for b, (off, n) in zip(bufs, reads)])
        gets = _gets(before)
    for b, (off, n), got in zip(bufs, reads, counts):
        assert got == max(0, min(n, SIZE - off))
        assert bytes(b[:got]) == data[off:off + got]
    assert gets <= _runs(reads, gap)


def test_a_run_cut_mid_body_resumes_and_lands_every_read(blob, fault_proxy):
    url, data = blob
    offsets = [i * 5000 for i in range(200)]  # 200 reads of 6000 bytes: each overlaps the next
    buf = np.zeros(200 * 6000, np.uint8)
    fault_proxy.cut_mid_body = 2
    with gdskit.settings.set(s3_part_size=PART, s3_coalesce_gap=0, s3_backoff=0.001), gdskit.open(url) as f:
        before = gdskit.stats()
        assert f.read_batch(buf, offsets, 6000) == [6000] * 200
        delta = gdskit.stats() - before
    assert fault_proxy.cut_mid_body == 0
    for i, off in enumerate(offsets):
        assert buf[i * 6000:(i + 1) * 6000].tobytes() == data[off:off + 6000]
    reads = [o for o in delta.objects if o.op == "read"]
    assert sum(o.retries for o in reads) == 2
    assert sum(o.ops - o.retries for o in reads) == 1  # one run, one GET (resumed twice)


def test_the_gap_setting_is_checked():
    with pytest.raises(gdskit.errors.ConfigError):
        gdskit.settings.set(s3_coalesce_gap=-1)
    with pytest.raises(gdskit.errors.ConfigError):
        gdskit.settings.set(s3_coalesce_gap="65MiB")
