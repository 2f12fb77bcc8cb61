"""Datasets whose samples are byte ranges of files: token windows, fixed-size records, ``.npy`` arrays.

A dataset only knows where each sample's bytes are and what tensor they make; reading is
the loader's (:mod:`gdskit.data.loader`), by scattered reads straight into a batch's rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import hashlib
import json
import math
import operator
import os
import posixpath
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from gdskit.formats import npy_format as npy
from gdskit.data.errors import FileSizeError, SampleMismatchError, TruncatedFileError, UnsupportedLayoutError
from gdskit.data.layout import Layout, from_numpy, torch_dtype
from gdskit.data.sources import Files, Source, resolve
from gdskit.durable import open_file_fd
from gdskit.engine import is_object_url
from gdskit.errors import InvalidArgumentError

__all__ = ["Dataset", "NpyDataset", "RecordDataset", "TokenDataset"]


#: Samples are numbered in int64.
MAX_SAMPLES = 2**63 - 1


def positive_int(name: str, value: Any) -> int:
    """``value`` as an int > 0, or :class:`InvalidArgumentError`."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r:.40}") from None
    if n <= 0:
        raise InvalidArgumentError(f"{name} must be a positive integer, got {n}")
    return n


def _check_readable(sources: Sequence[Source]) -> None:
    """Open and close each file: a missing or unreadable one is named now, not mid-epoch.
    (Objects were just found by a HEAD or a listing, with the credentials that read them.)"""
    for s in sources:
        if not is_object_url(s.path):
            os.close(open_file_fd(s.path, os.O_RDONLY)[0])


def _relative_names(paths: list[str]) -> list[str]:
    """The files' names relative to their common directory, or the objects' relative to their
    common prefix (a dataset moved elsewhere keeps them)."""
    if all(is_object_url(p) for p in paths):
        keys = [p.split("://", 1)[1] for p in paths]
        root = posixpath.commonpath(keys) if len(keys) > 1 else posixpath.dirname(keys[0])
        return [posixpath.relpath(k, root) for k in keys]
    if any(is_object_url(p) for p in paths):
        return [p if is_object_url(p) else os.path.abspath(p) for p in paths]
    paths = [os.path.abspath(p) for p in paths]
    root = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(paths[0])
    return [os.path.relpath(p, root) for p in paths]


class Dataset(ABC):
    """Samples laid out in files: sample ``i`` is ``layout`` bytes at ``locate([i])``.

    Subclasses fill in ``_sources``, ``_counts`` (samples per file), ``_bases`` (each file's
    first sample's offset), ``_stride`` (bytes from one sample to the next) and the layout(s).
    """

    _sources: tuple[Source, ...]
    _counts: np.ndarray
    _bases: np.ndarray
    _stride: int
    _layout: Layout | None          # every sample's, when they share one
    _layouts: tuple[Layout, ...]    # per file, otherwise

    def _finish(self) -> None:
        self._ends = np.cumsum(self._counts, dtype=np.int64)
        self._starts = self._ends - self._counts
        self._len = int(self._ends[-1]) if len(self._ends) else 0

    # -- what the loader asks ------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    @property
    def sources(self) -> tuple[Source, ...]:
        """The files, in the order their samples are numbered."""
        return self._sources

    @property
    def files(self) -> list[str]:
        return [s.key for s in self._sources]

    @property
    def layout(self) -> Layout | None:
        """The layout every sample shares (None where samples differ: ``.npy`` files of several shapes)."""
        return self._layout

    def layout_of(self, index: int) -> Layout:
        if self._layout is not None:
            return self._layout
        return self._layouts[int(self.locate(np.array([index]))[0][0])]

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For sample indices (in ``[0, len)``): the index of each one's file and its byte offset there."""
        idx = np.asarray(indices, dtype=np.int64)
        f = np.searchsorted(self._ends, idx, side="right")
        return f, self._bases[f] + (idx - self._starts[f]) * self._stride

    def fingerprint(self) -> str:
        """A digest of what the samples are: the kind, its parameters, the files' names (relative to
        their common directory, so that a moved dataset keeps it) and sizes."""
        names = _relative_names([s.path for s in self._sources])
        blob = json.dumps([type(self).__name__, self._params(), names, [s.size for s in self._sources]])
        return hashlib.sha256(blob.encode()).hexdigest()

    @abstractmethod
    def _params(self) -> dict[str, Any]: ...

    def __getitem__(self, index: int) -> torch.Tensor:
        """Sample ``index`` as a CPU tensor (read through the engine; the loader reads batches)."""
        from gdskit.data.read import FileCache, read_samples  # noqa: PLC0415 - import time

        n = self._len
        i = operator.index(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {index} of a dataset of {n}")
        with FileCache() as files:
            return read_samples(self, np.array([i], dtype=np.int64), torch.device("cpu"), files)[0]

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self._params().items())
        return f"{type(self).__name__}({len(self._sources)} files, {self._len} samples, {params})"


