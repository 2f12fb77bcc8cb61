"""The running digests a writer feeds as it writes: whatever pieces the bytes come in, they are
the digests ``gdskit digest`` computes from the file."""

from __future__ import annotations

import os
import random

import blake3
import pytest
from hypothesis import given, settings, strategies as st

from gdskit.errors import FormatError, InvalidArgumentError
from gdskit.formats.digest_scan import RunningDigests, Span, digest_file

_DATA = random.Random(9).randbytes(50_000)
_SPANS = [Span("a", 0, 1000), Span("b", 4096, 20_000), Span("c", 30_001, 19_999), Span("empty", 25_000, 0)]


@given(cuts=st.lists(st.integers(min_value=0, max_value=len(_DATA)), max_size=12),
       chunk=st.sampled_from([1024, 4096, 16384, 1 << 20]))
@settings(max_examples=60, deadline=None)
def test_any_pieces_give_the_digests_of_one_pass_over_the_file(cuts, chunk, tmp_path_factory):
    path = tmp_path_factory.mktemp("running") / "f.bin"
    path.write_bytes(_DATA)
    running = RunningDigests(chunk, _SPANS)
    edges = sorted({0, len(_DATA), *cuts})
    for lo, hi in zip(edges, edges[1:]):
        running.feed(_DATA[lo:hi])
    assert running.result(os.stat(path).st_mtime_ns) == digest_file(str(path), chunk, _SPANS)


def test_holes_are_zeros_and_a_given_digest_is_kept():
    data = b"head" + bytes(5000) + b"payload" * 100
    running = RunningDigests(4096, [Span("p", 5004, 700)])
    running.given("p", "ab" * 32)
    running.feed(b"head")
    running.feed_zeros(5000)
    running.feed(data[5004:])
    got = running.result(7)
    assert got.digest == blake3.blake3(data).hexdigest()
    assert got.chunks == (blake3.blake3(data[:4096]).hexdigest(), blake3.blake3(data[4096:]).hexdigest())
    assert got.tensors["p"].digest == "ab" * 32 and got.size == len(data) and got.mtime_ns == 7


def test_a_span_past_the_bytes_fed_or_given_late_is_refused():
    running = RunningDigests(1024, [Span("p", 10, 100)])
    running.feed(bytes(50))
    with pytest.raises(InvalidArgumentError):
        running.given("p", "ab" * 32)  # its bytes are being hashed already
    with pytest.raises(FormatError):
        running.result(0)
