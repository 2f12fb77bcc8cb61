"""Placement of items in a rank's DCP file: pure offset arithmetic."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from gdskit.dcp._layout import ItemShape, place

shapes = st.lists(st.builds(ItemShape, st.integers(0, 5000), st.integers(0, 3 << 20), st.integers(0, 5000)),
                  max_size=30)


@given(shapes, st.sampled_from([512, 4096, 65536]), st.integers(0, 2 << 20), st.integers(0, 10000))
@settings(max_examples=300, deadline=None)
def test_placements_are_ordered_disjoint_and_aligned(items: list[ItemShape], alignment: int, large: int,
                                                      start: int) -> None:
    placements, size = place(items, alignment=alignment, large=large, start=start)
    assert len(placements) == len(items)
    pos = start
    for s, p in zip(items, placements):
        assert p.offset >= pos                       # never overlaps the previous item
        assert p.length == s.length
        assert p.payload_offset == p.offset + s.head
        assert p.aligned == (s.payload >= large and s.payload > 0)
        if p.aligned:
            assert p.payload_offset % alignment == 0
            assert p.offset - pos < alignment        # the hole before it is less than one block
        else:
            assert p.offset == pos                   # small items are packed
        pos = p.end
    assert size == pos


def test_small_items_pack_and_large_ones_align() -> None:
    placements, size = place([ItemShape(0, 100, 0), ItemShape(700, 2 << 20, 800), ItemShape(700, 10, 800)])
    assert [p.offset for p in placements] == [0, 4096 - 700, 4096 + (2 << 20) + 800]
    assert placements[1].payload_offset == 4096
    assert size == placements[2].end


@pytest.mark.parametrize("kw", [{"alignment": 0}, {"large": -1}, {"start": -5}])
def test_bad_arguments(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        place([ItemShape(1, 1, 1)], **kw)


def test_negative_part() -> None:
    with pytest.raises(ValueError):
        place([ItemShape(1, -1, 1)])