class TokenDataset(Dataset):
    """Windows of flat binary token files (the nanoGPT / Megatron ``.bin`` layout).

    Sample ``i`` of a file is ``tokens[i * seq_len : i * seq_len + seq_len + 1]``: the inputs and
    the targets shifted by one share it. Windows never cross files; a file of ``n`` tokens
    holds ``(n - 1) // seq_len`` of them.

    Parameters
    ----------
    files : path, directory, glob or list of paths; or object URLs (``s3://bucket/key``, a
        prefix ``s3://bucket/dir/`` for every object under it), whose windows a batch reads by
        ranged GETs, nearby windows sharing one (``settings.s3_coalesce_gap``)
    dtype : the tokens' type: ``uint16``, ``uint32`` or ``int32`` (any integer type works)
    seq_len : tokens per window, not counting the extra target token

    Raises
    ------
    FileSizeError
        A file's size is not a whole number of tokens.
    """

    def __init__(self, files: Files, *, dtype: Any, seq_len: int) -> None:
        self.seq_len = positive_int("seq_len", seq_len)
        self.dtype = torch_dtype(dtype)
        if self.dtype.is_floating_point or self.dtype.is_complex or self.dtype is torch.bool:
            raise InvalidArgumentError(f"tokens are integers, not {self.dtype}")
        isz = self.dtype.itemsize
        self._sources = tuple(resolve(files))
        _check_readable(self._sources)
        counts = []
        for s in self._sources:
            if s.size % isz:
                raise FileSizeError(f"{s.path}: {s.size} bytes is not a whole number of {self.dtype} tokens "
                                    f"({isz} bytes each)")
            counts.append(max(0, (s.size // isz - 1) // self.seq_len))
        self._counts = np.array(counts, dtype=np.int64)
        self._bases = np.zeros(len(counts), dtype=np.int64)
        self._stride = self.seq_len * isz
        self._layout = Layout(self.dtype, (self.seq_len + 1,))
        self._layouts = ()
        self._finish()

    def _params(self) -> dict[str, Any]:
        return {"dtype": str(self.dtype).removeprefix("torch."), "seq_len": self.seq_len}


class RecordDataset(Dataset):
    """Fixed-size records back to back in files: sample ``i`` is record ``i``.

    Give ``record_bytes`` (records are then ``uint8`` rows unless ``dtype`` says otherwise),
    or ``dtype`` and ``shape`` (each record one array of them), or all three when they agree.
    ``dtype`` alone makes each record one value.

    Raises
    ------
    FileSizeError
        A file's size is not a whole number of records.
    """

    def __init__(self, files: Files, *, record_bytes: int | None = None, dtype: Any = None,
                 shape: Sequence[int] | None = None) -> None:
        if record_bytes is None and dtype is None and shape is None:
            raise InvalidArgumentError("give record_bytes, or dtype and shape")
        dt = torch.uint8 if dtype is None else torch_dtype(dtype)
        isz = dt.itemsize
        rb = None if record_bytes is None else positive_int("record_bytes", record_bytes)
        if shape is not None:
            try:
                shp = tuple(positive_int("each dimension of shape", d) for d in shape)
            except TypeError:
                raise InvalidArgumentError(f"shape must be a sequence of integers, got {shape!r:.40}") from None
            if rb is not None and rb != math.prod(shp) * isz:
                raise InvalidArgumentError(f"record_bytes={rb} but shape {list(shp)} of {dt} is "
                                           f"{math.prod(shp) * isz} bytes")
        elif rb is None:
            shp = ()
        else:
            if rb % isz:
                raise InvalidArgumentError(f"record_bytes={rb} is not a whole number of {dt} ({isz} bytes)")
            shp = (rb // isz,)
        self.dtype, self.shape = dt, shp
        self.record_bytes = math.prod(shp) * isz
        self._sources = tuple(resolve(files))
        _check_readable(self._sources)
        for s in self._sources:
            if s.size % self.record_bytes:
                raise FileSizeError(f"{s.path}: {s.size} bytes is not a whole number of "
                                    f"{self.record_bytes}-byte records")
        self._counts = np.array([s.size // self.record_bytes for s in self._sources], dtype=np.int64)
        self._bases = np.zeros(len(self._sources), dtype=np.int64)
        self._stride = self.record_bytes
        self._layout = Layout(dt, shp)
        self._layouts = ()
        self._finish()

    def _params(self) -> dict[str, Any]:
        return {"dtype": str(self.dtype).removeprefix("torch."), "shape": list(self.shape)}


class NpyDataset(Dataset):
    """``.npy`` arrays as samples: one sample per file, or the rows of the arrays.

    ``rows=None`` (default) takes the rows of a single file and one sample per file of
    several; ``rows=True`` takes the rows of every file (their rows must agree in dtype and
    shape), ``rows=False`` one sample per file even of one. Headers are read once, here;
    the data is read by scattered reads (no memory map). C and Fortran order and either byte
    order are taken; object arrays are refused (never unpickled). Row ``i`` is ``np.load(path)[i]``.

    Raises
    ------
    NpyHeaderError, ObjectDtypeError, UnsupportedDtypeError
        A header is invalid or its dtype has no tensor type (the file is named).
    TruncatedFileError
        A file is shorter than its header says.
    UnsupportedLayoutError
        ``rows`` of a 0-d array, or of a Fortran-order array whose rows are scattered through
        the file (more than one row, of more than one element: see :func:`row_layout`).
    SampleMismatchError
        ``rows=True`` over files whose rows differ.
    """

    def __init__(self, files: Files, *, rows: bool | None = None) -> None:
        self._sources = tuple(resolve(files))
        self.rows = len(self._sources) == 1 if rows is None else bool(rows)
        headers = []
        for s in self._sources:
            h, size = npy.read_header(s.path)
            if size < h.data_offset + h.nbytes:
                raise TruncatedFileError(f"{s.path}: {size} bytes, but its header describes "
                                         f"{h.data_offset + h.nbytes}")
            headers.append(h)
        if self.rows:
            self._rows_of(headers)
        else:
            layouts = tuple(from_numpy(h.dtype, h.shape, h.fortran_order) for h in headers)
            self._counts = np.ones(len(headers), dtype=np.int64)
            self._bases = np.array([h.data_offset for h in headers], dtype=np.int64)
            self._stride = 0
            self._layout = layouts[0] if all(lay == layouts[0] for lay in layouts) else None
            self._layouts = () if self._layout is not None else layouts
        self._finish()

    def _rows_of(self, headers: list[npy.NpyHeader]) -> None:
        row: Layout | None = None
        for s, h in zip(self._sources, headers):
            lay = row_layout(s.path, h)
            if row is not None and lay != row:
                raise SampleMismatchError(f"{s.path}: rows of {lay.describe()}, but earlier files' are "
                                          f"{row.describe()}")
            row = lay
        assert row is not None
        counts = [h.shape[0] for h in headers]
        if row.nbytes == 0 and sum(counts) > MAX_SAMPLES:  # only empty rows come in such numbers
            raise UnsupportedLayoutError(f"the files hold {sum(counts)} rows, more than a dataset can number "
                                         f"({MAX_SAMPLES})")
        self._counts = np.array(counts, dtype=np.int64)
        self._bases = np.array([h.data_offset for h in headers], dtype=np.int64)
        self._stride = row.nbytes
        self._layout = row
        self._layouts = ()

    def _params(self) -> dict[str, Any]:
        lay = self._layout
        return {"rows": self.rows, "layout": lay.describe() if lay is not None else "mixed"}


def row_layout(path: str, header: npy.NpyHeader) -> Layout:
    """The layout of each row of the array ``header`` describes, where each row is one run of bytes.

    In C order every row is. In Fortran order row ``i`` is elements ``i``, ``i + n``, ``i + 2n``...
    of the file (``n`` rows): one run only where there is at most one row, or a row holds at most
    one element; other Fortran-order arrays raise :class:`UnsupportedLayoutError`. The single row
    of a Fortran-order array is in Fortran order itself, which matters only where two of its
    dimensions exceed 1 (elsewhere both orders lay it out alike: it is taken as C order, and
    stacks with C-order files' rows).
    """
    shape = header.shape
    if not shape:
        raise UnsupportedLayoutError(f"{path}: a 0-d array has no rows")
    n, row = shape[0], shape[1:]
    if header.fortran_order and n > 1 and math.prod(row) > 1:
        raise UnsupportedLayoutError(f"{path}: the rows of a Fortran-order array of {n} rows are scattered "
                                     "through the file; save it in C order for row samples")
    fortran = header.fortran_order and n == 1 and sum(d > 1 for d in row) > 1
    return from_numpy(header.dtype, row, fortran)


def check_stackable(dataset: Dataset, batch_size: int) -> None:
    """Refuse, before anything is read, a dataset whose samples cannot be stacked in batches of ``batch_size``."""
    if batch_size > 1 and dataset.layout is None:
        kinds = sorted({lay.describe() for lay in dataset._layouts})
        raise SampleMismatchError(f"samples of {len(kinds)} different kinds ({', '.join(kinds[:3])}"
                                  f"{' ...' if len(kinds) > 3 else ''}) cannot be stacked in batches of "
                                  f"{batch_size}; use batch_size=1")

