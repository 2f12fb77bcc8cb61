"""Datasets straight to GPU (or host) memory through the gdskit engine.

>>> import gdskit.data as gd
>>> arrays = gd.preload("shards/", device="cuda:0")                       # doctest: +SKIP
>>> tokens = gd.TokenDataset("train.bin", dtype="uint16", seq_len=2048)   # doctest: +SKIP
>>> loader = gd.Loader(tokens, 64, device="cuda:0", shuffle=True)        # doctest: +SKIP
>>> for batch in loader:                                                  # doctest: +SKIP
...     x, y = batch[:, :-1], batch[:, 1:]

Each batch is assembled by scattered reads straight into its rows; ranks get disjoint
shares (``torch.distributed``'s rank and world size by default); ``state_dict()`` resumes
mid-epoch exactly; the ledger (``Loader.stats()``) says which path every byte took.
See docs/data.md. Needs torch (``pip install 'gdskit[torch]'``).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from gdskit.formats import require_torch

require_torch("gdskit.data")

if TYPE_CHECKING:
    from gdskit.data.datasets import Dataset, NpyDataset, RecordDataset, TokenDataset
    from gdskit.data.errors import (DatasetTooSmallError, FileSizeError, NpyHeaderError, ObjectDtypeError,
                                    ReaderProcessError, SampleMismatchError, StateDictMismatchError,
                                    TruncatedFileError, UnsupportedDtypeError, UnsupportedLayoutError)
    from gdskit.data.layout import Layout
    from gdskit.data.loader import Loader
    from gdskit.data.preload import preload

# Each name loads its module on first use: a program that only preloads arrays does not
# import the loader, and one that builds a dataset does not import the reads until it reads.
_LAZY = {"Dataset": "datasets", "NpyDataset": "datasets", "RecordDataset": "datasets", "TokenDataset": "datasets",
         "Layout": "layout", "Loader": "loader", "preload": "preload",
         **dict.fromkeys(("DatasetTooSmallError", "FileSizeError", "NpyHeaderError", "ObjectDtypeError",
                          "ReaderProcessError", "SampleMismatchError", "StateDictMismatchError",
                          "TruncatedFileError", "UnsupportedDtypeError", "UnsupportedLayoutError"), "errors")}

__all__ = ["DatasetTooSmallError", "Dataset", "FileSizeError", "Layout", "Loader", "NpyDataset", "NpyHeaderError",
           "ObjectDtypeError", "ReaderProcessError", "RecordDataset", "SampleMismatchError", "StateDictMismatchError",
           "TokenDataset", "TruncatedFileError", "UnsupportedDtypeError", "UnsupportedLayoutError", "preload"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"gdskit.data.{_LAZY[name]}"), name)
        setattr(sys.modules[__name__], name, value)  # looked up once
        return value
    raise AttributeError(f"module 'gdskit.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


class _Package(types.ModuleType):
    """``gdskit.data.preload`` is the function even after its submodule (same name) is imported:
    the import system sets a package's attribute to each submodule it loads."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "preload" and isinstance(value, types.ModuleType):
            value = value.preload
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
