"""A batch's read plan (numpy index arithmetic): every sample's bytes land in its row, neighbours
merged into one read, one group per file and read size; read into host memory in one call per
group, against numpy."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import gdskit  # noqa: E402
import gdskit.data as gd  # noqa: E402
from gdskit.data.read import FileCache, plan_batch, read_now  # noqa: E402

RECORD = 12
COUNTS = [40, 1, 17, 30]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan")
    rng = np.random.default_rng(0)
    paths, rows = [], []
    for f, n in enumerate(COUNTS):
        a = rng.integers(0, 256, (n, RECORD), dtype=np.uint8)
        p = d / f"r{f}.bin"
        a.tofile(p)
        paths.append(str(p))
        rows.append(a)
    return gd.RecordDataset(paths, record_bytes=RECORD), np.concatenate(rows)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_batch_lands_row_by_row(records, data):
    ds, rows = records
    n = len(ds)
    kind = data.draw(st.sampled_from(["random", "runs"]))
    if kind == "random":
        idx = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=40)), dtype=np.int64)
    else:  # runs of neighbours, some crossing from one file into the next
        start = data.draw(st.integers(0, n - 1))
        idx = np.arange(start, min(n, start + data.draw(st.integers(1, 50))))
        idx = np.concatenate([idx, idx[: data.draw(st.integers(0, len(idx)))]])
    plan = plan_batch(ds, idx)
    assert sum(g.size * len(g.file_offsets) for g in plan.groups) == plan.nbytes == len(idx) * RECORD
    assert len({(g.source.path, g.size) for g in plan.groups}) == len(plan.groups)
    places = sorted(bo for g in plan.groups for bo in g.buf_offsets)
    assert len(places) == len(set(places))
    buf = np.full(plan.nbytes, 0xEE, dtype=np.uint8)
    with FileCache() as files:
        read_now(files, plan, buf)
    assert np.array_equal(buf.reshape(len(idx), RECORD), rows[idx])


def test_a_sequential_batch_is_one_read_per_file_and_a_shuffled_one_one_group(records, tmp_path):
    ds, _ = records
    plan = plan_batch(ds, np.arange(0, 40))
    assert [(len(g.file_offsets), g.size) for g in plan.groups] == [(1, 40 * RECORD)]
    tokens = np.arange(20_000, dtype=np.uint16)
    tokens.tofile(tmp_path / "t.bin")
    tds = gd.TokenDataset(tmp_path / "t.bin", dtype="uint16", seq_len=64)
    idx = np.random.default_rng(1).permutation(len(tds))[:64]
    plan = plan_batch(tds, idx)
    assert len(plan.groups) == 1 and plan.groups[0].size == 65 * 2 and len(plan.groups[0].file_offsets) == 64
    assert plan.staged


def test_host_reads_are_recorded_as_the_host_path(records):
    ds, rows = records
    plan = plan_batch(ds, np.array([5, 3, 60, 61, 62, 0]))
    before = gdskit.stats()
    buf = bytearray(plan.nbytes)
    with FileCache() as files:
        read_now(files, plan, buf)
    delta = gdskit.stats() - before
    assert delta.bytes_read == plan.nbytes and set(delta.paths) == {"host"}
