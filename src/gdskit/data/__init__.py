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

from gdskit.formats import require_torch

require_torch("gdskit.data")

from gdskit.data.datasets import Dataset, NpyDataset, RecordDataset, TokenDataset  # noqa: E402
from gdskit.data.errors import (DatasetTooSmallError, FileSizeError, NpyHeaderError,  # noqa: E402
                                ObjectDtypeError, SampleMismatchError, StateDictMismatchError,
                                TruncatedFileError, UnsupportedDtypeError, UnsupportedLayoutError)
from gdskit.data.layout import Layout  # noqa: E402
from gdskit.data.loader import Loader  # noqa: E402
from gdskit.data.preload import preload  # noqa: E402

__all__ = ["DatasetTooSmallError", "Dataset", "FileSizeError", "Layout", "Loader", "NpyDataset", "NpyHeaderError",
           "ObjectDtypeError", "RecordDataset", "SampleMismatchError", "StateDictMismatchError", "TokenDataset",
           "TruncatedFileError", "UnsupportedDtypeError", "UnsupportedLayoutError", "preload"]
