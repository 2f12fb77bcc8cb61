"""Path ``peer``: bytes that arrived from another rank of a process group, in the ledger, its
summary, the published snapshot (and the schema readers check), the tables and the verdict."""

from __future__ import annotations

import io
import json
import os
import threading

import pytest
from rich.console import Console

from gdskit.errors import FormatError
from gdskit.engine.ledger import Ledger, PeerEntry, Stats
from gdskit.telemetry import schema
from gdskit.telemetry.render import paths_table, peers_table, processes_table, snapshot_view
from gdskit.telemetry.snapshot import Snapshot, ledger_dict
from gdskit.telemetry.verdict import ONLY_PEERS, split, verdict
from gdskit.vocabulary import Path, Reason, is_direct_path, is_peer_path

MiB = 1 << 20


def _rank_ledger() -> Ledger:
    """What one rank of three records after a fan-out load: a third from storage, the rest from peers."""
    led = Ledger()
    led.record(Path.HOST, Reason.NO_GPU, "read", 4 * MiB, 2, 0.01)
    led.record_peer(3 * MiB, source_rank=0, backend="gloo", busy_s=0.002, ops=3)
    led.record_peer(1 * MiB, source_rank=2, backend="gloo", busy_s=0.001)
    led.record_peer(1 * MiB, source_rank=2, backend="gloo", busy_s=0.001)
    return led


def test_peer_bytes_are_a_path_with_their_sender_and_backend():
    s = _rank_ledger().snapshot()
    assert s.paths["peer"].bytes_read == 5 * MiB and s.reasons["fan_out"].bytes_read == 5 * MiB
    assert s.peers == (PeerEntry(0, "gloo", 3 * MiB, 3, 0.002), PeerEntry(2, "gloo", 2 * MiB, 2, 0.002))
    assert (s.storage_bytes, s.peer_bytes, s.total_bytes, s.direct_bytes) == (4 * MiB, 5 * MiB, 9 * MiB, 0)
    assert is_peer_path("peer") and not is_direct_path("peer") and not is_peer_path("host")


def test_peer_rows_add_subtract_round_trip_and_reset():
    led = _rank_ledger()
    before = led.snapshot()
    led.record_peer(MiB, source_rank=2, backend="gloo")
    led.record_peer(MiB, source_rank=1, backend="nccl", device=0)
    after = led.snapshot()
    delta = after - before
    assert delta.peers == (PeerEntry(1, "nccl", MiB, 1, 0.0), PeerEntry(2, "gloo", MiB, 1, 0.0))
    assert (before + delta).peers == after.peers
    assert Stats.from_dict(json.loads(json.dumps(after.to_dict()))).peers == after.peers
    assert led.device_snapshot()[0]["peer"].bytes_read == MiB
    led.reset()
    assert led.snapshot().peers == () and "peers" not in led.snapshot().to_dict()


def test_peer_rows_of_ended_threads_are_kept():
    led = Ledger()
    t = threading.Thread(target=lambda: led.record_peer(MiB, source_rank=1, backend="gloo"))
    t.start()
    t.join()
    other = threading.Thread(target=lambda: led.record(Path.HOST, Reason.NO_GPU, "read", 1))  # folds ended shards
    other.start()
    other.join()
    assert led.snapshot().peers == (PeerEntry(1, "gloo", MiB, 1, 0.0),)


def test_summary_names_the_senders():
    text = _rank_ledger().snapshot().summary()
    assert "peer" in text and "from rank 0" in text and "from rank 2" in text and "gloo" in text
    assert "storage 4.0 MiB, from peers 5.0 MiB" in text


def _doc(stats: Stats) -> dict:
    return {"schema": schema.SCHEMA, "pid": os.getpid(), "level": 1, "ledger": ledger_dict(stats, 1)}


def test_snapshot_carries_peers_and_readers_accept_it():
    stats = _rank_ledger().snapshot()
    doc = _doc(stats)
    assert doc["ledger"]["peer_bytes"] == 5 * MiB and len(doc["ledger"]["peers"]) == 2
    raw = json.dumps(doc).encode()
    back = Snapshot(schema.parse(raw, "snap")).stats
    assert back.peers == stats.peers and back.peer_bytes == stats.peer_bytes
    assert "peers" not in ledger_dict(Ledger().snapshot(), 1)  # nothing new where no bytes came from peers


@pytest.mark.parametrize("change", [
    lambda led: led.update(peer_bytes=1),
    lambda led: led.update(peers={}),
    lambda led: led["peers"][0].update(source_rank=-1),
    lambda led: led["peers"][0].update(backend="NCCL!"),
    lambda led: led["peers"][0].pop("bytes"),
    lambda led: led["peers"].append(dict(led["peers"][0])),
])
def test_schema_refuses_bad_peer_fields(change):
    doc = _doc(_rank_ledger().snapshot())
    change(doc["ledger"])
    with pytest.raises(FormatError):
        schema.validate(doc, "snap")


def _render(renderable) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_tables_show_peer_bytes_apart_from_storage():
    stats = _rank_ledger().snapshot()
    caption = _render(paths_table(stats))
    assert "4.0 MiB from storage" in caption and "5.0 MiB from other ranks" in caption
    table = _render(peers_table(stats))
    assert "gloo" in table and "3.0 MiB" in table
    assert peers_table(Ledger().snapshot()) is None
    snap = Snapshot(_doc(stats) | {"argv": ["python"], "updated_at": 0.0})
    assert "From other ranks" in _render(snapshot_view(snap, 1))
    procs = _render(processes_table([snap]))
    assert "peer" in procs and "5.0 MiB" in procs


def test_verdict_counts_storage_bytes_only():
    stats = _rank_ledger().snapshot()
    assert split(stats) == (0, 4 * MiB)
    assert verdict(stats) == "everything went through posix: no_gpu"  # fan_out is no reason for posix
    only = Ledger()
    only.record_peer(MiB, source_rank=0, backend="nccl")
    assert verdict(only.snapshot()) == ONLY_PEERS
    direct = Ledger()
    direct.record(Path.CUFILE_NVFS, Reason.DIRECT, "read", MiB)
    direct.record_peer(MiB, source_rank=0, backend="nccl")
    assert split(direct.snapshot()) == (MiB, 0)
    assert verdict(direct.snapshot()) == "direct grew, posix flat"
