"""The errors of :mod:`gdskit.data`: each a :class:`~gdskit.errors.GdskitError` that also
subclasses the fitting built-in (``ValueError``, ``TypeError``...)."""

from __future__ import annotations

from gdskit.errors import FormatError, InvalidArgumentError, ReaderProcessError, TruncatedFileError
from gdskit.formats.npy_format import NpyHeaderError, ObjectDtypeError, UnsupportedDtypeError

__all__ = ["DatasetTooSmallError", "FileSizeError", "NpyHeaderError", "ObjectDtypeError", "ReaderProcessError",
           "SampleMismatchError", "StateDictMismatchError", "TruncatedFileError", "UnsupportedDtypeError",
           "UnsupportedLayoutError"]


class FileSizeError(FormatError):
    """A file's size is not a whole number of its tokens or records (the dtype or record size
    does not divide it). A file shorter than its ``.npy`` header says, or one that shrinks
    while it is read, raises :class:`TruncatedFileError`."""


class UnsupportedLayoutError(FormatError):
    """An ``.npy`` array whose rows cannot be samples: a 0-d array, a Fortran-order one whose
    rows are scattered through the file, or empty rows past what int64 numbers."""


class SampleMismatchError(FormatError):
    """Samples that would be stacked into one batch differ in shape, dtype or memory order."""


class DatasetTooSmallError(InvalidArgumentError):
    """The dataset has no sample, or (with ``drop_last``) fewer than one batch per rank."""


class StateDictMismatchError(InvalidArgumentError):
    """A loader state saved for another dataset, world size or batching cannot resume this loader."""
