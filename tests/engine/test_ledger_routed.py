"""The ledger's routed rows: bytes read into one GPU for another, recorded inside
``Ledger.routing``; snapshots add, subtract and round-trip them."""

from __future__ import annotations

import threading

from gdskit.engine.ledger import Ledger, RoutedEntry, Stats
from gdskit.vocabulary import Path, Reason


def test_records_inside_routing_go_to_the_target_and_the_routed_rows():
    led = Ledger()
    led.record(Path.BOUNCE_DIRECT, Reason.NVIDIA_FS_MISSING, "read", 100, device=0)
    with led.routing(1, 0):
        led.record(Path.CUFILE_NVFS, Reason.DIRECT, "read", 4096, ops=2, busy_s=0.5, device=1)
        t = threading.Thread(target=lambda: led.record(Path.CUFILE_NVFS, Reason.DIRECT, "read", 7, device=1))
        t.start()
        t.join()  # another thread's records are its own: not routed
    led.record(Path.CUFILE_NVFS, Reason.DIRECT, "read", 1, device=1)
    snap = led.snapshot()
    assert snap.routed == (RoutedEntry(1, 0, "cufile-nvfs", "read", 4096, 2, 0.5),)
    assert snap.routed_bytes == 4096 and snap.total_bytes == 100 + 4096 + 7 + 1
    per_gpu = led.device_snapshot()
    assert per_gpu[0]["cufile-nvfs"].bytes_read == 4096 and per_gpu[1]["cufile-nvfs"].bytes_read == 8


def test_routed_rows_add_subtract_and_round_trip():
    led = Ledger()
    before = led.snapshot()
    with led.routing(2, 3):
        led.record(Path.BOUNCE_CACHED, Reason.FORCED_BY_SETTING, "read", 10, device=2)
    mid = led.snapshot()
    with led.routing(2, 3):
        led.record(Path.BOUNCE_CACHED, Reason.FORCED_BY_SETTING, "read", 5, device=2)
    after = led.snapshot()
    assert (after - mid).routed_bytes == 5 and (mid - before).routed_bytes == 10
    assert (mid + (after - mid)).routed == after.routed
    d = after.to_dict()
    assert d["routed_bytes"] == 15 and d["routed"][0]["via_gpu"] == 2 and d["routed"][0]["target_gpu"] == 3
    assert Stats.from_dict(d).routed == after.routed
    assert "routed" not in before.to_dict()
    assert "for GPU 3 through GPU 2" in after.summary()
    led.reset()
    assert led.snapshot().routed == ()
