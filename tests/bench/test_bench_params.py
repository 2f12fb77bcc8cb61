"""Parsing and validation of `gdskit bench` arguments."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gdskit.bench import params as P
from gdskit.errors import GdskitError, InvalidArgumentError

KiB, MiB, GiB = P.KiB, P.MiB, P.GiB


def test_defaults():
    p = P.make_params()
    assert p.io_sizes == (1 * MiB,)
    assert p.op is P.Op.READ and p.cache is P.Cache.COLD
    assert p.repeat == 3 and not p.sweep and p.paths == ()


@pytest.mark.parametrize("text,expected", [("4K", 4096), ("1M", MiB), ("2G", 2 * GiB),
                                           ("8192", 8192), ("64KiB", 64 * KiB)])
def test_gdsio_sizes(text, expected):
    assert P.parse_bytes(text, "x") == expected


def test_range_is_a_sweep_with_both_ends():
    sizes, is_range = P.parse_io_sizes("4K:16M")
    assert is_range
    assert sizes[0] == 4 * KiB and sizes[-1] == 16 * MiB
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    assert P.parse_io_sizes("12K:40K")[0] == (12 * KiB, 24 * KiB, 40 * KiB)


@given(st.integers(1, 2000), st.integers(0, 12))
def test_sweep_sizes_property(lo, extra):
    hi = lo * 2**extra + lo // 3
    sizes = P.sweep_sizes(lo, hi)
    assert sizes[0] == lo and sizes[-1] == hi
    assert list(sizes) == sorted(set(sizes))
    assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:]))


def test_sweep_flag_default_range():
    p = P.make_params(sweep=True, size="64M")
    assert p.sweep and p.io_sizes[0] == 4 * KiB and p.io_sizes[-1] == 16 * MiB


def test_paths_and_ops():
    assert P.parse_paths("cufile, bounce,host,bounce") == ("cufile", "bounce", "host")
    assert P.parse_op("2") is P.Op.RANDREAD
    assert P.parse_op("randwrite") is P.Op.RANDWRITE


@pytest.mark.parametrize("kwargs", [
    dict(size="1M", io_size="4M"),                 # size smaller than I/O size
    dict(size="4M", io_size="1M", workers=8),      # a worker would get less than one I/O
    dict(paths="cufile,nvme"),                     # unknown path
    dict(workers=0),                               # zero workers
    dict(io_size="6000"),                          # not a multiple of 4 KiB
    dict(io_size="16M:4K"),                        # range upside down
    dict(io_size="4K:"),                           # half a range
    dict(size="lots"),                             # not a size
    dict(op="readwrite"),                          # unknown op
    dict(cache="warm"),                            # unknown cache policy
    dict(repeat=0),
    dict(duration=0),
    dict(device=-1),
    dict(file="x", directory="y"),
    dict(total="4K", io_size="1M"),
])
def test_bad_arguments_raise_invalid_argument(kwargs):
    with pytest.raises(InvalidArgumentError) as info:
        P.make_params(**kwargs)
    assert isinstance(info.value, GdskitError) and isinstance(info.value, ValueError)


def test_file_that_is_a_directory(tmp_path):
    with pytest.raises(InvalidArgumentError):
        P.make_params(file=str(tmp_path))


def test_as_dict_is_plain():
    d = P.make_params(io_size="4K:16K", paths="host").as_dict()
    assert d["op"] == "read" and d["cache"] == "cold" and d["io_sizes"] == [4096, 8192, 16384]
    assert d["paths"] == ["host"] and d["sweep"] is True
