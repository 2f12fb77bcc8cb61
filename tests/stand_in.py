"""Putting gdskit on a stand-in CUDA driver (tests/fake_cuda.py) and taking it off again; the
``fake_cuda`` fixture (conftest.py) and tests that need several stand-in devices use these."""

from __future__ import annotations

import pytest

STAND_INS: list = []  # the stand-in drivers in use now (each test checks they saw no breach)


def use_stand_in(mp: pytest.MonkeyPatch, fake) -> None:
    """Put gdskit on the stand-in driver ``fake`` until ``mp.undo()`` (then call :func:`leave_stand_in`)."""
    import gdskit
    from gdskit import cuda, numa, pool, routing

    gdskit.release_resources()
    mp.setattr(cuda, "_driver", lambda: fake)
    mp.setattr(cuda, "_contexts", {})
    mp.setattr(cuda, "_device_count", None)
    mp.setattr(cuda, "_peers_enabled", set())
    mp.setattr(pool.lanes, "_register_error", None)
    mp.setattr(cuda, "_batched_copies", None)
    cuda._stream_ordered_copy.cache_clear()
    routing.use_facts(routing.fact_source())  # forget the GPUs' addresses and peer links learnt before
    fake.numa_restore = numa.use_facts(None)  # stand-in GPUs are on no node of this machine
    STAND_INS.append(fake)


def leave_stand_in(mp: pytest.MonkeyPatch, fake) -> None:
    import gdskit
    from gdskit import cuda, routing

    try:
        gdskit.release_resources()
    finally:
        STAND_INS.remove(fake)
        cuda._stream_ordered_copy.cache_clear()
        gdskit.release_resources()
        mp.undo()
        cuda._device_count = None
        routing.use_facts(routing.fact_source())
        with fake.numa_restore:
            pass
