"""Property tests for the offset arithmetic."""

from __future__ import annotations

from hypothesis import given, strategies as st

from gdskit.engine.plan import aligned_span, chunks, split_aligned

offsets = st.integers(0, 2**40)
sizes = st.integers(0, 2**26)
aligns = st.sampled_from([512, 4096, 65536])


@given(off=offsets, boff=st.integers(0, 2**30), size=sizes, chunk=st.integers(1, 64).map(lambda k: k * 65536),
       align=aligns)
def test_chunks_cover_exactly(off, boff, size, chunk, align):
    plan = chunks(off, boff, size, chunk, align)
    assert sum(c.size for c in plan) == size
    pos = off
    for c in plan:
        assert c.file_offset == pos and c.buf_offset == boff + (pos - off)
        assert 0 < c.size <= chunk
        pos += c.size
    for c in plan[1:]:
        assert c.file_offset % align == 0, "chunks after the first start aligned"


@given(off=offsets, size=sizes, align=aligns)
def test_aligned_span(off, size, align):
    s = aligned_span(off, size, align)
    assert s.start % align == 0 and s.length % align == 0
    assert s.start <= off and s.start + s.length >= off + size
    assert s.head == off - s.start < align
    assert s.length - s.head - size < align


@given(off=offsets, boff=st.integers(0, 2**30), size=sizes, align=aligns)
def test_split_aligned(off, boff, size, align):
    parts = split_aligned(off, boff, size, align)
    pieces = [p for p in (parts.head, parts.body, parts.tail) if p is not None]
    assert sum(p.size for p in pieces) == size
    pos = off
    for p in pieces:
        assert p.file_offset == pos and p.buf_offset == boff + pos - off
        pos += p.size
    if parts.body is not None:
        assert parts.body.file_offset % align == 0 and parts.body.size % align == 0
        assert parts.head is None or parts.head.size < align
        assert parts.tail is None or parts.tail.size < align


def test_spread_samples_evenly_with_both_ends():
    from gdskit.engine.plan import spread

    got = spread(30, 16)
    assert got[0] == 0 and got[-1] == 29 and len(got) == 16 and got == sorted(set(got))
    assert spread(5, 16) == [0, 1, 2, 3, 4] and spread(1, 8) == [0] and spread(0, 8) == [] and spread(9, 1) == [0]
    assert spread(100, 2) == [0, 99]
