"""Record sizes of a torch.save zip archive, on every torch version gdskit supports.

``PyTorchFileReader.get_record_size`` exists only in torch releases newer than
2.11; older ones expose offsets but not sizes. There the zip central directory
gives the same number (torch stores records uncompressed; names in the directory
carry the archive's prefix folder, which the reader's names leave out).
"""

from __future__ import annotations

import zipfile
from typing import Any, BinaryIO


class RecordSizes:
    """``sizes(name)`` -> bytes of record ``name`` (e.g. ``"data/0"``) of one archive.

    ``source`` is what the reader was opened on: a path or a seekable binary stream.
    """

    def __init__(self, reader: Any, source: str | BinaryIO) -> None:
        self._reader = reader
        self._source = source
        self._sizes: dict[str, int] | None = None

    def __call__(self, name: str) -> int:
        if hasattr(self._reader, "get_record_size"):
            return int(self._reader.get_record_size(name))
        if self._sizes is None:
            with zipfile.ZipFile(self._source) as zf:
                self._sizes = {info.filename.split("/", 1)[-1]: info.file_size for info in zf.infolist()}
        if name not in self._sizes:
            raise RuntimeError(f"record {name} not found")
        return self._sizes[name]
