"""A checkpoint of every kind of tensor torch.save writes, and an exact comparison of two loads
(structure, dtypes, strides, storage offsets, bytes), for the tests of every torch reader."""

from __future__ import annotations

import collections

import torch


def same(x, y) -> bool:
    """Structure, types, dtypes, shapes, strides, storage offsets and bytes all equal."""
    if isinstance(x, torch.Tensor):
        if type(x) is not type(y) or x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.stride() != y.stride() or x.storage_offset() != y.storage_offset():
            return False
        if x.requires_grad != y.requires_grad:
            return False
        a, b = x.untyped_storage(), y.untyped_storage()
        if a.nbytes() != b.nbytes():
            return False
        u8 = torch.uint8
        return torch.equal(torch.empty(0, dtype=u8).set_(a.cpu()), torch.empty(0, dtype=u8).set_(b.cpu()))
    if isinstance(x, dict):
        return type(x) is type(y) and list(x) == list(y) and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(same(a, b) for a, b in zip(x, y))
    return x == y


def checkpoint() -> collections.OrderedDict:
    g = torch.Generator().manual_seed(1)
    sd = collections.OrderedDict()
    sd["w"] = torch.randn(64, 32, generator=g)
    sd["w_t"] = sd["w"].t()                       # a view sharing w's storage
    sd["w_rows"] = sd["w"][3:9]                   # a view with a storage offset
    sd["b"] = torch.randn(32, generator=g).to(torch.bfloat16)
    sd["scalar"] = torch.tensor(3.25, dtype=torch.float64)
    sd["empty"] = torch.empty(0, 4)
    sd["mask"] = torch.rand(10, generator=g) > 0.5
    sd["i64"] = torch.arange(-5, 5, dtype=torch.int64)
    sd["u16"] = torch.arange(7, dtype=torch.int32).to(torch.uint16)
    sd["c64"] = torch.randn(6, dtype=torch.complex64, generator=g)
    sd["f8"] = torch.randn(12, generator=g).to(torch.float8_e4m3fn)
    sd["big"] = torch.randn(600_000, generator=g)
    sd["param"] = torch.nn.Parameter(torch.randn(5, generator=g))
    sd["nested"] = {"list": [torch.ones(3), (torch.zeros(2, dtype=torch.int8), 7)], "step": 10, "name": "adam"}
    sd["small"] = [torch.full((200,), i, dtype=torch.int32) for i in range(50)]
    return sd
