"""How a sample's bytes become a tensor: its dtype, shape and memory order (torch-facing)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gdskit.data.errors import UnsupportedDtypeError
from gdskit.errors import InvalidArgumentError

# numpy typestr kind + item size -> the torch dtype of the same values.
_TORCH_BY_TYPESTR: dict[str, torch.dtype] = {
    "b1": torch.bool, "i1": torch.int8, "i2": torch.int16, "i4": torch.int32, "i8": torch.int64,
    "u1": torch.uint8, "u2": torch.uint16, "u4": torch.uint32, "u8": torch.uint64,
    "f2": torch.float16, "f4": torch.float32, "f8": torch.float64, "c8": torch.complex64, "c16": torch.complex128,
}
_NATIVE = "<" if sys.byteorder == "little" else ">"


@dataclass(frozen=True)
class Layout:
    """One sample: ``shape`` elements of ``dtype``; ``byteswap`` when the file's byte order is
    not this machine's; ``fortran`` when the file holds the sample in column-major order."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    fortran: bool = False
    byteswap: bool = False

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def describe(self) -> str:
        order = ", Fortran order" if self.fortran else ""
        swap = ", byte-swapped" if self.byteswap else ""
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}{order}{swap}"


def from_numpy(dtype: np.dtype, shape: tuple[int, ...], fortran: bool) -> Layout:
    """The layout of an ``.npy`` array (or of its rows) of a plain numeric dtype."""
    key = f"{dtype.kind}{dtype.itemsize}"
    t = _TORCH_BY_TYPESTR.get(key)
    if t is None:
        raise UnsupportedDtypeError(f"dtype {dtype.str} has no tensor type")
    swap = dtype.itemsize > 1 and dtype.byteorder not in ("=", "|", _NATIVE)
    return Layout(t, tuple(shape), fortran and len(shape) > 1, swap)


def torch_dtype(dtype: Any) -> torch.dtype:
    """A dtype given as a torch dtype, a numpy dtype or type, or a name (``"uint16"``, ``"<u2"``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        nd = np.dtype(dtype)
    except TypeError:
        raise InvalidArgumentError(f"not a dtype: {dtype!r:.60}") from None
    if nd.byteorder not in ("=", "|", _NATIVE):
        raise InvalidArgumentError(f"dtype {nd.str}: give files in this machine's byte order")
    t = _TORCH_BY_TYPESTR.get(f"{nd.kind}{nd.itemsize}")
    if t is None:
        raise UnsupportedDtypeError(f"dtype {nd} has no tensor type")
    return t


def batch_view(raw: torch.Tensor, n: int, layout: Layout) -> torch.Tensor:
    """``n`` samples of ``layout`` from the flat uint8 tensor ``raw`` that holds their bytes back
    to back: ``[n, *shape]``, each sample in the order its file stores it (a Fortran-order
    sample has Fortran strides, as numpy gives it). A byte-swapped layout costs one copy."""
    if layout.byteswap:  # each number's bytes reversed: a complex number's two parts one by one
        unit = layout.itemsize // 2 if layout.dtype.is_complex else layout.itemsize
        raw = raw.view(-1, unit).flip(-1).contiguous().view(-1)
    typed = raw.view(layout.dtype)
    if not layout.fortran:
        return typed.view((n, *layout.shape))
    nd = len(layout.shape)
    return typed.view((n, *layout.shape[::-1])).permute(0, *range(nd, 0, -1))


def sample_view(raw: torch.Tensor, layout: Layout) -> torch.Tensor:
    """One sample of ``layout`` from the flat uint8 tensor ``raw`` of its bytes, shaped ``shape``:
    :func:`batch_view` of one, without the batch dimension. Views only (no kernel) unless the
    layout is byte-swapped."""
    if layout.byteswap:
        return batch_view(raw, 1, layout)[0]
    typed = raw.view(layout.dtype)
    if not layout.fortran:
        return typed.view(layout.shape)
    return typed.view(layout.shape[::-1]).permute(*range(len(layout.shape) - 1, -1, -1))
