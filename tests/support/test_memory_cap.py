"""tests/support/memory_cap.py: each way a capped child can end is reported as what it was."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
from memory_cap import run_capped

from gdskit.errors import FormatError


def _hog() -> bytes:
    return bytes(512 << 20)  # past a 64 MiB cap


def _refuse() -> None:
    raise FormatError("not the format")


def test_a_return_comes_back() -> None:
    outcome = run_capped(lambda x, y=0: {"sum": x + y}, 2, y=3)
    assert outcome.status == "returned" and outcome.result() == {"sum": 5}


def test_an_allocation_past_the_cap_is_a_memory_error_in_the_child() -> None:
    outcome = run_capped(_hog, cap_bytes=64 << 20)
    assert outcome.status == "raised" and outcome.error == "MemoryError"
    assert outcome.raised("MemoryError") and not outcome.raised("GdskitError")


def test_the_same_allocation_under_a_larger_cap_returns() -> None:
    outcome = run_capped(lambda: len(_hog()), cap_bytes=2 << 30)
    assert outcome.result() == 512 << 20


def test_a_raise_names_its_class_and_bases() -> None:
    outcome = run_capped(_refuse)
    assert outcome.error == "FormatError" and outcome.raised("GdskitError") and outcome.raised("ValueError")


def test_a_child_killed_by_a_signal_is_killed() -> None:
    outcome = run_capped(lambda: os.kill(os.getpid(), signal.SIGKILL))
    assert outcome.status == "killed" and outcome.signal == signal.SIGKILL


def test_a_child_past_its_timeout_is_timed_out() -> None:
    outcome = run_capped(time.sleep, 60, timeout_s=0.5)
    assert outcome.status == "timed_out"


def test_an_unpicklable_result_comes_back_as_text() -> None:
    outcome = run_capped(lambda: (lambda: None))
    assert outcome.status == "returned" and isinstance(outcome.value, str)


def _touch(n: int) -> int:
    block = bytearray(n)
    pages = np.frombuffer(block, dtype=np.uint64)[:: 4096 // 8]
    pages[:] = np.arange(1, len(pages) + 1)  # every page resident and unlike the others (nothing to merge)
    return len(block)


def test_peak_growth_counts_what_the_case_made_resident() -> None:
    small, large = run_capped(_touch, 1 << 20), run_capped(_touch, 256 << 20)
    assert large.peak_rss_growth >= 200 << 20, large
    assert small.peak_rss_growth < 64 << 20, small
