"""The ledger's additions for telemetry: requests (latency), size histograms, per-GPU rows,
sums across processes, the JSON round trip, and the GDSKIT_STATS settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import gdskit
from gdskit.errors import ConfigError
from gdskit.engine.ledger import Ledger, LedgerEntry, PathStats, Stats, size_bucket
from gdskit.settings import ENV_VARS, Settings, env_name
from gdskit.vocabulary import Path, Reason


def _ledger() -> Ledger:
    led = Ledger()
    led.record(Path.HOST, Reason.NO_GPU, "read", 4096, 1, 0.002)
    led.record(Path.HOST, Reason.NO_GPU, "read", 5000, 2, 0.004)
    led.record(Path.CUFILE_NVFS, Reason.DIRECT, "write", 1 << 20, 1, 0.01, device=1)
    return led


def test_requests_latency_and_histogram_are_kept_per_row():
    s = _ledger().snapshot()
    host = s.paths["host"]
    assert (host.bytes_read, host.ops_read, host.requests) == (9096, 3, 2)
    assert host.mean_latency_s == pytest.approx(0.003)
    (entry,) = [e for e in s.entries if e.path == "host"]
    assert dict(entry.size_hist) == {12: 1, 13: 1}  # 4096 <= 2**12; 5000 <= 2**13
    assert s.requests == 3 and s.direct_bytes == 1 << 20


@pytest.mark.parametrize("n, k", [(0, 0), (1, 0), (2, 1), (3, 2), (4096, 12), (4097, 13), ((1 << 20) + 1, 21)])
def test_size_bucket_is_the_smallest_power_of_two_that_holds_the_size(n, k):
    assert size_bucket(n) == k
    assert n <= 1 << k


def test_per_gpu_rows_only_from_records_that_name_a_device():
    per = _ledger().device_snapshot()
    assert list(per) == [1]
    assert per[1]["cufile-nvfs"].bytes_written == 1 << 20 and per[1]["cufile-nvfs"].requests == 1


def test_stats_add_and_subtract_including_histograms():
    a = _ledger().snapshot()
    two = a + a
    assert two.total_bytes == 2 * a.total_bytes and two.requests == 2 * a.requests
    host = next(e for e in two.entries if e.path == "host")
    assert dict(host.size_hist) == {12: 2, 13: 2}
    back = two - a
    assert back.to_dict() == a.to_dict()
    assert [e.size_hist for e in back.entries] == [e.size_hist for e in a.entries]
    assert (a - a).entries == ()


def test_json_round_trip_keeps_everything_the_reader_needs():
    a = _ledger().snapshot()
    d = json.loads(json.dumps(a.to_dict()))
    for e, raw in zip(a.entries, d["entries"]):
        raw["size_hist"] = {str(1 << k): n for k, n in e.size_hist}
    b = Stats.from_dict(d)
    assert b.to_dict() == a.to_dict()
    assert [e.size_hist for e in b.entries] == [e.size_hist for e in a.entries]


def test_old_style_construction_still_works():
    e = LedgerEntry("host", "no_gpu", "read", 10, 1, 0.5)
    assert e.requests == 0 and e.size_hist == ()
    ps = PathStats(1, 2, 3, 4, 0.5)
    assert ps.requests == 0 and ps.mean_latency_s is None and ps.bytes == 3
    assert Stats.from_entries([e]).paths["host"].bytes_read == 10


def test_public_stats_still_subtracts(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(12345))
    import numpy as np

    buf = np.empty(12345, np.uint8)
    before = gdskit.stats()
    with gdskit.open(str(p)) as f:
        f.read(buf)
    delta = gdskit.stats() - before
    assert delta.total_bytes == 12345 and delta.requests == 1


def test_stats_level_setting_and_its_variable():
    assert env_name("stats_level") == "GDSKIT_STATS" and ENV_VARS["GDSKIT_STATS"] == "stats_level"
    assert ENV_VARS["GDSKIT_STATS_INTERVAL"] == "stats_interval"
    s = Settings()
    assert s.stats_level == 0
    s._apply_env({"GDSKIT_STATS": "3", "GDSKIT_STATS_INTERVAL": "0.25"})
    assert s.stats_level == 3 and s.stats_interval == 0.25
    s._apply_env({"GDSKIT_STATS": "on"})
    assert s.stats_level == 1
    for bad in ({"GDSKIT_STATS": "4"}, {"GDSKIT_STATS": "lots"}, {"GDSKIT_STATS_INTERVAL": "0"}):
        with pytest.raises(ConfigError):
            Settings()._apply_env(bad)


def test_import_is_cheap_and_silent_when_stats_are_off(tmp_path):
    code = ("import sys, gdskit, threading; "
            "print('gdskit.telemetry.publish' in sys.modules, [t.name for t in threading.enumerate()])")
    env = {**os.environ, "GDSKIT_STATS_DIR": str(tmp_path)}
    env.pop("GDSKIT_STATS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False ['MainThread']"
    assert os.listdir(tmp_path) == []


def test_threads_that_end_keep_their_figures_and_leave_no_shard_behind():
    import threading

    led = Ledger()

    def work():
        led.record(Path.HOST, Reason.NO_GPU, "read", 4096, 1, 0.001)

    for _ in range(50):
        t = threading.Thread(target=work)
        t.start()
        t.join()
    work()  # this thread's first record folds the ended threads' shards
    snap = led.snapshot()
    assert snap.bytes_read == 51 * 4096 and snap.requests == 51
    assert dict(snap.entries[0].size_hist) == {12: 51}
    assert len(led._shards) <= 3  # the folded rows, this thread, at most one more
    version = led.version
    led.reset()
    assert led.snapshot().total_bytes == 0 and led.version != version


def test_concurrent_records_and_snapshots_add_up_exactly():
    import threading

    led = Ledger()
    stop = threading.Event()
    seen: list[int] = []

    def reader():
        while not stop.is_set():
            seen.append(led.snapshot().bytes_read)

    def writer(i: int):
        for _ in range(2000):
            led.record(Path.HOST, Reason.NO_GPU, "read", 512 * (i + 1), 1, 0.0)

    r = threading.Thread(target=reader)
    r.start()
    ws = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for w in ws:
        w.start()
    for w in ws:
        w.join()
    stop.set()
    r.join()
    snap = led.snapshot()
    assert snap.bytes_read == 2000 * 512 * sum(range(1, 9)) and snap.requests == 16000
    assert seen == sorted(seen), "a snapshot went backwards"


def test_a_path_name_from_a_newer_gdskit_is_counted_as_not_direct():
    from gdskit.telemetry.render import paths_table
    from gdskit.telemetry.verdict import split, verdict

    stats = Stats(entries=(LedgerEntry("cufile-future", "direct", "read", 4096, 1, 0.001),
                           LedgerEntry("cufile-nvfs", "direct", "read", 8192, 1, 0.001)))
    assert stats.direct_bytes == 8192 and split(stats) == (8192, 4096)
    assert "not direct" in verdict(stats)
    paths_table(stats)  # raised ValueError on the unknown name before


def test_rows_recorded_in_another_process_add_up_exactly_and_bad_ones_add_nothing():
    """A reader process's rows (gdskit.data's workers) land in this ledger as if recorded here."""
    there = Ledger()
    there.record(Path.HOST, Reason.HOST_MEMORY, "read", 64 * 4096, 64, 0.003, requests=64)
    there.record(Path.HOST, Reason.HOST_MEMORY, "read", 1 << 20, 1, 0.001)
    here = Ledger()
    here.record(Path.HOST, Reason.HOST_MEMORY, "read", 4096, 1, 0.0005)
    want = here.snapshot() + there.snapshot()
    here.add_entries(there.snapshot().entries)
    got = here.snapshot()
    assert got.entries == want.entries  # bytes, ops, busy time, requests and the size histogram
    before = here.snapshot()
    good = there.snapshot().entries[0]
    for bad in (LedgerEntry("nowhere", "host_memory", "read", 1, 1, 0.0, 1),
                LedgerEntry("host", "host_memory", "delete", 1, 1, 0.0, 1),
                LedgerEntry("host", "host_memory", "read", -5, 1, 0.0, 1),
                LedgerEntry("host", "host_memory", "read", 1, 1, 0.0, 1, ((12, -3),))):
        with pytest.raises(ValueError):
            here.add_entries([good, bad])  # the good row first: nothing is added either
    assert here.snapshot().entries == before.entries
