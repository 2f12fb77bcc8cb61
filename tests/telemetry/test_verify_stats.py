"""Verified bytes in the ledger, the published snapshot (``gdskit stats``) and its schema."""

from __future__ import annotations

import copy
import time

import pytest

from gdskit.engine.ledger import Ledger, Stats, VerifiedStats
from gdskit.errors import FormatError
from gdskit.telemetry.schema import validate


def test_the_ledger_counts_checks_and_resets():
    led = Ledger()
    led.record_verified(1000, 0.5, gpu_bytes=600, checks=3)
    led.record_verified(24, 0.25)
    snap = led.snapshot()
    assert snap.verified == VerifiedStats(1024, 600, 0.75, 4)
    assert (snap - Stats()).verified == snap.verified
    assert Stats.from_dict(snap.to_dict()).verified == snap.verified
    assert "verified" in snap.summary()
    led.reset()
    assert led.snapshot().verified == VerifiedStats()
    assert "verified" not in led.snapshot().to_dict()


def _doc():
    from gdskit.engine.ledger import ledger
    from gdskit.telemetry.snapshot import build

    ledger.record_verified(4096, 0.01, gpu_bytes=4096)
    return build(level=1, pid=1, ticks=None, started_at=time.time(), interval_s=1.0, session=None, final=False,
                 seq=0)


def test_the_published_snapshot_carries_verified_bytes():
    doc = _doc()
    assert doc["ledger"]["verified"]["gpu_bytes"] >= 4096
    validate(doc, "test")


@pytest.mark.parametrize("field,value", [("bytes", -1), ("gpu_bytes", 10**18), ("seconds", "x"), ("checks", True),
                                         ("bytes", None)])
def test_a_malformed_verified_row_is_refused(field, value):
    doc = copy.deepcopy(_doc())
    doc["ledger"]["verified"][field] = value
    with pytest.raises(FormatError):
        validate(doc, "test")
