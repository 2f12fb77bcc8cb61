"""The knee finder on synthetic sweeps: clean, noisy, and without a knee."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gdskit.bench.knee import DIRECT_NEVER, cufile_fragment, find_knee

SIZES = [4096 * 2**i for i in range(13)]  # 4 KiB .. 16 MiB


def _reps(value, spread=0.0):
    return [value * (1 - spread), value, value * (1 + spread)]


@given(st.integers(0, len(SIZES) - 1), st.floats(0.0, 0.05))
def test_crossing_is_found_exactly(cross, spread):
    # direct is 40 % slower below the crossing and 20 % faster from it on
    cpu = {s: _reps(1.0 + i, spread) for i, s in enumerate(SIZES)}
    direct = {s: _reps((1.0 + i) * (0.6 if i < cross else 1.2), spread)
              for i, s in enumerate(SIZES)}
    k = find_knee(direct, cpu)
    assert k.knee == SIZES[cross] and k.threshold == SIZES[cross] and k.direct_pays
    assert k.gdskit_setting.startswith("GDSKIT_DIRECT_THRESHOLD=")


def test_direct_within_noise_counts_as_a_tie():
    cpu = {s: [0.9, 1.0, 1.1] for s in SIZES}
    direct = {s: [0.97, 0.98, 0.99] for s in SIZES}  # median below cpu median, inside its spread
    assert find_knee(direct, cpu).knee == SIZES[0]
    tight = {s: [1.0, 1.0, 1.0] for s in SIZES}
    assert find_knee(direct, tight).knee is None
    assert find_knee(direct, tight, tolerance=0.05).knee == SIZES[0]


def test_no_knee_when_direct_is_always_slower():
    cpu = {s: [2.0, 2.1, 2.2] for s in SIZES}
    direct = {s: [1.0, 1.1, 1.2] for s in SIZES}
    k = find_knee(direct, cpu, fstype="lustre")
    assert k.knee is None and not k.direct_pays and k.threshold == DIRECT_NEVER
    assert k.gdskit_setting == "GDSKIT_MODE=bounce"
    assert k.cufile_json["fs"]["lustre"]["posix_gds_min_kb"] >= 16 * 1024


def test_a_lucky_small_size_does_not_pull_the_knee_down():
    cpu = {s: [1.0, 1.0, 1.0] for s in SIZES}
    direct = {s: [2.0] * 3 for s in SIZES}
    direct[SIZES[5]] = [0.5] * 3           # direct loses at one middle size
    assert find_knee(direct, cpu).knee == SIZES[6]


@given(st.lists(st.tuples(st.floats(0.01, 100), st.floats(0.01, 100)), min_size=1, max_size=13))
def test_knee_definition_holds(pairs):
    sizes = SIZES[:len(pairs)]
    cpu = {s: [c, c * 1.1] for s, (c, _) in zip(sizes, pairs)}
    direct = {s: [d] for s, (_, d) in zip(sizes, pairs)}
    k = find_knee(direct, cpu)
    ok = {v.io_size: v.direct_as_fast for v in k.verdicts}
    if k.knee is None:
        assert not ok[sizes[-1]]
    else:
        assert all(ok[s] for s in sizes if s >= k.knee)
        below = [s for s in sizes if s < k.knee]
        assert not below or not ok[below[-1]]


def test_sizes_missing_on_one_side_are_ignored():
    k = find_knee({4096: [1.0], 8192: [1.0]}, {8192: [1.0]})
    assert [v.io_size for v in k.verdicts] == [8192]
    assert find_knee({}, {}).knee is None


@pytest.mark.parametrize("fs,key", [("lustre", True), ("beegfs", True), ("ext4", False),
                                    ("xfs", False), (None, False)])
def test_cufile_fragment_only_where_libcufile_reads_it(fs, key):
    frag = cufile_fragment(fs, 64 * 1024)
    assert (frag is not None) == key
    if key:
        assert frag == {"fs": {fs: {"posix_gds_min_kb": 64}}}


def test_as_dict_is_json_ready():
    import json
    k = find_knee({4096: [1.0]}, {4096: [1.0]}, fstype="ext4")
    d = json.loads(json.dumps(k.as_dict()))
    assert d["knee_bytes"] == 4096 and d["cufile_json"] is None and len(d["verdicts"]) == 1
